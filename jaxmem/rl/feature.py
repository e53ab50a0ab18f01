"""GRPO as a feature: its rules at load and its objective (jaxmem.rl.objective). The reference with rl.beta > 0
is the LoRA base with the adapters off (the LoRA plug-in's reference_inputs: no extra weights) or, for a full
fine-tune, a frozen bf16 copy of the initial weights (jaxmem.core.reference_copy, in the state and so in the
plan); its log-probs are taken once per rollout (jaxmem.rl.rollout) and carried by the batch like the old
policy's."""
from __future__ import annotations

from jaxmem.config.schema import Config, ConfigError
from jaxmem.rl.plan import plan_rl
from jaxmem.core import reference_copy
from jaxmem.core.plugins import Feature
from jaxmem.core.reference_copy import ReferenceCopy
from jaxmem.rl.objective import GRPOObjective
from jaxmem.rl.rewards import load_rewards


def check(cfg: Config) -> None:
    rl = cfg.rl
    if not rl.prompts:
        raise ConfigError("rl.prompts: train.objective=grpo needs a jsonl file of prompts")
    load_rewards(rl.rewards, rl.reward_weights)  # an unimportable reference is refused now, in one line
    if rl.group_size < 2:
        raise ConfigError(f"rl.group_size: {rl.group_size} must be >= 2 (advantages are taken within a group)")
    for key in ("prompts_per_step", "max_prompt_len", "max_completion_len", "updates_per_rollout"):
        if getattr(rl, key) < 1:
            raise ConfigError(f"rl.{key}: {getattr(rl, key)} must be >= 1")
    n = rl.completions
    if rl.generation_batch < 0 or (rl.generation_batch and n % rl.generation_batch):
        raise ConfigError(f"rl.generation_batch: {rl.generation_batch} must divide rl.prompts_per_step x "
                          f"rl.group_size ({n}); 0: all at once")
    if not rl.temperature > 0:
        raise ConfigError(f"rl.temperature: {rl.temperature} must be > 0 (a rollout samples)")
    if not 0 < rl.top_p <= 1 or rl.top_k < 0:
        raise ConfigError("rl.top_p must be in (0, 1] and rl.top_k >= 0")
    if rl.beta < 0 or not 0 <= rl.epsilon_low < 1 or rl.epsilon_high < 0:
        raise ConfigError("rl.beta must be >= 0, rl.epsilon_low in [0, 1), rl.epsilon_high >= 0")
    if not (rl.sapo_temperature_pos > 0 and rl.sapo_temperature_neg > 0):
        raise ConfigError("rl.sapo_temperature_pos and rl.sapo_temperature_neg must be > 0")
    if n % cfg.train.micro_batch:
        raise ConfigError(f"train.micro_batch: {cfg.train.micro_batch} must divide rl.prompts_per_step x "
                          f"rl.group_size ({n} completions a rollout)")
    if cfg.train.seq_len < rl.max_prompt_len + rl.max_completion_len:
        raise ConfigError(f"train.seq_len: {cfg.train.seq_len} must hold rl.max_prompt_len + rl.max_completion_len")
    if cfg.parallel.pp > 1 or cfg.optimizer.update_in_backward:
        raise ConfigError("train.objective=grpo: pipeline stages and optimizer.update_in_backward do not run it yet")


# what explain reads of a run of three phases: the training step's buffers (the rollout's and the log-prob
# passes' programs are priced by `jaxmem plan`)
EXPLAINED = ("train.objective=grpo: explained is the training phase (the GRPO step on a rollout's batch); "
             "`jaxmem plan` gives the rollout and log-prob phases and the run's peak")


def rollout_batches(cfg: Config) -> list[list[str]]:
    """tune's choices of rl.generation_batch, the largest first (fewer decode loops per rollout): every divisor
    of the rollout's completions (a batch the mesh's data ways do not split is refused by its plan)."""
    n = cfg.rl.completions
    return [[f"rl.generation_batch={rows}"] for rows in range(n, 0, -1) if n % rows == 0]


class RL(Feature):
    name = "rl"

    def applies(self, cfg: Config) -> bool:
        return cfg.train.objective == "grpo"

    def check(self, cfg: Config) -> None:
        if self.applies(cfg):
            check(cfg)

    def objective(self, cfg: Config):
        return GRPOObjective(cfg) if self.applies(cfg) else None

    def program_plugin(self, cfg: Config):
        return ReferenceCopy() if _holds_copy(cfg) else None

    def layout_part(self, cfg: Config, sizes: dict[str, int], trainable: dict) -> dict | None:
        return reference_copy.layout_part("bfloat16", False, trainable, sizes) if _holds_copy(cfg) else None

    def explained_program(self, cfg: Config) -> str | None:
        return EXPLAINED if self.applies(cfg) else None

    def search_variants(self, cfg: Config, n_devices: int) -> list[list[str]]:
        return rollout_batches(cfg) if self.applies(cfg) else []

    def plan_run(self, cfg: Config, features, topo, planner, *, compile: bool, source: str) -> dict | None:
        """Two programs, rollout and training, each beside the train state (jaxmem.rl.plan)."""
        return plan_rl(cfg, topo, planner, compile=compile, source=source) if self.applies(cfg) else None


def _holds_copy(cfg: Config) -> bool:
    """Whether the state holds a frozen reference copy (rl.beta > 0 in a full fine-tune)."""
    return cfg.train.objective == "grpo" and cfg.rl.beta > 0 and cfg.lora.rank == 0


RL_FEATURE = RL()
