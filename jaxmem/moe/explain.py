"""The mixture of experts' part of `jaxmem explain` (jaxmem.plan.buffer_kinds): which buffers of the
compiled step the experts' layer wrote, and what each holds."""
from __future__ import annotations

from jaxmem.config.names import MOE_NAMES, name_in_op
from jaxmem.config.schema import Config
from jaxmem.model import moe as model_moe
from jaxmem.runtime.source_paths import in_files, module_path

# What a mixture of experts' token-shaped buffer is (explain key -> the words its "why" starts with).
_MOE_CODE = (module_path(model_moe),)  # a mixture of experts' routing, dispatch, experts and combine

MOE_KINDS = {"moe_expanded": "MoE per-expert copy [experts, routed rows, width] (ragged_dot's dense GPU lowering)",
             "moe_dispatch": "MoE dispatch rows (tokens x top-k, sorted by expert) or an expert's values over them",
             "router_logits": "MoE router logits [tokens, experts]"}


def moe_kind(cfg: Config, shape, frame, op_name: str) -> str | None:
    """The MOE_KINDS key of a buffer a mixture of experts' layer wrote (its source line in jaxmem/model/moe.py
    or a MoE checkpoint name in its op_name), else None."""
    e = cfg.model.n_experts
    named = name_in_op(op_name or "")
    if not e or not (frame is not None and in_files(frame.file, _MOE_CODE)
                     or named and named.split("|")[0] in MOE_NAMES):
        return None
    local = e // max(cfg.parallel.ep, 1)  # with ep a device's copies hold its E / ep experts
    groups = {e, local} if local > 1 else {e}
    if len(shape) == 3 and groups & set(shape[:2]):
        return "moe_expanded"
    return "router_logits" if shape and shape[-1] == e else "moe_dispatch"


def refine(b, found: tuple) -> tuple:
    """A routed-rows buffer, whatever its dims resemble (tiny-moe's width is half its vocab): the MoE kind
    of a temp, logits or activation buffer that is not weight-shaped."""
    cat, key, why, ckpt = found
    kind = moe_kind(b.cfg, b.shape, b.frame, b.op_name) if cat in ("temp", "logits", "activation") and not b.weight \
        else None
    if kind is None:
        return found
    named = name_in_op(b.op_name)
    ckpt = ckpt or (named if named and named.split("|")[0] in MOE_NAMES else None)
    cat, key = ("activation", "activation") if cat == "activation" else ("temp", kind)
    return cat, key, f"{MOE_KINDS[kind]}: " + why.removeprefix("d(logits) [tokens, vocab] "), ckpt
