"""The documented set of checkpoint names the layers tag; remat policies key on these.

Each tagged value is also computed inside a jax name scope carrying its name (`scope`), so the name reaches
XLA's op metadata (`op_name`, e.g. ".../jvp(...)/ckpt.mlp_gate/dot_general") and `jaxmem explain` reads it
from there (`name_in_op`). The scope is only a name: remat policies match on `checkpoint_name`, not on it.
"""
from __future__ import annotations

import contextlib
import enum
import re


class CheckpointName(enum.StrEnum):
    LAYER_INPUT = "layer_input"  # residual stream entering a layer, tagged at its start
    ATTN_NORM = "attn_norm"  # RMSNorm output feeding q/k/v
    QUERY_PROJ = "query_proj"
    KEY_PROJ = "key_proj"
    VALUE_PROJ = "value_proj"
    ATTN_CONTEXT = "attn_context"  # attention output before the output projection
    FLASH_RESIDUALS = "flash_residuals"  # a flash kernel's output and per-row logsumexp, its backward's residuals
    ATTN_OUT = "attn_out"  # after the output projection
    MLP_NORM = "mlp_norm"  # MLP input: RMSNorm output
    MLP_GATE = "mlp_gate"
    MLP_UP = "mlp_up"
    MLP_ACT = "mlp_act"  # silu(gate) * up
    MLP_OUT = "mlp_out"  # the MLP output (a mixture of experts: the weighted combine of its experts)
    ROUTER_LOGITS = "router_logits"  # mixture of experts: [tokens, experts] router logits (fp32)
    MOE_DISPATCH = "moe_dispatch"  # the token rows sorted by expert, [tokens * experts_per_token, D] (ep: received)
    EXPERT_GATE = "expert_gate"  # the experts' gate projections over the dispatched rows
    EXPERT_UP = "expert_up"
    EXPERT_ACT = "expert_act"  # act(gate) * up of the dispatched rows
    EXPERT_OUT = "expert_out"  # the experts' down projections, before the weighted combine


ALL_NAMES = tuple(n.value for n in CheckpointName)
# Tagged only by a mixture-of-experts MLP (jaxmem.model.moe); a dense layer tags the rest.
MOE_NAMES = tuple(n.value for n in (CheckpointName.ROUTER_LOGITS, CheckpointName.MOE_DISPATCH,
                                    CheckpointName.EXPERT_GATE, CheckpointName.EXPERT_UP, CheckpointName.EXPERT_ACT,
                                    CheckpointName.EXPERT_OUT))

SCOPE_PREFIX = "ckpt."  # name-stack component of a tagged computation: "ckpt.<checkpoint name>"
_IN_OP = re.compile(re.escape(SCOPE_PREFIX) + r"(" + "|".join(sorted(ALL_NAMES, key=len, reverse=True)) + r")(?!\w)")


def scope_name(name: CheckpointName | str) -> str:
    return f"{SCOPE_PREFIX}{CheckpointName(name).value}"


@contextlib.contextmanager
def scope(name: CheckpointName | str):
    """Computes what is inside under the name scope of checkpoint name `name` (XLA's op_name shows it)."""
    import jax

    with jax.named_scope(scope_name(name)):
        yield


def name_in_op(op_name: str) -> str | None:
    """The checkpoint name whose scope an op was traced in, from its op_name: the innermost scope; for an op
    XLA merged from ops of several scopes ("prefix/(ckpt.a/dot:ckpt.b/dot)"), their names as "a|b"."""
    op_name = op_name or ""
    found = list(_IN_OP.finditer(op_name))
    if not found:
        return None
    if ":" in op_name[found[0].start():]:
        return "|".join(dict.fromkeys(m.group(1) for m in found))
    return found[-1].group(1)
