"""Evaluation reads the held-out set once (issue 52): a set smaller than `eval.batches` global batches is not
cycled, and `eval_tokens` counts each held-out token once; a token stream, which has no labels to mask, says
how many windows it reads again. One training step each on the tiny model, on the 8 virtual CPU devices."""
import json
from pathlib import Path

import numpy as np
import pytest

from chat_fixtures import chat, write_tokenizer
from jaxmem.loader import load_config
from jaxmem.io.data import make_source
from jaxmem.train import run
from jaxmem.train.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["train.steps=1", "checkpoint.enabled=false", "train.seq_len=64", "train.micro_batch=1",
          "parallel.fsdp=-1", "train.progress=false", "eval.batches=16"]


def _eval_record(out_dir) -> dict:
    (record,) = [r for r in read_jsonl(Path(out_dir) / "metrics.jsonl") if "eval_loss" in r]
    return record


def test_a_small_held_out_set_is_read_once(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("train.jsonl", 40), ("eval.jsonl", 2)):
        (tmp_path / name).write_text("".join(json.dumps({"messages": chat(rng)}) + "\n" for _ in range(n)))
    tokenizer = write_tokenizer(tmp_path / "tok")
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"out_dir={tmp_path / 'run'}", "data.kind=jsonl", f"data.path={tmp_path / 'train.jsonl'}",
        f"data.tokenizer={tokenizer}", "data.format=messages", f"data.cache_dir={tmp_path / 'cache'}",
        "data.workers=1", f"eval.path={tmp_path / 'eval.jsonl'}", *COMMON])
    run(cfg)
    held_out = make_source(cfg, path=cfg.eval.path).rows.stats["trained_tokens"]
    record = _eval_record(cfg.out_dir)
    assert record["eval_tokens"] == held_out  # was 16 batches' worth: the 2 records read again and again
    assert np.isfinite(record["eval_loss"])


def test_a_short_token_stream_says_what_it_reads_again(tmp_path, capsys):
    words = "the cat sat on the mat and the dog ran to the sea " * 12
    (tmp_path / "train.txt").write_text(words * 4)
    (tmp_path / "eval.txt").write_text(words[:300])  # 300 byte tokens: 4 windows of 64
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"out_dir={tmp_path / 'run'}", "data.kind=text", f"data.path={tmp_path / 'train.txt'}",
        f"eval.path={tmp_path / 'eval.txt'}", *COMMON])
    run(cfg)
    windows = (300 - 1) // 64
    assert _eval_record(cfg.out_dir)["eval_tokens"] == windows * 64
    err = capsys.readouterr().err
    assert f"{windows} windows of 64 tokens fill 1 batch(es) of 8; the other {8 - windows} rows read those" in err
