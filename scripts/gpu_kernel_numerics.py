"""The Pallas kernels compiled for the attached GPU (Triton, not interpret mode) against their pure-jnp references.

    python scripts/gpu_kernel_numerics.py OUT.json [--interpret] [CASE ...]

The suite checks these kernels in interpret mode on CPU; this is the same check through Triton's lowering on
a real GPU, at the shapes of the shipped families (Llama GQA, Gemma 3's head_dim 256 with a 1024 window,
gpt-oss's sinks with a 128 window, packed documents). Each case: forward and every input gradient (an fp32
output cotangent) of the kernel vs the reference computed in fp32 from the same inputs; the error is
max |err| / max |ref| per output, checked against the suite's per-dtype tolerance (tests/kernel_checks.py).
`--interpret` runs the same cases interpreted (on CPU: the script's own check). Writes one JSON object.
The reference runs at full fp32 matmul precision ("highest"). On a GPU an fp32 kernel's dots run in TF32
(Triton's default, as XLA's default precision for fp32 dots there), so fp32 cases there are held to
TF32_TOLERANCE instead of the suite's fp32 one.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.kernel_checks import TOLERANCES, attention_inputs  # noqa: E402

from jaxmem.kernels.attention.pallas import flash_attention  # noqa: E402
from jaxmem.kernels.attention.reference import attention_reference  # noqa: E402
from jaxmem.kernels.cross_entropy.pallas import linear_cross_entropy  # noqa: E402
from jaxmem.kernels.cross_entropy.reference import linear_cross_entropy_reference  # noqa: E402
from jaxmem.kernels.grouped_matmul.pallas import grouped_matmul  # noqa: E402
from jaxmem.kernels.grouped_matmul.reference import grouped_matmul_reference  # noqa: E402
from jaxmem.kernels.rms_norm.pallas import rms_norm  # noqa: E402
from jaxmem.kernels.rms_norm.reference import rms_norm_reference  # noqa: E402

# name: (q heads, kv heads, head dim, window, sinks, packed documents, dtype)
ATTENTION = {
    "llama_gqa_bf16": (32, 8, 128, None, False, False, jnp.bfloat16),
    "llama_packed_bf16": (32, 8, 128, None, False, True, jnp.bfloat16),
    "llama_gqa_fp32": (8, 2, 128, None, False, False, jnp.float32),
    "gemma3_local_h256_bf16": (16, 8, 256, 1024, False, False, jnp.bfloat16),
    "gemma3_global_h256_bf16": (16, 8, 256, None, False, False, jnp.bfloat16),
    "gptoss_local_sinks_bf16": (64, 8, 64, 128, True, False, jnp.bfloat16),
    "gptoss_global_sinks_bf16": (64, 8, 64, None, True, False, jnp.bfloat16),
}


# TF32 keeps 10 mantissa bits (bf16: 7): measured 2.5e-4 forward / 5.5e-4 gradients on one H200 (llama fp32)
TF32_TOLERANCE = (2e-3, 3e-3)


def _errors(actual, expected) -> list[float]:
    out = []
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = jnp.asarray(a, jnp.float32), jnp.asarray(e, jnp.float32)
        out.append(float(jnp.max(jnp.abs(a - e)) / jnp.maximum(jnp.max(jnp.abs(e)), 1e-6)))
    return out


def _compare(kernel, reference, args, diff_argnums, ct, dtype, tf32=False):
    """Forward and gradients (vjp with cotangent `ct`) of kernel(*args) vs reference(*fp32 args)."""
    args32 = [a.astype(jnp.float32) if a is not None and jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]

    def run(fn, xs):
        def f(*diff):
            full = list(xs)
            for i, d in zip(diff_argnums, diff):
                full[i] = d
            return fn(*full)
        out, vjp = jax.vjp(f, *[xs[i] for i in diff_argnums])
        return out, vjp(jax.tree.map(lambda o, c: c.astype(o.dtype), out, ct))

    out, grads = jax.jit(lambda *xs: run(kernel, xs))(*args)
    with jax.default_matmul_precision("highest"):
        ref_out, ref_grads = jax.jit(lambda *xs: run(reference, xs))(*args32)
    fwd_tol, grad_tol = TF32_TOLERANCE if tf32 and dtype == jnp.float32 else TOLERANCES[dtype]
    fwd = _errors(out, ref_out)
    grad = _errors(grads, ref_grads)
    ok = all(e <= fwd_tol for e in fwd) and all(e <= grad_tol for e in grad)
    return {"forward_err": fwd, "grad_err": grad, "tolerance": [fwd_tol, grad_tol], "ok": ok}


def attention_case(name, interpret, t):
    n, kv, h, window, with_sinks, packed, dtype = ATTENTION[name]
    q, k, v, ct, seg = attention_inputs(1, t, n, kv, h, dtype, packed, seed=3)
    sinks = jax.random.normal(jax.random.key(7), (n,), jnp.float32) if with_sinks else None
    kernel = lambda q, k, v, s: flash_attention(q, k, v, seg, window=window, sinks=s, interpret=interpret)
    reference = lambda q, k, v, s: attention_reference(q, k, v, segment_ids_bt=seg, window=window, sinks=s)
    diff = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
    return _compare(kernel, reference, [q, k, v, sinks], diff, ct, dtype, tf32=not interpret)


def rms_norm_case(interpret, rows=4096, d=4096, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (rows, d), jnp.float32).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(keys[1], (d,), jnp.float32)).astype(dtype)
    ct = jax.random.normal(keys[2], (rows, d), jnp.float32)
    return _compare(lambda x, w: rms_norm(x, w, interpret=interpret), rms_norm_reference, [x, w], (0, 1), ct, dtype)


def cross_entropy_case(interpret, t=2048, d=1024, v=32000, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(2), 3)
    hidden = jax.random.normal(keys[0], (t, d), jnp.float32).astype(dtype)
    w = (0.05 * jax.random.normal(keys[1], (d, v), jnp.float32)).astype(dtype)
    labels = jax.random.randint(keys[2], (t,), 0, v).at[:64].set(-100)
    kernel = lambda h, w: linear_cross_entropy(h, w, labels, interpret=interpret)[0]
    reference = lambda h, w: linear_cross_entropy_reference(h, w, labels)[0]
    return _compare(kernel, reference, [hidden, w], (0, 1), jnp.ones((), jnp.float32), dtype)


def grouped_matmul_case(interpret, rows=4096, d=1024, f=768, groups=16, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(4), 4)
    lhs = jax.random.normal(keys[0], (rows, d), jnp.float32).astype(dtype)
    rhs = (0.05 * jax.random.normal(keys[1], (groups, d, f), jnp.float32)).astype(dtype)
    cuts = jnp.sort(jax.random.randint(keys[2], (groups - 1,), 0, rows))
    sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, cuts.dtype), cuts, jnp.full(1, rows, cuts.dtype)]))
    sizes = sizes.astype(jnp.int32)
    ct = jax.random.normal(keys[3], (rows, f), jnp.float32)
    kernel = lambda x, w: grouped_matmul(x, w, sizes, interpret=interpret)
    reference = lambda x, w: grouped_matmul_reference(x, w, sizes)
    return _compare(kernel, reference, [lhs, rhs], (0, 1), ct, dtype)


def main(argv):
    out_path = Path(argv[0])
    interpret = "--interpret" in argv
    only = [a for a in argv[1:] if not a.startswith("--")]
    t = 512 if interpret else 4096
    cases = {f"attention_{name}_t{t}": (lambda name=name: attention_case(name, interpret, t)) for name in ATTENTION}
    small = dict(rows=256, d=256) if interpret else {}
    cases["rms_norm_bf16"] = lambda: rms_norm_case(interpret, **small)
    cases["cross_entropy_bf16"] = lambda: cross_entropy_case(interpret, **(dict(t=256, d=128, v=1000) if interpret
                                                                            else {}))
    cases["grouped_matmul_bf16"] = lambda: grouped_matmul_case(interpret, **(dict(rows=256, d=128, f=64, groups=4)
                                                                              if interpret else {}))
    device = jax.devices()[0]
    how = "interpret mode on CPU" if interpret else f"compiled for and run on {device.device_kind}"
    result = {"jax": jax.__version__, "device": device.device_kind, "how": how, "cases": {}}
    for name, fn in cases.items():
        if only and not any(word in name for word in only):
            continue
        start = time.perf_counter()
        try:
            row = fn()
        except Exception as err:  # one failing kernel must not hide the others' results
            row = {"ok": False, "error": f"{type(err).__name__}: {err}"[:600], "trace": traceback.format_exc()[-1500:]}
        row["seconds"] = round(time.perf_counter() - start, 1)
        result["cases"][name] = row
        errs = row.get("error") or f"fwd {max(row['forward_err']):.2e} grad {max(row['grad_err']):.2e}"
        print(f"{name}: {'ok' if row['ok'] else 'FAIL'} {errs} ({row['seconds']} s)", flush=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["ok"] for r in result["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
