"""A reference policy for a full fine-tune (preference.reference=model; GRPO with rl.beta > 0): a frozen bf16
copy of the initial weights beside the train state (its frozen part, jaxmem.core.plugins.FROZEN: sharded like
the params, never differentiated, never saved; a resume rebuilds it from where the initial weights came from).
The reference forward reads it in place of the params (jaxmem.core.objective)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.core.plugins import FROZEN, ProgramPlugin
from jaxmem.core.step_state import assemble_state

COPY_DTYPE = jnp.bfloat16


def layout_part(trainable: dict) -> dict:
    """The Layout's frozen part: the params' tree in COPY_DTYPE on the params' specs (the planner's bill
    counts it as the state's frozen bytes)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, COPY_DTYPE), trainable["abstract_params"])
    return {"frozen_abstract": abstract, "frozen_specs": trainable["param_specs"], "frozen_is_reference": True}


def _copy(params):
    return jax.tree.map(lambda x: x.astype(COPY_DTYPE), params)


class ReferenceCopy(ProgramPlugin):
    donates_params = False  # the copy is made from the loaded params
    assembles_state = False  # the state's frozen part is not assemble_state's (no layer-at-a-time host init)

    def frozen_layout(self, layout) -> dict:
        return {FROZEN: (layout.frozen_abstract, layout.frozen_specs)}

    def fresh_state(self, prog, params, seed) -> dict:
        state = assemble_state(prog.cfg, prog.precision, prog.optimizer, params)
        state[FROZEN] = _copy(params)
        return state

    def frozen_part(self, prog, load_params):
        """The copy rebuilt from the initial weights: checkpoint.init_from, else train.seed."""
        cfg, out = prog.cfg, prog.state_shardings[FROZEN]
        if cfg.checkpoint.init_from:
            return jax.jit(_copy, out_shardings=out)(load_params(prog, cfg.checkpoint.init_from))
        return jax.jit(lambda: _copy(prog.fresh_params(cfg.train.seed)), out_shardings=out)()

    def reference_inputs(self, params, frozen):
        return frozen, None
