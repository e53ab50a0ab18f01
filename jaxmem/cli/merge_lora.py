"""`jaxmem merge-lora CONFIG [key=value ...] --out DIR [--peft DIR]`: a LoRA run's latest checkpoint as a merged
Hugging Face checkpoint (each frozen linear dequantized and W + scale * A B folded into the adapted ones), and
optionally its adapters in PEFT's format."""
from __future__ import annotations

import argparse
import sys

import jax
from flax import nnx

from jaxmem.cli.help import HelpFormatter
from jaxmem.loader import load_config
from jaxmem.config.schema import ConfigError
from jaxmem.registry import build_program
from jaxmem.core.checkpoint import Checkpoints, restore_run
from jaxmem.io.fresh_folder import check_target, written_whole
from jaxmem.io.hf import save_hf
from jaxmem.io.hf_companions import write_companions
from jaxmem.lora.adapters import hf_target_names
from jaxmem.lora.export import merged_params
from jaxmem.lora.peft_format import save_peft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxmem merge-lora", formatter_class=HelpFormatter,
        description="Read the latest checkpoint of a LoRA run (the config's out_dir), dequantize each targeted base "
                    "weight one layer at a time, fold the adapters in (W + scale * A B) and write a Hugging Face "
                    "checkpoint that transformers loads; with --peft also the adapters alone in PEFT's format "
                    "(adapter_config.json and adapter_model.safetensors).",
        epilog="examples:\n"
               "  jaxmem merge-lora configs/lora/llama3-8b-qlora-1x4090.yaml --out merged/\n"
               "  jaxmem merge-lora run.yaml out_dir=runs/r1 --out merged/ --peft adapters/ --dtype bfloat16")
    ap.add_argument("config", help="the run's config YAML")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides (e.g. out_dir=...)")
    ap.add_argument("--out", required=True, help="folder for the merged Hugging Face checkpoint: new or empty")
    ap.add_argument("--peft", default=None, help="also write the adapters in PEFT's format to this folder")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (and --peft) whole")
    ap.add_argument("--dtype", default=None, help="tensor dtype of the merged files (default: the params')")
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    check_target(args.out, overwrite=args.overwrite)  # before anything is read
    if args.peft:
        check_target(args.peft, overwrite=args.overwrite, key="--peft")
    cfg = load_config(args.config, args.overrides)
    if cfg.lora.rank <= 0:
        raise ConfigError("lora.rank: merge-lora needs a LoRA run (lora.rank > 0)")
    ckpts = Checkpoints.for_run(cfg)
    if ckpts.latest_step() is None:
        raise ConfigError(f"out_dir: {cfg.out_dir} holds no checkpoint to merge")
    prog = build_program(cfg)
    state, meta = restore_run(prog, ckpts)
    ckpts.close()
    params = merged_params(prog, state)
    with written_whole(args.out, overwrite=args.overwrite) as staging:
        save_hf(nnx.merge(prog.graphdef, params), staging, dtype=args.dtype)
        note = write_companions(cfg, staging)  # tokenizer files, special ids, generation_config.json
    print(f"jaxmem merge-lora: step {int(meta.get('step', 0))} of {cfg.out_dir} merged into {args.out}; {note}")
    if args.peft:
        lo = cfg.lora
        with written_whole(args.peft, overwrite=args.overwrite, key="--peft") as staging:
            save_peft(jax.device_get(state["params"]), cfg.model, staging, rank=lo.rank, alpha=lo.alpha,
                      rslora=lo.rslora, dropout=lo.dropout,
                      targets=tuple(hf_target_names(prog.layout.part("lora").targets, cfg.model)),
                      base_model=cfg.checkpoint.init_from)
        print(f"jaxmem merge-lora: adapters in PEFT's format in {args.peft}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
