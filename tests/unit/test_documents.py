"""Fine-tuning records: reading, chat rendering like transformers, trained masks, packing, caches, workers."""
import collections
import dataclasses
import json
import re

import numpy as np
import pytest

from jaxmem.io.documents import IGNORE_INDEX, PackedRows, build_rows
from jaxmem.io.documents import build as build_module
from jaxmem.io.documents import tokenize as tokenize_module
from jaxmem.io.documents.tokenize import DocumentMaker, tokenizer_spec
from jaxmem.config.schema import ConfigError, DataConfig

from chat_fixtures import LLAMA3_TEMPLATE, chat as _chat, write_tokenizer as _write_tokenizer

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("documents")
    rng = np.random.default_rng(0)
    records = [{"messages": _chat(rng), "id": i} for i in range(300)]
    (root / "chats.jsonl").write_text("\n".join(json.dumps(r) for r in records[:150]) + "\n\n"
                                      + "\n".join(json.dumps(r) for r in records[150:]) + "\n")
    return {"root": root, "records": records, "tokenizer": _write_tokenizer(root / "tok")}


def _data(corpus, tmp_path, **kw):
    settings = dict(kind="jsonl", path=str(corpus["root"] / "chats.jsonl"), tokenizer=corpus["tokenizer"],
                    format="messages", cache_dir=str(tmp_path / "cache"), workers=1)
    return DataConfig(**{**settings, **kw})


def _maker(data, vocab_size=1000):
    return DocumentMaker(tokenizer_spec(data, vocab_size)[0])


def _build(data, seq_len=64, seed=0, log=print):
    return build_rows(data, path=data.path, seq_len=seq_len, vocab_size=1000, seed=seed, log=log)


def _rows_in_order(packed: PackedRows):
    """Every packed row in index order (undoing epoch 0's permutation)."""
    got = packed.rows(np.arange(packed.n_rows))
    where = np.argsort(packed.row_of(np.arange(packed.n_rows)))
    return {k: v[where] for k, v in got.items()}


def _segments(rows):
    """(inputs, labels, positions) of every segment, row by row."""
    out = []
    for r in range(len(rows["inputs"])):
        for s in range(rows["segment_ids"][r].max() + 1):
            here = rows["segment_ids"][r] == s
            out.append(tuple(rows[k][r][here] for k in ("inputs", "labels", "positions")))
    return out


def _expected(doc):
    ids, trained = doc
    return ids[:-1], np.where(trained[1:], ids[1:], IGNORE_INDEX)


# ---------------------------------------------------------------- rendering and masks


def test_rendering_matches_transformers(corpus, tmp_path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=corpus["tokenizer"], bos_token="<|begin_of_text|>",
                                 eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)
    maker = _maker(_data(corpus, tmp_path))
    for record in corpus["records"][:8]:
        messages = record["messages"]
        assert maker.template.render(messages) == hf.apply_chat_template(messages, tokenize=False)
        assert (maker.template.render(messages, add_generation_prompt=True)
                == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        hf_ids = hf.apply_chat_template(messages, tokenize=True)
        hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
        assert maker([messages], "test")[0].tolist() == list(hf_ids)


def test_trained_mask_is_exactly_the_assistant_turns_with_their_end_of_turn(corpus, tmp_path):
    vocab = json.load(open(corpus["tokenizer"]))["model"]["vocab"]
    special = {t["content"]: t["id"] for t in json.load(open(corpus["tokenizer"]))["added_tokens"]}
    assistant, everything = _maker(_data(corpus, tmp_path)), _maker(_data(corpus, tmp_path, train_on="all"))
    for record in corpus["records"][:40]:
        ids, trained = [special["<|begin_of_text|>"]], [False]
        for turn in record["messages"]:
            words = [vocab[w] for w in turn["content"].split()]
            ids += [special["<|start_header_id|>"], vocab[turn["role"]], special["<|end_header_id|>"]]
            ids += words + [special["<|eot_id|>"]]
            trained += [False] * 3 + [turn["role"] == "assistant"] * (len(words) + 1)
        got_ids, got_trained = assistant([record["messages"]], "test")
        assert got_ids.tolist() == ids and got_trained.tolist() == trained
        all_ids, all_trained = everything([record["messages"]], "test")
        assert all_ids.tolist() == ids and all_trained.all()


def test_prompt_completion_masks_the_prompt_and_text_trains_everything(corpus, tmp_path):
    vocab = json.load(open(corpus["tokenizer"]))["model"]["vocab"]
    bos, eos = len(vocab), len(vocab) + 4  # added after the words, in SPECIALS order
    pc = _maker(_data(corpus, tmp_path, format="prompt_completion"))
    ids, trained = pc(["why is the sky blue", "it is blue"], "test")
    assert ids.tolist() == [bos] + [vocab[w] for w in "why is the sky blue it is blue".split()] + [eos]
    assert trained.tolist() == [False] * 6 + [True] * 4
    ids, trained = _maker(_data(corpus, tmp_path, format="prompt_completion", train_on="all"))(["a b", "c"], "t")
    assert trained.all()
    ids, trained = _maker(_data(corpus, tmp_path, format="text"))(["the cat sat"], "test")
    assert ids.tolist() == [bos, vocab["the"], vocab["cat"], vocab["sat"], eos] and trained.all()


def test_a_template_whose_prefixes_differ_is_refused(corpus, tmp_path):
    odd = "{% for m in messages %}{{ m['role'] }}{{ messages|length }}: {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "odd.jinja").write_text(odd)
    maker = _maker(_data(corpus, tmp_path, chat_template=str(tmp_path / "odd.jinja")))
    with pytest.raises(ConfigError, match="data.chat_template: .*odd.jinja.*not a prefix"):
        maker([corpus["records"][0]["messages"]], "record 1")


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("packing", ["none", "greedy", "first_fit"])
def test_packed_rows_reproduce_every_document_exactly_once(corpus, tmp_path, packing):
    data = _data(corpus, tmp_path, packing=packing)
    maker = _maker(data)
    documents = [maker([r["messages"]], "t") for r in corpus["records"]]
    seq_len = max(len(ids) for ids, _ in documents) - 1  # nothing overlong
    packed = _build(data, seq_len=seq_len)
    rows = _rows_in_order(packed)
    segments = _segments(rows)
    for inputs, labels, positions in segments:
        np.testing.assert_array_equal(positions, np.arange(len(inputs)))
    key = lambda inputs, labels: (tuple(inputs.tolist()), tuple(labels.tolist()))  # noqa: E731
    want = collections.Counter(key(*_expected(doc)) for doc in documents)
    assert collections.Counter(key(i, lab) for i, lab, _ in segments) == want
    if packing != "first_fit":  # in file order
        assert [key(i, lab) for i, lab, _ in segments] == [key(*_expected(doc)) for doc in documents]
    tokens = sum(len(ids) - 1 for ids, _ in documents)
    assert packed.stats["tokens"] == tokens == int((rows["segment_ids"] >= 0).sum())
    assert packed.stats["efficiency"] == pytest.approx(tokens / (packed.n_rows * seq_len))
    assert packed.stats["trained_tokens"] == int((rows["labels"] != IGNORE_INDEX).sum())
    pad = rows["segment_ids"] < 0
    assert (rows["inputs"][pad] == 0).all() and (rows["labels"][pad] == IGNORE_INDEX).all()
    assert (rows["positions"][pad] == 0).all()
    if packing == "none":
        assert packed.n_rows == len(documents)
    assert all(v.dtype == np.int32 and v.shape == (packed.n_rows, seq_len) for v in rows.values())


def test_first_fit_needs_no_more_rows_than_greedy(corpus, tmp_path):
    greedy = _build(_data(corpus, tmp_path, packing="greedy"), seq_len=96)
    first_fit = _build(_data(corpus, tmp_path, packing="first_fit"), seq_len=96)
    assert first_fit.n_rows <= greedy.n_rows and first_fit.stats["tokens"] == greedy.stats["tokens"]
    assert first_fit.stats["efficiency"] > 0.9


def test_rows_are_deterministic_and_permuted_per_epoch(corpus, tmp_path):
    a = _build(_data(corpus, tmp_path), seq_len=64, seed=3)
    b = _build(_data(corpus, tmp_path), seq_len=64, seed=3)
    n = a.n_rows
    for k in ("inputs", "labels", "segment_ids", "positions"):
        np.testing.assert_array_equal(a.rows(np.arange(2 * n))[k], b.rows(np.arange(2 * n))[k])
        # a sample does not depend on which other samples are asked for with it
        np.testing.assert_array_equal(a.rows(np.array([n + 5]))[k][0], a.rows(np.arange(2 * n))[k][n + 5])
    for epoch in (0, 1):
        np.testing.assert_array_equal(a.row_of(np.arange(epoch * n, (epoch + 1) * n)),
                                      np.random.default_rng([3, epoch]).permutation(n))
    assert not np.array_equal(a.row_of(np.arange(n)), a.row_of(np.arange(n, 2 * n)))
    c = _build(_data(corpus, tmp_path), seq_len=64, seed=4)
    assert not np.array_equal(a.rows(np.arange(n))["inputs"], c.rows(np.arange(n))["inputs"])


def test_split_keeps_every_label_once_and_drop_counts(corpus, tmp_path):
    data = _data(corpus, tmp_path, packing="greedy")
    maker = _maker(data)
    documents = [maker([r["messages"]], "t") for r in corpus["records"]]
    seq_len = 16
    split = _build(dataclasses.replace(data, overlong="split"), seq_len=seq_len)
    segments = _segments(_rows_in_order(split))
    assert all(len(inputs) <= seq_len for inputs, _, _ in segments)
    for k, part in ((0, 0), (1, 1)):
        got = np.concatenate([s[part] for s in segments])
        np.testing.assert_array_equal(got, np.concatenate([_expected(doc)[k] for doc in documents]))
    overlong = sum(len(ids) - 1 > seq_len for ids, _ in documents)
    assert overlong and split.stats["split_overlong"] == overlong and split.stats["dropped_overlong"] == 0
    logged = []
    drop = _build(dataclasses.replace(data, overlong="drop"), seq_len=seq_len, log=logged.append)
    assert drop.stats["dropped_overlong"] == overlong and drop.stats["documents"] == len(documents)
    assert [line for line in logged if "dropped" in line] == [
        f"dropped {overlong} of {len(documents)} documents longer than train.seq_len + 1 = {seq_len + 1} "
        "tokens (data.overlong=drop)"]
    kept = [doc for doc in documents if len(doc[0]) - 1 <= seq_len]
    got = np.concatenate([s[1] for s in _segments(_rows_in_order(drop))])
    np.testing.assert_array_equal(got, np.concatenate([_expected(doc)[1] for doc in kept]))
    with pytest.raises(ConfigError, match="data.path: .* leaves no documents"):
        _build(dataclasses.replace(data, overlong="drop"), seq_len=2)


def test_describe_marks_the_trained_tokens(corpus, tmp_path):
    text = _build(_data(corpus, tmp_path)).describe(documents=2)
    lines = text.splitlines()
    assert len(lines) == 3 and lines[0].startswith("document 0: <|begin_of_text|>")
    assert "⟦" in lines[0] and "<|eot_id|>⟧" in lines[0] and "rows of 64" in lines[2]
    assert "⟦" not in lines[0].split("assistant")[0]  # the system / user turns before it are not trained


# ---------------------------------------------------------------- record kinds


def test_jsonl_parquet_and_hf_give_identical_rows(corpus, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = corpus["records"]
    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(records[:100]), folder / "a.parquet")
    pq.write_table(pa.Table.from_pylist(records[100:]), folder / "b.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))
    lines = tmp_path / "lines"
    lines.mkdir()
    (lines / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records[120:]))  # read after a.jsonl
    (lines / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records[:120]))
    built = [_build(_data(corpus, tmp_path)),
             _build(_data(corpus, tmp_path, path=str(lines))),
             _build(_data(corpus, tmp_path, kind="parquet", path=str(folder))),
             _build(_data(corpus, tmp_path, kind="hf", path=str(tmp_path / "hf")))]
    n = built[0].n_rows
    for other in built[1:]:
        assert other.n_rows == n and other.stats == built[0].stats
        for k, v in built[0].rows(np.arange(2 * n)).items():
            np.testing.assert_array_equal(other.rows(np.arange(2 * n))[k], v)


# ---------------------------------------------------------------- bad input


def _refused(data, pattern):
    with pytest.raises(ConfigError) as refused:
        _build(data)
    message = str(refused.value)
    assert re.search(pattern, message) and "\n" not in message, message


def test_bad_input_is_one_line_naming_key_and_file(corpus, tmp_path):
    import datasets

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n\n{"messages": [}\n')
    _refused(_data(corpus, tmp_path, path=str(bad)), rf"^data.path: {re.escape(str(bad))}:3 is not valid JSON \(.*\)$")
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"messages": []}\n{"messages": []}\n{"text": "a"}\n')
    _refused(_data(corpus, tmp_path, path=str(missing)),
             rf"^data.messages_field: record 3 \({re.escape(str(missing))}:3\) has no 'messages'")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    _refused(_data(corpus, tmp_path, path=str(empty)), rf"^data.path: {re.escape(str(empty))} holds no records")
    big = _write_tokenizer(tmp_path / "big", extra_words=2000)
    _refused(_data(corpus, tmp_path, tokenizer=big),
             rf"^data.tokenizer: {re.escape(big)} has \d+ tokens > model.vocab_size=1000")
    _refused(_data(corpus, tmp_path, path=str(tmp_path / "nowhere")), r"^data.path: .*nowhere does not exist$")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(corpus["records"][:2])})
    splits.save_to_disk(str(tmp_path / "splits"))
    _refused(_data(corpus, tmp_path, kind="hf", path=str(tmp_path / "splits")),
             r"^data.path: .*splits is a DatasetDict \(splits train\); point data.path at one split")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


# ---------------------------------------------------------------- cache and workers


def test_second_build_reads_the_cache(corpus, tmp_path, monkeypatch):
    data = _data(corpus, tmp_path)
    first = _build(data)

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt what the cache holds")

    monkeypatch.setattr(build_module, "tokenize_documents", fail)
    monkeypatch.setattr(build_module, "pack", fail)
    monkeypatch.setattr(build_module, "read_records", fail)
    second = _build(data)
    assert second.stats == first.stats
    for k, v in first.rows(np.arange(first.n_rows)).items():
        np.testing.assert_array_equal(second.rows(np.arange(first.n_rows))[k], v)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(AssertionError, match="rebuilt"):  # a new seq_len packs again, from the cached documents
        _build(data, seq_len=32)


def test_processes_building_one_cache_at_once_agree(corpus, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    data = _data(corpus, tmp_path)
    with ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: _build(data, log=lambda line: None), range(4)))
    for other in built[1:]:
        for k, v in built[0].rows(np.arange(built[0].n_rows)).items():
            np.testing.assert_array_equal(other.rows(np.arange(built[0].n_rows))[k], v)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()) == ["documents", "rows"]


def test_workers_give_the_same_documents_as_in_process(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize_module, "IN_PROCESS_BELOW", 0)
    monkeypatch.setattr(tokenize_module, "_CHUNK", 64)
    pools = []

    class CountedPool(tokenize_module.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(kwargs["mp_context"].get_start_method())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tokenize_module, "ProcessPoolExecutor", CountedPool)
    one = _build(_data(corpus, tmp_path / "one", workers=1))
    two = _build(_data(corpus, tmp_path / "two", workers=2))
    assert pools == ["spawn"]  # workers=1 tokenized in-process, workers=2 in a pool
    for a, b in ((one.ids, two.ids), (one.trained, two.trained), (one.offsets, two.offsets)):
        np.testing.assert_array_equal(a, b)


def test_ignore_index_is_the_losses_one():
    from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX as LOSS_IGNORE_INDEX

    assert IGNORE_INDEX == LOSS_IGNORE_INDEX
