"""Token sources and the batch iterator: determinism, per-process rows, text/bin/tokenizer files."""
import numpy as np
import pytest

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.io.data import Batches, SyntheticSource, batches, make_source, process_rows
from jaxmem.registry import build_program

SEQ = 16


def _cfg(*overrides):
    return load_config(None, [f"train.seq_len={SEQ}", "train.micro_batch=2", *overrides])


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_a_pure_function_of_seed_and_sample_index():
    a, b = SyntheticSource(256, seed=0), SyntheticSource(256, seed=0)
    rows = a.samples(np.arange(10, 20), SEQ + 1)
    np.testing.assert_array_equal(rows, b.samples(np.arange(10, 20), SEQ + 1))
    # a sample does not depend on which other samples are asked for with it
    np.testing.assert_array_equal(rows[5], b.samples(np.array([15]), SEQ + 1)[0])
    assert not np.array_equal(rows, SyntheticSource(256, seed=1).samples(np.arange(10, 20), SEQ + 1))
    assert rows.dtype == np.int32 and rows.min() >= 0 and rows.max() < 256


def test_synthetic_follows_its_transition_table():
    src = SyntheticSource(64, seed=3)
    rows = src.samples(np.arange(200), 33)
    allowed = {(int(t), int(s)) for t in range(64) for s in src.successors[t]}
    seen = {(int(x), int(y)) for row in rows for x, y in zip(row[:-1], row[1:])}
    assert seen <= allowed
    assert len(seen) > len(allowed) // 2  # and explores it, so there is something to learn


# ---------------------------------------------------------------- batches


def test_batch_of_step_i_is_a_function_of_i():
    cfg = _cfg()
    prog = build_program(cfg)
    it = batches(cfg, prog)
    for _ in range(3):
        next(it)
    per_step = prog.grad_accum * prog.rows
    assert it.step == 3 and it.position == 3 * per_step and it.position_at(2) == 2 * per_step
    fresh = batches(cfg, prog, step=3)
    np.testing.assert_array_equal(fresh.local_batch(fresh.position), it.local_batch(it.position))
    got = np.asarray(next(fresh)["tokens"])
    assert got.shape == prog.batch_shape
    np.testing.assert_array_equal(got, it.local_batch(it.position))


def test_process_shares_tile_the_global_batch():
    cfg = _cfg("train.grad_accum=2")
    prog = build_program(cfg)
    assert process_rows(prog) == (0, prog.rows)  # one process holds every row
    full = Batches(make_source(cfg), prog)
    whole = full.local_batch(64)
    half = prog.rows // 2
    parts = []
    for rows in ((0, half), (half, prog.rows)):  # what two processes would build
        share = Batches(make_source(cfg), prog)
        share.row_range = rows
        parts.append(share.local_batch(64))
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    # sample index = position + micro-batch * rows + row: no sample appears twice in a step
    flat = whole.reshape(-1, SEQ + 1)
    assert len({r.tobytes() for r in flat}) == len(flat)


# ---------------------------------------------------------------- files


def _windows_of(stream, seq):
    return {tuple(stream[w * seq: w * seq + seq + 1]) for w in range((len(stream) - 1) // seq)}


def test_text_bytes_source_cuts_windows_in_a_seeded_order(tmp_path):
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefgh üßé"), 900))  # random, so no two windows are alike
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    cfg = _cfg("data.kind=text", f"data.path={path}")
    src = make_source(cfg)
    stream = np.frombuffer(text.encode("utf-8"), np.uint8)
    n = src.n_windows
    assert n == (len(stream) - 1) // SEQ
    epoch = src.samples(np.arange(n), SEQ + 1)
    windows = _windows_of(stream, SEQ)
    assert len(windows) == n
    assert sorted(map(tuple, epoch)) == sorted(windows)  # every window exactly once per epoch
    again = make_source(cfg).samples(np.arange(n, 2 * n), SEQ + 1)  # next epoch: same windows, new order
    assert sorted(map(tuple, again)) == sorted(map(tuple, epoch))
    assert not np.array_equal(again, epoch)


def test_text_tokens_beyond_the_vocabulary_are_a_config_error(tmp_path):
    path = tmp_path / "utf8.txt"
    path.write_text("ünïcödé " * 20, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"data\.path.*model\.vocab_size=128"):
        make_source(_cfg("data.kind=text", f"data.path={path}", "model.vocab_size=128"))


def test_text_shorter_than_one_window_is_a_config_error(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("tiny")
    with pytest.raises(ConfigError, match=r"data\.path.*train\.seq_len"):
        make_source(_cfg("data.kind=text", f"data.path={path}"))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_source_reads_the_token_file(tmp_path, dtype):
    stream = (np.arange(1000) * 7 % 250).astype(dtype)
    path = tmp_path / "tokens.bin"
    stream.tofile(path)
    cfg = _cfg("data.kind=bin", f"data.path={path}", f"data.bin_dtype={dtype}")
    rows = make_source(cfg).samples(np.arange(20), SEQ + 1)
    assert rows.dtype == np.int32
    assert {tuple(r) for r in rows} <= _windows_of(stream.astype(np.int64), SEQ)
    assert len({tuple(r) for r in rows}) == 20


def test_bin_of_odd_size_is_a_config_error(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match=r"data\.path.*data\.bin_dtype=uint16"):
        make_source(_cfg("data.kind=bin", f"data.path={path}"))


def test_tokenizer_json_source(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    text = "the cat sat on the mat " * 30 + "dog"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    cfg = _cfg("data.kind=text", f"data.path={corpus}", f"data.tokenizer={tok_path}")
    ids = np.array(tokenizers.Tokenizer.from_file(str(tok_path)).encode(text).ids)
    assert ids[-1] == 5 and ids[:6].tolist() == [0, 1, 2, 3, 0, 4]
    src = make_source(cfg)
    rows = src.samples(np.arange(src.n_windows), SEQ + 1)
    assert {tuple(r) for r in rows} == _windows_of(ids, SEQ)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=4"):
        make_source(_cfg("data.kind=text", f"data.path={corpus}", f"data.tokenizer={tok_path}",
                         "model.vocab_size=4"))
