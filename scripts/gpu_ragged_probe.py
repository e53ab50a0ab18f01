"""ragged_dot on the attached GPU: compiled temporaries and fwd+bwd time at Qwen3-30B-A3B expert shapes."""
import json, sys, time
import jax, jax.numpy as jnp
E, D, F = 128, 2048, 768
out = []
for M in (16384, 65536):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, D), jnp.bfloat16)
    w = (jax.random.normal(k[1], (E, D, F), jnp.float32) * D**-0.5).astype(jnp.bfloat16)
    g = jnp.full((E,), M // E, jnp.int32)
    fb = jax.jit(jax.grad(lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, g).astype(jnp.float32)), argnums=(0, 1)))
    c = fb.lower(x, w).compile()
    row = dict(M=M, E=E, D=D, F=F, jax=jax.__version__, temp_gib=c.memory_analysis().temp_size_in_bytes / 2**30,
               how="compiled on the GPU")
    if M == 16384:
        jax.block_until_ready(c(x, w)); ts = []
        for _ in range(5):
            t = time.perf_counter(); jax.block_until_ready(c(x, w)); ts.append(time.perf_counter() - t)
        row["fwd_bwd_ms"] = sorted(ts)[2] * 1e3
        row["tflops_active"] = 3 * 2 * M * D * F / (sorted(ts)[2]) / 1e12
    print(json.dumps(row), flush=True); out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
