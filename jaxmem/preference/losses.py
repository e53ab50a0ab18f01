"""The preference losses per pair, from per-sequence log-probs of the completions (sums over completion
tokens, and their token counts). Definitions follow the papers as TRL implements them (DPO's sigmoid loss with
conservative label smoothing, IPO on the per-token mean log-ratio, SimPO on the mean log-prob with a margin,
ORPO's odds ratio on the mean log-prob beside the chosen completion's NLL); docs/preference.md says where
jaxmem differs (ORPO's NLL covers the completion only).

Each function takes [P] arrays (one entry per pair) and returns (loss per pair [P], chosen reward [P],
rejected reward [P]); rewards are what TRL logs under rewards/chosen and rewards/rejected.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def dpo(policy_c, policy_r, ref_c, ref_r, *, beta: float, label_smoothing: float = 0.0):
    """-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d), d = the chosen minus the rejected log-ratio."""
    chosen, rejected = policy_c - ref_c, policy_r - ref_r
    d = beta * (chosen - rejected)
    loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(d) - label_smoothing * jax.nn.log_sigmoid(-d)
    return loss, beta * chosen, beta * rejected


def ipo(policy_c, policy_r, ref_c, ref_r, n_c, n_r, *, beta: float):
    """(mean log-ratio per token of chosen minus rejected - 1 / (2 beta))^2."""
    chosen, rejected = policy_c - ref_c, policy_r - ref_r
    d = chosen / jnp.maximum(n_c, 1) - rejected / jnp.maximum(n_r, 1)
    return (d - 1.0 / (2.0 * beta)) ** 2, beta * chosen, beta * rejected


def simpo(policy_c, policy_r, n_c, n_r, *, beta: float, gamma: float, length_normalize: bool = True):
    """-log sigmoid(beta (chosen - rejected) - gamma) on the mean log-prob per token (or the sum)."""
    if length_normalize:
        policy_c, policy_r = policy_c / jnp.maximum(n_c, 1), policy_r / jnp.maximum(n_r, 1)
    loss = -jax.nn.log_sigmoid(beta * (policy_c - policy_r) - gamma)
    return loss, beta * policy_c, beta * policy_r


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo_odds(policy_c, policy_r, n_c, n_r, *, lam: float):
    """The odds-ratio term per pair, -lam log sigmoid(log odds(chosen) - log odds(rejected)), on the mean
    log-prob per token; the chosen completion's NLL is added over its tokens (objective.py)."""
    mean_c, mean_r = policy_c / jnp.maximum(n_c, 1), policy_r / jnp.maximum(n_r, 1)
    log_odds = (mean_c - mean_r) - (_log1mexp(mean_c) - _log1mexp(mean_r))
    return -lam * jax.nn.log_sigmoid(log_odds), lam * mean_c, lam * mean_r
