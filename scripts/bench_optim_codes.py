"""The low-bit moment codes' figures: error bounds (from the tables), errors on random tensors, state bytes per
parameter of a Llama-3-8B-shaped model, and a 50-step toy run against fp32 AdamW.

Usage: python scripts/bench_optim_codes.py --json benchmarks/optim_codes.json --md benchmarks/optim_codes.md
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmem.optim import adamw_lowbit, codes, states

# One decoder layer and the embedding / LM head of Llama-3-8B (d 4096, 32 heads of 128, 8 kv heads, mlp 14336).
LLAMA3_8B = {"embed": (128256, 4096), "lm_head": (4096, 128256), "final_norm": (4096,),
             "layer": {"attn_norm": (4096,), "wq": (4096, 32, 128), "wk": (4096, 8, 128), "wv": (4096, 8, 128),
                       "wo": (32, 128, 4096), "mlp_norm": (4096,), "w_gate": (4096, 14336),
                       "w_up": (4096, 14336), "w_down": (14336, 4096)}}


def relative_by_decade(code: codes.Code, decades=(1, 2, 3)) -> dict:
    """Worst |dequantized - x| / |x| over |x| >= 10**-k of the block scale, swept over the table."""
    values = np.asarray(code.values, np.float64)
    out = {}
    for k in decades:
        y = np.geomspace(10.0 ** -k, 1.0, 400001)
        if code.sqrt_linear:
            nearest = (np.clip(np.round(16 * np.sqrt(y)), 1, 16) / 16) ** 2
        else:
            above = np.clip(np.searchsorted(values, y), 1, len(values) - 1)
            nearest = np.where(np.abs(values[above] - y) < np.abs(values[above - 1] - y), values[above],
                               values[above - 1])
        out[f"1e-{k}"] = float(np.max(np.abs(nearest - y) / y))
    return out


def measured(name: str, block: int) -> dict:
    """Errors on a 64 x 4096 normal tensor (its squares for the unsigned codes), relative to each block's scale."""
    x = np.random.default_rng(0).standard_normal((64, 4096)).astype(np.float32)
    x = x if codes.CODES[name].signed else np.square(x)
    back = np.asarray(codes.dequantize(codes.quantize(jnp.asarray(x), name, block)))
    blocks = lambda a: a.reshape(-1, block)  # noqa: E731  (4096 is a multiple of both default blocks)
    err = np.abs(blocks(back) - blocks(x)) / np.abs(blocks(x)).max(-1, keepdims=True)
    return {"max_abs_over_scale": float(err.max()), "mean_abs_over_scale": float(err.mean())}


def state_bytes_per_param(bits: int) -> float:
    """m + v bytes per parameter of the Llama-3-8B shapes (32 layers) with the default blocks and threshold."""
    opt = adamw_lowbit.scale_by_adam_lowbit(moments=f"int{bits}")
    tree = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in LLAMA3_8B.items() if k != "layer"}
    layer = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in LLAMA3_8B["layer"].items()}
    count = lambda t: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(t))  # noqa: E731
    state_bytes = lambda t: sum(int(np.prod(x.shape)) * x.dtype.itemsize  # noqa: E731
                                for x in jax.tree.leaves(jax.eval_shape(opt.init, t)) if x.ndim)
    return (state_bytes(tree) + 32 * state_bytes(layer)) / (count(tree) + 32 * count(layer))


def toy_run(bits: int | None, steps: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """(weights, target): weights after `steps` noisy AdamW steps towards a fixed 64 x 4096 target."""
    target = jnp.asarray(np.random.default_rng(0).standard_normal((64, 4096)), jnp.float32)
    adam = (optax.scale_by_adam(0.9, 0.95) if bits is None
            else adamw_lowbit.scale_by_adam_lowbit(0.9, 0.95, moments=f"int{bits}"))
    tx = optax.chain(adam, optax.scale_by_learning_rate(1e-2))
    w, state = jnp.zeros_like(target), tx.init(target)

    @jax.jit
    def step(w, state, key):
        u, state = tx.update(w - target + 0.5 * jax.random.normal(key, w.shape), state, w)
        return w + u, state

    for i in range(steps):
        w, state = step(w, state, jax.random.key(i))
    return np.asarray(w), np.asarray(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    args = parser.parse_args()
    result = {"codes": {}, "bytes_per_param": {}, "toy": {}}
    for bits, kind in ((8, states.moment_kind("int8")), (4, states.moment_kind("int4"))):
        (m, v), block = kind.codes, kind.default_block
        for role, name in (("m", m), ("v", v)):
            code = codes.CODES[name]
            result["codes"][name] = {"bits": bits, "moment": role, "block": block, "max_error": code.max_error,
                                     "relative": relative_by_decade(code), **measured(name, block)}
        result["bytes_per_param"][str(bits)] = state_bytes_per_param(bits)
    fp32, target = toy_run(None)
    for bits in (8, 4):
        w, _ = toy_run(bits)
        result["toy"][str(bits)] = {"drift_from_fp32": float(np.linalg.norm(w - fp32) / np.linalg.norm(fp32)),
                                    "distance_to_target": float(np.linalg.norm(w - target) / np.linalg.norm(target))}
    result["toy"]["fp32_distance_to_target"] = float(np.linalg.norm(fp32 - target) / np.linalg.norm(target))
    text = markdown(result)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    print(text)


def markdown(r: dict) -> str:
    lines = ["# Low-bit AdamW moments: code errors and state bytes", "",
             "Derived from the code tables (jaxmem.optim.codes) and measured on CPU. Regenerate: "
             "`python scripts/bench_optim_codes.py --json benchmarks/optim_codes.json --md benchmarks/optim_codes.md`.",
             "", "| code | moment | block | max error / block scale | worst relative error for x >= 0.1 / 0.01 / "
             "0.001 of the scale | normal 64x4096: max / mean error / scale |", "|---|---|---:|---:|---|---|"]
    for name, c in r["codes"].items():
        rel = " / ".join(f"{x:.3g}" for x in c["relative"].values())
        lines.append(f"| {name} | {c['moment']} | {c['block']} | {c['max_error']:.4g} | {rel} | "
                     f"{c['max_abs_over_scale']:.4g} / {c['mean_abs_over_scale']:.3g} |")
    lines += ["", "m + v bytes per parameter, Llama-3-8B shapes (32 layers, embedding and LM head; tensors under 4096 "
              "values in fp32, scales fp32): " + ", ".join(f"{b}-bit {x:.4f}" for b, x in r["bytes_per_param"].items())
              + " (fp32: 8, bf16: 4).", "",
              "Toy run, 50 noisy steps towards a 64 x 4096 target: fp32 ends "
              f"{r['toy']['fp32_distance_to_target']:.4f} from it (relative); " + "; ".join(
                  f"{b}-bit {t['distance_to_target']:.4f}, {t['drift_from_fp32']:.3f} from fp32's weights"
                  for b, t in r["toy"].items() if b != "fp32_distance_to_target") + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
