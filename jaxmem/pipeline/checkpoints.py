"""Pipeline checkpoints: a pp run saves {"stages": [state of each stage]} (the `stages` item of
jaxmem.pipeline.stage_store, written by each stage's own processes) and its layer counts (meta "pp_layers"). A resume with the same counts restores each stage straight onto its shardings; any
other layout (other counts, other pp, no pp) and a non-pp checkpoint under a pipeline go through host
memory: the saved state is read onto the host, re-cut by layer ranges (jaxmem.pipeline.partition) and
placed on the new layout's shardings. Parameters and optimizer state keep their logical identity."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxmem.model import abstract_model
from jaxmem.optim.choice import make_optimizer
from jaxmem.pipeline import partition
from jaxmem.pipeline.stage_store import STAGES
from jaxmem.core.checkpoint import check_state_kind
from jaxmem.core.precision import Precision
from jaxmem.core.step_state import assemble_state
from jaxmem.config.schema import Config

PP_META = "pp_layers"


def on_cpu_host(tree):
    """The same shapes and dtypes, placed on the host (the CPU backend) for a restore."""
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu), tree)


def whole_params(cfg: Config) -> dict:
    """The whole model's params (every layer), as ShapeDtypeStructs in the param dtype."""
    prec = Precision.from_config(cfg.precision)
    return nnx.to_pure_dict(nnx.split(abstract_model(cfg.model, param_dtype=prec.param))[1])


def _state_shapes(cfg: Config, params: dict) -> dict:
    prec = Precision.from_config(cfg.precision)
    return jax.eval_shape(lambda p: assemble_state(cfg, prec, make_optimizer(cfg), p), params)


def whole_shapes(cfg: Config) -> dict:
    """The train state of the whole model (a non-pp run's), as ShapeDtypeStructs."""
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=1, pp_layers="even"))
    return _state_shapes(cfg, whole_params(cfg))


def stage_shapes(cfg: Config, counts) -> dict:
    """{"stages": [...]} of a pipeline with `counts` layers per stage, as ShapeDtypeStructs."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=sum(counts)),
                              parallel=dataclasses.replace(cfg.parallel, pp=len(counts)))
    params = whole_params(cfg)
    return {"stages": [_state_shapes(cfg, partition.stage_params(cfg, params, counts, s))
                       for s in range(len(counts))]}


def read_whole(cfg: Config, ckpts, step: int, meta: dict, required_meta=()) -> dict:
    """The checkpoint at `step` as the whole model's train state, on the host (numpy)."""
    saved = meta.get(PP_META)
    if saved:
        host, _ = ckpts.restore(on_cpu_host(stage_shapes(cfg, saved)), step, required_meta, item=STAGES)
        return partition.merge_tree(host["stages"], whole_shapes(cfg))
    host, _ = ckpts.restore(on_cpu_host(whole_shapes(cfg)), step, required_meta)
    return jax.tree.map(np.asarray, host)


def restore_pipeline(prog, ckpts, step: int, required_meta=()) -> tuple[dict, dict]:
    """(state, meta) of a pipeline run from any run's checkpoint."""
    meta = ckpts.meta(step)
    check_state_kind(prog.cfg, meta, ckpts.directory / str(step))
    if meta.get(PP_META) == list(prog.counts):
        return ckpts.restore(prog.abstract_state, step, required_meta, item=STAGES)
    return prog.state_from_whole(read_whole(prog.cfg, ckpts, step, meta, required_meta)), meta


class StagedLayout:
    """A pipeline run's checkpoint as another program layout sees it (jaxmem.core.checkpoint.OTHER_LAYOUTS):
    a one-program run reads it whole on the host."""

    @staticmethod
    def saved(meta: dict) -> bool:
        return bool(meta.get(PP_META))

    read_whole = staticmethod(read_whole)
