"""The train program: sharded train state, its shardings, and the jitted step.

`jaxmem train`, `jaxmem plan` and user scripts all build their step here, so the
step that is planned is the step that runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmem.runtime import aot, memory_kinds_shim
from jaxmem import kernels
from jaxmem.core import offload, offload_rules, remat
from jaxmem.mesh import sharding
from jaxmem.config.schema import Config
from jaxmem.core import embed_grad, grad_dtype, host_init, objective
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.core.layout import Layout, resolve as resolve_layout
from jaxmem.model import ForwardContext, init_model
from jaxmem.model.transformer import take_rows, take_rows_late_zeros
from jaxmem.mesh import axes
from jaxmem.mesh.axes import activation_rules
from jaxmem.model.moe import ROUTER_METRICS, is_moe
from jaxmem.optim.choice import make_optimizer
from jaxmem.optim.hyper import schedule
from jaxmem.optim import stochastic_round
from jaxmem.optim import fused_host
from jaxmem.optim.host_update import whole_update
from jaxmem.optim.layerwise import adam_count, layerwise_update
from jaxmem.optim.specs import layerwise_state_specs
from jaxmem.core.plugins import FROZEN, Features, ProgramPlugin
from jaxmem.core.precision import Precision, update_loss_scale
from jaxmem.model.seq_tiling import per_token_tiles, tile_count
from jaxmem.core.step_state import GRADS_SCOPE, UPDATE_SCOPE, assemble_state, split_batch
from jaxmem.io.data import batch_keys
from jaxmem.core.checkpoint import model_params_from
from jaxmem.core.checkpoint import WHOLE_STATE
from jaxmem.core.checkpoint import restore_whole
from jaxmem.core.checkpoint import init_whole


@dataclasses.dataclass
class TrainProgram:
    cfg: Config
    mesh: Mesh
    precision: Precision
    optimizer: optax.GradientTransformation
    state_shardings: dict
    abstract_state: dict  # ShapeDtypeStructs carrying shardings
    ctx: ForwardContext
    layout: Layout  # every decision the step is built from, as the planner reads them
    plugin: ProgramPlugin = dataclasses.field(default_factory=ProgramPlugin)  # an add-on's hooks (core.plugins)
    features: Features = dataclasses.field(default_factory=Features)  # what the program was built with
    fused_update: fused_host.FusedAdamW | None = None  # the host update through the one-pass kernel (optim.fused_host)

    @property
    def foreign_layouts(self) -> tuple:
        """Checkpoint layouts of other programs this one reads and re-cuts (the features bring them)."""
        return self.features.foreign_layouts

    # ------------------------------------------------------------ from the layout
    @property
    def graphdef(self) -> Any:
        return self.layout.graphdef

    @property
    def grad_specs(self) -> dict:
        return self.layout.grad_specs

    @property
    def grad_accum(self) -> int:
        return self.layout.grad_accum

    @property
    def rows(self) -> int:
        """Global rows per micro-batch."""
        return self.layout.rows

    # ------------------------------------------------------------ batches
    @property
    def batch_keys(self) -> tuple[str, ...]:
        return batch_keys(self.cfg)

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        """[A, rows, T + 1] tokens (labels are the inputs shifted by one), or [A, rows, T] for each array of a
        record batch (jaxmem.io.data: inputs, labels, and with packing segment ids and positions)."""
        extra = 1 if self.batch_keys == ("tokens",) else 0
        return (self.grad_accum, self.rows, self.cfg.train.seq_len + extra)

    @property
    def batch_sharding(self) -> NamedSharding:
        data = sharding.batch_spec(self.mesh)[0]
        return NamedSharding(self.mesh, P(None, data, None))

    def abstract_batch(self) -> dict:
        chosen = self.features.objective(self.cfg)
        own = chosen.abstract_batch(self) if chosen is not None else None  # an objective's own batch (GRPO's)
        if own is not None:
            return own
        array = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
        return {key: array for key in self.batch_keys}

    def shard_batch(self, local) -> dict:
        """Builds the global batch from this process's rows: [A, rows/processes, T+1] tokens, or a dict of such
        arrays under batch_keys."""
        local = local if isinstance(local, dict) else {"tokens": local}
        if set(local) != set(self.batch_keys):
            raise ValueError(f"batch has {sorted(local)}, the step takes {list(self.batch_keys)}")
        return {key: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local[key], np.int32),
                                                            self.batch_shape) for key in self.batch_keys}

    # ------------------------------------------------------------ state
    def init_state(self, seed: int | None = None) -> dict:
        seed = self.cfg.train.seed if seed is None else seed
        if host_init.applies(self):
            return host_init.fresh_state(self, seed=seed)
        return self.seeded_state_fn(seed)()

    def seeded_state_fn(self, seed: int):
        """jit of () -> the step-0 state from `seed`, on the state's shardings (where host_init does not apply)."""
        return jax.jit(lambda: self._fresh_state(seed), out_shardings=self.state_shardings)

    def assembled_state_fn(self):
        """jit of the model's params -> the step-0 state around them, donating them where the plug-in's state
        reuses their buffers (checkpoint.init_from where host_init does not apply)."""
        donate = (0,) if self.plugin.donates_params else ()
        return jax.jit(self.state_from_params, out_shardings=self.state_shardings, donate_argnums=donate)

    def fresh_params(self, seed: int) -> dict:
        """The model's params as initialized from `seed`."""
        model = init_model(self.cfg.model, seed=seed, param_dtype=self.precision.param)
        return nnx.to_pure_dict(nnx.split(model)[1])

    def _fresh_state(self, seed: int) -> dict:
        return self.plugin.seed_state(self, seed)

    def state_from_params(self, params, seed: int | None = None) -> dict:
        """A step-0 train state (fresh optimizer state, master = fp32 params) around given model params; a
        plug-in may make them its frozen part and train others (LoRA: fresh adapters on the params as base)."""
        return self.plugin.fresh_state(self, params, seed)

    def abstract_model_params(self) -> dict:
        """The model's params (ShapeDtypeStructs with their shardings): what init_from restores."""
        specs = self.layout.model_param_specs
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, self.precision.param,
                                                              sharding=NamedSharding(self.mesh, s)),
                            self.layout.model_abstract_params, specs)

    def frozen_base(self):
        """The state's frozen part (state[FROZEN], a LoRA base) rebuilt where the config says; None if the
        state has none."""
        return self.plugin.frozen_part(self, model_params_from)

    def model(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)

    # ------------------------------------------------------------ step
    def step_fn(self):
        return _make_step(self)

    def jit_step(self):
        batch = {key: array.sharding for key, array in self.abstract_batch().items()}
        return jax.jit(self.step_fn(), in_shardings=(self.state_shardings, batch),
                       out_shardings=(self.state_shardings, None), donate_argnums=(0,))

    @contextlib.contextmanager
    def lowering(self):
        """The context every lowering of this program's functions runs in: its target device is the
        default (aot.lowering_target), and jax's lowering caches are cleared around a shim host placement
        (memory_kinds_shim.clear_lowering_caches says why)."""
        shim = memory_kinds_shim.uses_shim(self.state_shardings)
        with aot.lowering_target(self.mesh.devices.flat[0]):
            if shim:
                memory_kinds_shim.clear_lowering_caches()
            try:
                yield
            finally:
                if shim:
                    memory_kinds_shim.clear_lowering_caches()

    def lower(self):
        with self.lowering():
            return self.jit_step().lower(self.abstract_state, self.abstract_batch())

    def lower_init(self):
        """The program that builds the run's step-0 state, lowered on abstract inputs (a plan compiles it):
        around the loaded params where checkpoint.init_from names a checkpoint, else from train.seed. None where
        the plug-in loads the state itself, outside one program (LoRA streams a Hugging Face base per layer)."""
        path = self.cfg.checkpoint.init_from
        if path and self.plugin.streams_state(path):
            return None
        if host_init.applies(self):
            return host_init.lower(self, from_params=bool(path))
        with self.lowering():
            if path:
                return self.assembled_state_fn().lower(self.abstract_model_params())
            return self.seeded_state_fn(self.cfg.train.seed).lower()

    # ------------------------------------------------------------ run hooks (jaxmem.core.plugins.RunProgram)
    @property
    def state_item(self):
        return WHOLE_STATE

    def checkpoint_meta(self) -> dict:
        """What a checkpoint's meta records about this program beside the run's (LoRA: the base it trains)."""
        return self.plugin.meta(self.cfg)

    def restore_run(self, ckpts, step: int | None, required_meta: tuple[str, ...] = ()) -> tuple[dict, dict]:
        return restore_whole(self, ckpts, step, required_meta)

    def init_from(self, path) -> dict:
        return init_whole(self, path)

    def compile_step(self):
        return self.lower().compile()


def build_program(cfg: Config, mesh: Mesh | None = None, devices=None, *, keep: tuple[str, ...] | None = None,
                  features: Features) -> TrainProgram:
    """Everything needed to init, step, checkpoint and plan a run, without allocating weights, with the active
    `features` (the registry's: jaxmem.registry.build_program hands them).

    `keep` names the top-level params the state holds (a pipeline stage's: jaxmem.pipeline); default all."""
    mesh = mesh or sharding.make_mesh(cfg.parallel, devices)
    layout = resolve_layout(cfg, mesh.size, kernels.platform_of(mesh.devices.flat),
                            mesh_sizes={a.value: mesh.shape.get(a.value, 1) for a in axes.MESH_AXES},
                            features=features)
    if keep is not None:
        layout = layout.keeping(keep)
    prec = Precision.from_config(cfg.precision)
    opt = make_optimizer(cfg)
    plugin = features.program_plugin(cfg)

    abstract = jax.eval_shape(lambda p: assemble_state(cfg, prec, opt, p), layout.abstract_params)
    specs = {"step": P(), "params": layout.param_specs}
    specs["opt"] = layerwise_state_specs(abstract["opt"], layout.abstract_params, layout.opt_specs, layout.mesh_sizes)
    if "master" in abstract:
        specs["master"] = layout.opt_specs
    if "loss_scale" in abstract:
        specs["loss_scale"] = {"scale": P(), "good_steps": P()}
    if "grad_norm" in abstract:
        specs["grad_norm"] = P()
    for key, (frozen_abstract, frozen_specs) in plugin.frozen_layout(layout).items():
        abstract[key], specs[key] = frozen_abstract, frozen_specs
    shardings = plugin.place_frozen(offload.place_shardings(cfg, sharding.named(mesh, specs), abstract), abstract)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    # config rules ran at load; these need the data ways
    offload_rules.check_micro_batches(cfg, layout.grad_accum)
    features.check_micro_batches(cfg, layout.grad_accum)
    platform = layout.platform
    fetch = plugin.layer_fetch(cfg, layout, offload.layer_fetch(cfg, prec.grad_reduce))
    scan_layers, segment = remat.layer_scan(cfg.remat, cfg.model.n_layers, fetch=fetch)
    ctx = ForwardContext(compute_dtype=prec.compute, attention=kernels.select_attention(cfg.kernels, platform, mesh),
                         norm=kernels.select_norm(cfg.kernels, platform, mesh), scan_layers=scan_layers,
                         grouped_matmul=kernels.select_grouped_matmul(cfg.kernels, platform, mesh),
                         segment=segment, per_token=per_token_tiles(cfg.remat.seq_tile, layout.mesh_sizes["sp"]),
                         per_token_tiled=tile_count(cfg.train.seq_len, layout.mesh_sizes["sp"], cfg.remat.seq_tile) > 1,
                         # where the mesh sums gradients over devices, the embedding gradient's zeros wait for the
                         # backward (one device: no collective to hide, and the scheduler's choice was as lean)
                         lookup=take_rows_late_zeros if layout.data_ways * layout.mesh_sizes["sp"] > 1 else take_rows)
    ctx = features.forward_context(cfg, mesh, ctx)  # an expert-parallel dispatcher, ...
    fused = fused_host.choose(cfg, platform, mesh.size, prec.param, mesh, specs.get("master"))
    return TrainProgram(cfg, mesh, prec, opt, shardings, abstract, plugin.forward_context(ctx), layout, plugin,
                        features, fused)


def loss_sum_fn(prog: TrainProgram, ctx: ForwardContext | None = None):
    """fn(params, inputs_bt, labels_bt, segment_ids_bt=None, positions_bt=None) -> (loss_sum, n_valid): the
    summed next-token cross-entropy over the labels that are not IGNORE_INDEX, and their count, with the
    kernels, precision and activation sharding constraints the config selects (segment ids keep attention
    inside each packed document; positions restart RoPE per document). The train step differentiates this
    function (jaxmem.api.loss_fn too).
    `ctx` replaces the program's forward context (the update-in-backward step swaps its layer scan)."""
    return stage_fn(prog, ctx)


# Top-level params a pipeline stage may lack (jaxmem.pipeline.partition.stage_keys decides which it holds).
END_PARAMS = ("embed", "final_norm", "lm_head")


def _head_grad_axes(prog: TrainProgram) -> tuple | None:
    """The mesh axes the LM head's gradient is kept split over along d_model (FSDP, ZeRO-2/3; none where it is
    replicated): a fused loss reduce-scatters its dW over them. None: the head is not trained."""
    tied = prog.cfg.model.tie_embeddings
    spec = prog.layout.grad_specs.get("embed" if tied else "lm_head")
    if spec is None:  # a LoRA step: the head is frozen
        return None
    return sharding.entry_axes((tuple(spec) + (None, None))[1 if tied else 0])  # embed is [V, D], lm_head [D, V]


def stage_fn(prog: TrainProgram, ctx: ForwardContext | None = None, *, first: bool = True, last: bool = True,
             router_carry: bool = False, logprobs: bool = False, temperature: float = 1.0):
    """fn(params, x, labels_bt, segment_ids_bt=None, positions_bt=None, *, base=None, dropout_key=None): the
    model's parts in order. `first`: x is tokens [B, T] and is embedded, else x is hidden states [B, T, D]; then
    the layers `params` hold; `last`: the final norm, LM head and loss -> (loss_sum, n_valid), else the hidden states.
    With first = last = True this is loss_sum_fn; a pipeline stage runs its part (jaxmem.pipeline).
    `base` is the state's frozen part and `dropout_key` the train step's per micro-batch key, both read by the
    program's plug-in (jaxmem.core.plugins; LoRA: its base, and its adapters' input dropout).
    `router_carry` (a mixture of experts' pipeline stage): a stage that is not first takes x = (hidden states,
    the earlier layers' router statistics), one that is not last returns (hidden states, statistics).
    `logprobs`: the last part gives the per-token log-probs of the labels [B, T] instead (an objective's,
    jaxmem.core.objective), through the same fused kernels; `temperature`: of the logits divided by it (the
    hidden state scaled by its inverse before the LM head, which is linear: no [tokens, vocab] logits)."""
    ctx = ctx or prog.ctx
    cfg, mesh = prog.cfg, prog.mesh
    constrainer = sharding.activation_constrainer(sharding.RULE_TABLES[cfg.parallel.rules], mesh)
    select = kernels.select_token_logprobs if logprobs else kernels.select_loss
    loss_impl = select(cfg.kernels, prog.layout.platform, mesh=mesh, dw_axes=_head_grad_axes(prog)) if last else None

    plugin = prog.plugin
    plugin.check_mesh(mesh)

    carry = router_carry and is_moe(cfg.model)

    def run(params, x, labels_bt=None, segment_ids_bt=None, positions_bt=None, *, base=None, dropout_key=None,
            router_losses=False):
        stats_in = None
        if carry and not first:  # a later pipeline stage of a mixture of experts: (h, the earlier layers' stats)
            x, stats_in = x
        params, run_ctx = plugin.bind(prog, params, base, dropout_key, ctx)
        # a stage's module holds placeholders for the end params it does not own (never read)
        params = dict(params, **{k: jnp.zeros((), jnp.float32) for k in END_PARAMS
                                 if k not in params and (k != "lm_head" or not cfg.model.tie_embeddings)})
        model = nnx.merge(prog.graphdef, params)
        with activation_rules(constrainer):
            h_btd = plugin.embed(prog, base, model, x, run_ctx) if first else x
            h_btd = model.run_layers(h_btd, run_ctx, segment_ids_bt=segment_ids_bt, positions_bt=positions_bt,
                                     router_losses=router_losses, stats_in=stats_in,
                                     return_stats=carry and not last)
            if router_losses:  # a mixture of experts: ((loss_sum, n_valid), jaxmem.model.moe.ROUTER_METRICS)
                h_btd, router = h_btd
            if not last:
                return h_btd
            h_btd = model.final_hidden(h_btd, run_ctx)
        w_dv = plugin.head_weight(prog, base, model)
        if temperature != 1.0:
            h_btd = h_btd * jnp.asarray(1.0 / temperature, h_btd.dtype)
        out = loss_impl(h_btd, w_dv, labels_bt)
        return (out, router) if router_losses else out

    return run


def _make_step(prog: TrainProgram):
    replaced = prog.plugin.make_step(prog, loss_sum_fn)  # update-in-backward's
    if replaced is not None:
        return replaced
    chosen = prog.features.objective(prog.cfg)  # a feature's loss instead of next-token cross-entropy
    if chosen is not None:
        return objective.make_step(prog, chosen, functools.partial(stage_fn, prog, logprobs=True,
                                                                       temperature=chosen.temperature), _updated_state)
    cfg = prog.cfg
    grad_fn, router_zero = _micro_grad_fn(prog)
    rows_grad_fn = embed_grad.grad_fn(prog, stage_fn(prog, first=False))
    lr_at = schedule(cfg)

    def step(state, batch):
        state = offload.mark_host_entries(cfg, state)
        micro_batches = split_batch(batch)  # inputs, labels, segment ids, positions: [A, rows, T] (or None)
        # the mean over every valid label of the global step (all micro-batches, all data ways)
        n_valid = jnp.maximum(jnp.sum(micro_batches[1] != IGNORE_INDEX), 1).astype(jnp.float32)
        scale = state["loss_scale"]["scale"] if "loss_scale" in state else jnp.float32(1.0)
        p_grad = grad_dtype.step_params(prog, grad_fn, state["params"], micro_batches, n_valid / scale,
                                        state.get(FROZEN))
        # Named scopes (metadata only) put "grads/" and "optimizer_update/" in every op_name of the two
        # phases; `jaxmem explain` reads them to tell gradients and optimizer temporaries from activations.
        with jax.named_scope(GRADS_SCOPE):
            grads, loss_sum, router = _gradients(prog, grad_fn, rows_grad_fn, router_zero, state, micro_batches,
                                                 p_grad, n_valid, scale)
        new_state, grad_norm, finite = _updated_state(prog, state, grads, scale)
        count = offload.to_device(adam_count(new_state["opt"]))
        metrics = {"loss": loss_sum / n_valid, "grad_norm": grad_norm, "lr": lr_at(jnp.maximum(count - 1, 0)),
                   "tokens": n_valid, "update_skipped": jnp.logical_not(finite), "loss_scale": scale, **router}
        return new_state, metrics

    return step


def _micro_grad_fn(prog: TrainProgram):
    """(the gradient of one micro-batch's loss share w.r.t. the trainable params, with (loss sum, router
    statistics) beside it; the router statistics' zeros to accumulate from)."""
    cfg = prog.cfg
    token_loss = loss_sum_fn(prog)
    routed = is_moe(cfg.model)
    router_zero = {k: np.float32(0) for k in ROUTER_METRICS} if routed else {}  # no eager op (deviceless plans)

    def micro_loss(params, micro, denom, base, dropout_key):
        if not routed:
            loss_sum, _ = token_loss(params, *micro, base=base, dropout_key=dropout_key)
            return loss_sum / denom, (loss_sum, {})
        # a mixture of experts: the router losses, weighted by their coefficients and the micro-batch's tokens
        (loss_sum, n_micro), router = token_loss(params, *micro, base=base, dropout_key=dropout_key,
                                                 router_losses=True)
        extra = (cfg.model.router_aux_loss_coef * router["moe_aux_loss"]
                 + cfg.model.router_z_loss_coef * router["moe_z_loss"])
        return (loss_sum + n_micro.astype(jnp.float32) * extra) / denom, (loss_sum, router)

    return jax.grad(micro_loss, has_aux=True), router_zero  # params only: the frozen part gets no gradient


def _gradients(prog: TrainProgram, grad_fn, rows_grad_fn, router_zero: dict, state: dict, micro_batches, p_grad,
               n_valid, scale):
    """(gradients, loss sum, router statistics' mean) of the step, accumulated in fp32 over the micro-batches
    (each weighted by n_valid / scale); the embedding's from its touched rows where jaxmem.core.embed_grad
    applies."""
    cfg, params = prog.cfg, state["params"]
    grad_shardings = sharding.named(prog.mesh, prog.grad_specs)
    keyed = prog.plugin.keys_micro_batches(cfg)  # LoRA dropout's masks
    rows_mode = embed_grad.applies(cfg, prog.layout, prog.precision)  # the embedding's gradient as its rows
    if rows_mode:
        embed, p_grad = p_grad["embed"], {k: v for k, v in p_grad.items() if k != "embed"}
        grad_shardings = {k: v for k, v in grad_shardings.items() if k != "embed"}

    def one(micro, index=None):
        if rows_mode:
            (g, d_rows), loss_sum = rows_grad_fn(p_grad, params["embed"], micro, n_valid / scale)
            return (offload.constrain_device_part(cfg, g, grad_shardings), d_rows), (loss_sum, {})
        key = prog.plugin.micro_key(cfg, state["step"], 0 if index is None else index) if keyed else None
        g, loss_sum = grad_fn(p_grad, micro, n_valid / scale, state.get(FROZEN), key)
        return offload.constrain_device_part(cfg, g, grad_shardings), loss_sum

    if prog.grad_accum == 1:
        grads, (loss_sum, router) = one(jax.tree.map(lambda x: x[0], micro_batches))
        grads, d_rows = grads if rows_mode else (grads, None)
    else:
        def acc(carry, micro):
            g, l = one(*micro) if keyed else one(micro)
            g, d_rows = g if rows_mode else (g, None)  # the rows' gradients are stacked, not summed
            return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry[0], g),
                    jax.tree.map(jnp.add, carry[1], l)), d_rows

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p_grad)
        zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)
        xs = (micro_batches, jnp.arange(prog.grad_accum)) if keyed else micro_batches
        (grads, (loss_sum, router)), d_rows = jax.lax.scan(acc, (zeros, (jnp.float32(0.0), router_zero)), xs)
        router = {k: v / prog.grad_accum for k, v in router.items()}  # the micro-batches' mean
    if rows_mode:
        grads = dict(grads, embed=embed_grad.from_rows(micro_batches[0], d_rows, embed.shape[0]))
    return grads, loss_sum, router


def rounding_key(prog: TrainProgram, step):
    """The stochastic-rounding key of optimizer step `step` (the train state's step before the update: the same
    on a resume), or None where the update rounds to nearest (precision.stochastic_rounding off)."""
    if not prog.precision.stochastic_rounding:
        return None
    return stochastic_round.step_key(prog.cfg.train.seed, step)


def _updated_state(prog: TrainProgram, state: dict, grads, scale):
    """(the state after the optimizer update, the gradients' global norm, whether they were finite)."""
    cfg, prec = prog.cfg, prog.precision
    scaling = cfg.precision.loss_scale
    params = state["params"]
    weights = state["master"] if "master" in state else params
    host_update = prog.layout.homes.update_on_host
    common = dict(clip_norm=cfg.optimizer.clip_norm, param_dtype=prec.param, skip_nonfinite=scaling.enabled,
                  round_key=rounding_key(prog, state["step"]))
    if host_update:  # whole tensors (optim.host_update): the layer scan's copies are what XLA:CPU's update cost
        update = functools.partial(whole_update, prog.optimizer, fused=prog.fused_update, **common)
    else:
        update = functools.partial(layerwise_update, prog.optimizer, rest_chunks=prog.layout.rest_pieces, **common)
    # the old params are the buffer the new ones are written into, a layer at a time (an update on the host
    # makes its own, and reads the old ones only to skip a non-finite fp16 step)
    old_params = params if scaling.enabled or not host_update else None
    with jax.named_scope(UPDATE_SCOPE):
        new_params, new_opt, new_weights, (grad_norm, finite) = offload.run_update(
            cfg, update, grads, state["opt"], weights, old_params, scale)
    new_params = offload.constrain_device_part(cfg, new_params, prog.state_shardings["params"])
    new_state = dict(state, step=state["step"] + 1, params=new_params, opt=new_opt)
    if "master" in state:
        new_state["master"] = new_weights
    if "loss_scale" in state:  # fp16: the skipped step backs the scale off
        new_state["loss_scale"] = update_loss_scale(state["loss_scale"], finite, scaling)
    return new_state, grad_norm, finite
