"""Which jaxmem source line and checkpoint name a buffer of the compiled step comes from: XLA's stack
frames for the line, the op's name stack (op_name metadata) for the checkpoint name.

The files this module treats specially are derived from the modules themselves (`module_path`), so moving
or renaming one moves its entry instead of silently breaking attribution."""
from __future__ import annotations

import re

import jaxmem.kernels.attention
import jaxmem.mesh.axes
import jaxmem.model.layers
import jaxmem.model.moe
import jaxmem.core.program
import jaxmem.core.remat
import jaxmem.mesh.sharding
from jaxmem.config.schema import Config
from jaxmem.config.validate import fixed_mesh_size
from jaxmem.config.names import name_in_op
from jaxmem.plan import hlo_dump
from jaxmem.runtime.source_paths import (_ROOT, PACKAGE, in_files, is_ours, module_path,  # noqa: F401
                                         rel_path)  # (explain's vocabulary, read through this module)

# Frames of step/scan plumbing: a buffer is attributed to the model code they call.
PLUMBING = tuple(module_path(m) for m in (jaxmem.core.program, jaxmem.core.remat, jaxmem.mesh.sharding,
                                          jaxmem.mesh.axes, "jaxmem.plan.explain"))  # (the dump compile's caller; imports us)
# Helpers that only tag a value (their frame is the checkpoint_name call, not the op that made it).
_TAG_HELPERS = (jaxmem.model.layers.tag.__qualname__,)
ATTENTION_CODE = module_path(jaxmem.kernels.attention)


def model_frame(module: hlo_dump.HloModuleText, ins: hlo_dump.Instr):
    """The innermost jaxmem frame that is not step/scan plumbing, else the innermost jaxmem frame."""
    stack = module.stack(ins.frame)
    ours = [f for f in stack if is_ours(f.file)]
    model = [f for f in ours if not in_files(f.file, PLUMBING) and f.function not in _TAG_HELPERS]
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
            wanted = prefer or (PACKAGE + "/",)
            if frame is not None and not in_files(frame.file, PLUMBING) and in_files(frame.file, wanted):
                return ins, frame
            nxt.extend(o for o in ins.operands if o in module.instrs)
        frontier = nxt
    ins = module.instrs.get(name)
    return ins, (model_frame(module, ins)[0] if ins else None)


# Ops that only move, cast or cut the value they read (operand 0; a dynamic-update-slice: the value it writes).
_MOVES = {"bitcast", "copy", "reshape", "transpose", "slice", "dynamic-slice", "convert", "reduce-precision",
          "bitcast-convert", "copy-start", "copy-done", "all-gather", "all-gather-start", "all-gather-done",
          "all-to-all", "collective-permute", "collective-permute-start", "collective-permute-done",
          "dynamic-update-slice", "get-tuple-element", "optimization-barrier", "async-done"}
# Ops that run a computation whose root is their value: a fusion, and an async-start (XLA in jax 0.12 writes
# a scan's stacked residual with an async dynamic-update-slice fusion; its async-done reads the start).
_WRAPPERS = ("fusion", "async-start")


def tagged_name(module: hlo_dump.HloModuleText, ins: hlo_dump.Instr | None, depth: int = 10) -> str | None:
    """The checkpoint name of the value `ins` holds or writes (tagged_op's name)."""
    found = tagged_op(module, ins, depth)
    return found[0] if found else None


def tagged_op(module: hlo_dump.HloModuleText, ins: hlo_dump.Instr | None,
              depth: int = 10) -> tuple[str, hlo_dump.Instr] | None:
    """(name, the op that carries it) of the value `ins` holds or writes (e.g. into a scan's stacked residual).
    The layers compute each tagged value inside a name scope carrying its name (jaxmem.config.names.scope),
    which XLA keeps in op_name. From `ins`, through ops that only move, cast or cut a value (into a fusion or
    async computation from its root, out of it through its parameters; a dynamic-update-slice: the value it
    writes), the first op whose op_name carries a name gives it. Several names (XLA merged ops of different
    scopes) -> "a|b". `depth` counts ops walked: an async fusion takes two more than a plain one.
    An op that computes something else (rope, a residual add) ends the walk: None."""
    for _ in range(depth):
        if ins is None:
            return None
        name = name_in_op(ins.op_name)
        if name:
            return name, ins
        if ins.opcode in _WRAPPERS and ins.calls:
            ins = module.instrs.get(module.roots.get(ins.calls[0], ""))
            continue
        if ins.opcode == "parameter" and ins.computation != module.entry:
            callers = [module.instrs[c] for c in module.callers.get(ins.computation, [])
                       if module.instrs[c].opcode in _WRAPPERS]
            index = int(ins.operands[0]) if ins.operands and ins.operands[0].isdigit() else None
            if not callers or index is None or index >= len(callers[0].operands):
                return None
            ins = module.instrs.get(callers[0].operands[index])
            continue
        if ins.opcode not in _MOVES or not ins.operands:
            return None
        ins = module.instrs.get(ins.operands[1 if ins.opcode == "dynamic-update-slice" else 0])
    return None


# The named scope select_attention (jaxmem.kernels) puts around plain XLA attention: the one implementation
# that materializes the S x S scores (the flash kernels never hold them).
XLA_ATTENTION_SCOPE = "attention_xla"


def is_scores(cfg: Config, shape, op_names=()) -> bool:
    """S x S attention scores: two seq_len dims, written by an op of plain XLA attention (its name scope in
    one of `op_names`, the producing op's metadata). The shape alone is no evidence: with seq_len == d_model
    a layer's [L, B, T, D] residual has two seq_len-sized dims too."""
    return list(shape).count(cfg.train.seq_len) >= 2 and any(XLA_ATTENTION_SCOPE in (n or "") for n in op_names)


def shape_name(cfg: Config, shape: tuple[int, ...], op_names=()) -> str | None:
    """Checkpoint name(s) a per-layer tensor of this shape can be (when the op's name scopes name none)."""
    m = cfg.model
    if is_scores(cfg, shape, op_names):
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
    """The vocab dim and the shards of it the run's mesh can cut (none on one device: a [B, T, D] residual with
    d_model == vocab / 2 is no logits shard there)."""
    v, devices = cfg.model.vocab_size, fixed_mesh_size(cfg.parallel)
    return {v} | {v // d for d in (2, 4, 8, 16) if v % d == 0 and (devices is None or devices % d == 0)}


# The named scope select_loss (jaxmem.kernels) puts around the loss: "loss_naive", "loss_chunked", ... (in a
# name stack as a component, or wrapped by a transformation: "jvp(loss_chunked)")
LOSS_SCOPE = re.compile(r"(^|[/(])loss_[a-z]+($|[/)])")


def in_loss_scope(op_names) -> bool:
    """Whether an op (one of `op_names`, its name stacks) ran inside the loss kernel's scope."""
    return any(LOSS_SCOPE.search(n or "") for n in op_names)
