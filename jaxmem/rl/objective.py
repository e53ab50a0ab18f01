"""GRPO's objective (jaxmem.core.plugins.Objective): a micro-batch's rows are completions, labels only on the
completion's tokens. Its `reference` is "batch": the rollout stores per token, in the batch's REFERENCE_KEY
array [B, T, 3] float32, the log-probs the rollout's policy gave (old), the reference's (0 with rl.beta=0)
and the completion's advantage. Per token: the clipped importance-ratio surrogate (PPO's) plus beta x the k3
KL estimate to the reference (rl.loss_type cispo: the capped ratio without gradient times the advantage and the
log-prob; sapo: a sigmoid gate of the ratio instead of the clip; vespo: a gamma weight of the completion's ratio
times the advantage and the log-prob; rl.importance_sampling_level sequence: GSPO's one ratio per completion);
then normalized as rl.loss_type says, as TRL's GRPOTrainer does."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.config.schema import Config
from jaxmem.core.plugins import REFERENCE_KEY, Objective
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.mesh import sharding

METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
OLD, REFERENCE, ADVANTAGE = 0, 1, 2  # the stored array's last axis


def per_token_terms(policy_bt, old_bt, ref_bt, advantage_bt, *, beta, epsilon_low, epsilon_high, loss_type="dapo",
                    sapo_temperatures=(1.0, 1.05), mask_bt=None, level="token", vespo=(2.0, 3.0, 3.0, 2.0)):
    """(loss per token, kl per token (0 with beta 0: no reference), low clipped, high clipped), each [B, T] (the
    clip flags [B, 1] with a sequence-level ratio); with loss_type cispo "high clipped" is where the ratio is over
    its cap (epsilon_high) with a positive advantage. level "sequence" (GSPO): the ratio is exp of the mean
    log-ratio over each completion's tokens (`mask_bt`), one per completion. vespo: (k_pos, lambda_pos, k_neg,
    lambda_neg) of its gamma weight."""
    advantage_b1 = advantage_bt
    log_ratio = policy_bt - old_bt
    if level == "sequence":
        count = jnp.maximum(jnp.sum(mask_bt, axis=-1, keepdims=True), 1.0)
        log_ratio = jnp.sum(log_ratio * mask_bt, axis=-1, keepdims=True) / count
        advantage_b1 = advantage_bt[:, :1]
    ratio = jnp.exp(log_ratio)
    if loss_type == "cispo":  # the capped ratio weighs the log-prob's gradient
        loss = -jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high)) * advantage_b1 * policy_bt
    elif loss_type == "sapo":  # a smooth gate, its temperature by the advantage's sign
        tau = jnp.where(advantage_b1 > 0, *sapo_temperatures)
        loss = -jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantage_b1
    elif loss_type == "vespo":  # a gamma weight of the whole completion's ratio, without gradient
        loss = -jax.lax.stop_gradient(vespo_weight(policy_bt - old_bt, mask_bt, advantage_b1, *vespo)) \
            * advantage_b1 * policy_bt
    else:
        clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        loss = -jnp.minimum(ratio * advantage_b1, clipped * advantage_b1)
    kl = jnp.exp(ref_bt - policy_bt) - (ref_bt - policy_bt) - 1.0 if beta else jnp.zeros_like(policy_bt)
    if beta:
        loss = loss + beta * kl
    if loss_type in ("sapo", "vespo"):  # no clip: nothing to count
        low = high = jnp.zeros(ratio.shape, bool)
    else:
        low = (ratio < 1.0 - epsilon_low) & (advantage_b1 < 0)
        high = (ratio > (epsilon_high if loss_type == "cispo" else 1.0 + epsilon_high)) & (advantage_b1 > 0)
    return jnp.broadcast_to(loss, policy_bt.shape), kl, low, high


def vespo_weight(log_ratio_bt, mask_bt, advantage_b1, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's phi(w) = exp(lambda) w^k exp(-lambda w) of the completion's ratio w = exp(sum of its tokens'
    log-ratios), k and lambda by the advantage's sign, [B, 1]; computed in log space with TRL's clamps."""
    floor = math.log(1e-8)
    seq = jnp.sum(jnp.clip(log_ratio_bt, -20.0, 20.0) * mask_bt, axis=-1, keepdims=True)
    log_w = jnp.clip(seq, floor, 20.0)
    positive = advantage_b1 >= 0
    k = jnp.where(positive, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(positive, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def normalized(loss_bt, mask_bt, loss_type: str, totals: dict):
    """This micro-batch's share of the step's loss: grpo and sapo (each completion's mean over its tokens, then
    the mean over completions), dr_grpo (the sum over completions x rl.max_completion_len), bnpo (the mean over
    the micro-batch's tokens, then over micro-batches), luspo (each completion's sum over its tokens, then the
    mean over completions), dapo, cispo and vespo (over all tokens)."""
    summed = jnp.sum(loss_bt * mask_bt, axis=-1)
    if loss_type in ("grpo", "sapo"):
        return jnp.sum(summed / jnp.maximum(jnp.sum(mask_bt, axis=-1), 1.0)) / totals["completions"]
    if loss_type == "luspo":  # each completion's token sum, then the mean over completions
        return jnp.sum(summed) / totals["completions"]
    if loss_type == "dr_grpo":
        return jnp.sum(summed) / (totals["completions"] * totals["max_completion_len"])
    if loss_type == "bnpo":
        return jnp.sum(summed) / jnp.maximum(jnp.sum(mask_bt), 1.0) / totals["micro_batches"]
    return jnp.sum(summed) / totals["tokens"]


def abstract_batch(prog) -> dict:
    """A rollout's training batch (jaxmem.rl.rollout): inputs and labels [A, rows, T] int32, the stored
    [A, rows, T, 3] float32; rows over the data ways."""
    data = sharding.batch_spec(prog.mesh)[0]
    shape = (prog.grad_accum, prog.rows, prog.cfg.train.seq_len)
    rows = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(prog.mesh, P(None, data, None)))
    stored = jax.ShapeDtypeStruct(shape + (3,), jnp.float32, sharding=NamedSharding(prog.mesh, P(None, data, None,
                                                                                                  None)))
    return {"inputs": rows, "labels": rows, REFERENCE_KEY: stored}


class GRPOObjective(Objective):
    name = "grpo"
    reference = "batch"
    metric_names = METRICS

    def __init__(self, cfg: Config):
        self.settings = cfg.rl
        self.temperature = cfg.rl.temperature  # the rollout samples at it; the loss's log-probs take it too

    def abstract_batch(self, prog) -> dict:
        return abstract_batch(prog)

    def totals(self, labels_arbt, segments_arbt=None) -> dict:
        a, rows = labels_arbt.shape[:2]
        tokens = jnp.sum(labels_arbt != IGNORE_INDEX).astype(jnp.float32)
        return {"completions": jnp.float32(a * rows), "tokens": jnp.maximum(tokens, 1.0),
                "micro_batches": jnp.float32(a), "max_completion_len": jnp.float32(self.settings.max_completion_len)}

    def micro_loss(self, policy_bt, stored_bt3, labels_bt, totals: dict, segments_bt=None):
        s = self.settings
        mask = (labels_bt != IGNORE_INDEX).astype(jnp.float32)
        loss, kl, low, high = per_token_terms(
            policy_bt, stored_bt3[..., OLD], stored_bt3[..., REFERENCE], stored_bt3[..., ADVANTAGE], beta=s.beta,
            epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high, loss_type=s.loss_type,
            sapo_temperatures=(s.sapo_temperature_pos, s.sapo_temperature_neg), mask_bt=mask,
            level=s.importance_sampling_level, vespo=(s.vespo_k_pos, s.vespo_lambda_pos, s.vespo_k_neg,
                                                      s.vespo_lambda_neg))
        # with cispo, clip_ratio/high_mean is TRL's cispo_clip_ratio (the ratio over its cap, advantage > 0); with a
        # sequence-level ratio the clip shares are over completions (TRL's, one value per sequence)
        token_share = lambda x: jnp.sum(x.astype(jnp.float32) * mask) / totals["tokens"]  # noqa: E731
        clip_share = token_share if low.shape == mask.shape else (
            lambda x: jnp.sum(x.astype(jnp.float32)) / totals["completions"])  # noqa: E731
        metrics = {"kl": token_share(kl), "clip_ratio/low_mean": clip_share(low),
                   "clip_ratio/high_mean": clip_share(high), "clip_ratio/region_mean": clip_share(low | high)}
        return normalized(loss, mask, s.loss_type, totals), metrics
