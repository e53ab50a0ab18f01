"""The interfaces through which a feature (LoRA, update in backward, a pipeline, a mixture of experts) plugs
into a run, so the core and the planner call hooks instead of branching on features.

`Feature` is what a feature package hands the registry (jaxmem.registry, the only module that imports every
feature): its rules, its part of the layout, its program hooks, the checkpoints it reads, and, for the
planner, its bill terms, explain rules and search axes. `Features` is the set a config turns on, as the core
is handed it. `ProgramPlugin` is the program-level part: it hands the program (jaxmem.core.program) its state
layout, per-layer weight fetch, forward pieces, initial and restored state and step, and the checkpointer
(jaxmem.core.checkpoint) what a checkpoint records and checks. Its hooks are a full fine-tune's (the
identity); a plug-in overrides the few it changes.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxmem.config.schema import ConfigError
from jaxmem.core.step_state import assemble_state
from jaxmem.io import data

# The train-state entry holding a plug-in's frozen part (a LoRA base): never differentiated, never saved
# (a checkpoint's restore rebuilds it: ProgramPlugin.frozen_part).
FROZEN = "base"


class ProgramPlugin:
    """A full fine-tune: every hook leaves the program as it is."""

    @classmethod
    def from_config(cls, cfg) -> "ProgramPlugin | None":
        """This plug-in for `cfg`, or None where the config does not ask for it."""
        return cls()

    # ------------------------------------------------------------ state layout
    def frozen_layout(self, layout) -> dict:
        """{FROZEN: (abstract tree, partition specs)} for a frozen part beside the trainable state; {} if none."""
        return {}

    def place_frozen(self, shardings: dict, abstract: dict) -> dict:
        """The state's shardings with the frozen part's memory kinds decided (a part kept in pinned host
        memory); as they are by default."""
        return shardings

    def fresh_state(self, prog, params, seed) -> dict:
        """A step-0 train state around the model's `params` (the program's state_from_params)."""
        return assemble_state(prog.cfg, prog.precision, prog.optimizer, params)

    def seed_state(self, prog, seed: int) -> dict:
        """A step-0 train state around the model initialized from `seed` (traced under the program's jit)."""
        return self.fresh_state(prog, prog.fresh_params(seed), seed)

    def frozen_part(self, prog, load_params):
        """The frozen part rebuilt where the config says (a resume); `load_params(prog, path)` reads a
        params-only checkpoint. None: the state has no frozen part."""
        return None

    def streams_state(self, path) -> bool:
        """Whether streamed_state loads `path` itself (so no one program builds the state a plan could compile)."""
        return False

    def streamed_state(self, prog, path):
        """A step-0 state read from `path` (checkpoint.init_from) its own way; None: the program loads the
        model's params and calls fresh_state."""
        return None

    donates_params = True  # the loaded params' buffers may become the state's
    # fresh_state is assemble_state of the model's params: jaxmem.core.host_init may fill its pinned-host layer
    # stacks a layer at a time
    assembles_state = True

    # ------------------------------------------------------------ forward
    def layer_fetch(self, cfg, layout, fetch):
        """The layer scan's fetch (one layer's slice -> what the layer reads), given the program's."""
        return fetch

    def forward_context(self, ctx):
        return ctx

    def check_mesh(self, mesh) -> None:
        """A ConfigError where the forward cannot run on `mesh`."""

    def bind(self, prog, params, frozen, dropout_key, ctx):
        """(the params the model is merged from, the forward context) for the trainable `params` and the
        state's `frozen` part; `dropout_key` is the train step's micro_key."""
        return params, ctx

    def embed(self, prog, frozen, model, tokens, ctx):
        """The embedded tokens [B, T, D] the layers start from."""
        return model.embed_tokens(tokens, ctx)

    def head_weight(self, prog, frozen, model):
        """The LM head weight [D, V] the loss reads."""
        return model.lm_head_weight().astype(prog.precision.compute)

    # ------------------------------------------------------------ step
    def keys_micro_batches(self, cfg) -> bool:
        """Whether the train step hands each micro-batch a key (micro_key)."""
        return False

    def micro_key(self, cfg, step, index):
        raise NotImplementedError

    def reference_inputs(self, params, frozen):
        """(params, frozen part) of a forward that runs the reference policy an objective compares with (a
        LoRA base: zero adapters on the frozen base; a frozen copy the state holds), or None where the state
        holds none."""
        return None

    def make_step(self, prog, loss_sum_fn):
        """A train step replacing the program's, or None."""
        return None

    # ------------------------------------------------------------ checkpoints
    def meta(self, cfg) -> dict:
        """Entries a checkpoint's meta records beside the run's."""
        return {}

    def check_meta(self, cfg, meta: dict, directory) -> None:
        """A ConfigError where a checkpoint's meta says its state does not belong to this run."""


class Objective:
    """What the train step minimizes over a micro-batch, taken from the per-token log-probs of the labels
    (the fused LM head + loss path, never [tokens, vocab] logits). Next-token cross-entropy, the default, is
    the program's own step and brings none; a feature hands one through Feature.objective (preference
    tuning; GRPO) and the core builds the step around it (jaxmem.core.objective).

    A micro-batch's loss and metrics are shares of the step's: `totals` are step-wide counts taken over the
    whole batch (the pairs, their tokens), so summing the shares over micro-batches gives the step's means."""

    name = ""
    # where the reference policy's per-token log-probs come from: "none", "forward" (a forward on
    # ProgramPlugin.reference_inputs, no gradient), or "batch" (the batch array REFERENCE_KEY: stored values)
    reference = "none"
    metric_names: tuple = ()  # the metrics a step reports beside loss, named 'group/name'
    # the log-probs are those of the logits divided by this (a sampling policy's temperature: GRPO's, as TRL
    # takes them); the fused LM head path scales the hidden state instead, never building [tokens, vocab]
    temperature = 1.0

    def totals(self, labels_arbt, segments_arbt=None) -> dict:
        """Step-wide counts (traced) from the labels of all micro-batches [A, rows, T] (and their segment ids
        where rows are packed, else None)."""
        return {}

    def abstract_batch(self, prog) -> dict | None:
        """The step's batch as abstract arrays where it is not the data source's (GRPO: a rollout's rows and
        stored log-probs), or None."""
        return None

    def micro_loss(self, policy_bt, reference_bt, labels_bt, totals: dict, segments_bt=None):
        """(this micro-batch's share of the step loss, {metric: share}) from the policy's per-token log-probs
        [B, T] (0 on ignored labels), the reference's (None where `reference` is "none"), the labels and, where
        rows are packed, the segment ids (sequences' sums are then taken per segment), else None."""
        raise NotImplementedError


# The batch array an objective whose `reference` is "batch" reads (jaxmem.io.data.REFERENCE_KEY).
REFERENCE_KEY = data.REFERENCE_KEY


# ---------------------------------------------------------------- program level


class StateItem(Protocol):
    """How a program's train state sits in a checkpoint: one orbax item of the step directory."""

    name: str  # the item's directory in a step ("state", "stages")

    def save_args(self, state: dict): ...  # orbax save args for the state (its frozen part left out)

    def restore_args(self, abstract_state: dict): ...  # orbax restore args onto the abstract state's layout

    def saved_shapes(self, item_dir) -> dict[str, tuple]: ...  # 'opt.mu.wq' -> shape, from metadata only

    def state_of(self, restored) -> dict: ...  # the train state from what the restore args gave back

    def parts(self, state: dict) -> list: ...  # the trees of one program each (this process's), for checks


class RunProgram(Protocol):
    """What the train loop (jaxmem.cli.train) and the checkpointer (jaxmem.core.checkpoint) ask of a program,
    so they call methods instead of branching on its kind: TrainProgram (one program) and PipelineProgram
    (one per stage) both satisfy it."""

    cfg: object
    abstract_state: dict
    state_item: StateItem

    def checkpoint_meta(self) -> dict:
        """Entries a checkpoint's meta records about the state's layout (a pipeline's layer counts)."""

    def restore_run(self, ckpts, step: int | None, required_meta: tuple[str, ...]) -> tuple[dict, dict]:
        """(state, meta) of a run's checkpoint at `step`, on this program's layout whatever layout saved it."""

    def init_from(self, path) -> dict:
        """A step-0 train state whose model params come from the params-only checkpoint at `path`."""

    def compile_step(self):
        """The train step, step(state, batch) -> (state, metrics), compiled or compiling at its first call."""


# ---------------------------------------------------------------- features


class Feature:
    """A lever a config turns on, with everything it brings; every hook defaults to "nothing to add"."""

    name = ""

    def applies(self, cfg) -> bool:
        """Whether `cfg` turns this feature on (its hooks run only then; `check` runs for every config)."""
        return False

    def check(self, cfg) -> None:
        """The feature's rules at load, refused combinations included: a one-line ConfigError naming the key."""

    def check_micro_batches(self, cfg, grad_accum: int) -> None:
        """Rules on the number of micro-batches per step (known once the data ways are)."""

    def micro_batch_unit(self, cfg) -> int:
        """train.micro_batch must be a multiple of this (preference pairs: 2); tune and sweep search in it."""
        return 1

    def check_layout(self, cfg, sizes: dict[str, int], kernels: dict[str, str]) -> None:
        """Rules on the mesh sizes and the kernels `auto` resolved to."""

    def layout_part(self, cfg, sizes: dict[str, int], trainable: dict) -> dict | None:
        """This feature's part of the Layout, or None: any of the trainable trees (abstract_params, param_specs,
        grad_specs, opt_specs, gathered_specs) it replaces, the state's frozen part (frozen_abstract,
        frozen_specs), and under "part" its own decisions (the layout's attribute of the feature's name)."""
        return None

    def program_plugin(self, cfg) -> ProgramPlugin | None:
        """The program-level hooks, or None (at most one active feature brings them)."""
        return None

    def forward_context(self, cfg, mesh, ctx):
        """The forward context with this feature's pieces (an expert dispatcher, ...)."""
        return ctx

    def objective(self, cfg) -> Objective | None:
        """The loss the step minimizes instead of next-token cross-entropy, or None (at most one feature)."""
        return None

    def prepare_source(self, cfg, prog, state, source, resumed: bool):
        """The data source a run trains on, given the one the config names and the run's start `state` (a
        pass with the initial weights that stores what the batches then carry); the source unchanged if none."""
        return source

    def run_program(self, cfg, features: "Features"):
        """A program that replaces the one-program run (a pipeline: one per stage), or None."""
        return None

    foreign_layouts: tuple = ()  # checkpoints of this feature's layout that a one-program run reads and re-cuts

    # The planner's terms (jaxmem.plan, which asks the registry for them): (phase, fn(draft)) pairs the analytic
    # bill runs in its phases (jaxmem.plan.bill.PHASES), rules that name what a compiled buffer is
    # (jaxmem.plan.buffer_kinds), and the override axes a search adds (jaxmem.cli.tune).
    bill_terms: tuple = ()
    buffer_terms: tuple = ()
    search_axes: tuple = ()  # tune's stages this feature brings: (name, [overrides of each candidate lever])

    def search_meshes(self, load, cfg, n_devices: int) -> list[list[str]]:
        """Meshes tune also tries on a free mesh (a mixture of experts: its expert-parallel ones), as overrides
        that `load(overrides)` accepts."""
        return []

    def search_variants(self, cfg, n_devices: int) -> list[list[str]]:
        """The settings of this feature tune tries every candidate with, as overrides, the fastest first (GRPO:
        its rollout batch); [] where it has none. A run of several programs plans each candidate whole
        (plan_run), so a variant's cost shows in its plan."""
        return []

    def expand_grid(self, grid: dict, load, cfg, n_devices: int) -> dict:
        """A sweep grid with this feature's `auto` values replaced by the ones `load` accepts."""
        return grid

    # The cost model's terms (jaxmem.plan.costmodel), each "nothing changes" by default: what the cost model's
    # output reports of this feature on every run (its values where the feature is off) and the constants it lists.
    cost_breakdown_defaults: dict = {}
    cost_constants: dict = {}

    def layer_flops(self, cfg, tokens: int, ops: dict[str, float]) -> dict[str, float]:
        """One layer's forward FLOPs per op over `tokens` tokens, given the dense layer's `ops`."""
        return ops

    def mlp_width_per_token(self, cfg, width: int) -> int:
        """The MLP activations' width per token, given the dense MLP's `width` (model.d_ff)."""
        return width

    def extra_trained_params(self, cfg) -> int:
        """Elements this feature trains beside the model's weights (LoRA's adapters): 6 FLOPs per element and token."""
        return 0

    def own_rate_matmuls(self, cfg, bill, ops: dict, rebuilt: list[str], weight_passes: int):
        """(FLOPs, achieved fraction of peak, breakdown entries) of the matmuls this feature runs at its own
        kernel's rate instead of the dense one's (a mixture of experts' grouped matmuls), or None."""
        return None

    def collective_seconds(self, cfg, bill, gpu, grad_accum: int) -> float:
        """Seconds per step of this feature's own collectives (estimated), overlapping compute."""
        return 0.0

    def extra_step_flops(self, cfg, forward_flops: float) -> float:
        """FLOPs per step this feature runs beside the trained forward and backward, given `forward_flops`, one
        forward of the whole model over the step's tokens (a preference reference policy's forward: that many
        again); the cost model adds them to the step's compute at the dense matmul rate."""
        return 0.0

    def zero3_gathered(self, cfg, bill) -> tuple[int, float]:
        """(weight elements this feature shards its own way under ZeRO-3, the bytes of them one all-gather
        brings each device per pass); the cost model gathers the rest over the state axes."""
        return 0, 0.0

    def parameter_counts(self, cfg, counts: dict[str, int]) -> dict[str, int]:
        """The plan's parameter counts ("total", "active": the ones a token uses) given the dense model's."""
        return counts

    # A run that is not one program (a pipeline's stages): its plan and the report's section on it.
    def plan_run(self, cfg, features: "Features", topo, planner, *, compile: bool, source: str) -> dict | None:
        """The plan dict (docs/plan_schema.md) of a run this feature makes more than one program, built with
        the planner's own pieces (`planner`: jaxmem.plan.Planner), or None (the one-program plan)."""
        return None

    def unsupported(self, cfg, command: str) -> str | None:
        """Why `jaxmem COMMAND` (tune, sweep, explain) cannot take `cfg` yet, in one line naming the key, or
        None."""
        return None

    def explained_program(self, cfg) -> str | None:
        """Which of this run's programs `jaxmem explain` reads, in one line, where the run is more than the one
        train step (GRPO: its training phase); None otherwise."""
        return None

    def render_plan(self, plan: dict, console) -> None:
        """Prints this feature's section of a plan's report, where the plan dict carries one."""

    def plan_section(self, cfg, bill, cost) -> dict | None:
        """This feature's section of a one-program plan (stored under its name; render_plan prints it): what
        the step's bill and cost (jaxmem.plan.costmodel.Cost) do not cover, e.g. a pass before training."""
        return None


@dataclasses.dataclass(frozen=True)
class Features:
    """The features a config turns on, in the registry's order, as the core and the planner are handed them."""

    active: tuple = ()
    known: tuple[str, ...] = ()  # every feature the registry holds, on or off
    # checkpoint layouts of every feature the registry holds, on or off: a run reads a checkpoint another
    # layout saved (a one-program resume of a pipeline's checkpoint)
    foreign_layouts: tuple = ()

    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.active)

    def has(self, name: str) -> bool:
        return any(f.name == name for f in self.active)

    def program_plugin(self, cfg) -> ProgramPlugin:
        for feature in self.active:
            plugin = feature.program_plugin(cfg)
            if plugin is not None:
                return plugin
        return ProgramPlugin()

    def forward_context(self, cfg, mesh, ctx):
        for feature in self.active:
            ctx = feature.forward_context(cfg, mesh, ctx)
        return ctx

    def objective(self, cfg) -> Objective | None:
        return next((o for o in (f.objective(cfg) for f in self.active) if o is not None), None)

    def prepare_source(self, cfg, prog, state, source, resumed: bool):
        for feature in self.active:
            source = feature.prepare_source(cfg, prog, state, source, resumed)
        return source

    def check_micro_batches(self, cfg, grad_accum: int) -> None:
        for feature in self.active:
            feature.check_micro_batches(cfg, grad_accum)

    def check_layout(self, cfg, sizes, kernels) -> None:
        for feature in self.active:
            feature.check_layout(cfg, sizes, kernels)

    def layout_part(self, cfg, sizes, trainable: dict) -> tuple[dict, dict]:
        """(the trainable trees, the Layout's other fields the features set: the frozen part, `parts`, and
        `part_names`) after every active feature's layout_part."""
        fields = {"parts": {}, "part_names": self.known}
        for feature in self.active:
            found = dict(feature.layout_part(cfg, sizes, trainable) or {})
            if "part" in found:
                fields["parts"][feature.name] = found.pop("part")
            trainable = dict(trainable, **{k: v for k, v in found.items() if k in trainable})
            fields.update({k: v for k, v in found.items() if k not in trainable})
        return trainable, fields

    def run_program(self, cfg):
        return next((p for p in (f.run_program(cfg, self) for f in self.active) if p is not None), None)

    # ------------------------------------------------------------ the cost model's terms, over the features
    def layer_flops(self, cfg, tokens: int, ops: dict[str, float]) -> dict[str, float]:
        for feature in self.active:
            ops = feature.layer_flops(cfg, tokens, ops)
        return ops

    def mlp_width_per_token(self, cfg, width: int) -> int:
        for feature in self.active:
            width = feature.mlp_width_per_token(cfg, width)
        return width

    def extra_trained_params(self, cfg) -> int:
        return sum(feature.extra_trained_params(cfg) for feature in self.active)

    def own_rate_matmuls(self, cfg, bill, ops: dict, rebuilt: list[str], weight_passes: int) -> list:
        found = (f.own_rate_matmuls(cfg, bill, ops, rebuilt, weight_passes) for f in self.active)
        return [x for x in found if x is not None]

    def collective_seconds(self, cfg, bill, gpu, grad_accum: int) -> float:
        return sum(feature.collective_seconds(cfg, bill, gpu, grad_accum) for feature in self.active)

    def extra_step_flops(self, cfg, forward_flops: float) -> float:
        return sum(feature.extra_step_flops(cfg, forward_flops) for feature in self.active)

    def zero3_gathered(self, cfg, bill) -> list[tuple[int, float]]:
        return [feature.zero3_gathered(cfg, bill) for feature in self.active]

    def parameter_counts(self, cfg, counts: dict[str, int]) -> dict[str, int]:
        for feature in self.active:
            counts = feature.parameter_counts(cfg, counts)
        return counts

    def plan_run(self, cfg, topo, planner, *, compile: bool, source: str) -> dict | None:
        plans = (f.plan_run(cfg, self, topo, planner, compile=compile, source=source) for f in self.active)
        return next((p for p in plans if p is not None), None)

    def plan_sections(self, cfg, bill, cost) -> dict:
        sections = ((f.name, f.plan_section(cfg, bill, cost)) for f in self.active)
        return {name: section for name, section in sections if section is not None}

    def refuse_unsupported(self, cfg, command: str) -> None:
        """A one-line ConfigError where an active feature says `jaxmem COMMAND` cannot take `cfg` yet."""
        reason = next((r for r in (f.unsupported(cfg, command) for f in self.active) if r), None)
        if reason:
            raise ConfigError(reason)

    def explained_program(self, cfg) -> str | None:
        """The first active feature's line on which of the run's programs explain reads, or None."""
        return next((line for line in (f.explained_program(cfg) for f in self.active) if line), None)

    def terms(self, kind: str) -> tuple:
        """The planner's terms of `kind` (bill_terms, buffer_terms, search_axes) of every active feature."""
        return tuple(term for f in self.active for term in getattr(f, kind))
