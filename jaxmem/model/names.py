"""The documented set of checkpoint names the layers tag; remat policies key on these."""
import enum


class CheckpointName(enum.StrEnum):
    LAYER_INPUT = "layer_input"  # residual stream entering a layer, tagged at its start
    ATTN_NORM = "attn_norm"  # RMSNorm output feeding q/k/v
    QUERY_PROJ = "query_proj"
    KEY_PROJ = "key_proj"
    VALUE_PROJ = "value_proj"
    ATTN_CONTEXT = "attn_context"  # attention output before the output projection
    ATTN_OUT = "attn_out"  # after the output projection
    MLP_NORM = "mlp_norm"  # MLP input: RMSNorm output
    MLP_GATE = "mlp_gate"
    MLP_UP = "mlp_up"
    MLP_ACT = "mlp_act"  # silu(gate) * up
    MLP_OUT = "mlp_out"


ALL_NAMES = tuple(n.value for n in CheckpointName)
