"""What the train step takes and gives by name: the state's layout (assemble_state), the batch's arrays
(split_batch; the batch's keys: jaxmem.io.data.batch_keys) and the named scopes of its two phases. The program builds its step from these;
data sources, checkpoints and the planner read them without importing the program."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.optim.layerwise import init_opt_state
from jaxmem.core.precision import Precision, init_loss_scale
from jaxmem.config.schema import Config

# The jax.named_scope of the gradient computation (forward, backward, micro-batch accumulation) and of the
# optimizer update in the step; they show up in the compiled HLO's op_name metadata.
GRADS_SCOPE = "grads"
UPDATE_SCOPE = "optimizer_update"


def split_batch(batch: dict) -> tuple:
    """(inputs, labels, segment_ids or None, positions or None), each [A, rows, T]."""
    if "tokens" in batch:
        tokens = batch["tokens"]
        return tokens[..., :-1], tokens[..., 1:], None, None
    return batch["inputs"], batch["labels"], batch.get("segment_ids"), batch.get("positions")


def assemble_state(cfg: Config, prec: Precision, opt, params) -> dict:
    """The train state's layout, the one place that defines it."""
    master = jax.tree.map(lambda x: x.astype(jnp.float32), params) if prec.master else None
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": init_opt_state(opt, master or params)}
    if master is not None:
        state["master"] = master
    if cfg.precision.loss_scale.enabled:
        state["loss_scale"] = init_loss_scale(cfg.precision.loss_scale)
    if cfg.optimizer.update_in_backward:
        state["grad_norm"] = jnp.zeros((), jnp.float32)  # the previous step's, which clips this one
    return state


def leaf_name(path) -> str:
    """'opt.layers.0.mu.wq' for a key path (the names the shape checks and a pipeline's stage files use)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
