#!/usr/bin/env python3
"""The analytic plan (bill, cost model, verdict; no compile) of every config under configs/ and every recipe of
the everyday matrix, as one JSON file, so a refactor can show that no benchmark row's bill moved.

    python scripts/plan_snapshot.py OUT.json            # write the snapshot of this checkout
    python scripts/plan_snapshot.py --compare A.json B.json   # exit 1 and list the cases that differ

Run it with this checkout's jaxmem first on PYTHONPATH; figures are estimated (analytic), nothing compiles.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# tiny configs without a target plan for 8 x h100-80g, as the lowered check's cases do
TINY_CASES = {
    "tiny": [], "tiny-fsdp4-tp2": ["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp"],
    "tiny-lora-nf4": ["lora.rank=4", "lora.base_dtype=nf4", "lora.double_quant=true"],
    "tiny-lora-qembed": ["lora.rank=4", "lora.base_dtype=int8", "lora.quantize_embeddings=true",
                         "kernels.loss=chunked", "parallel.fsdp=1", "target.gpus_per_host=1"],
    "tiny-accum2-bf16": ["train.grad_accum=2", "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16"],
    "tiny-sp2": ["parallel.sp=2", "parallel.fsdp=4"], "tiny-ep2": ["model.n_experts=4", "model.experts_per_token=2",
                                                                   "parallel.ep=2", "parallel.fsdp=4"],
    "tiny-opt-host": ["offload.optimizer=host"], "tiny-params-host": ["offload.params=host", "remat.preset=full"],
    "tiny-pp2": ["parallel.pp=2", "train.grad_accum=2"],
}


def cases() -> dict[str, tuple[str | None, list[str]]]:
    out = {}
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        if "sweeps" in path.parts:
            continue
        out[str(path.relative_to(ROOT))] = (str(path), [])
    for name, extra in TINY_CASES.items():
        out[name] = (str(ROOT / "configs/tiny.yaml"), ["target.name=h100-80g", "target.gpus_per_host=8", *extra])
    import bench_everyday

    for recipe in bench_everyday.RECIPES:
        out["everyday/" + recipe.name] = (None, recipe.overrides())
    return out


def snapshot() -> dict:
    from jaxmem.loader import load_config
    from jaxmem.plan import plan, resolve_topology

    result = {}
    for name, (config, overrides) in cases().items():
        try:
            cfg = load_config(config, overrides)
            result[name] = plan(cfg, resolve_topology(cfg), compile=False)
        except Exception as e:  # a case that fails must fail alike on both sides
            result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(name, "error" if "error" in result[name] else "ok", file=sys.stderr)
    return result


def _clean(value):
    """The plan without what names the checkout (source paths, revision)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in ("source", "revision", "config_path")}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:3])
        differ = [k for k in sorted(set(a) | set(b)) if _clean(a.get(k)) != _clean(b.get(k))]
        for k in differ:
            print(f"differs: {k}")
        print(f"plan_snapshot: {len(set(a) | set(b)) - len(differ)} cases equal, {len(differ)} differ")
        return 1 if differ else 0
    Path(argv[0]).write_text(json.dumps(snapshot(), indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
