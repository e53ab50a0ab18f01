"""Packed preference pairs (data.packing with a preference objective): whole pairs as two segments each of a
row. On the same pairs a packed micro-batch gives the unpacked one's loss, rewards/chosen, rewards/rejected and
LoRA gradient to 1e-5 (dpo, simpo, orpo); the stored reference log-probs of the packed pass equal the unpacked pass's
and give the forward reference's loss; a segment's log-probs do not change when another pair of its row does;
the rows are whole pairs, every pair once an epoch, the same on every build (a resume reads the same rows);
`jaxmem data --preview` shows the segments and `jaxmem plan` plans the packed rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import cli
from jaxmem.config import ConfigError
from jaxmem.core import objective as core_objective
from jaxmem.core.program import stage_fn
from jaxmem.io.data import REFERENCE_KEY, make_source
from jaxmem.plan.bill_parts import batch_row_elems
from jaxmem.preference import precompute
from jaxmem.preference.objective import segment_sums
from jaxmem.registry import build_program
from test_preference import PAIRS, _cfg, _random_adapters, folder  # noqa: F401 (the module's fixture)

SEQ = 128  # about three of the fixture's pairs a row
ROWS = 3  # packed rows of the compared micro-batch


def _packed_cfg(folder, objective, *extra):  # noqa: F811
    return _cfg(folder, objective, "precision.compute_dtype=float32", f"train.seq_len={SEQ}", "train.micro_batch=4",
                "data.packing=first_fit", *extra)


@pytest.fixture(scope="module")
def setup(folder):  # noqa: F811
    """(program, initial state, random adapters, packed rows, unpacked rows) of one device; one program serves
    both layouts (the forward takes segment ids where given)."""
    cfg = _packed_cfg(folder, "dpo")
    prog = build_program(cfg, devices=jax.devices()[:1])
    state = prog.init_from(cfg.checkpoint.init_from)
    packed = make_source(cfg).rows
    unpacked = make_source(_packed_cfg(folder, "dpo", "data.packing=none")).rows
    assert packed.pairs == unpacked.pairs  # no cut in either layout: the same pairs
    return prog, state, _random_adapters(state["params"]), packed, unpacked


def _step_share(prog, cfg, params, frozen, batch, packed: bool):
    """(loss, metrics, gradient) of one micro-batch holding the whole step."""
    chosen = prog.features.objective(cfg)
    grad_fn = jax.jit(core_objective.micro_grad_fn(prog, chosen, stage_fn(prog, logprobs=True)))
    labels = jnp.asarray(batch["labels"])
    segments = jnp.asarray(batch["segment_ids"]) if packed else None
    positions = jnp.asarray(batch["positions"]) if packed else None
    stored = batch.get(REFERENCE_KEY)
    micro = (jnp.asarray(batch["inputs"]), labels, segments, positions, None if stored is None else jnp.asarray(stored))
    totals = dict(chosen.totals(labels[None], None if segments is None else segments[None]), scale=jnp.float32(1.0))
    grads, (loss, metrics) = grad_fn(params, micro, totals, frozen, None)
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads


def _close(a, b, what, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
    assert err < tol, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_packed_pairs_train_like_a_row_each(setup, folder, objective):  # noqa: F811
    prog, state, adapters, packed, unpacked = setup
    cfg = _packed_cfg(folder, objective)
    row_ids = packed.row_of(np.arange(ROWS))  # the first step's rows
    pairs = [k for row in row_ids for k in packed.row_pairs(int(row))]
    assert len(pairs) > ROWS  # rows hold several pairs
    got = _step_share(prog, cfg, adapters, state["base"], packed.packed_rows(row_ids), packed=True)
    want = _step_share(prog, cfg, adapters, state["base"], unpacked.pair_rows(pairs), packed=False)
    _close(got[0], want[0], "loss")
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen"):
        _close(got[1][key], want[1][key], key)
    for name, layer in want[2]["layers"].items():
        for part in ("a", "b"):
            _close(got[2]["layers"][name][part], layer[part], f"{name}.{part}")
    if objective == "dpo":  # the stored reference (packed pass) is the frozen base's: the same numbers
        stored = precompute.packed_reference_sums(prog, state["params"], state["base"], packed)
        np.testing.assert_allclose(stored, precompute.reference_sums(prog, state["params"], state["base"], unpacked),
                                   rtol=1e-5, atol=1e-5)
        packed.reference = stored
        try:
            cfg_stored = _packed_cfg(folder, "dpo", "preference.reference=precompute")
            again = _step_share(prog, cfg_stored, adapters, state["base"], packed.packed_rows(row_ids), packed=True)
        finally:
            packed.reference = None
        _close(again[0], got[0], "loss with stored reference log-probs")
        _close(again[1]["rewards/chosen"], got[1]["rewards/chosen"], "rewards/chosen with stored log-probs")


def test_a_segment_does_not_see_the_other_pairs_of_its_row(setup):
    prog, state, adapters, packed, _ = setup
    row = next(r for r in range(packed.n_rows) if len(packed.row_pairs(r)) >= 3)
    batch = packed.packed_rows([row])
    forward = stage_fn(prog, logprobs=True)
    sums = jax.jit(lambda x, y, s, p: segment_sums(forward(adapters, x, y, s, p, base=state["base"]), s))
    before = np.asarray(sums(*(batch[k] for k in ("inputs", "labels", "segment_ids", "positions"))))
    other = (batch["segment_ids"] == 2) | (batch["segment_ids"] == 3)  # the row's second pair
    changed = dict(batch, inputs=np.where(other, (batch["inputs"] + 7) % 64, batch["inputs"]).astype(np.int32))
    after = np.asarray(sums(*(changed[k] for k in ("inputs", "labels", "segment_ids", "positions"))))
    np.testing.assert_allclose(after[0, :2], before[0, :2], rtol=1e-6)  # the first pair: before it
    np.testing.assert_allclose(after[0, 4:6], before[0, 4:6], rtol=1e-6)  # the third pair: after it
    assert np.all(np.abs(after[0, 2:4] - before[0, 2:4]) > 1e-3)  # the second pair's own did change
    starts = np.flatnonzero(np.diff(batch["segment_ids"][0]) != 0) + 1
    assert np.all(batch["positions"][0][starts[batch["segment_ids"][0][starts] >= 0]] == 0)  # positions restart


def test_packed_rows_hold_whole_pairs_once_an_epoch(folder, capsys):  # noqa: F811
    cfg = _packed_cfg(folder, "dpo")
    rows = make_source(cfg).rows
    assert "pairs packed in" in capsys.readouterr().err
    for epoch in range(2):  # every pair once an epoch, each as its two segments (chosen, then rejected)
        ids = rows.row_of(np.arange(epoch * rows.n_rows, (epoch + 1) * rows.n_rows))
        assert sorted(k for r in ids for k in rows.row_pairs(int(r))) == list(range(PAIRS))
    batch = rows.rows(np.arange(2 * rows.n_rows - 2, 2 * rows.n_rows + 2))  # across an epoch's end
    again = make_source(cfg).rows.rows(np.arange(2 * rows.n_rows - 2, 2 * rows.n_rows + 2))
    assert all(np.array_equal(batch[k], again[k]) for k in batch)  # a resume reads the same rows
    for i, row in enumerate(rows.row_of(np.arange(2 * rows.n_rows - 2, 2 * rows.n_rows + 2))):
        members = rows.row_pairs(int(row))
        assert set(np.unique(batch["segment_ids"][i])) - {-1} == set(range(2 * len(members)))
        for j, k in enumerate(members):
            prompt, chosen, rejected = rows.pairs[k]
            for side, completion in ((0, chosen), (1, rejected)):
                here = batch["segment_ids"][i] == 2 * j + side
                assert here.sum() == len(prompt) + len(completion) - 1
                assert batch["labels"][i][here][len(prompt) - 1:].tolist() == completion  # completion only
                assert np.all(batch["labels"][i][here][:len(prompt) - 1] == -100)
    # an odd micro-batch is allowed packed (rows of whole pairs), refused unpacked
    assert _packed_cfg(folder, "dpo", "train.micro_batch=3").train.micro_batch == 3
    with pytest.raises(ConfigError, match="train.micro_batch: 3 must be even"):
        _packed_cfg(folder, "dpo", "train.micro_batch=3", "data.packing=none")


def test_a_pair_too_long_for_a_packed_row_is_cut_to_fit(folder):  # noqa: F811
    rows = make_source(_packed_cfg(folder, "dpo", "train.seq_len=30", "data.max_prompt_len=12")).rows
    assert rows.stats["cut"] > 0
    assert all(2 * len(p) + len(c) + len(r) - 2 <= 30 for p, c, r in rows.pairs)


def test_data_preview_shows_segments_and_plan_plans(folder, capsys, tmp_path):  # noqa: F811
    import json

    from test_preference import _cli_overrides

    overrides = _cli_overrides(folder, "dpo") + [f"train.seq_len={SEQ}", "train.micro_batch=4",
                                                 "data.packing=first_fit"]
    assert cli.main(["data", "configs/tiny.yaml", "--preview", "--documents", "3", *overrides]) == 0
    out = capsys.readouterr().out
    assert "pairs packed in" in out and "segment 0 (pair" in out and "segment 3 (pair" in out
    plans = {}
    for packing in ("first_fit", "none"):  # the same rows per micro-batch: the same bill, the batch's two more arrays
        path = tmp_path / f"{packing}.json"
        code = cli.main(["plan", "configs/tiny.yaml", *overrides, f"data.packing={packing}", "--no-compile", "--json",
                         str(path), "--target", "h100-80g", "--gpus-per-host", "1"])  # a GPU: the cost model runs
        printed = capsys.readouterr().out
        assert code in (0, 1) and "verdict:" in printed
        plans[packing] = json.loads(path.read_text())
        extra = (plans[packing][0] if isinstance(plans[packing], list) else plans[packing])["cost"]["breakdown"]
        # the frozen base's forward (reference=base, LoRA's default) priced and said
        assert extra["extra_flops"] > 0 and f"+{extra['extra_flops']:.3e} in passes beside the model's" in printed
    plans = {k: v[0] if isinstance(v, list) else v for k, v in plans.items()}
    assert any("whole pairs packed in rows" in n for n in plans["first_fit"]["analytic"]["notes"])
    assert plans["first_fit"]["cost"]["model_flops"] == plans["none"]["cost"]["model_flops"]
    # the bill's batch rows: inputs and labels, packed also segment ids and positions
    assert batch_row_elems(_packed_cfg(folder, "dpo")) == 4 * SEQ
    assert batch_row_elems(_packed_cfg(folder, "dpo", "data.packing=none")) == 2 * SEQ


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "references"), [([], ("base", "precompute")),
                                                   (["lora.rank=0"], ("model", "precompute"))], ids=["lora", "full"])
def test_a_packed_run_trains_and_its_references_agree(folder, tmp_path, extra, references):  # noqa: F811
    """The train loop on packed rows over the fsdp mesh (8 devices, a packed row each): the frozen base (or a
    frozen copy) and the stored log-probs (the precompute pass over the packed rows) give the same losses to 1e-5
    at every step; packed held-out pairs are each evaluated once."""
    from jaxmem.train import run

    losses = {}
    for ref in references:
        held_out = [f"eval.path={folder[0] / 'pairs.jsonl'}"] if ref != "precompute" else []
        cfg = _packed_cfg(folder, "dpo", f"out_dir={tmp_path / ref}", f"preference.reference={ref}", "train.steps=3",
                          "train.log_every=1", "train.progress=false", "train.micro_batch=1", "parallel.fsdp=-1",
                          "optimizer.warmup_steps=0", "optimizer.lr=1e-2", "checkpoint.every=0", *extra, *held_out)
        records = run(cfg)["records"]
        losses[ref] = [r["loss"] for r in records if "loss" in r]
        assert len(losses[ref]) == 3 and losses[ref][-1] < losses[ref][0]  # it trains
        if held_out:  # packed held-out pairs: every pair counted once
            assert [r["eval_pairs"] for r in records if "eval_pairs" in r] == [PAIRS]
    np.testing.assert_allclose(losses[references[0]], losses[references[1]], rtol=1e-5, atol=1e-6)
