"""A catalogue of bad inputs: each is a one-line error naming the key or file, or exact recovery; never a
traceback, never a user's file written over. One section per class: the run folder, checkpoints that prove
their integrity, settings and data that cannot train, Hugging Face folders checked against themselves,
bounded inputs (YAML aliases, chat templates, nested JSON, message parts), the explain page."""
import hashlib
import json
import os
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmem import cli
from jaxmem.train import run
from jaxmem.config import ConfigError
from jaxmem.config.schema import ModelConfig
from jaxmem.core import checksum
from jaxmem.io.hf import load_hf, save_hf
from jaxmem.io.hf_safetensors import INDEX_FILE
from jaxmem.train.run_folder import check_out_dir
from jaxmem.model.transformer import abstract_model
from jaxmem.plan import timeline_html

from chat_fixtures import write_tokenizer
from tiny_config import TINY, tiny_config


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_run_never_writes_into_its_config_files_folder(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("# my notes\nmodel:\n  preset: tiny\nout_dir: .\ntrain:\n  steps: 1\n")
    before = _md5(config)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "config.yaml"]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem train: config error: out_dir: {tmp_path} is the folder of the config file config.yaml; a run "
        "writes its outputs into out_dir: name a folder of its own (e.g. out_dir=runs/NAME)")
    assert _md5(config) == before and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_an_empty_out_dir_is_refused_at_load(tmp_path, capsys):
    assert cli.main(["train", str(TINY), "out_dir=''"]) == 2
    assert _one_error_line(capsys) == ("jaxmem train: config error: out_dir: empty; name the folder for the run's "
                                       "outputs (e.g. out_dir=runs/NAME)")


def test_a_folder_of_someone_elses_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "config.yaml").write_text("mine too")  # an older run's name, but without that run's outputs
    assert cli.main(["train", str(TINY), f"out_dir={tmp_path}", "train.steps=1"]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem train: config error: out_dir: {tmp_path} holds files that are not a jaxmem run's (config.yaml, "
        "notes.txt); name a new or empty folder, or a jaxmem run's to resume it")
    assert (tmp_path / "config.yaml").read_text() == "mine too"


def test_out_dir_rules_without_a_run(tmp_path):
    check_out_dir(tmp_path / "new" / "deeper")  # not there yet: fine
    check_out_dir(tmp_path)  # empty: fine
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.resolved.yaml", "metrics.jsonl", "allocator.json", "memory_profile_step3.prof"):
        (run / name).write_text("")
    check_out_dir(run)  # a jaxmem run's folder: resumable
    (run / "config.yaml").write_text("")  # an older run wrote its resolved config under this name
    check_out_dir(run)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^out_dir: .*/file is a file; name a folder"):
        check_out_dir(tmp_path / "file")
    with pytest.raises(ConfigError, match=r"^out_dir: .*/file/run cannot be written: .*/file is not a folder$"):
        check_out_dir(tmp_path / "file" / "run")


# ---------------------------------------------------------------- checkpoints prove their integrity

RUN = ["train.steps=4", "checkpoint.every=2", "train.log_every=1", "train.seq_len=32"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A straight 4-step run saving steps 2 and 4: its folder and its loss per step."""
    out = tmp_path_factory.mktemp("straight") / "run"
    summary = run(tiny_config(out, *RUN))
    return out, {r["step"]: r["loss"] for r in summary["records"]}


def _flipped_copy(straight, tmp_path) -> Path:
    """A copy of the straight run whose step 4 has 16 bytes flipped in the middle of its biggest data file."""
    copy = tmp_path / "run"
    shutil.copytree(straight[0], copy)
    data = max((copy / "checkpoints" / "4" / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 16] = bytes(b ^ 0xFF for b in raw[middle:middle + 16])
    data.write_bytes(bytes(raw))
    return copy


@pytest.mark.slow
def test_a_flipped_byte_in_a_checkpoint_stops_naming_the_step_and_the_array(straight, tmp_path, capsys):
    copy = _flipped_copy(straight, tmp_path)
    assert cli.main(["train", str(TINY), f"out_dir={copy}", "train.progress=false", *RUN]) == 2
    assert re.fullmatch(
        rf"jaxmem train: config error: {copy}/checkpoints/4: checkpoint is incomplete or damaged \(array \S+ of "
        r"step 4 does not match the checksum saved with it\); delete this directory to resume from step 2 \(or "
        r"set checkpoint.on_corrupt=previous\)", _one_error_line(capsys))
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["2", "4"]  # nothing moved or written


def test_on_corrupt_previous_resumes_from_the_newest_intact_step_exactly(straight, tmp_path, capsys):
    copy = _flipped_copy(straight, tmp_path)
    summary = run(tiny_config(copy, *RUN, "checkpoint.on_corrupt=previous"))
    assert summary["resumed_from"] == 2 and summary["start_step"] == 2
    assert {r["step"]: r["loss"] for r in summary["records"]} == {s: straight[1][s] for s in (3, 4)}
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["2", "4", "4.damaged"]
    err = capsys.readouterr().err
    assert "checkpoint step 4 is damaged (array " in err and f"set aside as {copy}/checkpoints/4.damaged" in err
    assert "resuming from step 2, the newest intact checkpoint (checkpoint.on_corrupt=previous)" in err


def test_digests_do_not_depend_on_the_mesh():
    x = np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    one = checksum.digests({"w": jnp.asarray(x), "b": jnp.asarray(x).astype(jnp.bfloat16)})
    spread = checksum.digests({"w": jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
                               "b": jax.device_put(x.astype(jnp.bfloat16), NamedSharding(mesh, P("b", None)))})
    host = NamedSharding(mesh, P("b", "a"), memory_kind="pinned_host")  # offload.optimizer=host: summed on the host
    on_host = checksum.digests({"w": jax.device_put(x, host), "b": jax.device_put(x.astype(jnp.bfloat16), host)})
    assert one == spread == on_host and one["w"].startswith("float32:") and one["b"].startswith("bfloat16:")
    nudged = x.copy()
    nudged[3, 5] = np.nextafter(nudged[3, 5], np.float32(1))  # one bit of one element
    swapped = x[[1, 0, *range(2, 16)]]  # the same values in other places
    for changed in (nudged, swapped):
        assert checksum.first_mismatch(one, {"w": jnp.asarray(changed)}) == "w"
    assert checksum.first_mismatch(one, {"w": jnp.asarray(x).astype(jnp.float16)}) is None  # cast: not compared


# ---------------------------------------------------------------- refuse what cannot train

@pytest.mark.parametrize("override,line", [
    ("optimizer.lr=-1", "optimizer.lr: must be in [0, inf), got -1.0"),
    ("optimizer.b1=1", "optimizer.b1: must be in [0, 1), got 1.0"),
    ("optimizer.b2=-0.5", "optimizer.b2: must be in [0, 1), got -0.5"),
    ("optimizer.eps=0", "optimizer.eps: must be in (0, inf), got 0.0"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay: must be in [0, inf), got -0.1"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps: must be >= 0, got -1"),
    ("train.seed=-1", "train.seed: must be in [0, 2**63), got -1"),  # a ValueError from numpy before
])
def test_settings_outside_their_range_are_one_line_before_anything_runs(tmp_path, capsys, override, line):
    assert cli.main(["train", str(TINY), f"out_dir={tmp_path / 'run'}", override]) == 2
    assert _one_error_line(capsys) == f"jaxmem train: config error: {line}"
    assert not (tmp_path / "run").exists()


def test_clip_norm_zero_or_below_still_means_no_clipping():
    from jaxmem.loader import load_config

    assert load_config(TINY, ["optimizer.clip_norm=0"]).optimizer.clip_norm == 0
    assert load_config(TINY, ["optimizer.clip_norm=-1"]).optimizer.clip_norm == -1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def _records(tmp_path, name: str, lines: list) -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _chat_args(tokenizer, tmp_path, path, *extra):
    return [str(TINY), "data.kind=jsonl", "data.format=messages", f"data.tokenizer={tokenizer}",
            f"data.cache_dir={tmp_path / 'cache'}", f"data.path={path}", *extra]


def _last_error_line(capsys) -> str:
    """The one error line among the data loader's log lines (`jaxmem data: tokenized ...`)."""
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Traceback" in line]
    assert len(errors) == 1, errors
    return errors[0]


def test_records_without_a_trained_token_refuse_to_train_and_jaxmem_data_warns(tokenizer, tmp_path, capsys):
    question = {"messages": [{"role": "user", "content": "why is the sky blue"}]}
    path = _records(tmp_path, "questions.jsonl", [question] * 3)
    why = (f"data.path: {path} leaves no token to train on after masking (data.format=messages, "
           "data.train_on=assistant: e.g. chats without an assistant turn); give records with assistant turns or "
           "completions, or set data.train_on=all")
    assert cli.main(["train", *_chat_args(tokenizer, tmp_path, path, f"out_dir={tmp_path / 'run'}")]) == 2
    assert _last_error_line(capsys) == f"jaxmem train: config error: {why}"
    assert not (tmp_path / "run").exists()
    assert cli.main(["data", *_chat_args(tokenizer, tmp_path, path)]) == 0
    captured = capsys.readouterr()
    assert f"jaxmem data: warning: {why}" in captured.err.splitlines()
    assert "0 trained of " in captured.out


# ---------------------------------------------------------------- a Hugging Face folder checked against itself

FOUR_LAYERS = ModelConfig(preset="custom", vocab_size=64, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1,
                          head_dim=8, d_ff=24, max_seq_len=64)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A 4-layer tiny Llama in several shards with an index (random values: no init compile)."""
    folder = tmp_path_factory.mktemp("hf") / "four"
    graphdef, state = nnx.split(abstract_model(FOUR_LAYERS))
    rng = np.random.default_rng(0)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                                                 nnx.to_pure_dict(state)))
    save_hf(nnx.merge(graphdef, state), folder, max_shard_bytes=4000)
    return folder


def _edited(folder, tmp_path, name, edit) -> Path:
    copy = tmp_path / "hf"
    shutil.copytree(folder, copy)
    content = json.loads((copy / name).read_text())
    edit(content)
    (copy / name).write_text(json.dumps(content))
    return copy


def test_a_config_of_fewer_layers_than_the_shards_is_refused(hf_folder, tmp_path, capsys):
    copy = _edited(hf_folder, tmp_path, "config.json", lambda c: c.update(num_hidden_layers=2))
    assert cli.main(["import-hf", str(copy), str(tmp_path / "out")]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem import-hf: config error: {copy}: config.json does not match the safetensors shards: 18 tensors "
        "config.json does not use (model.layers.2.input_layernorm.weight, model.layers.2.mlp.down_proj.weight, "
        "model.layers.2.mlp.gate_proj.weight, ...)")
    assert not (tmp_path / "out").exists()


def test_a_config_of_another_width_lists_the_first_mismatches(hf_folder, tmp_path):
    copy = _edited(hf_folder, tmp_path, "config.json", lambda c: c.update(intermediate_size=32))
    with pytest.raises(ConfigError) as e:
        load_hf(copy)
    shard = lambda name: json.loads((copy / INDEX_FILE).read_text())["weight_map"][name]  # noqa: E731
    expected = [f"tensor model.layers.0.mlp.{name} has shape {have}, config.json implies {want} "
                f"({copy / shard(f'model.layers.0.mlp.{name}')})"
                for name, have, want in (("down_proj.weight", [16, 24], [16, 32]),
                                         ("gate_proj.weight", [24, 16], [32, 16]),
                                         ("up_proj.weight", [24, 16], [32, 16]))]
    assert str(e.value) == (f"{copy}: config.json does not match the safetensors shards: {'; '.join(expected)}; "
                            "and 9 more")


_OPENED: list[str] | None = None  # while a list: the paths `open` is called with (an audit hook records them)


def _record_opens(event, args):
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, os.PathLike)):
        _OPENED.append(os.fspath(args[0]))


sys.addaudithook(_record_opens)


@pytest.mark.parametrize("outside", ["../outside/x.safetensors", "/etc/passwd", "sub/../../outside/x.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_opens_nothing_and_says_nothing_of_it(
        hf_folder, tmp_path, capsys, monkeypatch, outside):
    global _OPENED
    from jaxmem.io import hf_safetensors

    real_safe_open = hf_safetensors.safe_open  # safetensors opens in Rust, out of the audit hook's sight
    monkeypatch.setattr(hf_safetensors, "safe_open", lambda path, **kw: (_OPENED.append(path), real_safe_open(
        path, **kw))[1])
    first = next(iter(json.loads((hf_folder / INDEX_FILE).read_text())["weight_map"]))
    copy = _edited(hf_folder, tmp_path, INDEX_FILE, lambda index: index["weight_map"].update({first: outside}))
    lines = []
    for exists in (False, True):  # the message is the same whether the file is there or not
        if exists and not outside.startswith("/"):
            (tmp_path / "outside").mkdir()
            shutil.copy(next(hf_folder.glob("*.safetensors")), tmp_path / "outside" / "x.safetensors")
        _OPENED = []
        try:
            assert cli.main(["import-hf", str(copy), str(tmp_path / "out")]) == 2
            here = [Path(p).resolve() for p in _OPENED]
            assert [p for p in here if p == Path("/etc/passwd") or (p.is_relative_to(tmp_path.resolve())
                                                                    and not p.is_relative_to(copy.resolve()))] == []
        finally:
            _OPENED = None
        lines.append(_one_error_line(capsys))
    assert lines[0] == lines[1] == (
        f"jaxmem import-hf: config error: {copy / INDEX_FILE}: weight_map maps {first} to {outside!r}, which is "
        "not a file inside the folder; shards are named relative to the folder, without '..'")


# ---------------------------------------------------------------- bounded inputs

def test_a_billion_laughs_config_is_refused_naming_the_file(tmp_path, capsys):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    config = tmp_path / "laughs.yaml"
    config.write_text("\n".join(lines + ["model: {preset: tiny}"]) + "\n")
    assert cli.main(["train", str(config), f"out_dir={tmp_path / 'run'}"]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem train: config error: {config}: refused, its aliases (*name) expand to more than 1,000,000 nodes "
        "and characters; write the values out")
    config.write_text("a: &x [*x]\n")
    assert cli.main(["train", str(config)]) == 2
    assert _one_error_line(capsys) == (f"jaxmem train: config error: {config}: refused, an alias refers to a node "
                                       "that contains it; write the values out")


def test_a_few_aliases_still_load(tmp_path):
    from jaxmem.loader import load_config

    config = tmp_path / "shared.yaml"
    config.write_text("model: {preset: tiny}\ntrain: {steps: &n 3, log_every: *n}\n")
    assert load_config(config).train.log_every == 3


SLOW_TEMPLATES = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                          "{% for m in messages %}{{ m.content }}{% endfor %}",
    "a huge repeat": "{{ 'x' * 4000000000 }}",
    "a huge padding": "{{ 'x' | center(4000000000) }}",
    "doubling": "{% set s = namespace(t='x') %}{% for i in range(64) %}{% set s.t = s.t ~ s.t %}{% endfor %}",
}


@pytest.mark.parametrize("name", SLOW_TEMPLATES)
def test_a_template_that_would_run_forever_or_fill_memory_is_one_line_naming_it(
        tokenizer, tmp_path, capsys, monkeypatch, name):
    from jaxmem.io.documents import template_bounds

    monkeypatch.setattr(template_bounds, "SECONDS_LIMIT", 0.5)  # the default, 10 s, would be as good, slower
    template = tmp_path / "chat.jinja"
    template.write_text(SLOW_TEMPLATES[name])
    path = _records(tmp_path, "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yes"}]}])
    assert cli.main(["data", *_chat_args(tokenizer, tmp_path, path, f"data.chat_template={template}")]) == 2
    line = _last_error_line(capsys)
    assert line.startswith(f"jaxmem data: config error: data.chat_template: {template}: rendering record 1 "
                           f"({path}:1) failed (")
    assert ("rendering took longer than 0.5 s" in line) == (name == "nested range loops")
    assert ("over the limit of 10,000,000" in line) == (name != "nested range loops")


def test_a_json_line_nested_too_deeply_is_one_line_naming_the_file_and_line(tokenizer, tmp_path, capsys):
    path = _records(tmp_path, "deep.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                             '{"messages": ' + "[" * 100000 + "]" * 100000 + "}"])
    assert cli.main(["train", *_chat_args(tokenizer, tmp_path, path, f"out_dir={tmp_path / 'run'}")]) == 2
    assert _last_error_line(capsys) == (
        f"jaxmem train: config error: data.path: {path}:2 nests its JSON too deeply to read (thousands of levels of "
        "[ or {); a record is an object of a few levels")


def test_text_parts_are_joined_other_parts_refused_empty_chats_skipped_and_counted(tokenizer, tmp_path, capsys):
    from jaxmem.io.documents.tokenize import DocumentMaker, payloads, tokenizer_spec
    from jaxmem.loader import load_config

    plain = {"messages": [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "yes"}]}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "the cat"},
                                                       {"type": "text", "text": " sat"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "yes"}]}]}
    path = _records(tmp_path, "chats.jsonl", [parts, {"messages": []}, plain, {"messages": []}])
    data = load_config(TINY, _chat_args(tokenizer, tmp_path, path)[1:]).data
    items, skipped = payloads(data, [(parts, "a:1"), ({"messages": []}, "a:2"), (plain, "a:3")])
    assert skipped == 1 and [where for _, where in items] == ["record 1 (a:1)", "record 3 (a:3)"]
    maker = DocumentMaker(tokenizer_spec(data, 64)[0])
    (ids_parts, trained_parts), (ids_plain, trained_plain) = (maker(values, where) for values, where in items)
    assert ids_parts.tolist() == ids_plain.tolist() and trained_parts.tolist() == trained_plain.tolist()
    assert cli.main(["data", *_chat_args(tokenizer, tmp_path, path)]) == 0
    assert capsys.readouterr().out.strip().endswith(", 2 records with no messages skipped")
    image = _records(tmp_path, "image.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]}])
    assert cli.main(["data", *_chat_args(tokenizer, tmp_path, image)]) == 2
    assert _last_error_line(capsys) == (
        f"jaxmem data: config error: data.messages_field: record 1 ({image}:1) turn 0 (user) content part 0 is "
        "'image_url', not text; only {\"type\": \"text\", \"text\": ...} parts are read: leave the others out")


# ---------------------------------------------------------------- the explain page

def test_a_config_name_that_opens_a_comment_and_a_script_cannot_break_the_page():
    name = "x<!--<script>alert(1)</script>&amp;</script>"
    timeline = {"config": name, "label": name, "positions": [0, 1], "instructions": ["a", "b"], "phases": [],
                "peak": {"device_bytes": 1}, "device": {"total": [0, 1]}, "host": {"total": [0, 0]}, "bands": []}
    page = timeline_html.page([timeline], measured={"source": name, "points": []})
    scripts = []

    class Scripts(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "script":
                scripts.append([dict(attrs), ""])

        def handle_data(self, data):
            if scripts and self.lasttag == "script":
                scripts[-1][1] += data

    Scripts().feed(page)
    assert [attrs for attrs, _ in scripts] == [{"type": "application/json", "id": "data"}, {}]
    payload = scripts[0][1]
    # HTML's script-data rules change state only at "<" ("</script", "<!--", "<script"): none is left to act on
    assert not set("<>&") & set(payload)
    data = json.loads(payload)
    assert data["panels"][0]["config"] == name and data["measured"]["source"] == name
    assert page.count("</script>") == 2


# ---------------------------------------------------------------- a disk that fills, a save that fails


def _train_cli(tmp_path, *extra) -> int:
    return cli.main(["train", str(TINY), f"out_dir={tmp_path / 'run'}", "train.steps=8", "train.log_every=1",
                     "checkpoint.every=2", "train.progress=false", "train.seq_len=32", *extra])


@pytest.mark.slow
def test_a_full_disk_stops_the_run_before_the_save_in_one_line_and_keeps_the_last_good_step(
        tmp_path, capsys, monkeypatch):
    from jaxmem.core import checkpoint

    real = checkpoint._free_bytes
    monkeypatch.setattr(checkpoint, "_free_bytes", lambda d: real(d) if not (d / "4").exists() else 1000)
    assert _train_cli(tmp_path) == 1  # checkpoints 2 and 4 fit, then the disk "fills"
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"jaxmem train: not enough disk for the checkpoint of step 6 in {tmp_path}/run/"
                              "checkpoints: it needs up to ") and err[-1].endswith(
        "MiB, 0.0 MiB is free; the last good checkpoint is step 4")
    assert not [line for line in err if "Traceback" in line]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4"]
    monkeypatch.setattr(checkpoint, "_free_bytes", real)  # room again: the run resumes at step 4
    assert _train_cli(tmp_path) == 0
    assert "resuming at step 4 of 8" in capsys.readouterr().err


def test_a_save_that_fails_in_the_background_stops_the_next_step_in_one_line(tmp_path, capsys, monkeypatch):
    """The second save's writer fails (as a full disk or an I/O error would, after the run's own check): the
    run stops before the next step, in one line naming the last good step; that step is left as it was."""
    import orbax.checkpoint as ocp

    real_save, real_check, saves = ocp.CheckpointManager.save, ocp.CheckpointManager.check_for_errors, []

    def save(self, step, *args, **kwargs):
        saves.append(step)
        return real_save(self, step, *args, **kwargs)

    def check(self):
        if len(saves) >= 2:
            raise ValueError("RESOURCE_EXHAUSTED: Failed to write: No space left on device")
        return real_check(self)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    monkeypatch.setattr(ocp.CheckpointManager, "check_for_errors", check)
    assert _train_cli(tmp_path) == 1
    err = capsys.readouterr().err.strip().splitlines()
    last = re.fullmatch(f"jaxmem train: writing a checkpoint in {tmp_path}/run/checkpoints failed \\(RESOURCE_EXHAUSTED: "
                        r"Failed to write: No space left on device\); the last good checkpoint is step (\d); "
                        r"[\d.]+ GiB free", err[-1])
    assert last and (tmp_path / "run" / "checkpoints" / last.group(1) / "_CHECKPOINT_METADATA").is_file(), err[-1]
    assert not [line for line in err if "Traceback" in line or "OOM" in line]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert saves == [2, 4] and records[-1]["step"] == 4  # stopped before step 5 ran
