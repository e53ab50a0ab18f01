"""The estimated side of a GRPO run's plan: each phase's peak from the training step's analytic bill and the
rollout's key/value cache (what `plan --no-compile`, and tune's pruning, read), and the run's time per step from
the cost model's training step plus a rollout that reads the weights and its cache once per new token (decode is
bound by memory bandwidth) and the log-prob passes (forwards: a third of the step's compute each)."""
from __future__ import annotations

import dataclasses

from jaxmem.config.schema import Config, ConfigError
from jaxmem.generation.buckets import bucket

ESTIMATED = "estimated (analytic)"
STATE_TERMS = ("params", "base", "master", "opt_m", "opt_v")  # the bill's terms the train state is made of
STORED_BYTES = 2 * 4 + 3 * 4  # per token of the rollout's batch: inputs and labels (int32), the stored float32 x 3
HBM_EFFICIENCY = 0.7  # the share of the memory bandwidth a decode step reaches (the cost model's own constant)


def state_bytes(bill) -> int:
    """The train state per device (estimated): what stays live across the phases."""
    return sum(bill.device[k] for k in STATE_TERMS)


def estimated_phases(cfg: Config, bill, cache_bytes: int) -> dict:
    """{phase: {"peak", "label"}} per device, each beside the train state (the bill's state terms): the rollout
    holds its key/value cache (`cache_bytes`, analytic) twice and its rows' prefill activations and logits; the
    log-prob pass one layer's working set or the LM head's (the larger); training the step's bill and the
    rollout's stored batch."""
    m, ways = cfg.model, bill.layout.data_ways
    rows = cfg.rl.rollout_rows
    if rows % ways:
        raise ConfigError(f"rl.generation_batch: {rows} rows do not split over the mesh's {ways} data ways; use a "
                          "multiple")
    state = state_bytes(bill)
    rows_here = rows // ways
    prefill = rows_here * bucket(cfg.rl.max_prompt_len) * m.d_model * 4 * 4 + rows_here * m.vocab_size * 4 * 2
    d = bill.device
    stored = -(-cfg.rl.completions // ways) * cfg.train.seq_len * STORED_BYTES
    # the decode loop carries its cache from one token to the next: two copies live while a step writes one
    return {"rollout": {"peak": state + 2 * cache_bytes + prefill, "label": ESTIMATED},
            "logprobs": {"peak": state + d["inputs"] + max(d["working_set"], d["logits"]), "label": ESTIMATED},
            "training": {"peak": bill.device_total + stored, "label": ESTIMATED}}


def rollout_seconds(cfg: Config, bill, gpu, cache_bytes: int) -> float:
    """A rollout's decode on `gpu` (estimated): per chunk of rl.generation_batch rows and per new token, the
    weights and the chunk's cache read once at the reached share of the memory bandwidth; 0 without a GPU."""
    if gpu is None:
        return 0.0
    chunks = cfg.rl.completions // cfg.rl.rollout_rows
    weights = bill.device["params"] + bill.device["base"]
    return chunks * bucket(cfg.rl.max_completion_len) * (weights + cache_bytes) / (gpu.hbm_bandwidth * HBM_EFFICIENCY)


def run_cost(cfg: Config, cost, bill, gpu, cache_bytes: int):
    """The cost model's Cost of one GRPO step (a rollout, its log-prob passes, rl.updates_per_rollout updates):
    step_seconds their sum (estimated), tokens_per_step the tokens the updates train on."""
    rollout = rollout_seconds(cfg, bill, gpu, cache_bytes)
    forward = cost.compute_seconds * (cost.model_flops / cost.hardware_flops if cost.hardware_flops else 1.0) / 3
    logprobs = forward * (2 if cfg.rl.beta > 0 else 1) if gpu is not None else 0.0
    training = cost.step_seconds * cfg.rl.updates_per_rollout
    step = rollout + logprobs + training
    breakdown = dict(cost.breakdown, rollout_seconds=rollout, logprob_seconds=logprobs, training_seconds=training)
    return dataclasses.replace(cost, step_seconds=step, mfu=cost.mfu * training / step if step else 0.0,
                               tokens_per_step=cost.tokens_per_step * cfg.rl.updates_per_rollout, breakdown=breakdown)
