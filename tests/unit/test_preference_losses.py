"""The preference losses per pair (jaxmem.preference.losses) against float64 numpy references written from the
papers' formulas, conservative DPO (label smoothing) and SimPO's sum form included (TRL has no sigmoid loss
with label smoothing to compare with; tests/integration/test_preference.py compares the rest with TRL)."""
import numpy as np
import pytest

from jaxmem.preference import losses

rng = np.random.default_rng(0)
P = 16
POLICY_C, POLICY_R = -rng.uniform(5, 40, P), -rng.uniform(5, 40, P)
REF_C, REF_R = POLICY_C + rng.normal(0, 2, P), POLICY_R + rng.normal(0, 2, P)
N_C, N_R = rng.integers(3, 20, P).astype(np.float64), rng.integers(3, 20, P).astype(np.float64)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_conservative_dpo(eps):
    beta = 0.2
    d = beta * ((POLICY_C - REF_C) - (POLICY_R - REF_R))
    want = -(1 - eps) * _log_sigmoid(d) - eps * _log_sigmoid(-d)
    loss, r_c, r_r = losses.dpo(POLICY_C, POLICY_R, REF_C, REF_R, beta=beta, label_smoothing=eps)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(r_c, beta * (POLICY_C - REF_C), rtol=1e-5)
    np.testing.assert_allclose(r_r, beta * (POLICY_R - REF_R), rtol=1e-5)


def test_ipo_on_the_mean_log_ratio_per_token():
    beta = 0.5
    d = (POLICY_C - REF_C) / N_C - (POLICY_R - REF_R) / N_R
    loss, _, _ = losses.ipo(POLICY_C, POLICY_R, REF_C, REF_R, N_C, N_R, beta=beta)
    np.testing.assert_allclose(loss, (d - 1 / (2 * beta)) ** 2, rtol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
def test_simpo(normalize):
    beta, gamma = 2.0, 0.5
    c, r = (POLICY_C / N_C, POLICY_R / N_R) if normalize else (POLICY_C, POLICY_R)
    loss, r_c, _ = losses.simpo(POLICY_C, POLICY_R, N_C, N_R, beta=beta, gamma=gamma, length_normalize=normalize)
    np.testing.assert_allclose(loss, -_log_sigmoid(beta * (c - r) - gamma), rtol=1e-5)
    np.testing.assert_allclose(r_c, beta * c, rtol=1e-5)


def test_orpo_odds_ratio():
    lam = 0.1
    c, r = POLICY_C / N_C, POLICY_R / N_R
    log_odds = (c - np.log1p(-np.exp(c))) - (r - np.log1p(-np.exp(r)))
    loss, _, _ = losses.orpo_odds(POLICY_C, POLICY_R, N_C, N_R, lam=lam)
    np.testing.assert_allclose(loss, -lam * _log_sigmoid(log_odds), rtol=1e-5)
