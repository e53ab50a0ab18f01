"""preference.reference=model stored as bf16, int8 or nf4, on the device or the host: each gives the reference
log-probs of the bf16 copy within what its quantization error explains (int8 per channel closer than nf4's
16 levels), and the layout's frozen part shrinks as the stored forms say."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.core import objective as core_objective
from jaxmem.core.plugins import FROZEN
from jaxmem.core.program import stage_fn
from jaxmem.io.data import make_source
from jaxmem.core import reference_copy
from jaxmem.registry import build_program
from test_preference import PAIRS, SEQ, _cfg, folder  # noqa: F401 (the module's fixture)


def _rewards(folder, *extra):  # noqa: F811
    """(mean |rewards/chosen| / beta, |rewards/rejected| / beta): the policy (the initial weights) against the
    copy, i.e. how far the copy's log-prob sums are from the weights' own, and the program."""
    cfg = _cfg(folder, "dpo", "lora.rank=0", "preference.reference=model", "train.micro_batch=2", *extra)
    prog = build_program(cfg, devices=jax.devices()[:1])
    state = prog.init_from(cfg.checkpoint.init_from)
    batch = make_source(cfg).samples(np.arange(2 * PAIRS), SEQ)
    chosen = prog.features.objective(cfg)
    grad_fn = jax.jit(core_objective.micro_grad_fn(prog, chosen, stage_fn(prog, logprobs=True)))
    labels = jnp.asarray(batch["labels"])
    micro = (jnp.asarray(batch["inputs"]), labels, None, None, None)
    totals = dict(chosen.totals(labels[None]), scale=jnp.float32(1.0))
    _, (_, metrics) = grad_fn(state["params"], micro, totals, state[FROZEN], None)
    beta = cfg.preference.beta
    return abs(float(metrics["rewards/chosen"])) / beta, abs(float(metrics["rewards/rejected"])) / beta, prog


def _layer_bytes(prog) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(prog.layout.frozen_abstract["layers"]))


@pytest.mark.slow
def test_reference_dtypes_and_host_give_the_bf16_copys_log_probs(folder):  # noqa: F811
    bf16 = _rewards(folder)
    assert bf16[:2] == (0.0, 0.0)  # the weights are bf16 values: the bf16 copy is exact
    host = _rewards(folder, "preference.reference_memory=host")
    assert host[:2] == (0.0, 0.0)
    int8 = _rewards(folder, "preference.reference_dtype=int8")
    nf4 = _rewards(folder, "preference.reference_dtype=nf4", "preference.reference_memory=host")
    print("mean |log-prob sum error| per sequence, chosen / rejected: int8", int8[:2], "nf4", nf4[:2])
    for err in (*int8[:2], *nf4[:2]):
        assert 0.0 < err
    # a per-sequence sum over ~20 tokens: int8 keeps each weight within half a step of 1/127 of its channel's
    # absmax, nf4 within half a code gap (up to 1/6) of its block's
    assert max(int8[:2]) < 1e-3 and max(nf4[:2]) < 2e-2 and max(int8[:2]) < max(nf4[:2])
    layers = {}
    for name, (*_, prog) in (("bf16", bf16), ("host", host), ("int8", int8), ("nf4", nf4)):
        layers[name] = _layer_bytes(prog)
        assert layers[name] == reference_copy.copy_bytes(prog.cfg.preference.reference_dtype,
                                                                  prog.layout.abstract_params)[0]  # the bill's
    assert layers["host"] == layers["bf16"]
    # int8: a byte a weight and an fp32 scale per 32 of them, nf4: half a byte and an fp32 absmax per 64; the
    # norms stay bf16
    assert 0.5 < layers["int8"] / layers["bf16"] < 0.65 and 0.25 < layers["nf4"] / layers["bf16"] < 0.4


def test_plan_prices_the_precompute_pass(folder, tmp_path):  # noqa: F811
    """`jaxmem plan` of reference=precompute: the pass's time (a forward per token of the cost model's step, over
    the file's records) and the bytes it stores, as np.save writes them."""
    import io

    from rich.console import Console

    from jaxmem.plan import plan, resolve_topology
    from jaxmem.plan.report import render

    cfg = _cfg(folder, "dpo", "lora.rank=0", "preference.reference=precompute", "parallel.fsdp=1")
    out = plan(cfg, resolve_topology(cfg, target="h100-80g", gpus_per_host=1, hosts=1), compile=False)
    section, cost = out["preference"], out["cost"]
    assert section["pairs"] == PAIRS + 2 and section["label"].startswith("estimated")
    # a forward is a third of a full fine-tune's step FLOPs (less where remat recomputes): the step's pairs
    # (rows / 2) take that share of the step's compute time
    step_pairs = cost["tokens_per_step"] / (2 * cfg.train.seq_len)
    assert 0.2 < section["seconds_per_pair"] * step_pairs / cost["compute_seconds"] <= 1 / 3 + 1e-9
    assert section["seconds"] == pytest.approx(section["seconds_per_pair"] * section["pairs"])
    np.save(tmp_path / "v.npy", np.zeros((section["pairs"], 2), np.float32))
    stored = (tmp_path / "v.npy").stat().st_size
    assert stored < section["disk_bytes"] <= stored + 256
    console = Console(file=io.StringIO(), width=200)
    render(out, console)
    assert "one forward pass over the pairs before training" in console.file.getvalue()


def test_held_out_pairs_give_the_step_metrics_over_every_pair(folder):  # noqa: F811
    """eval.path with a preference objective: TRL's metrics as means over every held-out pair, read once in
    batches of 3 pairs (the last one 2 short: its masked pairs count nowhere), equal to one micro-batch of all
    the pairs (the train step's metrics) under the same adapters."""
    from test_preference import _jaxmem

    from jaxmem.train.evaluate import Evaluator

    loss, metrics, _, adapters, _, _ = _jaxmem(_cfg(folder, "dpo"))
    cfg = _cfg(folder, "dpo", f"eval.path={folder[0] / 'pairs.jsonl'}", "eval.batches=8", "train.micro_batch=6")
    prog = build_program(cfg, devices=jax.devices()[:1])
    state = dict(prog.init_from(cfg.checkpoint.init_from), params=adapters)
    got = Evaluator.for_run(cfg, prog).run(state)
    assert got["eval_pairs"] == PAIRS and len(prog.features.objective(cfg).metric_names) == 6
    np.testing.assert_allclose(got["eval_loss"], loss, rtol=1e-5, atol=1e-6)
    for name, value in metrics.items():
        np.testing.assert_allclose(got[f"eval_{name}"], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_run_evaluates_held_out_pairs_with_a_reference_copy(folder, tmp_path):  # noqa: F811
    """The loop's periodic evaluation of a full fine-tune (FSDP over 8 devices) against its int8 reference copy:
    TRL's names in the records; at step 1 the policy has moved from the reference (nonzero rewards)."""
    from test_preference import _run_cfg

    from jaxmem.train import run

    summary = run(_run_cfg(folder, tmp_path / "run", "lora.rank=0", "preference.reference=model",
                           "preference.reference_dtype=int8", f"eval.path={folder[0] / 'pairs.jsonl'}",
                           "eval.every=1", "eval.batches=2", "train.steps=2"))
    evals = [r for r in summary["records"] if "eval_loss" in r]
    assert len(evals) == 2 and all(r["eval_pairs"] == PAIRS for r in evals)  # 2 batches of 8 pairs (8 devices)
    assert abs(evals[-1]["eval_rewards/margins"]) > 0 and 0.0 <= evals[-1]["eval_rewards/accuracies"] <= 1.0
    assert evals[-1]["eval_rewards/margins"] == pytest.approx(
        evals[-1]["eval_rewards/chosen"] - evals[-1]["eval_rewards/rejected"], abs=1e-6)
