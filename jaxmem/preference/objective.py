"""Preference tuning's objective (jaxmem.core.plugins.Objective): a micro-batch's rows hold pairs, the chosen
completion on row 2i and the rejected one on row 2i + 1 (jaxmem.io.documents.pairs), or, packed, whole pairs as
segments 2j and 2j + 1 of a row (jaxmem.io.documents.pair_packing), labels only on completion tokens. Per
sequence (a row, or a segment) the policy's (and the reference's) log-probs are summed over those tokens; the
loss is the mean over the step's pairs of the per-pair loss (jaxmem.preference.losses), with TRL's metric
names. The per-pair arrays of a packed micro-batch have a slot for every possible pair of a row (T / 2); the
slots past a row's pairs have no labels and count nowhere."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.config.preference import REFERENCE_FREE, resolved_reference  # noqa: F401 (re-exported)
from jaxmem.config.schema import Config
from jaxmem.core.plugins import Objective
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.preference import losses

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def _pairs(x_b):
    """[B] per row -> ([P] chosen, [P] rejected): rows 2i and 2i + 1."""
    pairs = x_b.reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def segment_sums(x_bt, segments_bt):
    """[..., T] -> [..., S] sums per segment id (S = T rounded up to even: a segment fills at least one
    position), padding (segment id < 0) dropped."""
    n = x_bt.shape[-1] + x_bt.shape[-1] % 2
    one_row = lambda x, seg: jnp.zeros((n,), x.dtype).at[jnp.where(seg < 0, n, seg)].add(x, mode="drop")  # noqa: E731
    flat = jax.vmap(one_row)(x_bt.reshape(-1, x_bt.shape[-1]), segments_bt.reshape(-1, x_bt.shape[-1]))
    return flat.reshape(*x_bt.shape[:-1], n)


def sequence_pairs(x_bt, segments_bt):
    """Per-token values [B, T] -> their sums per sequence as ([P] chosen, [P] rejected): one sequence a row
    (segments None: rows 2i and 2i + 1) or packed pairs (pair j of a row: segments 2j and 2j + 1; a row's
    slots past its pairs sum to 0)."""
    if segments_bt is None:
        return _pairs(jnp.sum(x_bt, axis=-1))
    return _pairs(segment_sums(x_bt, segments_bt).reshape(-1))


class PreferenceObjective(Objective):
    metric_names = METRICS

    def __init__(self, cfg: Config):
        self.name, self.settings = cfg.train.objective, cfg.preference
        source = resolved_reference(cfg)
        self.reference = {"none": "none", "precompute": "batch"}.get(source, "forward")

    def totals(self, labels_arbt, segments_arbt=None) -> dict:
        """The step's pairs (those whose chosen sequence has labels: every pair in training; held-out batches mask
        the rows past the set's end) and their chosen completions' tokens: `pairs` (at least 1, a divisor),
        `pair_count` (exact)."""
        valid = (labels_arbt != IGNORE_INDEX).astype(jnp.float32)
        tokens_c, _ = sequence_pairs(valid.reshape(-1, valid.shape[-1]),
                                     None if segments_arbt is None else segments_arbt.reshape(-1, valid.shape[-1]))
        pairs = jnp.sum(tokens_c > 0).astype(jnp.float32)
        return {"pairs": jnp.maximum(pairs, 1.0), "pair_count": pairs,
                "chosen_tokens": jnp.maximum(jnp.sum(tokens_c), 1.0)}

    def micro_loss(self, policy_bt, reference_bt, labels_bt, totals: dict, segments_bt=None):
        valid = labels_bt != IGNORE_INDEX
        policy_c, policy_r = sequence_pairs(jnp.where(valid, policy_bt, 0.0), segments_bt)
        n_c, n_r = sequence_pairs(valid.astype(jnp.float32), segments_bt)
        real = n_c > 0  # a pair slot without labels (past a held-out set's end, past a packed row's pairs)
        safe = lambda x: jnp.where(real, x, -1.0)  # noqa: E731 (finite losses and gradients on the empty slots)
        p = self.settings
        extra = 0.0
        if self.name in ("dpo", "ipo"):
            # a forward's reference is 0 on ignored labels; stored sums sit at a sequence's first position
            ref_c, ref_r = map(safe, sequence_pairs(reference_bt, segments_bt))
            if self.name == "dpo":
                loss, r_c, r_r = losses.dpo(safe(policy_c), safe(policy_r), ref_c, ref_r, beta=p.beta,
                                            label_smoothing=p.label_smoothing)
            else:
                loss, r_c, r_r = losses.ipo(safe(policy_c), safe(policy_r), ref_c, ref_r, n_c, n_r, beta=p.beta)
            logp_c, logp_r = policy_c, policy_r
        elif self.name == "simpo":
            loss, r_c, r_r = losses.simpo(safe(policy_c), safe(policy_r), n_c, n_r, beta=p.beta,
                                          gamma=p.simpo_gamma, length_normalize=p.length_normalize)
            logp_c, logp_r = r_c / p.beta, r_r / p.beta
        else:  # orpo: the chosen completion's NLL per token of the step, plus the odds-ratio term per pair
            loss, r_c, r_r = losses.orpo_odds(safe(policy_c), safe(policy_r), n_c, n_r, lam=p.orpo_lambda)
            logp_c, logp_r = policy_c / jnp.maximum(n_c, 1), policy_r / jnp.maximum(n_r, 1)
            extra = -jnp.sum(policy_c) / totals["chosen_tokens"]
        share = lambda x: jnp.sum(jnp.where(real, x, 0.0)) / totals["pairs"]  # noqa: E731
        metrics = {"rewards/chosen": share(r_c), "rewards/rejected": share(r_r),
                   "rewards/accuracies": share((r_c > r_r).astype(jnp.float32)), "rewards/margins": share(r_c - r_r),
                   "logps/chosen": share(logp_c), "logps/rejected": share(logp_r)}
        return share(loss) + extra, metrics
