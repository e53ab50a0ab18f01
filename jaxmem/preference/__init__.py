"""Preference tuning: DPO, IPO, ORPO, SimPO on pairs of completions (docs/preference.md)."""
