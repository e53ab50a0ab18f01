"""The user's reference, generated from the code: `jaxmem config` (the resolved config as commented YAML),
`jaxmem list` (model presets, remat presets and checkpoint names, GPU targets, kernel implementations)
and docs/config.md.

Every key's description lives once, next to its field in `jaxmem.config.schema` (`field_docs`); this module only
renders it.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxmem.cli.help import HelpFormatter
from jaxmem.config.schema import Config, ModelConfig, field_docs, registered_choices, to_dict
from jaxmem.loader import load_config
from jaxmem.core import remat
from jaxmem.config.names import ALL_NAMES
from jaxmem.config.schema import RematConfig
from jaxmem.config.targets import TARGETS
from jaxmem import kernels
from jaxmem.config.schema import KernelConfig
from jaxmem.model.presets import PRESETS, param_count, resolve_model
from jaxmem.optim import states

DOCS_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "config.md"
REGENERATE = "jaxmem config --markdown docs/config.md"
_FUSED_KINDS = " / ".join(kind.name for kind in states.KINDS if kind.fused_host)  # the host kernel's kinds

# What each tagged value is (jaxmem.config.names.CheckpointName), for `jaxmem list remat`.
CHECKPOINT_NAME_HELP = {
    "layer_input": "residual stream entering a decoder layer",
    "attn_norm": "RMSNorm output feeding the q/k/v projections",
    "query_proj": "query projection output",
    "key_proj": "key projection output",
    "value_proj": "value projection output",
    "attn_context": "attention output, before the output projection",
    "flash_residuals": "the Pallas flash kernel's output and logsumexp (kept: its forward does not rerun)",
    "attn_out": "attention output projection",
    "mlp_norm": "RMSNorm output feeding the MLP",
    "mlp_gate": "MLP gate projection output",
    "mlp_up": "MLP up projection output",
    "mlp_act": "silu(gate) * up",
    "mlp_out": "MLP down projection output (the layer's output)",
    "router_logits": "mixture of experts: router logits [tokens, experts], fp32",
    "moe_dispatch": "mixture of experts: token rows sorted by expert [tokens x top-k, d_model]",
    "expert_gate": "mixture of experts: gate projections of the dispatched rows",
    "expert_up": "mixture of experts: up projections of the dispatched rows",
    "expert_act": "mixture of experts: act(gate) * up of the dispatched rows",
    "expert_out": "mixture of experts: down projections of the dispatched rows, before the combine",
}

# What each kernel implementation is, for `jaxmem list kernels`.
KERNEL_HELP = {
    ("loss", "naive"): "materializes the full [tokens, vocab] logits",
    ("loss", "chunked"): "tiles of loss_block_t tokens x loss_block_v vocab columns; smallest scratch, cuBLAS",
    ("loss", "pallas"): "Pallas logsumexp forward kernel + the chunked tiled backward; compiled on GPU, "
                        "interpreted on CPU",
    ("attention", "xla"): "plain attention; keeps the S x S scores",
    ("attention", "pallas"): "Pallas flash attention (compiled on GPU, interpreted on CPU)",
    ("attention", "cudnn"): "cuDNN fused attention; NVIDIA GPU only",
    ("norm", "xla"): "XLA, which fuses the RMSNorm itself",
    ("norm", "pallas"): "Pallas RMSNorm kernel (compiled on GPU, interpreted on CPU)",
    ("grouped_matmul", "ragged_dot"): "jax.lax.ragged_dot; XLA:GPU lowers it densely (G x the FLOPs)",
    ("grouped_matmul", "blocked"): "XLA loop over blocks of one expert's rows; no dense [rows, G x D] lhs",
    ("grouped_matmul", "pallas"): "Pallas (Triton) grouped GEMM over the same blocks (compiled on GPU, "
                                  "interpreted on CPU)",
    ("host_update", "xla"): "XLA:CPU code under host compute; one loop per output (master, m, v, params)",
    ("host_update", "fused"): "one pass per tensor (C++ through XLA's FFI, built here on first use); CPU or GPU "
                              f"programs, each device's shard; {_FUSED_KINDS} moments, fp32 master, bf16 params",
}


# ---------------------------------------------------------------- rendering values and types


def _inline(value: Any) -> str:
    """A value as one line of YAML flow style ('' for an empty string, {} for an empty mapping)."""
    text = yaml.safe_dump([value], default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text[1:-1]


def _type_text(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " / ".join(_inline(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join([_type_text(a) for a in args] + ["null"])
    if tp is dict or origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _leaf_docs():
    """(dotted key, type, default, description) of every leaf key (sections left out)."""
    for key, f, text in field_docs():
        tp = _field_type(key, f)
        if dataclasses.is_dataclass(tp):
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        yield key, tp, default, text


def _field_type(key: str, f: dataclasses.Field) -> Any:
    """A key's type; an open key's the values its owner registered (precision.moment_dtype: jaxmem.optim.states)."""
    if "choices" in f.metadata:
        return Literal[tuple(registered_choices(f.metadata["choices"], f.metadata["owner"]))]
    return _hints(_owner(key))[f.name]


def _owner(key: str) -> type:
    cls = Config
    for part in key.split(".")[:-1]:
        cls = _hints(cls)[part]
    return cls


# ---------------------------------------------------------------- jaxmem config


def baseline(cfg: Config) -> Config:
    """What `cfg` is compared against: the schema's defaults, with model.* filled from the config's own
    model.preset (a key the preset fills is a default, not a choice), model.preset itself left at its default."""
    model = resolve_model(ModelConfig(preset=cfg.model.preset), {}) if cfg.model.preset != "custom" \
        else ModelConfig(preset="custom")
    return dataclasses.replace(Config(), model=dataclasses.replace(model, preset=ModelConfig().preset))


def differing(cfg, base=None) -> dict:
    """The keys of `cfg` whose values differ from `base` (default: `baseline(cfg)`), as nested plain data;
    sections with no differing key are left out."""
    base = baseline(cfg) if base is None else base
    out = {}
    for f in dataclasses.fields(cfg):
        value, default = getattr(cfg, f.name), getattr(base, f.name)
        if dataclasses.is_dataclass(value):
            sub = differing(value, default)
            if sub:
                out[f.name] = sub
        elif value != default:
            out[f.name] = to_dict(value) if isinstance(value, dict) else value
    return out


def config_yaml(cfg: Config, diff: bool = False) -> str:
    """The resolved config as YAML, each key with its description as a comment and its default where the value
    differs from it; `diff`: only the keys that differ."""
    docs = {key: text for key, _, text in field_docs()}
    base = to_dict(baseline(cfg))
    lines: list[str] = []

    def emit(obj, base_obj, prefix: str, indent: int) -> None:
        for f in dataclasses.fields(obj):
            key, value = prefix + f.name, getattr(obj, f.name)
            pad = "  " * indent
            if dataclasses.is_dataclass(value):
                start = len(lines)
                lines.append(f"{pad}{f.name}:  # {docs[key]}")
                emit(value, base_obj[f.name], key + ".", indent + 1)
                if diff and len(lines) == start + 1:
                    lines.pop()  # no differing key in this section
                continue
            raw_value = to_dict(value) if isinstance(value, dict) else value
            default = base_obj[f.name]
            same = raw_value == default
            if diff and same:
                continue
            note = "" if same else f" (default: {_inline(default)})"
            lines.append(f"{pad}{f.name}: {_inline(raw_value)}  # {docs[key]}{note}")

    emit(cfg, base, "", 0)
    return "\n".join(lines) + "\n" if lines else "{}  # every key is at its default\n"


def _config_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="jaxmem config", formatter_class=HelpFormatter,
        description="Print the fully resolved config (the YAML file, its base: chain, the dotted overrides and "
                    "the model preset) as YAML. Each key carries its description as a comment, and its default "
                    "where the value differs from it. The output is itself a valid config.",
        epilog="examples:\n"
               "  jaxmem config configs/tiny.yaml                  # every key, with descriptions\n"
               "  jaxmem config configs/tiny.yaml --diff           # only what differs from the defaults\n"
               "  jaxmem config configs/llama3-8b-8xh100.yaml remat.preset=full --diff\n"
               "  jaxmem config                                    # the defaults\n"
               f"  {REGENERATE}     # regenerate the config reference\n")
    ap.add_argument("items", nargs="*", metavar="CONFIG [key=value ...]",
                    help="a config YAML file (optional), then dotted key=value overrides")
    ap.add_argument("--diff", action="store_true", help="only the keys whose values differ from the defaults")
    ap.add_argument("--markdown", nargs="?", const="-", default=None, metavar="FILE",
                    help="write the config reference (docs/config.md) to FILE, or print it with no FILE")
    return ap


def config_main(argv: list[str] | None = None) -> int:
    args = _config_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.markdown is not None:
        text = config_markdown()
        if args.markdown == "-":
            sys.stdout.write(text)
        else:
            Path(args.markdown).write_text(text)
            print(f"wrote {args.markdown}")
        return 0
    path = args.items[0] if args.items and "=" not in args.items[0] else None
    overrides = args.items[1:] if path else args.items
    cfg = load_config(path, overrides)
    sys.stdout.write(config_yaml(cfg, diff=args.diff))
    return 0


# ---------------------------------------------------------------- docs/config.md


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_markdown() -> str:
    """docs/config.md: every key of every section, with its type, default and description."""
    out = [
        "# Config reference",
        "",
        f"<!-- Generated from the field descriptions in jaxmem/config/schema.py; do not edit. Regenerate: {REGENERATE} -->",
        "",
        "A run config is a YAML file of the sections below; any key can also be given as a dotted `key=value`",
        "override on the command line (`jaxmem train configs/tiny.yaml train.steps=10`), and `base: OTHER.yaml`",
        "extends another config. `jaxmem config CONFIG [--diff]` prints a resolved config with these",
        "descriptions; `jaxmem list presets|remat|targets|kernels` lists the names the keys accept.",
        "",
        "Keys of `model.*` left unset are filled from `model.preset`; the default shown for them is the schema's.",
        "",
    ]
    current = None
    for key, f, text in field_docs():
        tp = _field_type(key, f)
        if dataclasses.is_dataclass(tp):
            out += ["", f"## `{key}`", "", text[0].upper() + text[1:] + ".", "",
                    "| key | type | default | description |", "|---|---|---|---|"]
            current = key
            continue
        if current is None:  # top-level keys (out_dir)
            out += ["## Top level", "", "| key | type | default | description |", "|---|---|---|---|"]
            current = ""
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out.append(f"| `{key}` | {_cell(_type_text(tp))} | `{_cell(_inline(default))}` | {_cell(text)} |")
    return "\n".join(out) + "\n"


def write_docs(path: str | Path = DOCS_CONFIG) -> Path:
    path = Path(path)
    path.write_text(config_markdown())
    return path


# ---------------------------------------------------------------- jaxmem list


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _attention_kinds(m: ModelConfig) -> str:
    if not m.sliding_window:
        return "global"
    if not m.global_every:
        return f"local {m.sliding_window}"
    return f"{m.global_every - 1} local {m.sliding_window} : 1 global"


def list_presets() -> str:
    rows = [("preset", "d_model", "n_layers", "heads/kv x head_dim", "d_ff", "vocab", "max_seq_len", "attention",
             "params")]
    for name in PRESETS:
        m = resolve_model(ModelConfig(preset=name), {})
        rows.append((name, str(m.d_model), str(m.n_layers), f"{m.n_heads}/{m.n_kv_heads} x {m.head_dim}", str(m.d_ff),
                     str(m.vocab_size), str(m.max_seq_len), _attention_kinds(m), _count(param_count(m))))
    return ("model presets (model.preset; `custom`: give every model.* shape key yourself):\n" + _table(rows))


def list_remat() -> str:
    lines = ["remat presets (remat.preset): what each keeps between the forward and the backward pass, besides "
             "each checkpointed group's input; everything else is recomputed"]
    rows = []
    for name, spec in remat.PRESETS.items():
        cfg = RematConfig(preset=name)
        if not remat.uses_checkpoint(cfg):
            rows.append((name, "no checkpointing: every activation stays on the device"))
            continue
        choices = remat.name_choices(cfg)
        kept = [n for n, c in choices.items() if c == "device"]
        off = [n for n, c in choices.items() if c == "offload"]
        parts = []
        if kept:
            parts.append("keeps " + ", ".join(kept))
        if off:
            parts.append("offloads to host " + ", ".join(off))
        if spec.get("base"):
            parts.append(f"keeps what jax's {spec['base']} policy saves (matmul outputs)")
        rows.append((name, "; ".join(parts) or "keeps only each checkpointed group's input"))
    lines.append(_table(rows, indent="  "))
    lines += ["", "checkpoint names (remat.names.NAME: remat | device | offload; an entry overrides the "
              "preset's choice for that name, the others keep the preset's; with preset none any entry turns "
              "checkpointing on and unlisted names are recomputed):"]
    lines.append(_table([(n, CHECKPOINT_NAME_HELP.get(n, "")) for n in ALL_NAMES], indent="  "))
    return "\n".join(lines)


def list_targets() -> str:
    rows = [("target", "device", "memory", "HBM bandwidth", "bf16 dense", "host RAM", "sm")]
    for name, t in TARGETS.items():
        rows.append((name, t.description, f"{t.hbm_bytes / 1024**3:.1f} GiB", f"{t.hbm_bandwidth / 1e12:.2f} TB/s",
                     f"{t.bf16_flops / 1e12:.0f} TFLOP/s", f"{t.host_ram_bytes / 1024**3:.0f} GiB",
                     "{}.{}".format(*t.compute_capability)))
    return "GPU targets (target.name, --target):\n" + _table(rows)


def list_kernels() -> str:
    hints = _hints(KernelConfig)
    one_gpu, gpus, cpu = (kernels.resolve(KernelConfig(), platform, n) for platform, n in
                          (("gpu", 1), ("gpu", 8), ("cpu", 1)))
    lines = ["kernel implementations (kernels.loss / kernels.attention / kernels.norm / kernels.grouped_matmul / "
             "kernels.host_update); `auto` picks per platform and device count:"]
    for op in ("loss", "attention", "norm", "grouped_matmul"):
        on_gpu = (f"{one_gpu[op]} on gpu" if one_gpu[op] == gpus[op]
                  else f"{one_gpu[op]} on one gpu, {gpus[op]} on several")
        if op == "attention":  # kernels.resolve looks for the library on the machine it runs on
            on_gpu = f"cudnn on gpu where the cuDNN library loads, else pallas (here: {one_gpu[op]})"
        lines.append(f"  kernels.{op}: auto -> {on_gpu}, {cpu[op]} on cpu")
        impls = [a for a in typing.get_args(hints[op]) if a != "auto"]
        lines.append(_table([(impl, KERNEL_HELP.get((op, impl), "")) for impl in impls], indent="    "))
    # decided where the update is built (jaxmem.optim.fused_host.choose): it also asks the state kind
    lines.append("  kernels.host_update: auto -> xla on gpu (fused there on request: compiled, not yet measured on a "
                 "gpu) and over several devices (fused on request); fused in a one-device cpu program whose state "
                 "it covers and where it builds, else xla")
    lines.append(_table([(impl, KERNEL_HELP[("host_update", impl)]) for impl in ("xla", "fused")], indent="    "))
    return "\n".join(lines)


LISTS = {"presets": list_presets, "remat": list_remat, "targets": list_targets, "kernels": list_kernels}


def _table(rows: list[tuple], indent: str = "  ") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def list_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxmem list", formatter_class=HelpFormatter,
        description="List the names config keys accept: model presets with their shapes and parameter counts "
                    "(model.preset), remat presets with what each keeps and the checkpoint names "
                    "(remat.preset, remat.names), GPU targets (target.name, --target) and kernel "
                    "implementations with what `auto` picks on GPU and CPU (kernels.*). With no WHAT, all four.",
        epilog="examples:\n"
               "  jaxmem list presets\n"
               "  jaxmem list remat\n"
               "  jaxmem list targets\n"
               "  jaxmem list kernels\n")
    ap.add_argument("what", nargs="*", metavar="WHAT", help="one or more of " + ", ".join(LISTS))
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    for w in args.what:
        if w not in LISTS:
            ap.error(f"WHAT: {w!r} is not one of {', '.join(LISTS)}")
    print("\n\n".join(LISTS[w]() for w in (args.what or LISTS)))
    return 0


if __name__ == "__main__":  # python -m jaxmem.cli.config_cmd: regenerate docs/config.md
    print(f"wrote {write_docs()}")
