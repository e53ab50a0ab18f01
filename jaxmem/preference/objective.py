"""Preference tuning's objective (jaxmem.core.plugins.Objective): a micro-batch's rows hold pairs, the chosen
completion on row 2i and the rejected one on row 2i + 1 (jaxmem.io.documents.pairs), labels only on completion
tokens. Per row the policy's (and the reference's) log-probs are summed over those tokens; the loss is the mean
over the step's pairs of the per-pair loss (jaxmem.preference.losses), with TRL's metric names."""
from __future__ import annotations

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


class PreferenceObjective(Objective):
    metric_names = METRICS

    def __init__(self, cfg: Config):
        self.name, self.settings = cfg.train.objective, cfg.preference
        source = resolved_reference(cfg)
        self.reference = {"none": "none", "precompute": "batch"}.get(source, "forward")

    def totals(self, labels_arbt) -> dict:
        """The step's pairs (those whose chosen row has labels: every pair in training; held-out batches mask the
        rows past the set's end) and their chosen completions' tokens."""
        chosen = labels_arbt[:, 0::2] != IGNORE_INDEX
        pairs = jnp.sum(jnp.any(chosen, axis=-1))
        return {"pairs": jnp.maximum(pairs, 1).astype(jnp.float32),
                "chosen_tokens": jnp.maximum(jnp.sum(chosen), 1).astype(jnp.float32)}

    def micro_loss(self, policy_bt, reference_bt, labels_bt, totals: dict):
        valid = labels_bt != IGNORE_INDEX
        policy_c, policy_r = _pairs(jnp.sum(jnp.where(valid, policy_bt, 0.0), axis=-1))
        n_c, n_r = _pairs(jnp.sum(valid, axis=-1).astype(jnp.float32))
        p = self.settings
        extra = 0.0
        if self.name in ("dpo", "ipo"):
            # a forward's reference is 0 on ignored labels; stored sums sit at a row's first position
            ref_c, ref_r = _pairs(jnp.sum(reference_bt, axis=-1))
            if self.name == "dpo":
                loss, r_c, r_r = losses.dpo(policy_c, policy_r, ref_c, ref_r, beta=p.beta,
                                            label_smoothing=p.label_smoothing)
            else:
                loss, r_c, r_r = losses.ipo(policy_c, policy_r, ref_c, ref_r, n_c, n_r, beta=p.beta)
            logp_c, logp_r = policy_c, policy_r
        elif self.name == "simpo":
            loss, r_c, r_r = losses.simpo(policy_c, policy_r, n_c, n_r, beta=p.beta, gamma=p.simpo_gamma,
                                          length_normalize=p.length_normalize)
            logp_c, logp_r = r_c / p.beta, r_r / p.beta
        else:  # orpo: the chosen completion's NLL per token of the step, plus the odds-ratio term per pair
            loss, r_c, r_r = losses.orpo_odds(policy_c, policy_r, n_c, n_r, lam=p.orpo_lambda)
            logp_c, logp_r = policy_c / jnp.maximum(n_c, 1), policy_r / jnp.maximum(n_r, 1)
            extra = -jnp.sum(policy_c) / totals["chosen_tokens"]
        real = n_c > 0  # a pair without labels (past a held-out set's end) counts nowhere
        share = lambda x: jnp.sum(jnp.where(real, x, 0.0)) / totals["pairs"]  # noqa: E731
        metrics = {"rewards/chosen": share(r_c), "rewards/rejected": share(r_r),
                   "rewards/accuracies": share((r_c > r_r).astype(jnp.float32)), "rewards/margins": share(r_c - r_r),
                   "logps/chosen": share(logp_c), "logps/rejected": share(logp_r)}
        return share(loss) + extra, metrics
