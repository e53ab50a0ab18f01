"""Values that cannot train are refused at load in one line naming the key (issue 52's probe): loss weights,
the model's real-valued keys, LoRA's alpha and dropout, export's shard size, chat roles, YAML timestamps and other
non-plain values, data paths that are not files or folders, and entries of a data or model folder that lead out
of it. Each case asserts the one-line message, or the value the loader now gives."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from jaxmem.cli import main as cli_main
from jaxmem.config import ConfigError
from jaxmem.loader import load_config
from jaxmem.io.documents.reading import read_records, record_files
from jaxmem.io.documents.tokenize import payloads

from chat_fixtures import write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
FP16 = ["precision.compute_dtype=float16", "precision.loss_scale.enabled=true"]


def _refused(overrides, path=TINY) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("overrides, key, allowed", [
    (["kernels.z_loss=-1"], "kernels.z_loss", ">= 0"),
    (["kernels.z_loss=.nan"], "kernels.z_loss", ">= 0"),
    (["model.norm_eps=.nan"], "model.norm_eps", "finite"),
    (["model.norm_eps=0"], "model.norm_eps", "> 0"),
    (["model.norm_eps=-1e-5"], "model.norm_eps", "> 0"),
    (["model.rope_theta=0"], "model.rope_theta", "> 0"),
    (["model.rope_theta=-10000"], "model.rope_theta", "> 0"),
    (["model.rope_theta=.inf"], "model.rope_theta", "finite"),
    (["model.router_aux_loss_coef=.nan"], "model.router_aux_loss_coef", "finite"),
    (["lora.rank=8", "lora.alpha=.nan"], "lora.alpha", "finite"),
    (["lora.rank=8", "lora.alpha=.inf"], "lora.alpha", "finite"),
    (["lora.rank=8", "lora.dropout=1"], "lora.dropout", "[0, 1)"),
    (["lora.rank=8", "lora.dropout=-0.1"], "lora.dropout", "[0, 1)"),
    (["lora.rank=8", "lora.dropout=.nan"], "lora.dropout", "[0, 1)"),
    (["data.roles={human: person}"], "data.roles", "assistant"),
    (["target.host_ram_gb=.nan"], "target.host_ram_gb", "finite"),
    ([*FP16, "precision.loss_scale.init_scale=0"], "precision.loss_scale.init_scale", "> 0"),
    ([*FP16, "precision.loss_scale.init_scale=.inf"], "precision.loss_scale.init_scale", "finite"),
    ([*FP16, "precision.loss_scale.growth_factor=0.5"], "precision.loss_scale.growth_factor", ">= 1"),
    ([*FP16, "precision.loss_scale.backoff_factor=1"], "precision.loss_scale.backoff_factor", "(0, 1)"),
    ([*FP16, "precision.loss_scale.backoff_factor=.nan"], "precision.loss_scale.backoff_factor", "(0, 1)"),
    ([*FP16, "precision.loss_scale.min_scale=-1"], "precision.loss_scale.min_scale", "> 0"),
    ([*FP16, "precision.loss_scale.growth_interval=0"], "precision.loss_scale.growth_interval", ">= 1"),
])
def test_values_that_cannot_train_are_refused(overrides, key, allowed):
    message = _refused(overrides)
    assert message.startswith(key + ":") and allowed in message


def test_the_values_next_to_them_still_load():
    cfg = load_config(TINY, ["kernels.z_loss=1e-4", "model.norm_eps=1e-6", "model.rope_theta=500000",
                             "lora.rank=8", "lora.alpha=16", "lora.dropout=0.05", "data.roles={human: user}"])
    assert (cfg.kernels.z_loss, cfg.model.norm_eps, cfg.model.rope_theta) == (1e-4, 1e-6, 500000.0)
    assert cfg.data.roles == {"human": "user"}


def test_yaml_dates_stay_the_text_written(tmp_path):
    """`out_dir: 2026-11-29` in YAML was a date object, then a JSON TypeError; it is the folder name written."""
    path = tmp_path / "run.yaml"
    path.write_text(f"base: {TINY}\nout_dir: 2026-11-29\ndata:\n  cache_dir: 2026-11-29 10:00:00\n")
    cfg = load_config(path, [])
    assert cfg.out_dir == "2026-11-29" and cfg.data.cache_dir == "2026-11-29 10:00:00"
    assert load_config(TINY, ["out_dir=2027-01-31"]).out_dir == "2027-01-31"


@pytest.mark.parametrize("value, key", [("!!binary aGVsbG8=", "out_dir"), ("!!set {a, b}", "out_dir")])
def test_other_non_plain_values_are_one_line(tmp_path, value, key):
    path = tmp_path / "run.yaml"
    path.write_text(f"base: {TINY}\n{key}: {value}\n")
    message = _refused([], path)
    assert message.startswith(f"{key}:") and "quote it" in message


def test_cli_prints_one_line_for_a_date_and_a_bool(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"base: {TINY}\nout_dir: true\n")
    assert cli_main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out_dir: True is not a string" in err and "Traceback" not in err


def test_the_empty_value_hint_survives_a_shell():
    """The hint for `eval.path=` is what a shell passes on as an empty YAML string, and it loads."""
    message = _refused(["eval.path="])
    hint = message[message.rindex("(") + 1:-1]
    assert hint == "eval.path='\"\"'"
    import shlex

    (as_passed,) = shlex.split(hint)
    assert load_config(TINY, [as_passed]).eval.path == ""


def test_export_max_shard_size_must_be_positive():
    from jaxmem.cli.export_hf import _shard_bytes

    assert _shard_bytes("500MB") == 500_000_000
    for text in ("0", "0GB", "0.0000001KB"):
        with pytest.raises(ConfigError, match="--max-shard-size: .* at least 1 byte"):
            _shard_bytes(text)


# ---------------------------------------------------------------- data files


def _fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf", "text"])
def test_a_fifo_as_data_path_is_one_line(tmp_path, kind):
    from jaxmem.io.data import make_source

    tok = write_tokenizer(tmp_path / "tok")
    cfg = load_config(TINY, [f"data.kind={kind}", f"data.path={_fifo(tmp_path)}", f"data.tokenizer={tok}"])
    with pytest.raises(ConfigError, match=r"^data.path: .*pipe is not a regular file or folder$"):
        make_source(cfg)
    with pytest.raises(ConfigError, match="is not a regular file or folder"):
        record_files("jsonl", str(tmp_path / "pipe"))


def _hf_folder(tmp_path) -> Path:
    import datasets

    folder = tmp_path / "hf"
    datasets.Dataset.from_list([{"text": "the cat"}, {"text": "the dog"}]).save_to_disk(str(folder))
    return folder


def _state_entry(folder: Path, name: str) -> None:
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"][0]["filename"] = name
    (folder / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("entry", ["../secret.arrow", "/abs/secret.arrow", "link.arrow"])
def test_hf_state_entries_stay_inside_the_folder(tmp_path, entry):
    folder = _hf_folder(tmp_path)
    arrow = next(folder.glob("*.arrow"))
    secret = tmp_path / "secret.arrow"
    secret.write_bytes(arrow.read_bytes())
    (folder / "link.arrow").symlink_to(secret)
    _state_entry(folder, entry)
    with pytest.raises(ConfigError) as e:
        record_files("hf", str(folder))
    message = str(e.value)
    assert message.startswith(f"data.path: {folder / 'state.json'} lists {entry!r}, which is not a file inside")
    assert "\n" not in message
    assert len(read_records("hf", record_files("hf", str(_hf_folder(tmp_path / "ok"))))) == 2  # a plain one reads


@pytest.mark.parametrize("kind, suffix", [("parquet", ".parquet"), ("jsonl", ".jsonl")])
def test_a_folder_of_records_reads_no_link_leading_out(tmp_path, kind, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    outside = tmp_path / f"secret{suffix}"
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist([{"text": "secret"}]), outside)
    else:
        outside.write_text('{"text": "secret"}\n')
    folder = tmp_path / "records"
    folder.mkdir()
    (folder / f"a{suffix}").symlink_to(outside)
    with pytest.raises(ConfigError, match=rf"^data.path: {folder / ('a' + suffix)} is a link leading outside"):
        record_files(kind, str(folder))
    inside = folder / f"b{suffix}"
    (folder / f"a{suffix}").unlink()
    inside.write_bytes(outside.read_bytes())
    (folder / f"c{suffix}").symlink_to(inside)  # a link within the folder is fine
    assert record_files(kind, str(folder)) == [inside, folder / f"c{suffix}"]


def test_a_hub_cache_snapshot_may_link_into_its_blobs(tmp_path):
    """Hugging Face's hub cache keeps a snapshot's files as links into the repository's blobs/ folder."""
    repo = tmp_path / "datasets--x--y"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text('{"text": "hello"}\n')
    snapshot = repo / "snapshots" / "rev0"
    snapshot.mkdir(parents=True)
    (snapshot / "train.jsonl").symlink_to(Path("../../blobs/abc123"))
    assert [r for r, _ in read_records("jsonl", record_files("jsonl", str(snapshot)))] == [{"text": "hello"}]


def test_a_model_index_reads_no_shard_linked_from_outside(tmp_path):
    from safetensors.numpy import save_file

    from jaxmem.io.hf_safetensors import INDEX_FILE, CheckpointReader

    save_file({"w": np.ones((2, 2), np.float32)}, str(tmp_path / "outside.safetensors"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model-1.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    with pytest.raises(ConfigError, match=r"model-1.safetensors: a link leading outside"):
        CheckpointReader(folder)
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(ConfigError, match=r"weight_map maps w to '../outside.safetensors'"):
        CheckpointReader(folder)


# ---------------------------------------------------------------- chat roles


CHAT = ["data.kind=jsonl", "data.path=chat.jsonl", "data.tokenizer=tokenizer.json", "data.format=messages"]


def _chat_records(tmp_path, roles) -> list:
    path = tmp_path / "chat.jsonl"
    chats = [[{"role": "user", "content": "why"}, {"role": roles[0], "content": "the sky"}],
             [{"role": "human", "content": "how"}, {"role": roles[1], "content": "blue"}]]
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return read_records("jsonl", [path])


def test_an_unknown_chat_role_names_the_file_line_and_role(tmp_path):
    cfg = load_config(TINY, CHAT)
    with pytest.raises(ConfigError) as e:
        payloads(cfg.data, _chat_records(tmp_path, ["asistant", "assistant"]))
    message = str(e.value)
    assert f"{tmp_path / 'chat.jsonl'}:1" in message and "'asistant'" in message and "data.roles" in message
    assert "\n" not in message


def test_data_roles_maps_a_dataset_s_names(tmp_path):
    cfg = load_config(TINY, [*CHAT, "data.roles={human: user, gpt: assistant}"])
    items, _ = payloads(cfg.data, _chat_records(tmp_path, ["assistant", "gpt"]))
    assert [[t["role"] for t in values[0]] for values, _ in items] == [["user", "assistant"], ["user", "assistant"]]


def test_the_preview_says_why_its_token_counts_differ(tmp_path):
    """The log's tokenized count and the rows' count differ by one per document: the summary says why."""
    from jaxmem.io.data import LABEL_SHIFT, make_source, packing_summary

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("the cat sat", "a dog")))
    cfg = load_config(TINY, ["data.kind=jsonl", f"data.path={tmp_path / 'd.jsonl'}", "data.workers=1",
                             f"data.tokenizer={write_tokenizer(tmp_path / 'tok')}", f"data.cache_dir={tmp_path}"])
    rows = make_source(cfg).rows
    assert rows.stats["tokens"] == len(rows.ids) - rows.stats["documents"]
    assert LABEL_SHIFT in packing_summary(rows, cfg.train.seq_len)
    assert "its last token is only a label" in rows.describe()
