"""Every decision a run makes from its config and its device count, resolved once.

`jaxmem.core.program.build_program` builds the train step from a `Layout`, and the analytic bill
(`jaxmem.plan.bill`) reads the same `Layout`, so what the plan counts is what the step does: the mesh
sizes, the parameter / gradient / optimizer-state partition specs of the ZeRO stage, the kernels that
`auto` picks on the platform, what the remat policy keeps across the backward, which train-state
entries live in host memory and where the optimizer update runs (`homes`: every lever decision in the planner
and the steps reads these, not `cfg.offload.*`), the batch layout, and the per-layer parameter count.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

from jaxmem import kernels
from jaxmem.kernels.attention.sequence_parallel import heads_divide
from jaxmem.core import offload, remat
from jaxmem.mesh import sharding
from jaxmem.config.schema import Config, ConfigError
from jaxmem.model import abstract_model
from jaxmem.model.presets import layer_param_count
from jaxmem.optim.kind import StateKind, state_kind
from jaxmem.optim.layerwise import rest_chunks, split_layers
from jaxmem.core.precision import Precision
from jaxmem.io.data import batch_keys
from jaxmem.model.seq_tiling import INSIDE_TILES, tile_count
from jaxmem.config.validate import batch_layout
from jaxmem.core.plugins import Features


@dataclasses.dataclass(frozen=True)
class Layout:
    mesh_sizes: dict[str, int]  # dp, fsdp, sp, tp
    platform: str  # "gpu" for deviceless targets and GPUs, else the devices' platform
    kernels: dict[str, str]  # attention, loss, norm: `auto` decided for the platform
    graphdef: Any  # the model's structure (flax nnx)
    abstract_params: dict  # ShapeDtypeStructs in the param dtype
    param_specs: dict  # PartitionSpec trees shaped like the params, per ZeRO stage
    grad_specs: dict
    opt_specs: dict
    gathered_specs: dict  # a weight as the step uses it: all-gathered over the data axes, still split over tp
    grad_accum: int
    rows: int  # global rows per micro-batch
    checkpointed: bool  # the layer scan runs under jax.checkpoint (a remat policy applies)
    saved: dict[str, str]  # checkpoint name -> where its per-layer value lives across the backward
    keeps_scores: bool  # plain attention's S x S scores saved across the backward
    host_state: tuple[str, ...]  # train-state entries in pinned host memory between steps
    homes: offload.StateHomes  # where params / optimizer state live and where the update runs
    layer_param_elems: int  # parameters of one decoder layer
    rules: tuple  # the logical-axis rule table (parallel.rules) that shards weights and activations
    # The model's own parameters (where a feature trains other trees, LoRA's adapters, the trainable trees above
    # are those, and these are the model's shapes before the feature stored them its way).
    model_abstract_params: dict = None
    model_gathered_specs: dict = None
    model_param_specs: dict = None
    frozen_abstract: dict | None = None  # the state's frozen part in its stored form (a LoRA base), or None
    frozen_specs: dict | None = None
    # the frozen part is a reference policy's copy of the weights (jaxmem.core.reference_copy): the model itself
    # is trained in full
    frozen_is_reference: bool = False
    # Each active feature's own decisions by its name (LoRA: its setup); `layout.part(NAME)` reads them, None for
    # a feature the registry knows that the config leaves off.
    parts: dict = dataclasses.field(default_factory=dict)
    part_names: tuple = ()
    optimizer: StateKind = StateKind("adamw", "float32", 0)  # the optimizer state the run keeps (optim.kind)

    def part(self, name: str):
        """Feature `name`'s own decisions (its layout_part's "part": LoRA's setup), or None where the config
        leaves it off; a name the registry does not know is a mistake."""
        if name not in self.part_names:
            raise KeyError(f"Layout: no feature {name!r} among {self.part_names}")
        return self.parts.get(name)

    @property
    def freezes_model(self) -> bool:
        """Whether the model's weights are a frozen part of the state (LoRA's base) and the trainable trees a
        feature's own: no weight gradient for the model."""
        return self.frozen_abstract is not None and not self.frozen_is_reference

    def per_device_elems(self, names: tuple, shape: tuple[int, ...]) -> int:
        """Elements per device of a value with these logical axis names and global shape, sharded exactly as
        sharding.logical_to_spec shards it in the step (a dim the mesh axes do not divide is replicated)."""
        spec = sharding.logical_to_spec(names, self.rules, sharding.shape_only_mesh(self.mesh_sizes), shape)
        return math.prod(shape) // sharding.spec_ways(spec, self.mesh_sizes)

    def keeping(self, keys: tuple[str, ...]) -> "Layout":
        """This layout with the trainable trees cut to the top-level params `keys` (a pipeline stage's)."""
        cut = lambda tree: {k: v for k, v in tree.items() if k in keys}  # noqa: E731
        names = ("abstract_params", "param_specs", "grad_specs", "opt_specs", "gathered_specs")
        return dataclasses.replace(self, **{n: cut(getattr(self, n)) for n in names})

    @property
    def rest_pieces(self):
        """The non-layer leaves' pieces (optim.rest_chunks: per-leaf axes, count) where a streamed update moves
        them a piece at a time (offload.StateHomes.rest_in_pieces), or where the device requantizes block-quantized
        moments (its encode's temporaries are the leaf's size: the LM head's, a piece of it), else None."""
        if not (self.homes.rest_in_pieces or (self.optimizer.quantized and not self.homes.update_on_host)):
            return None
        rest, _ = split_layers(self.abstract_params)
        rest_specs, _ = split_layers(self.opt_specs)
        return rest_chunks(rest, spec_leaves(rest_specs), self.mesh_sizes, kind=self.optimizer)

    @property
    def data_ways(self) -> int:
        return sharding.batch_ways(self.mesh_sizes)

    @property
    def fused_attention(self) -> bool:
        return self.kernels["attention"] != "xla"


def state_specs(cfg: Config, params_state: nnx.State, sizes: dict[str, int]) -> tuple[dict, dict, dict, dict]:
    """(param, grad, optimizer-state, gathered) specs: ZeRO-1 shards the optimizer state, 2 also the
    gradients, 3 also the parameters; what is not sharded is replicated over the data axes (tp still
    applies), which is also how FSDP all-gathers a weight for use (`gathered`)."""
    rules = sharding.RULE_TABLES[cfg.parallel.rules]
    mesh = sharding.shape_only_mesh(sizes)
    sharded = sharding.param_specs(params_state, rules, mesh)
    replicated = sharding.param_specs(params_state, sharding.without_data_axes(rules), mesh)
    stage = cfg.parallel.zero_stage
    return (sharded if stage == 3 else replicated), (sharded if stage >= 2 else replicated), sharded, replicated


def check_sequence_split(cfg: Config, sizes: dict[str, int], attention: str) -> None:
    """Sequence parallelism and tiling against the mesh sizes and the attention kernel `auto` resolved to."""
    sp, seq, m = sizes.get("sp", 1), cfg.train.seq_len, cfg.model
    if seq % sp:
        raise ConfigError(f"parallel.sp: {sp} does not divide train.seq_len={seq}")
    if sp > 1 and attention != "xla" and not heads_divide(m.n_heads, sizes):
        raise ConfigError(f"parallel.sp: model.n_heads={m.n_heads} does not split over tp x sp = "
                          f"{sizes.get('tp', 1) * sp}; kernels.attention={attention} needs whole heads per "
                          "device (use kernels.attention=xla, which gathers k and v, or an sp that divides them)")
    tile = cfg.remat.seq_tile
    if tile and (seq // sp) % tile:
        raise ConfigError(f"remat.seq_tile: {tile} does not divide the per-device sequence train.seq_len / "
                          f"parallel.sp = {seq // sp}")


def resolve(cfg: Config, n_devices: int, platform: str, mesh_sizes: dict[str, int] | None = None, *,
            features: Features) -> Layout:
    """The layout of `cfg` on `n_devices` devices of `platform` ("gpu", "cpu", ...) with the active `features`
    (jaxmem.registry.for_config); `mesh_sizes` when the caller already holds a mesh (else from `parallel.*`)."""
    sizes = dict(mesh_sizes) if mesh_sizes else sharding.mesh_shape(cfg.parallel, n_devices)
    sizes.setdefault("sp", 1)
    sizes.setdefault("ep", 1)
    graphdef, params_state = nnx.split(abstract_model(cfg.model, param_dtype=Precision.from_config(
        cfg.precision).param))
    param_specs, grad_specs, opt_specs, gathered_specs = state_specs(cfg, params_state, sizes)
    cudnn_fits = kernels.cudnn_takes(Precision.from_config(cfg.precision).compute, sinks=cfg.model.attention_sinks,
                                     segments="segment_ids" in batch_keys(cfg),  # packed documents
                                     head_dim=cfg.model.head_dim)
    chosen = kernels.resolve(cfg.kernels, platform, n_devices, cudnn_fits)
    check_sequence_split(cfg, sizes, chosen["attention"])
    features.check_layout(cfg, sizes, chosen)
    fused_attention = chosen["attention"] != "xla"
    saved = remat.saved_across_backward(cfg.remat, fused_attention)
    if tile_count(cfg.train.seq_len, sizes["sp"], cfg.remat.seq_tile) > 1:
        saved = {n: "remat" if n in INSIDE_TILES else where for n, where in saved.items()}
    grad_accum, rows = batch_layout(cfg, sharding.batch_ways(sizes))
    model_abstract = nnx.to_pure_dict(params_state)
    trainable = dict(abstract_params=model_abstract, param_specs=param_specs, grad_specs=grad_specs,
                     opt_specs=opt_specs, gathered_specs=gathered_specs)
    trainable, feature_fields = features.layout_part(cfg, sizes, trainable)
    homes = offload.StateHomes.from_config(cfg)
    return Layout(
        mesh_sizes=sizes, platform=platform, kernels=chosen, graphdef=graphdef, **trainable,
        grad_accum=grad_accum, rows=rows, model_abstract_params=model_abstract,
        model_gathered_specs=gathered_specs, model_param_specs=param_specs, **feature_fields,
        checkpointed=remat.uses_checkpoint(cfg.remat),
        saved=saved,
        keeps_scores=remat.keeps_attention_scores(cfg.remat, fused_attention),
        host_state=homes.host_keys(), homes=homes, layer_param_elems=layer_param_count(cfg.model),
        rules=tuple(sharding.RULE_TABLES[cfg.parallel.rules]), optimizer=state_kind(cfg))


def spec_leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
