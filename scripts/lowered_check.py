#!/usr/bin/env python3
"""Is the lowered train step byte-identical between two checkouts of jaxmem (issue #29's check)?

    python lowered_check.py BEFORE_REPO AFTER_REPO     # dumps both, compares, exit 0 when identical
    python lowered_check.py --dump REPO OUT_DIR        # writes OUT_DIR/<case>.mlir for one checkout
    python lowered_check.py --compare DIR_A DIR_B      # compares two such dumps

Each case is lowered in a fresh process whose PYTHONPATH is the checkout (its own jaxmem), on 8 virtual CPU
devices, through the public API only (`jaxmem.load_config`, `jaxmem.build_program`, `TrainProgram.lower`),
which both layouts keep: `jax.jit(step).lower(abstract state, abstract batch).as_text()` (StableHLO, no
source locations), plus the lowered step-0 state (`state_from_params` around freshly initialized model params)
and the state's layout (each leaf's shape, dtype and sharding). Cases: the default tiny config; grad_accum 2 +
bf16; fsdp 4 x tp 2; LoRA (nf4 base; dropout with grad_accum 2; quantized embeddings on one device);
optimizer.update_in_backward (configs/levers/update-in-backward.yaml). A pipeline (pp 2, grad_accum 2) has no
one step: per stage, its lowered forward and update, the lowered step-0 state around its params, and the
pipeline state's layout (jaxmem.pipeline.runtime.build_pipeline, which both layouts keep).
Python: the interpreter running this script (e.g. /work/main/.venv/bin/python); override with --python.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TINY, IN_BACKWARD = "configs/tiny.yaml", "configs/levers/update-in-backward.yaml"
LORA = ["lora.rank=4"]
# name -> (config file, overrides, devices: 8 virtual CPU devices, or the first n)
CASES = {
    "default": (TINY, [], 8),
    "grad_accum2_bf16": (TINY, ["train.grad_accum=2", "precision.param_dtype=bfloat16",
                                "precision.compute_dtype=bfloat16", "precision.master_weights=true"], 8),
    "fsdp4_tp2": (TINY, ["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp"], 8),
    "lora_nf4": (TINY, LORA + ["lora.base_dtype=nf4", "lora.double_quant=true"], 8),
    "lora_dropout_accum2": (TINY, LORA + ["lora.dropout=0.1", "train.grad_accum=2", "lora.targets=all-linear"], 8),
    "lora_qembed_1dev": (TINY, LORA + ["lora.base_dtype=int8", "lora.quantize_embeddings=true",
                                       "kernels.loss=chunked", "parallel.fsdp=1"], 1),
    "update_in_backward": (IN_BACKWARD, [], 8),
    "pp2_accum2": (TINY, ["parallel.pp=2", "train.grad_accum=2"], 8),
}

_DUMP = r"""
import sys
from pathlib import Path
import jax
jax.config.update("jax_threefry_partitionable", True)
from flax import nnx
import jaxmem
from jaxmem.model import init_model
repo, out, name, config, n = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
assert Path(jaxmem.__file__).resolve().is_relative_to(repo.resolve()), (jaxmem.__file__, repo)
cfg = jaxmem.load_config(str(repo / config), sys.argv[6:])
if cfg.parallel.pp > 1:
    import jax.numpy as jnp
    try:  # the registry's (features handed to the stages), else an older checkout's
        from jaxmem.registry import build_pipeline
    except ImportError:
        from jaxmem.pipeline.runtime import build_pipeline
    pipe, steps, inits = build_pipeline(cfg, jax.devices()[:n]), [], []
    for st in pipe.stages:
        sp = st.prog
        shaped = lambda tree, shardings: jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
        params = shaped(jax.eval_shape(st.params_for_grad, sp.abstract_state["params"]), st.grad_shardings)
        grads = shaped(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), sp.layout.abstract_params),
                       st.grad_shardings)
        tok = jax.ShapeDtypeStruct((sp.rows, cfg.train.seq_len), jnp.int32, sharding=st.rows)
        x = tok if st.first else jax.ShapeDtypeStruct(st.activation_shape, sp.precision.compute, sharding=st.activation)
        with sp.lowering():
            steps.append(st.forward.lower(params, x, (tok if st.last else None, None, None)).as_text())
            steps.append(st.update.lower(sp.abstract_state, grads, jax.ShapeDtypeStruct((), jnp.float32)).as_text())
            inits.append(jax.jit(lambda q: sp.state_from_params(q, 0), out_shardings=sp.state_shardings)
                         .lower(sp.abstract_state["params"]).as_text())
    (out / f"{name}.mlir").write_text("\n".join(steps))
    (out / f"{name}.init.mlir").write_text("\n".join(inits))
    prog = pipe
else:
    prog = jaxmem.build_program(cfg, devices=jax.devices()[:n])
    (out / f"{name}.mlir").write_text(prog.lower().as_text())
    fresh = lambda: nnx.to_pure_dict(nnx.split(init_model(cfg.model, seed=0, param_dtype=prog.precision.param))[1])
    with prog.lowering():
        init = jax.jit(lambda: prog.state_from_params(fresh(), 0), out_shardings=prog.state_shardings).lower()
    (out / f"{name}.init.mlir").write_text(init.as_text())
leaves = jax.tree_util.tree_leaves_with_path(prog.abstract_state)
(out / f"{name}.state.txt").write_text("".join(f"{jax.tree_util.keystr(p)} {a.shape} {a.dtype} {a.sharding}\n"
                                               for p, a in leaves))
print(f"{name}: lowered with {jaxmem.__file__}")
"""


def dump(repo: Path, out: Path, python: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(repo), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for name, (config, overrides, devices) in CASES.items():
        done = subprocess.run([python, "-c", _DUMP, str(repo), str(out), name, config, str(devices), *overrides],
                              env=env, cwd=repo,
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"lowered_check: {name} failed in {repo}:\n{done.stderr[-3000:]}")
        print(done.stdout.strip())


def compare(a: Path, b: Path) -> int:
    differ = 0
    for name in (f"{case}{part}" for case in CASES for part in (".mlir", ".init.mlir", ".state.txt")):
        ta, tb = (a / name).read_text(), (b / name).read_text()
        ha, hb = (hashlib.sha256(t.encode()).hexdigest()[:16] for t in (ta, tb))
        same = ta == tb
        differ += not same
        print(f"{name}: {'identical' if same else 'DIFFERENT'} ({len(ta)} bytes sha256 {ha} vs {len(tb)} bytes {hb})")
        if not same:
            sys.stdout.writelines(list(difflib.unified_diff(ta.splitlines(True), tb.splitlines(True), "before",
                                                            "after", n=1))[:40])
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", action="store_true", help="REPO OUT_DIR: dump one checkout")
    parser.add_argument("--compare", action="store_true", help="DIR_A DIR_B: compare two dumps")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("paths", nargs=2)
    args = parser.parse_args(argv)
    first, second = (Path(p).resolve() for p in args.paths)
    if args.dump:
        dump(first, second, args.python)
        return 0
    if args.compare:
        return compare(first, second)
    with tempfile.TemporaryDirectory() as tmp:
        dump(first, Path(tmp) / "before", args.python)
        dump(second, Path(tmp) / "after", args.python)
        return compare(Path(tmp) / "before", Path(tmp) / "after")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
