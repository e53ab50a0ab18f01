"""A LoRA run's model with its adapters merged into the base, for export (`jaxmem merge-lora`, `jaxmem export-hf`):
each frozen linear dequantized and W + scale * A B folded into the adapted ones."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxmem.lora.adapters import merge
from jaxmem.lora.frozen import layer_shapes, unstore
from jaxmem.lora.frozen_vocab import unstore_rows



def merged_params(prog, state: dict) -> dict:
    """The model's params (host arrays, in the param dtype) with the adapters merged into the base."""
    setup = prog.layout.part("lora")
    shapes = layer_shapes(prog.cfg, setup)
    base, adapters = jax.device_get(state["base"]), jax.device_get(state["params"])
    params = dict(base, layers=dict(base["layers"]))
    for name in setup.frozen:  # one layer at a time: a quantized base is never dequantized whole on a device
        stored = base["layers"][name]
        n_layers = jax.tree.leaves(stored)[0].shape[0]
        params["layers"][name] = np.stack([np.asarray(unstore(setup, jax.tree.map(lambda x: x[i], stored),
                                                              shapes[name], jnp.float32))
                                           for i in range(n_layers)])
    if setup.quantize_embeddings:  # stored per vocab row (frozen_vocab): back to [V, D] / the head's [D, V]
        for key in ("embed", "lm_head"):
            if isinstance(base.get(key), dict):
                n_rows, d = jax.tree.leaves(base[key])[0].shape[0], prog.cfg.model.d_model
                w = np.concatenate([np.asarray(unstore_rows(jax.tree.map(lambda x: x[i:i + 8192], base[key]), d,
                                                            jnp.float32)) for i in range(0, n_rows, 8192)])
                params[key] = w.T if key == "lm_head" else w
    merged = merge(params, jax.tree.map(np.asarray, adapters), setup.scale)
    dtype = prog.precision.param
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(dtype)), merged)
