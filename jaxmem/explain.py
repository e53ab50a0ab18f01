"""`jaxmem explain CONFIG [--target T] [--top N] [--json FILE]`: the buffers live at the memory peak of
the compiled train step, each with its category, the jaxmem source line that created it, and a fix.

Also `report_oom(cfg, exc)`, for the training loop: explain an out-of-memory instead of XLA's raw text.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxmem.aot import Topology, resolve_topology
from jaxmem.config import Config, ConfigError, from_dict, load_config, to_dict
from jaxmem.model.names import ALL_NAMES
from jaxmem.plan import hlo_dump

CATEGORIES = ("param", "grad", "optimizer", "activation", "logits", "temp")
_PLUMBING = ("jaxmem/program.py", "jaxmem/remat.py", "jaxmem/sharding.py", "jaxmem/model/axes.py")
# Where per-layer values are computed (the scan call in transformer.py only owns the stacking).
_LAYER_CODE = ("jaxmem/model/layers.py", "jaxmem/model/rope.py", "jaxmem/kernels/")
SUGGESTIONS = {
    "logits": "[tokens, vocab] fp32 logits: use kernels.loss=chunked (or pallas/triton) so they are never "
              "materialized",
    "scores": "S x S attention scores: use a flash kernel (kernels.attention=pallas) or a remat policy that "
              "does not save dots (remat.preset=full or selective)",
    "param": "parameters: shard them (parallel.zero_stage=3 with a larger fsdp axis) or offload.params=host",
    "optimizer": "optimizer state: offload.optimizer=host, or precision.moment_dtype=bfloat16",
    "grad": "gradients: parallel.zero_stage>=2 shards them; precision.grad_reduce_dtype=bfloat16 halves them",
    "gathered": "all-gathered full weight (FSDP): fewer layers gathered ahead (XLA's scheduler prefetch; "
                "lower remat.every_k) or add tensor parallelism (parallel.tp)",
    "activation": "scan residual '{name}' kept for every layer: set remat.names.{name}=remat (recompute) or "
                  "=offload, or use remat.preset=full / offload_layer_inputs",
    "activation_unnamed": "per-layer scan residual: a remat policy that saves less (remat.preset=full) or "
                          "offload (remat.preset=offload_layer_inputs)",
    "temp": "temporary of one op: remat.granularity=segments shrinks the layer working set; a fused kernel "
            "removes it",
}


# ------------------------------------------------------------------ compiling with dumps


def _worker(cfg_json: str, topo_json: str) -> None:
    """Runs in a fresh process whose XLA_FLAGS ask for dumps: compile only."""
    from jaxmem.program import build_program

    cfg = from_dict(json.loads(cfg_json))
    topo = Topology(**json.loads(topo_json))
    build_program(cfg, devices=list(topo.devices())).lower().compile()


def compile_with_dumps(cfg: Config, topo: Topology, dump_dir: Path) -> None:
    flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step"
    env = dict(os.environ, JAX_PLATFORMS="cpu" if topo.name else os.environ.get("JAX_PLATFORMS", ""),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    topo_json = json.dumps({k: getattr(topo, k) for k in ("name", "gpus_per_host", "hosts", "headroom",
                                                         "host_ram_bytes")})
    code = "import sys; from jaxmem.explain import _worker; _worker(sys.argv[1], sys.argv[2])"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(to_dict(cfg)), topo_json], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"explain: the dump compile failed:\n{tail}")


# ------------------------------------------------------------------ attribution


def _rel(path: str) -> str:
    i = path.rfind("jaxmem/")
    return path[i:] if i >= 0 else path


def _model_frame(module: hlo_dump.HloModuleText, ins: hlo_dump.Instr):
    """The innermost jaxmem frame that is not step/scan plumbing, else the innermost jaxmem frame."""
    stack = module.stack(ins.frame)
    ours = [f for f in stack if "jaxmem/" in f.file and "site-packages" not in f.file]
    model = [f for f in ours if not any(_rel(f.file).startswith(p) for p in _PLUMBING) and f.function != "tag"]
    return (model or ours or [None])[0], stack


def _defining(module, name: str, depth: int = 4, prefer=None):
    """Follows copies, bitcasts and scan-residual updates back to an instruction with a model frame
    (one in `prefer` files when given)."""
    frontier, seen = [name], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            ins = module.instrs.get(n)
            if ins is None or n in seen:
                continue
            seen.add(n)
            frame, _ = _model_frame(module, ins)
            wanted = prefer or ("jaxmem/",)
            if frame is not None and not any(_rel(frame.file).startswith(p) for p in _PLUMBING) \
                    and any(_rel(frame.file).startswith(p) for p in wanted):
                return ins, frame
            nxt.extend(o for o in ins.operands if o in module.instrs)
        frontier = nxt
    ins = module.instrs.get(name)
    return ins, (_model_frame(module, ins)[0] if ins else None)


def _source_name(frame) -> str | None:
    """The checkpoint name tagged on the source line (or the statement right after it)."""
    try:
        lines = Path(frame.file).read_text().splitlines()
    except OSError:
        return None
    for line in lines[frame.line - 1: frame.line + 1]:
        m = re.search(r"CN\.([A-Z_]+)", line)
        if m:
            return m.group(1).lower()
    return None


def _shape_name(cfg: Config, shape: tuple[int, ...]) -> str | None:
    """Checkpoint name(s) a per-layer tensor of this shape can be (when the source line names none)."""
    m, t = cfg.model, cfg.train.seq_len
    if len(shape) >= 2 and shape[-1] == t and shape[-2] == t:
        return "attention_scores"
    if len(shape) >= 2 and shape[-1] == m.head_dim:
        if shape[-2] in _divided(m.n_kv_heads) and m.n_kv_heads != m.n_heads:
            return "key_proj|value_proj"
        if shape[-2] in _divided(m.n_heads):
            return "query_proj|attn_context"
    if shape and shape[-1] in _divided(m.d_ff) and shape[-1] not in _divided(m.d_model):
        return "mlp_gate|mlp_up|mlp_act"
    return None


def _divided(n: int) -> set[int]:
    return {n // d for d in (1, 2, 4, 8, 16) if n % d == 0}


def classify(cfg: Config, module, name: str, index: str, size: int) -> dict:
    ins = module.instrs.get(name)
    type_ = hlo_dump.element_type(ins.type, index) if ins else "?"
    dtype, shape = hlo_dump.parse_array_type(type_)
    op_name = ins.op_name if ins else ""
    category, key, ckpt = "temp", "temp", None
    src_ins, frame = (None, None)
    if ins is not None and ins.opcode == "while" and ins.body and index.strip("{}"):
        root = module.instrs.get(module.roots.get(ins.body, ""))
        i = int(index.strip("{}").split(",")[0])
        if root is not None and i < len(root.operands):
            src_ins, frame = _defining(module, root.operands[i], depth=6, prefer=_LAYER_CODE)
            if frame is None or not any(_rel(frame.file).startswith(p) for p in _LAYER_CODE):
                src_ins, frame = _defining(module, name)
    elif ins is not None and _is_residual_write(ins):
        src_ins, frame = _defining(module, name, depth=6, prefer=_LAYER_CODE)
    elif ins is not None:
        src_ins, frame = _defining(module, name)
    if op_name.startswith("state['params']"):
        category, key = "param", "param"
    elif op_name.startswith(("state['opt']", "state['master']")):
        category, key = "optimizer", "optimizer"
    elif op_name.startswith("batch"):
        category, key = "temp", "temp"
    elif frame is not None and "cross_entropy" in frame.file and shape and shape[-1] in _vocab_dims(cfg):
        category, key = "logits", "logits"
    elif ins is not None and (ins.opcode == "while" or _is_residual_write(ins)):
        category, key = "activation", "activation"
        ckpt = (_source_name(frame) if frame else None) or _shape_name(cfg, shape)
        if ckpt == "attention_scores":
            key = "scores"
    elif ins is not None and "all-gather" in ins.opcode:
        category, key = "temp", "gathered"
    elif "transpose(" in op_name and _is_param_shape(cfg, shape, module):
        category, key = "grad", "grad"
    elif _shape_name(cfg, shape) == "attention_scores":
        key = "scores"
    if ckpt and ckpt not in ALL_NAMES and ckpt != "attention_scores" and "|" not in ckpt:
        ckpt = _shape_name(cfg, shape)
    suggestion = SUGGESTIONS["activation_unnamed" if key == "activation" and not ckpt else key]
    if "{name}" in suggestion:
        suggestion = suggestion.format(name=ckpt.split("|")[0])
    source = f"{_rel(frame.file)}:{frame.line} {frame.function}" if frame else (op_name or name)
    return {"buffer": f"{name}{index}", "bytes": size, "shape": list(shape), "dtype": dtype,
            "category": category, "checkpoint_name": ckpt, "source": source, "op": op_name,
            "suggestion": suggestion}


def _is_residual_write(ins) -> bool:
    """A per-layer value written into its stacked [layers, ...] scan residual inside the loop body."""
    return "while/body" in ins.op_name and "dynamic_update_slice" in ins.op_name


def _vocab_dims(cfg: Config) -> set[int]:
    v = cfg.model.vocab_size
    return {v} | {v // d for d in (2, 4, 8, 16) if v % d == 0}


def _is_param_shape(cfg: Config, shape, module) -> bool:
    params = {hlo_dump.parse_array_type(i.type)[1] for i in module.instrs.values()
              if i.opcode == "parameter" and i.op_name.startswith("state['params']")}
    return tuple(shape) in params


def explain_dump(cfg: Config, dump_dir: Path, top: int = 10) -> dict:
    hlo_path, live_path, usage_path = hlo_dump.find_dump(Path(dump_dir))
    module = hlo_dump.HloModuleText(hlo_path.read_text())
    peak = hlo_dump.peak_buffers(live_path.read_text())
    total = sum(b for _, _, b in peak)
    ranked = sorted(peak, key=lambda x: -x[2])[:top]
    buffers = [classify(cfg, module, n, i, b) for n, i, b in ranked]
    usage = usage_path.read_text().splitlines()[1].strip() if usage_path else ""
    return {"peak_live_bytes": total, "buffers": buffers, "memory_usage_report": usage}


def explain(cfg: Config, topo: Topology, top: int = 10, dump_dir: str | None = None) -> dict:
    """Compiles with dumps in a subprocess and explains the peak (bytes are compiled, deviceless for a target)."""
    with tempfile.TemporaryDirectory(prefix="jaxmem-explain-") as tmp:
        where = Path(dump_dir or tmp)
        compile_with_dumps(cfg, topo, where)
        out = explain_dump(cfg, where, top)
    out["label"] = f"compiled for {topo.label} ({'deviceless' if topo.name else 'attached devices'})"
    return out


def render(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from rich.markup import escape

    console = console or Console()
    table = Table(title=f"buffers live at the peak ({result['peak_live_bytes'] / 2**30:.2f} GiB), "
                        f"{result['label']}")
    for col in ("#", "MiB", "shape", "dtype", "category", "source"):
        table.add_column(col, overflow="fold", justify="right" if col in ("#", "MiB") else "left")
    for i, b in enumerate(result["buffers"], 1):
        cat = b["category"] + (f" ({b['checkpoint_name']})" if b["checkpoint_name"] else "")
        table.add_row(str(i), f"{b['bytes'] / 2**20:,.1f}", escape(str(b["shape"])), b["dtype"], escape(cat),
                      escape(b["source"]))
    console.print(table)
    shown = set()
    for i, b in enumerate(result["buffers"], 1):
        if b["suggestion"] not in shown:
            shown.add(b["suggestion"])
            console.print(f"  #{i}: {escape(b['suggestion'])}", highlight=False)


# ------------------------------------------------------------------ out-of-memory in a real run


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "out of device memory"))


def _attached_target() -> str:
    import jax

    from jaxmem.targets import TARGETS

    kind = getattr(jax.devices()[0], "device_kind", "")
    for name, target in TARGETS.items():
        if target.description.lower() in kind.lower() or kind.lower() in target.description.lower():
            return name
    return ""


def report_oom(cfg: Config, exc: BaseException, top: int = 10, file=None) -> bool:
    """If `exc` is an out-of-memory error, prints the explain report for this run and returns True.

    The compile runs deviceless in a subprocess for the attached GPU model, so it needs no GPU memory.
    """
    if not is_oom(exc):
        return False
    from rich.console import Console

    console = Console(file=file or sys.stderr, width=160)
    console.print("[red]out of memory[/red]: the buffers live at the peak of this step (explain):")
    try:
        import jax

        topo = resolve_topology(cfg, cfg.target.name or _attached_target() or None,
                                gpus_per_host=jax.local_device_count(), hosts=jax.process_count())
        render(explain(cfg, topo, top), console)
    except Exception as e:  # the report is best effort; never mask the original error
        console.print(f"(could not explain the peak: {type(e).__name__}: {e})")
    return True


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxmem explain", description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    ap.add_argument("--target", default=None)
    ap.add_argument("--gpus-per-host", type=int, default=None)
    ap.add_argument("--hosts", type=int, default=None)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--dump-dir", default=None, help="keep XLA's dump files here")
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if args.top < 1:
        raise ConfigError(f"--top: must be >= 1, got {args.top}")
    cfg = load_config(args.config, args.overrides)
    topo = resolve_topology(cfg, args.target, args.gpus_per_host, args.hosts)
    result = explain(cfg, topo, args.top, args.dump_dir)
    render(result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0

