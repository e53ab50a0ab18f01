"""`jaxmem train CONFIG [key=value ...]`: the command line of a config-driven, resumable training run
(the loop itself is the library jaxmem.train: `jaxmem.train.run(cfg)`)."""
from __future__ import annotations

import sys
from pathlib import Path

import jax

from jaxmem.loader import load_config
from jaxmem.runtime import cpu_host, distributed
from jaxmem.train import TrainError, run, run_lock
from jaxmem.train.loop import SaveError
from jaxmem.train.save_clock import stopped_line
from jaxmem.train.signals import EXIT_ERROR, EXIT_LOCKED, EXIT_SAVED, exit_now
from jaxmem.cli.help import HelpFormatter
from jaxmem.plan import allocator
from jaxmem.plan.explain import report_oom

_DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
_USAGE = "usage: jaxmem train [CONFIG.yaml] [key=value ...]   (overrides only: CONFIG is configs/tiny.yaml)"
_DESCRIPTION = """\
Train a config: load CONFIG (YAML) with dotted key=value overrides, validate every key before anything is
built, then train on the attached devices. The run writes out_dir/config.resolved.yaml (the resolved config),
out_dir/metrics.jsonl (one record per logged step) and out_dir/checkpoints/; starting again in an out_dir
that holds checkpoints resumes from the latest complete one. With overrides but no CONFIG, the embedded
tiny config (configs/tiny.yaml) is used. On a machine without a GPU, XLA gets as many virtual CPU devices as
the parallel.* axes take (unless XLA_FLAGS sets a count). checkpoint.init_from may name a Hugging Face folder:
with no model section, its config.json gives the model. Key reference: docs/config.md, `jaxmem config`,
`jaxmem list`."""
_EPILOG = """\
examples:
  jaxmem train configs/tiny.yaml out_dir=runs/demo             # the demo: a tiny model on CPU
  jaxmem train configs/tiny.yaml train.steps=200 parallel.fsdp=4 parallel.tp=2 parallel.rules=fsdp_tp
  jaxmem train train.steps=10 out_dir=runs/quick               # overrides only: the tiny config
  jaxmem train configs/llama3-8b-8xh100.yaml checkpoint.init_from=out/ckpt   # from `jaxmem import-hf`
  jaxmem train configs/lora/llama3-8b-qlora-1x4090.yaml checkpoint.init_from=/path/to/hf_model  # an HF folder"""


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(config path or None, overrides) from `[CONFIG] [key=value ...]`."""
    if argv and "=" not in argv[0]:
        return argv[0], argv[1:]
    return None, list(argv)




def _as_program() -> bool:
    """Whether this process is the `jaxmem` command itself (`jaxmem ...`, `python -m jaxmem.cli ...`), which may
    end at once, rather than a program calling `jaxmem.cli.main` (a test, a notebook)."""
    cli = sys.modules.get("jaxmem.cli")
    return cli is not None and getattr(sys.modules.get("__main__"), "main", None) is getattr(cli, "main", False)


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="jaxmem train", usage=_USAGE[len("usage: "):], description=_DESCRIPTION,
                                 epilog=_EPILOG, formatter_class=HelpFormatter)
    ap.add_argument("items", nargs="*", metavar="CONFIG [key=value ...]",
                    help="a config YAML file, then dotted key=value overrides (e.g. train.steps=10)")
    if not argv:  # nothing to train: say how, rather than start a run nobody asked for
        ap.print_help()
        return 0
    path, overrides = parse_args(ap.parse_args(argv).items)
    if path is None:
        if _DEFAULT_CONFIG.is_file():
            path = str(_DEFAULT_CONFIG)
            print("jaxmem train: no CONFIG given; using the embedded tiny config (configs/tiny.yaml)",
                  file=sys.stderr)
        else:
            print("jaxmem train: no CONFIG given; using the schema's defaults (the tiny preset)", file=sys.stderr)
    cfg = load_config(path, overrides)
    # a CPU host gets the devices the mesh takes (before the backend starts; docs/config.md, parallel)
    cpu_host.give_mesh_its_devices(cfg.parallel, distributed.expected_processes(cfg.distributed))
    distributed.initialize(cfg.distributed)  # starts no backend; the lock needs the process index
    try:
        # before anything is written into out_dir, which is never the config file's folder nor someone else's
        with run_lock.owned(cfg.out_dir, config_path=path):
            allocator.prepare(cfg, "train", out_dir=cfg.out_dir)  # before the backend starts (docs/allocator.md)
            summary = run(cfg)
    except run_lock.RunLockError as e:
        print(f"jaxmem train: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except SaveError as e:
        if _as_program():  # not minutes in orbax's threads on the way out, nor their tracebacks
            exit_now(f"jaxmem train: {e}", EXIT_ERROR)
        print(f"jaxmem train: {e}", file=sys.stderr)
        return EXIT_ERROR
    except TrainError as e:
        print(f"jaxmem train: {e}", file=sys.stderr)
        report_oom(cfg, e)
        return EXIT_ERROR
    records = summary["records"]
    if summary.get("stopped_by"):
        if jax.process_index() == 0:
            print(f"jaxmem train: {stopped_line(summary, cfg.checkpoint.enabled)}", file=sys.stderr, flush=True)
        return EXIT_SAVED
    if records and jax.process_index() == 0:
        print(f"jaxmem train: steps {summary['start_step']}->{summary['final_step']}, loss "
              f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}; outputs in {cfg.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
