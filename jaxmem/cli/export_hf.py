"""`jaxmem export-hf RUN_DIR --out DIR [--step N]`: a run's checkpoint as a self-contained Hugging Face folder.

A full fine-tune exports its weights (the fp32 master copy when the run keeps one); a LoRA run exports the base
with the adapters merged in, as `jaxmem merge-lora` does. Either way the folder holds sharded safetensors (+ the
index when there is more than one shard), config.json with the bos / eos / pad ids, the run's tokenizer files
with its chat template, and generation_config.json whose eos ids include the template's end-of-turn token
(jaxmem.io.hf_companions): transformers' AutoModelForCausalLM and AutoTokenizer load it alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import jax

from jaxmem.config.schema import ConfigError, DistributedConfig, ParallelConfig
from jaxmem.io.fresh_folder import check_target, written_whole
from jaxmem.train.run_folder import resolved_config
from jaxmem.loader import load_config
from jaxmem.lora.export import merged_params
from jaxmem.core.checkpoint import Checkpoints, restore_run
from jaxmem.io.hf import DEFAULT_SHARD_BYTES, save_hf
from jaxmem.io.hf_companions import write_companions
from jaxmem.registry import build_program
from jaxmem.cli.help import HelpFormatter

_EXAMPLES = """\
examples:
  jaxmem export-hf runs/sft --out exported/sft                 # the latest checkpoint
  jaxmem export-hf runs/sft --out exported/sft-200 --step 200 --dtype bfloat16
  python -c "import transformers as t; m = t.AutoModelForCausalLM.from_pretrained('exported/sft')"   # then"""


def _shard_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise ConfigError(f"--max-shard-size: {text!r} is not a size; use e.g. 2GB, 500MB or 100000")
    scale = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}
    size = int(float(match.group(1)) * scale[match.group(2)])
    if size <= 0:  # export's 0 would mean "the default": the user asked for something else
        raise ConfigError(f"--max-shard-size: {text!r} must be at least 1 byte; use e.g. 2GB, 500MB or 100000")
    return size


def run_config(run_dir: str | Path):
    """The run's resolved config (RUN_DIR/config.resolved.yaml) laid out for this machine: one process, the default mesh
    (checkpoints restore onto any layout, a pipeline's re-cut into one model)."""
    path = resolved_config(run_dir)
    if not path.is_file():
        raise ConfigError(f"RUN_DIR: {path} not found; give the out_dir of a `jaxmem train` run")
    cfg = load_config(path, [f"out_dir={Path(run_dir)}"])
    return dataclasses.replace(cfg, parallel=ParallelConfig(fsdp=-1), distributed=DistributedConfig())


def exported_params(prog, state: dict) -> dict:
    """The model's params to export: merged adapters for LoRA, else the master copy if kept, else the params."""
    if prog.layout.freezes_model:
        return merged_params(prog, state)
    return state["master"] if "master" in state else state["params"]


def export(run_dir: str | Path, out: str | Path, step: int | None = None, dtype: str | None = None,
           max_shard_bytes: int | None = None, overwrite: bool = False) -> tuple[int, str]:
    """Writes the folder whole (jaxmem.io.fresh_folder: a non-empty `out` only with `overwrite`, then replaced);
    returns (the step exported, a line on the tokenizer files)."""
    check_target(out, overwrite=overwrite)  # before anything is read
    cfg = run_config(run_dir)
    prog, state, step = restored_step(cfg, run_dir, step, f"RUN_DIR: {run_dir} holds no finalized checkpoint to export")
    params = exported_params(prog, state)
    model = prog.model(jax.device_get(params) if not prog.layout.freezes_model else params)
    with written_whole(out, overwrite=overwrite) as staging:
        save_hf(model, staging, dtype=dtype or cfg.precision.param_dtype,
                max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)
        note = write_companions(cfg, staging)
    return step, note


def restored_step(cfg, folder, step: int | None, none_saved: str):
    """(program, train state, step) of the run's checkpoint at `step` (default: its latest); a one-line
    ConfigError when the run saved none (`none_saved`), or not that step (naming `folder`)."""
    ckpts = Checkpoints.for_run(cfg)
    try:
        steps = ckpts.all_steps()
        if not steps:
            raise ConfigError(none_saved)
        if step is not None and step not in steps:
            raise ConfigError(f"--step: {folder} holds no step {step}; saved steps: {', '.join(map(str, steps))}")
        prog = build_program(cfg)
        state, meta = restore_run(prog, ckpts, step if step is not None else steps[-1])
    finally:
        ckpts.close()
    return prog, state, int(meta.get("step", step if step is not None else steps[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxmem export-hf", formatter_class=HelpFormatter, epilog=_EXAMPLES,
        description="Write a run's checkpoint as a Hugging Face folder that transformers loads alone: safetensors "
                    "shards (+ index), config.json with bos/eos/pad ids, the run's tokenizer files and chat "
                    "template, generation_config.json (eos includes the chat template's end-of-turn token). A "
                    "LoRA run is exported merged (W + scale * A B), like merge-lora.")
    ap.add_argument("run_dir", metavar="RUN_DIR", help="the out_dir of a `jaxmem train` run (holds config.resolved.yaml)")
    ap.add_argument("--out", required=True, help="folder to write: new or empty (created if missing)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out whole")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint step to export (default: the latest)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="tensor dtype of the files (default: the run's precision.param_dtype)")
    ap.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (default 2GB)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    step, note = export(args.run_dir, args.out, args.step, args.dtype, _shard_bytes(args.max_shard_size),
                        overwrite=args.overwrite)
    print(f"jaxmem export-hf: step {step} of {args.run_dir} written to {args.out}; {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
