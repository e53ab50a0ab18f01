"""Record batches in the train step: packed documents do not see each other (attention, positions) with every
kernel, and the loss is the mean over the whole global batch's trained labels, whatever the accumulation and
mesh layout."""
import jax
import numpy as np
import pytest

from jaxmem.loader import load_config
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.core.program import loss_sum_fn
from jaxmem.registry import build_program

SEQ = 64
DOCS = (23, 17, 24)  # input positions of three documents packed into one row
RECORDS = ["data.kind=jsonl", "data.path=train.jsonl", "data.tokenizer=tokenizer.json"]


def _documents(seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 256, n + 1).astype(np.int32) for n in DOCS]  # n + 1 ids give n input positions
    masks = [rng.random(n + 1) < 0.7 for n in DOCS]  # which ids are trained targets
    return docs, masks


def _row(docs, masks, only: int | None = None, alone: bool = False):
    """One [1, SEQ] row of (inputs, labels, segment_ids, positions): the documents packed in order, or with
    `alone` just document `only` at the row's start; with `only`, labels of the other documents masked."""
    inputs = np.zeros(SEQ, np.int32)
    labels = np.full(SEQ, IGNORE_INDEX, np.int32)
    seg = np.full(SEQ, -1, np.int32)
    pos = np.zeros(SEQ, np.int32)
    at = 0
    for j, (ids, mask) in enumerate(zip(docs, masks)):
        if alone and j != only:
            continue
        n = len(ids) - 1
        inputs[at:at + n] = ids[:-1]
        if only is None or j == only:
            labels[at:at + n] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        seg[at:at + n], pos[at:at + n] = j, np.arange(n)
        at += n
    return tuple(x[None] for x in (inputs, labels, seg, pos))


@pytest.mark.parametrize("kernels", [["kernels.attention=xla", "kernels.loss=chunked"],
                                     ["kernels.attention=pallas", "kernels.loss=pallas"],
                                     ["kernels.attention=xla", "kernels.loss=naive"]],
                         ids=["xla-chunked", "pallas-pallas", "xla-naive"])
def test_packed_documents_lose_what_they_lose_one_by_one(kernels):
    cfg = load_config("configs/tiny.yaml", RECORDS + kernels + [f"train.seq_len={SEQ}", "parallel.fsdp=1",
                                                                "train.micro_batch=1"])
    prog = build_program(cfg, devices=jax.devices()[:1])
    params = prog.init_state(seed=0)["params"]
    loss = jax.jit(loss_sum_fn(prog))
    docs, masks = _documents()
    total = float(loss(params, *_row(docs, masks))[0])
    per_doc = []
    for j in range(len(docs)):
        packed, n_packed = loss(params, *_row(docs, masks, only=j))
        alone, n_alone = loss(params, *_row(docs, masks, only=j, alone=True))
        assert int(n_packed) == int(n_alone) == int(masks[j][1:].sum())
        np.testing.assert_allclose(float(packed), float(alone), rtol=2e-5)
        per_doc.append(float(alone))
    np.testing.assert_allclose(total, sum(per_doc), rtol=2e-5)
    # without segment ids and positions the documents do see each other: the comparison above has teeth
    inputs, labels, _, _ = _row(docs, masks, only=2)
    leaky = float(loss(params, inputs, labels)[0])
    assert abs(leaky - per_doc[2]) > 1e-3 * abs(per_doc[2])


def _global_batch(rows=8, steps=3, seed=1):
    """[steps][rows, SEQ] record batches with very uneven trained-label counts per row."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        inputs = rng.integers(1, 256, (rows, SEQ)).astype(np.int32)
        keep = rng.random((rows, SEQ)) < np.linspace(0.05, 0.95, rows)[:, None]
        labels = np.where(keep, rng.integers(1, 256, (rows, SEQ)), IGNORE_INDEX).astype(np.int32)
        seg = np.repeat(np.arange(4), SEQ // 4)[None].repeat(rows, 0).astype(np.int32)
        pos = np.tile(np.arange(SEQ // 4), 4)[None].repeat(rows, 0).astype(np.int32)
        out.append({"inputs": inputs, "labels": labels, "segment_ids": seg, "positions": pos})
    return out


def _train(overrides, devices):
    cfg = load_config("configs/tiny.yaml", RECORDS + [f"train.seq_len={SEQ}", "optimizer.warmup_steps=0",
                                                      "optimizer.lr=1e-1", "optimizer.eps=1e-1"] + overrides)
    prog = build_program(cfg, devices=devices)
    assert prog.grad_accum * prog.rows == 8
    state, step = prog.init_state(), prog.jit_step()
    losses, norms, n_valid = [], [], []
    for batch in _global_batch():
        local = {k: v.reshape(prog.batch_shape) for k, v in batch.items()}
        state, m = step(state, prog.shard_batch(local))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        n_valid.append(float(m["tokens"]))
    return losses, norms, n_valid, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def one_device():
    return _train(["parallel.fsdp=1", "train.micro_batch=8"], jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["parallel.fsdp=1", "train.micro_batch=2", "train.grad_accum=4"],
                                       ["parallel.fsdp=8", "train.micro_batch=1"],
                                       ["parallel.fsdp=2", "train.micro_batch=1", "train.grad_accum=4"]],
                         ids=["accum4", "fsdp8", "fsdp2_accum4"])
def test_loss_is_the_mean_over_the_global_batch(overrides, one_device):
    devices = jax.devices()[:1] if "parallel.fsdp=1" in overrides else jax.devices()[:int(overrides[0][-1])]
    losses, norms, n_valid, params = _train(overrides, devices)
    np.testing.assert_allclose(losses, one_device[0], rtol=2e-5)
    np.testing.assert_allclose(norms, one_device[1], rtol=2e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), params, one_device[3])
    # the step's token count is every trained label of the global batch
    assert n_valid == [float((b["labels"] != IGNORE_INDEX).sum()) for b in _global_batch()]
