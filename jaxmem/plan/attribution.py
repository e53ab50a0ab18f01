"""Which jaxmem source line and checkpoint name a buffer of the compiled step comes from (XLA's stack frames)."""
from __future__ import annotations

import re
from pathlib import Path

from jaxmem.config import Config
from jaxmem.plan import hlo_dump

# Frames of step/scan plumbing: a buffer is attributed to the model code they call.
PLUMBING = ("jaxmem/program.py", "jaxmem/remat.py", "jaxmem/sharding.py", "jaxmem/model/axes.py",
             "jaxmem/plan/explain.py")  # (the dump compile's caller)


def rel_path(path: str) -> str:
    i = path.rfind("jaxmem/")
    return path[i:] if i >= 0 else path


def model_frame(module: hlo_dump.HloModuleText, ins: hlo_dump.Instr):
    """The innermost jaxmem frame that is not step/scan plumbing, else the innermost jaxmem frame."""
    stack = module.stack(ins.frame)
    ours = [f for f in stack if "jaxmem/" in f.file and "site-packages" not in f.file]
    model = [f for f in ours if not any(rel_path(f.file).startswith(p) for p in PLUMBING) and f.function != "tag"]
    return (model or ours or [None])[0], stack


def defining(module, name: str, depth: int = 4, prefer=None):
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
            frame, _ = model_frame(module, ins)
            wanted = prefer or ("jaxmem/",)
            if frame is not None and not any(rel_path(frame.file).startswith(p) for p in PLUMBING) \
                    and any(rel_path(frame.file).startswith(p) for p in wanted):
                return ins, frame
            nxt.extend(o for o in ins.operands if o in module.instrs)
        frontier = nxt
    ins = module.instrs.get(name)
    return ins, (model_frame(module, ins)[0] if ins else None)


def tagged_name(frame) -> str | None:
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


def is_scores(cfg: Config, shape, frame=None) -> bool:
    """S x S attention scores: two seq_len dims (when d_model == seq_len too, a heads dim after the first or
    attention code)."""
    m, t = cfg.model, cfg.train.seq_len
    if list(shape).count(t) < 2:
        return False
    heads = (divided(m.n_heads) | divided(m.n_kv_heads) | divided(max(m.n_heads // m.n_kv_heads, 1))) - {1}
    return m.d_model != t or any(d in heads for d in shape[1:]) or (frame is not None and "attention" in frame.file)


def shape_name(cfg: Config, shape: tuple[int, ...], frame=None) -> str | None:
    """Checkpoint name(s) a per-layer tensor of this shape can be (when the source line names none)."""
    m = cfg.model
    if is_scores(cfg, shape, frame):
        return "attention_scores"
    if len(shape) >= 2 and shape[-1] == m.head_dim:
        if shape[-2] in divided(m.n_kv_heads) and m.n_kv_heads != m.n_heads:
            return "key_proj|value_proj"
        if shape[-2] in divided(m.n_heads):
            return "query_proj|attn_context"
    if shape and shape[-1] in divided(m.d_ff) and shape[-1] not in divided(m.d_model):
        return "mlp_gate|mlp_up|mlp_act"
    return None


def divided(n: int) -> set[int]:
    return {n // d for d in (1, 2, 4, 8, 16) if n % d == 0}


def vocab_dims(cfg: Config) -> set[int]:
    v = cfg.model.vocab_size
    return {v} | {v // d for d in (2, 4, 8, 16) if v % d == 0}
