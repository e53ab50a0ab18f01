"""Preference tuning (train.objective dpo, ipo, orpo, simpo) as a feature: its rules at load, its objective
(jaxmem.preference.objective) and, for a full fine-tune with preference.reference=model, the program plug-in
holding the frozen reference copy (jaxmem.core.reference_copy). With LoRA the reference is the frozen base
with the adapters off (the LoRA plug-in's reference_inputs): no extra weights."""
from __future__ import annotations

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core.plugins import Feature
from jaxmem.preference.objective import REFERENCE_FREE, PreferenceObjective, resolved_reference
from jaxmem.preference import plan as preference_plan
from jaxmem.preference import precompute
from jaxmem.core import reference_copy
from jaxmem.preference.bill import BILL_TERMS
from jaxmem.core.reference_copy import ReferenceCopy


def check(cfg: Config) -> None:
    objective, p = cfg.train.objective, cfg.preference
    if objective in ("sft", "grpo"):  # grpo: jaxmem.rl
        if cfg.data.format == "preference":
            raise ConfigError("data.format: preference pairs need train.objective dpo, ipo, orpo or simpo")
        return
    if cfg.data.format != "preference":
        raise ConfigError(f"train.objective: {objective} trains on preference pairs; set data.format=preference "
                          "(records with prompt, chosen, rejected)")
    if cfg.train.micro_batch % 2 and cfg.data.packing == "none":
        raise ConfigError(f"train.micro_batch: {cfg.train.micro_batch} must be even with train.objective="
                          f"{objective} (a pair's chosen and rejected sequences share a device's micro-batch; "
                          "with data.packing greedy or first_fit a row holds whole pairs and any count is allowed)")
    if cfg.parallel.pp > 1:
        raise ConfigError(f"parallel.pp: pipeline stages do not run train.objective={objective} yet; use pp=1")
    if cfg.optimizer.update_in_backward:
        raise ConfigError(f"optimizer.update_in_backward: does not run train.objective={objective} yet; set false")
    if cfg.eval.path and resolved_reference(cfg) == "precompute":
        raise ConfigError("eval.path: held-out pairs need the reference's log-probs, which precompute stores for the "
                          "training pairs only; set preference.reference=model (or base with LoRA) to evaluate")
    if p.beta <= 0:
        raise ConfigError(f"preference.beta: {p.beta} must be > 0")
    if not 0.0 <= p.label_smoothing < 0.5:
        raise ConfigError(f"preference.label_smoothing: {p.label_smoothing} must be in [0, 0.5)")
    if p.orpo_lambda < 0:
        raise ConfigError(f"preference.orpo_lambda: {p.orpo_lambda} must be >= 0")
    _check_reference(cfg)


def _check_reference(cfg: Config) -> None:
    objective, reference = cfg.train.objective, cfg.preference.reference
    if objective in REFERENCE_FREE:
        if reference != "auto":
            raise ConfigError(f"preference.reference: train.objective={objective} compares with no reference "
                              "policy (none is allocated); leave it auto")
        return
    if reference == "base" and cfg.lora.rank == 0:
        raise ConfigError("preference.reference: base is the frozen LoRA base with the adapters off; it needs "
                          "lora.rank > 0 (a full fine-tune: precompute or model)")
    if reference != "model" and (cfg.preference.reference_dtype != "bfloat16"
                                 or cfg.preference.reference_memory != "device"):
        raise ConfigError(f"preference.reference_dtype / reference_memory: set how a reference=model copy is "
                          f"stored; preference.reference is {reference} (no copy)")
    if reference == "model" and cfg.lora.rank > 0:
        raise ConfigError("preference.reference: model would copy the LoRA base the run already holds frozen; "
                          "use base (the same weights, no copy) or precompute")


class Preference(Feature):
    name = "preference"

    def applies(self, cfg: Config) -> bool:
        return cfg.train.objective not in ("sft", "grpo")

    def check(self, cfg: Config) -> None:
        check(cfg)

    def micro_batch_unit(self, cfg: Config) -> int:
        return 2 if self.applies(cfg) and cfg.data.packing == "none" else 1  # a pair's two rows

    def objective(self, cfg: Config):
        return PreferenceObjective(cfg) if self.applies(cfg) else None

    def prepare_source(self, cfg: Config, prog, state, source, resumed: bool):
        if self.applies(cfg) and resolved_reference(cfg) == "precompute":
            return precompute.prepare_source(cfg, prog, state, source, resumed)
        return source

    def program_plugin(self, cfg: Config):
        if not _holds_copy(cfg):
            return None
        return ReferenceCopy(cfg.preference.reference_dtype, cfg.preference.reference_memory == "host")

    def layout_part(self, cfg: Config, sizes: dict[str, int], trainable: dict) -> dict | None:
        if not _holds_copy(cfg):
            return None
        p = cfg.preference
        return reference_copy.layout_part(p.reference_dtype, p.reference_memory == "host", trainable, sizes)

    bill_terms = BILL_TERMS

    def extra_step_flops(self, cfg: Config, forward_flops: float) -> float:
        """reference=base or model: one more forward of the whole model per step, under stop_gradient (precompute
        runs its pass before training: the plan's preference section prices it)."""
        with_forward = self.applies(cfg) and resolved_reference(cfg) in ("base", "model")
        return forward_flops if with_forward else 0.0

    def plan_section(self, cfg: Config, bill, cost) -> dict | None:
        return preference_plan.precompute_section(cfg, bill, cost) if self.applies(cfg) else None

    def render_plan(self, plan: dict, console) -> None:
        preference_plan.render(plan, console)


def _holds_copy(cfg: Config) -> bool:
    """Whether the state holds a frozen reference copy (reference=model in a full fine-tune)."""
    return PREFERENCE.applies(cfg) and cfg.lora.rank == 0 and resolved_reference(cfg) == "model"


PREFERENCE = Preference()
