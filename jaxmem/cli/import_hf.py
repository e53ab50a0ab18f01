"""`jaxmem import-hf HF_DIR OUT_DIR [--dtype D]`: a local Hugging Face checkpoint as an orbax params checkpoint
that `checkpoint.init_from` starts training from."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import yaml
from flax import nnx

from jaxmem.cli.help import HelpFormatter
from jaxmem.config.schema import ConfigError, ParallelConfig
from jaxmem.mesh import sharding
from jaxmem.io.fresh_folder import refuse_runs
from jaxmem.io.hf import DTYPES, load_hf
from jaxmem.io.no_follow import write_text


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="jaxmem import-hf", formatter_class=HelpFormatter,
        description="Convert a local Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text) into an "
                    "orbax params "
                    "checkpoint that `checkpoint.init_from` starts training from. The safetensors shards are "
                    "streamed into parameters sharded over the local devices; the config snippet to use it is "
                    "printed at the end.",
        epilog="examples:\n"
               "  jaxmem import-hf /path/to/Meta-Llama-3-8B out/llama3-8b\n"
               "  jaxmem import-hf /path/to/Qwen2.5-7B out/qwen --dtype bfloat16\n"
               "  jaxmem train configs/llama3-8b-8xh100.yaml checkpoint.init_from=out/llama3-8b   # then train")
    parser.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    parser.add_argument("out_dir", help="writes OUT_DIR/params (orbax) and OUT_DIR/model.json")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help="parameter dtype to store")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import orbax.checkpoint as ocp

    out = Path(args.out_dir).resolve()
    params_dir = out / "params"
    if params_dir.exists():
        raise ConfigError(f"{params_dir}: already exists; choose a new OUT_DIR")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out}: is a file; OUT_DIR must be a directory (it is created if missing)")
    refuse_runs(out, "OUT_DIR")  # params/ and model.json never go into a training run's folder
    # Spread the params over every local device (FSDP) so no single device holds the model.
    mesh = sharding.make_mesh(ParallelConfig())
    model = load_hf(args.hf_dir, dtype=args.dtype, mesh=mesh)
    params = nnx.to_pure_dict(nnx.split(model)[1])
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(params_dir, params)
    checkpointer.wait_until_finished()
    model_fields = dataclasses.asdict(model.cfg)
    if jax.process_index() == 0:
        write_text(out / "model.json", json.dumps(model_fields, indent=2) + "\n")  # never through a link
    snippet = {"model": model_fields, "checkpoint": {"init_from": str(out)}}
    if args.dtype != "float32":
        snippet["precision"] = {"param_dtype": args.dtype}
    print(f"wrote {params_dir} (orbax params, {args.dtype}) and {out / 'model.json'}")
    print("# to start training from it, put this in your config:")
    print(yaml.safe_dump(snippet, sort_keys=False).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
