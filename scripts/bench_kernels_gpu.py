"""Kernel timings on the attached GPU: LM head + cross-entropy and attention, forward + backward.

    python scripts/bench_kernels_gpu.py OUTDIR [CASE ...] [--budget SECONDS]

Each case runs in its own process (fresh peak statistics; a failure or an out-of-memory stays in its case)
and appends one JSON line to OUTDIR/kernels_gpu.jsonl. A case is NAME or NAME@{"field": value} with
KernelConfig / block fields, e.g. `ce_pallas@{"fused_loss_block_v": 256}`. Times are the median of 10 calls
after 2 warm-ups, synchronized with block_until_ready: measured on GPU. `scripts/kernels_gpu_table.py`
turns the JSON lines into benchmarks/kernels_gpu.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

GIB = 2**30
CE_SHAPE = tuple(json.loads(os.environ.get("CE_SHAPE", "[8192, 4096, 128256]")))  # T, D, V: Llama-3-8B, seq 8192
ATTN_HEADS = (32, 8, 128)  # q heads, kv heads, head dim (Llama-3-8B)
DEFAULT_CASES = [
    "ce_naive", "ce_chunked", 'ce_chunked@{"loss_block_t": 1024, "loss_block_v": 4096}', "ce_pallas",
    "attn_cudnn_8192", "attn_pallas_8192", "attn_cudnn_32768", "attn_pallas_32768",
]


def _median_ms(fn, *args, n=10):
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[n // 2]


def _rel(a, b) -> float:
    import jax.numpy as jnp

    a, b = a.astype(jnp.float32).ravel(), b.astype(jnp.float32).ravel()
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def cross_entropy_case(impl: str, fields: dict, check: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxmem import kernels
    from jaxmem.config import KernelConfig

    t, d, v = CE_SHAPE
    if "backward" in fields:  # which backward the Pallas loss runs (an experiment switch)
        from jaxmem.kernels.cross_entropy import pallas as pallas_loss

        pallas_loss.BACKWARD = fields.pop("backward")
    tuning = {x: fields.pop(x) for x in ("num_warps", "num_stages") if x in fields}
    if tuning:  # Triton launch settings are not config keys: patch the blocks the dispatch builds
        import dataclasses

        blocks_of = kernels.loss_blocks
        kernels.loss_blocks = lambda cfg: dataclasses.replace(blocks_of(cfg), **tuning)
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (t, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, v), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(k[2], (t,), 0, v).at[::80].set(-100)  # 1.25% ignored tokens
    fn = kernels.select_loss(KernelConfig(loss=impl, **fields), jax.default_backend())

    def mean_loss(h, w):
        total, n = fn(h, w, labels)
        return total / n

    step = jax.jit(jax.value_and_grad(mean_loss, argnums=(0, 1))).lower(h, w).compile()
    out = {"temp_gib": step.memory_analysis().temp_size_in_bytes / GIB, "fwd_bwd_ms": _median_ms(step, h, w)}
    flops = 6 * t * d * v  # forward matmul + the two gradient matmuls (recompute not counted)
    out["model_tflops_per_s"] = flops / (out["fwd_bwd_ms"] * 1e-3) / 1e12
    forward = jax.jit(mean_loss).lower(h, w).compile()
    out["fwd_ms"] = _median_ms(forward, h, w)
    if check:
        try:
            out.update(_check_loss(step, h, w, labels, fn_ref=kernels.select_loss(KernelConfig(loss="naive"),
                                                                                  jax.default_backend())))
        except Exception as e:  # the timing above stands; say why the check is missing
            out["check_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _check_loss(step, h, w, labels, fn_ref) -> dict:
    import jax
    import jax.numpy as jnp

    loss, (dh, dw) = step(h, w)
    f32 = lambda h, w: fn_ref(h.astype(jnp.float32), w.astype(jnp.float32), labels)[0] / jnp.sum(labels != -100)
    with jax.default_matmul_precision("highest"):  # a true fp32 reference, not TF32
        ref_loss, (rdh, rdw) = jax.jit(jax.value_and_grad(f32, argnums=(0, 1)))(h, w)
    return dict(loss=float(loss), loss_ref=float(ref_loss), dh_rel=_rel(dh, rdh), dw_rel=_rel(dw, rdw))


def attention_case(impl: str, seq: int, fields: dict, check: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxmem import kernels
    from jaxmem.config import KernelConfig

    n, kv, hd = ATTN_HEADS
    tuning = {x: fields.pop(x) for x in ("num_warps", "num_stages") if x in fields}
    if tuning:  # Triton launch settings are not config keys: patch the blocks the dispatch builds
        import jaxmem.kernels.attention.config as attention_config

        blocks_of = attention_config.AttentionBlocks
        attention_config.AttentionBlocks = lambda **kw: blocks_of(**{**tuning, **kw})
    k = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(k[0], (1, seq, n, hd), jnp.bfloat16)
    key = jax.random.normal(k[1], (1, seq, kv, hd), jnp.bfloat16)
    val = jax.random.normal(k[2], (1, seq, kv, hd), jnp.bfloat16)
    ct = jax.random.normal(k[3], (1, seq, n, hd), jnp.bfloat16)
    if impl == "tokamax":  # tokamax's Pallas Mosaic GPU flash attention (a candidate, not a jaxmem kernel)
        import tokamax

        fn = lambda q, k, v, seg: tokamax.dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                                implementation=fields.get("impl", "mosaic"))
    else:
        fn = kernels.select_attention(KernelConfig(attention=impl, **fields), jax.default_backend())

    def fwd_bwd(q, key, val):
        out, vjp = jax.vjp(lambda q, key, val: fn(q, key, val, None), q, key, val)
        return out, vjp(ct)

    step = jax.jit(fwd_bwd).lower(q, key, val).compile()
    out = {"temp_gib": step.memory_analysis().temp_size_in_bytes / GIB, "fwd_bwd_ms": _median_ms(step, q, key, val)}
    flops = 3.5 * 4 * seq * seq * n * hd / 2  # causal: half of 4 T S N H forward; backward 2.5x the forward
    out["tflops_per_s"] = flops / (out["fwd_bwd_ms"] * 1e-3) / 1e12
    if check and seq <= 4096:  # the fp32 reference keeps [N, T, S] fp32 scores and their gradients
        try:
            out.update(_check_attention(step, q, key, val, ct))
        except Exception as e:  # the timing above stands; say why the check is missing
            out["check_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _check_attention(step, q, key, val, ct) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxmem.kernels.attention.reference import attention_reference

    o, grads = step(q, key, val)
    f32 = lambda q, key, val: attention_reference(q.astype(jnp.float32), key.astype(jnp.float32),
                                                  val.astype(jnp.float32))
    with jax.default_matmul_precision("highest"):
        ro, rvjp = jax.vjp(f32, q, key, val)
        rgrads = rvjp(ct.astype(jnp.float32))
    return dict(o_rel=_rel(o, ro), **{f"d{x}_rel": _rel(a, b) for x, a, b in zip("qkv", grads, rgrads)})


def run_case(spec: str) -> dict:
    name, _, fields = spec.partition("@")
    fields = json.loads(fields) if fields else {}
    check = set(fields) <= {"backward"}  # numerics against fp32 once per implementation, at its defaults
    import jax

    gpu = jax.default_backend() == "gpu"
    result = {"case": spec, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "how": "measured on GPU" if gpu else f"measured on {jax.default_backend().upper()}"}
    parts = name.split("_")
    if parts[0] == "ce":
        result.update(cross_entropy_case(parts[1], fields, check))
    elif parts[0] == "attn":
        result.update(attention_case(parts[1], int(parts[2]), fields, check))
    else:
        raise ValueError(f"unknown case {name!r}: ce_<impl> or attn_<impl>_<seq>")
    return result


def main(argv: list[str]) -> int:
    if argv[:1] == ["--case"]:
        sys.argv = sys.argv[:1]  # tokamax parses sys.argv as absl flags
        try:
            out = run_case(argv[1])
        except Exception as e:  # reported as the case's result, the sweep goes on
            out = {"case": argv[1], "error": f"{type(e).__name__}: {str(e)[:1200]}",
                   "traceback": traceback.format_exc()[-2000:]}
        print("RESULT " + json.dumps(out), flush=True)
        return 0
    budget = float(argv[argv.index("--budget") + 1]) if "--budget" in argv else 540.0
    args = [a for i, a in enumerate(argv) if a != "--budget" and (i == 0 or argv[i - 1] != "--budget")]
    outdir, cases = args[0], args[1:] or DEFAULT_CASES
    os.makedirs(outdir, exist_ok=True)
    start = time.time()
    with open(os.path.join(outdir, "kernels_gpu.jsonl"), "a") as log:
        for spec in cases:
            left = budget - (time.time() - start)
            if left < 20:
                print(f"budget spent, skipped {spec}", flush=True)
                continue
            t0 = time.time()
            try:
                p = subprocess.run([sys.executable, __file__, "--case", spec], capture_output=True, text=True,
                                   timeout=min(150, left))
                lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                out = json.loads(lines[-1][7:]) if lines else {"case": spec, "error": f"rc {p.returncode}",
                                                                "stderr": p.stderr[-2000:]}
            except subprocess.TimeoutExpired:
                out = {"case": spec, "error": "timeout"}
            out["wall_s"] = round(time.time() - t0, 1)
            log.write(json.dumps(out) + "\n")
            log.flush()
            brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()
                     if k not in ("traceback", "stderr")}
            print(json.dumps(brief), flush=True)
            if "error" in out:
                print((out.get("traceback") or out.get("stderr") or "")[-1200:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
