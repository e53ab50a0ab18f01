"""Damaged input files: each fails with a one-line ConfigError that names the file and says what is wrong."""
import gc
import json
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from flax import nnx

from jaxmem.core.checkpoint import Checkpoints, init_from, run_meta
from jaxmem.cli import main as cli_main
from jaxmem.config import ConfigError, ModelConfig, to_dict
from jaxmem.loader import load_config
from jaxmem.io.data import make_source
from jaxmem.io.hf import load_hf, save_hf
from jaxmem.cli.import_hf import main as import_hf
from jaxmem.model.transformer import abstract_model
from jaxmem.registry import build_program
from jaxmem.train import initial_state, run

GARBAGE = bytes(range(128, 256)) + bytes(range(128))  # invalid UTF-8 from byte 0 on


def _one_line_error(fn, *fragments) -> str:
    """Runs fn, which must raise a one-line ConfigError holding every fragment; returns the message."""
    with pytest.raises(ConfigError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for fragment in fragments:
        assert str(fragment) in msg, f"{fragment!r} not in {msg!r}"
    return msg


def _cut(path, keep=0.5):
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


# ---------------------------------------------------------------- YAML configs

YAML_CASES = {  # file content -> what the error says; every message names the file
    "garbage": (GARBAGE, "binary content (invalid start byte at byte 0)"),
    "latin-1": ("train:\n  steps: 3  # café\n".encode("latin-1"), "binary content (invalid continuation byte"),
    "nul byte": (b"train:\n  steps: 3\x00\n", "binary content"),
    "truncated": (b"train:\n  steps: 3\nmodel: {preset: ti", "not valid YAML (line 3"),
    "tab indent": (b"train:\n\tsteps: 3\n", "not valid YAML (line 2"),
    "empty": (b"", "empty config"),
    "comments only": (b"# train:\n#   steps: 3\n", "empty config"),
    "top-level list": (b"- train\n- model\n", "top level must be a mapping"),
    "repeated section": (b"train:\n  steps: 3\nmodel:\n  preset: tiny\ntrain:\n  seq_len: 32\n",
                         "line 5: key 'train' appears twice"),
    "base missing": (b"base: nope.yaml\n", "base nope.yaml not found"),
    "base not a path": (b"base: [a.yaml]\n", "base must be the path of another config file"),
    "base cycle": (b"base: run.yaml\n", "a cycle of base: files"),
}


YAML_KEY_CASES = {  # parse fine but hold bad values: the message names the key instead of the file
    "wrong type": (b"train:\n  steps: many\n", "train.steps: 'many' is not an int"),
    "section is a scalar": (b"train: 3\n", "train: expected a mapping"),
    "unknown section": (b"trian:\n  steps: 3\n", "trian: unknown key"),
}


@pytest.mark.parametrize("content,fragment,names_file",
                         [(*c, True) for c in YAML_CASES.values()] + [(*c, False) for c in YAML_KEY_CASES.values()],
                         ids=[*YAML_CASES, *YAML_KEY_CASES])
def test_damaged_yaml_config(tmp_path, content, fragment, names_file):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    _one_line_error(lambda: load_config(path), *((f"{path}: ",) if names_file else ()), fragment)


def test_broken_base_names_the_base_file(tmp_path):
    (tmp_path / "parent.yaml").write_bytes(GARBAGE)
    (tmp_path / "run.yaml").write_text("base: parent.yaml\ntrain:\n  steps: 3\n")
    _one_line_error(lambda: load_config(tmp_path / "run.yaml"), f"{tmp_path / 'parent.yaml'}: binary content")


SWEEP_CASES = {  # `jaxmem sweep FILE`: the file is a sweep spec or a config
    "garbage": (GARBAGE, "binary content"),
    "truncated": (b"config: ../tiny.yaml\ngrid: {remat.preset: [full, no", "not valid YAML"),
    "empty": (b"", "expected a mapping"),
    "grid not a mapping": (b"config: run.yaml\ngrid: [1, 2]\n", "grid: must map each key"),
    "unknown key": (b"config: run.yaml\ngrid: {train.seq_len: [16]}\ngird: 1\n", "gird: unknown key"),
}


@pytest.mark.parametrize("content,fragment", SWEEP_CASES.values(), ids=SWEEP_CASES.keys())
def test_damaged_sweep_file(tmp_path, capsys, content, fragment):
    from jaxmem import cli

    path = tmp_path / "sweep.yaml"
    path.write_bytes(content)
    assert cli.main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and fragment in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_yaml_config_with_a_byte_order_mark_loads(tmp_path, encoding):
    path = tmp_path / "run.yaml"
    path.write_bytes("train:\n  steps: 3\n".encode(encoding))
    assert load_config(path).train.steps == 3


# ---------------------------------------------------------------- Hugging Face checkpoints

TINY_HF = ModelConfig(preset="custom", vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                      d_ff=24, max_seq_len=64)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """single/ (model.safetensors) and sharded/ (several shards + index) of one tiny Llama."""
    root = tmp_path_factory.mktemp("hf")
    graphdef, state = nnx.split(abstract_model(TINY_HF))  # random values, not init_model: no init compile
    rng = np.random.default_rng(0)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                                                 nnx.to_pure_dict(state)))
    model = nnx.merge(graphdef, state)
    save_hf(model, root / "single")
    save_hf(model, root / "sharded", max_shard_bytes=4000)
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    return root


def _write(name, data):
    """Replaces file `name` with `data` (bytes, or a function of the old bytes)."""
    def damage(d):
        path = d / name
        path.write_bytes(data(path.read_bytes()) if callable(data) else data)
    return damage


def _config(**changes):
    """Edits config.json; a value of None removes the key."""
    def damage(d):
        cfg = json.loads((d / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                del cfg[key]
            else:
                cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
    return damage


def _tensors(edit, name="model.safetensors"):
    """Rewrites a shard as a valid safetensors file after edit(dict of numpy tensors)."""
    def damage(d):
        tensors = safetensors.numpy.load_file(d / name)
        edit(tensors)
        safetensors.numpy.save_file(tensors, d / name, metadata={"format": "pt"})
    return damage


def _header_length(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def _index(edit):
    def damage(d):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        edit(index["weight_map"])
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return damage


def _first_shard(d):
    return sorted(d.glob("model-*.safetensors"))[0]


def _duplicate_tensor(d):
    """Two shards both hold model.norm.weight and no index says which one counts."""
    index = d / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["model.norm.weight"]
    norm = safetensors.numpy.load_file(d / shard)["model.norm.weight"]
    index.unlink()
    _tensors(lambda t: t.update({"model.norm.weight": norm}), _first_shard(d).name)(d)


def _drop_from_its_shard(tensor):
    def damage(d):
        shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][tensor]
        _tensors(lambda t: t.pop(tensor), shard)(d)
    return damage


HF_CASES = {  # (checkpoint, file the message names, damage, what it says)
    "config missing": ("single", "config.json", lambda d: (d / "config.json").unlink(), "not found"),
    "config garbage": ("single", "config.json", _write("config.json", GARBAGE), "not JSON text"),
    "config truncated": ("single", "config.json", _write("config.json", lambda b: b[: len(b) // 2]),
                         "not valid JSON"),
    "config empty": ("single", "config.json", _write("config.json", b""), "empty file"),
    "config is a list": ("single", "config.json", _write("config.json", b"[1, 2]"), "expected a JSON object"),
    "config lacks vocab_size": ("single", "config.json", _config(vocab_size=None),
                                "vocab_size must be a positive int, got None"),
    "config size is a string": ("single", "config.json", _config(hidden_size="16"),
                                "hidden_size must be a positive int, got '16'"),
    "config layers is a bool": ("single", "config.json", _config(num_hidden_layers=True),
                                "num_hidden_layers must be a positive int, got True"),
    "config kv heads do not divide": ("single", "config.json", _config(num_key_value_heads=3),
                                      "num_key_value_heads=3 must divide num_attention_heads=2"),
    "config eps is a string": ("single", "config.json", _config(rms_norm_eps="1e-5"),
                               "rms_norm_eps must be a positive number"),
    "config rope is a list": ("single", "config.json", _config(rope_parameters=[1]),
                              "rope_parameters must be a mapping or null"),
    "config tie is a string": ("single", "config.json", _config(tie_word_embeddings="false"),
                               "tie_word_embeddings must be true or false"),
    "shard truncated": ("single", "model.safetensors", _write("model.safetensors", lambda b: b[: len(b) // 2]),
                        "truncated; its tensors end at byte"),
    "shard cut in its header": ("single", "model.safetensors", _write("model.safetensors", lambda b: b[:20]),
                                "runs past the end of the file (20 bytes)"),
    "shard empty": ("single", "model.safetensors", _write("model.safetensors", b""),
                    "0 bytes, too short for a safetensors file"),
    "shard garbage": ("single", "model.safetensors", _write("model.safetensors", GARBAGE), "runs past the end"),
    "shard header length past the end": (
        "single", "model.safetensors", _write("model.safetensors", lambda b: struct.pack("<Q", 1 << 40) + b[8:]),
        f"header length {1 << 40} runs past the end"),
    "shard header garbage": (
        "single", "model.safetensors",
        _write("model.safetensors", lambda b: b[:8] + b"\xff" * _header_length(b) + b[8 + _header_length(b):]),
        "header is not valid JSON"),
    "tensor of the wrong shape": (
        "single", "model.safetensors", _tensors(lambda t: t.update({"model.norm.weight": np.ones((2, 8), np.float32)})),
        "tensor model.norm.weight has shape [2, 8], config.json implies [16]"),
    "tensor of an int dtype": (
        "single", "model.safetensors", _tensors(lambda t: t.update({"model.norm.weight": np.ones(16, np.int32)})),
        "tensor model.norm.weight has dtype I32; weights must be one of"),
    "tensor missing": ("single", ".", _tensors(lambda t: t.pop("lm_head.weight")),
                       "tensor lm_head.weight is missing"),
    "tensor holds NaN": (
        "single", "model.safetensors",
        _tensors(lambda t: t.update({"model.norm.weight": np.full(16, np.nan, np.float32)})),
        "tensor model.norm.weight holds inf/NaN values"),
    "tensor in two shards": ("sharded", ".", _duplicate_tensor, "tensor model.norm.weight is also in"),
    "index garbage": ("sharded", "model.safetensors.index.json", _write("model.safetensors.index.json", GARBAGE),
                      "not JSON text"),
    "index truncated": ("sharded", "model.safetensors.index.json",
                        _write("model.safetensors.index.json", lambda b: b[: len(b) // 2]), "not valid JSON"),
    "index empty": ("sharded", "model.safetensors.index.json", _write("model.safetensors.index.json", b""),
                    "empty file"),
    "index is a list": ("sharded", "model.safetensors.index.json", _write("model.safetensors.index.json", b"[]"),
                        "expected a JSON object"),
    "index without weight_map": ("sharded", "model.safetensors.index.json",
                                 _write("model.safetensors.index.json", b"{}"), "weight_map must be"),
    "index lists a missing shard": ("sharded", "model.safetensors.index.json", lambda d: _first_shard(d).unlink(),
                                    "lists model-00001-of-"),
    "index maps a tensor to the wrong shard": (
        "sharded", "model.safetensors.index.json",
        _index(lambda m: m.update({"model.norm.weight": "model-00001-of-%05d.safetensors" % len(set(m.values()))})),
        "maps model.norm.weight to model-00001-of-"),
    "index lists a tensor no shard holds": ("sharded", ".", _drop_from_its_shard("lm_head.weight"),
                                            "tensor lm_head.weight is missing"),
}


@pytest.mark.parametrize("base,named,damage,fragment", HF_CASES.values(), ids=HF_CASES.keys())
def test_damaged_hf_checkpoint_fails_import_hf_writing_nothing(hf_dirs, tmp_path, base, named, damage, fragment):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(hf_dirs / base, src)
    damage(src)
    _one_line_error(lambda: import_hf([str(src), str(dst)]), f"{src / named}", fragment)
    assert not dst.exists()


@pytest.mark.parametrize("base", ["single", "sharded"])
def test_intact_tiny_checkpoints_load(hf_dirs, tmp_path, base):
    # the rewrite the damage cases use keeps a file valid: their errors come from the damage alone
    shutil.copytree(hf_dirs / base, tmp_path / "copy")
    _tensors(lambda t: None, "model.safetensors" if base == "single" else _first_shard(tmp_path / "copy").name)(
        tmp_path / "copy")
    assert load_hf(tmp_path / "copy").cfg == TINY_HF


def test_import_hf_cli_prints_one_line_and_writes_nothing(hf_dirs, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    shutil.copytree(hf_dirs / "single", src)
    _cut(src / "model.safetensors")
    assert cli_main(["import-hf", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jaxmem import-hf: config error: {src / 'model.safetensors'}: truncated")
    assert len(err.splitlines()) == 1 and not dst.exists()


# ---------------------------------------------------------------- tokenizer.json, text and bin data

SEQ = 16


def _data_cfg(*overrides):
    return load_config(None, [f"train.seq_len={SEQ}", "train.micro_batch=2", *overrides])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


TOKENIZER_CASES = {
    "garbage": GARBAGE,
    "truncated": lambda b: b[: len(b) // 2],
    "empty": b"",
    "other JSON object": b'{"hello": 1}',
    "JSON list": b"[1, 2, 3]",
}


@pytest.mark.parametrize("data", TOKENIZER_CASES.values(), ids=TOKENIZER_CASES.keys())
def test_damaged_tokenizer_json(tmp_path, tokenizer, data):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(data(tokenizer.read_bytes()) if callable(data) else data)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat " * 20)
    cfg = _data_cfg("data.kind=text", f"data.path={corpus}", f"data.tokenizer={path}")
    _one_line_error(lambda: make_source(cfg), f"data.tokenizer: {path} is not a tokenizer.json (")


TEXT_CASES = {  # (text file bytes, with the tokenizer?, what the error says)
    "latin-1 with a tokenizer": ("the cat café ".encode("latin-1") * 20, True,
                                 "is not UTF-8 text (invalid continuation byte at byte 11)"),
    "binary with a tokenizer": (GARBAGE * 4, True, "is not UTF-8 text (invalid start byte at byte 0)"),
    "empty with a tokenizer": (b"", True, "holds 0 tokens, fewer than train.seq_len + 1"),
    "empty as bytes": (b"", False, "holds 0 tokens, fewer than train.seq_len + 1"),
}


@pytest.mark.parametrize("data,tokenized,fragment", TEXT_CASES.values(), ids=TEXT_CASES.keys())
def test_damaged_text_data(tmp_path, tokenizer, data, tokenized, fragment):
    path = tmp_path / "corpus.txt"
    path.write_bytes(data)
    cfg = _data_cfg("data.kind=text", f"data.path={path}", *([f"data.tokenizer={tokenizer}"] if tokenized else []))
    _one_line_error(lambda: make_source(cfg), f"data.path: {path}", fragment)


def test_text_as_bytes_takes_any_bytes(tmp_path):
    # byte-level tokens: every byte value is a token, so binary or non-UTF-8 text is valid input
    path = tmp_path / "corpus.bin.txt"
    path.write_bytes(GARBAGE * 4)
    src = make_source(_data_cfg("data.kind=text", f"data.path={path}"))
    assert src.samples(np.array([0]), SEQ + 1).max() < 256 and src.n_windows == (len(GARBAGE) * 4 - 1) // SEQ


def _ids(n, dtype, top=250):
    return (np.arange(1, n + 1) % top).astype(dtype)


BIN_CASES = {  # (file bytes, data.bin_dtype, what the error says)
    "empty": (b"", "uint16", "is empty; expected uint16 token ids"),
    "odd size for uint32": (b"\0" * 6, "uint32", "is 6 bytes, not a whole number of data.bin_dtype=uint32 tokens"),
    "too short": (_ids(5, np.uint16).tobytes(), "uint16", "holds 5 tokens, fewer than train.seq_len + 1"),
    "uint32 file read as uint16": (_ids(200, np.uint32).tobytes(), "uint16",
                                   "looks like uint32 tokens (every second uint16 is 0); set data.bin_dtype=uint32"),
    "uint16 file read as uint32": (_ids(200, np.uint16).tobytes(), "uint32",
                                   "looks like uint16 tokens; set data.bin_dtype=uint16"),
    "token beyond the vocabulary": (np.full(100, 300, np.uint16).tobytes(), "uint16",
                                    "holds token id 300 >= model.vocab_size=256"),
}


@pytest.mark.parametrize("data,dtype,fragment", BIN_CASES.values(), ids=BIN_CASES.keys())
def test_damaged_bin_data(tmp_path, data, dtype, fragment):
    path = tmp_path / "tokens.bin"
    path.write_bytes(data)
    cfg = _data_cfg("data.kind=bin", f"data.path={path}", f"data.bin_dtype={dtype}")
    _one_line_error(lambda: make_source(cfg), f"data.path: {path}", fragment)


def test_bin_token_beyond_the_vocabulary_late_in_the_file(tmp_path):
    # past the tokens read up front, a bad id is caught when its window is drawn
    path = tmp_path / "tokens.bin"
    np.concatenate([_ids(10_000, np.uint16), np.full(100, 300, np.uint16)]).tofile(path)
    src = make_source(_data_cfg("data.kind=bin", f"data.path={path}"))
    _one_line_error(lambda: src.samples(np.arange(src.n_windows), SEQ + 1), "token id 300 >= model.vocab_size=256")


def test_bad_data_fails_the_run_before_anything_is_written(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"")
    cfg = load_config(None, [f"out_dir={tmp_path / 'run'}", "data.kind=bin", f"data.path={path}"])
    _one_line_error(lambda: run(cfg), f"data.path: {path} is empty")
    assert not (tmp_path / "run").exists()


def test_train_cli_prints_one_line_for_a_damaged_config(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(GARBAGE)
    assert cli_main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"jaxmem train: config error: {path}: binary content (invalid start byte at byte 0); " \
                  "a config is a UTF-8 YAML file"


# ---------------------------------------------------------------- run checkpoints and init_from

RUN = ["model.preset=tiny", "train.seq_len=32", "train.micro_batch=1", "train.steps=4", "train.progress=false",
       "optimizer.decay_steps=10"]


def _run_cfg(out_dir, *overrides):
    return load_config(None, [f"out_dir={out_dir}", *RUN, *overrides])


def _random_state(prog, seed=0):
    """A train state of random values, without compiling the init (seconds on CPU)."""
    rng = np.random.default_rng(seed)

    def leaf(a, sharding):
        floating = jnp.issubdtype(a.dtype, jnp.floating)
        host = rng.standard_normal(a.shape).astype(a.dtype) if floating else np.zeros(a.shape, a.dtype)
        return jax.device_put(host, sharding)

    return jax.tree.map(leaf, prog.abstract_state, prog.state_shardings)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run's checkpoints/ (steps 1 and 2) and an import-hf style params dir, of the tiny model."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = _run_cfg(root / "run")
    prog = build_program(cfg)
    state = _random_state(prog)
    ckpts = Checkpoints.for_run(cfg)
    for step in (1, 2):
        ckpts.save(step, state, run_meta(cfg, step, step * 8, 8))
    ckpts.close()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(root / "hf" / "params", state["params"])
    (root / "hf" / "model.json").write_text(json.dumps(to_dict(cfg)["model"]))
    return dict(cfg=cfg, prog=prog, state=state, checkpoints=root / "run" / "checkpoints", hf=root / "hf")


@pytest.fixture(scope="module")
def other_prog(tmp_path_factory):
    """The same run with a wider MLP: its state does not fit the saved one."""
    return build_program(_run_cfg(tmp_path_factory.mktemp("other"), "model.d_ff=384"))


def _largest_array_file(item_dir):
    """The biggest data file of an orbax item (state/ or params/): it holds array chunks."""
    return max((p for p in item_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


def _overwrite_middle(path, n=64):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid: mid + n] = b"\xff" * len(data[mid: mid + n])
    path.write_bytes(bytes(data))


CKPT_CASES = {  # damage to step 2's directory -> what the error says
    "meta missing": (lambda s: (s / "meta" / "metadata").unlink(), "(meta: "),
    "meta garbage": (lambda s: (s / "meta" / "metadata").write_bytes(GARBAGE), "(meta: "),
    "meta truncated": (lambda s: _cut(s / "meta" / "metadata"), "(meta: "),
    "meta without resume keys": (lambda s: (s / "meta" / "metadata").write_text('{"step": 2}'),
                                 "(meta lacks step, data_position, batch_rows)"),
    "state metadata missing": (lambda s: (s / "state" / "_METADATA").unlink(), "(state metadata: "),
    "state metadata garbage": (lambda s: (s / "state" / "_METADATA").write_bytes(GARBAGE), "(state metadata: "),
    "state metadata truncated": (lambda s: _cut(s / "state" / "_METADATA"), "(state metadata: "),
    "state dir missing": (lambda s: shutil.rmtree(s / "state"), "(state metadata: "),
    "empty step dir": (lambda s: [shutil.rmtree(s), s.mkdir()], "(meta: "),
    "array file missing": (lambda s: _largest_array_file(s / "state").unlink(), "("),
    "array file truncated": (lambda s: _cut(_largest_array_file(s / "state")), "("),
    # The b-tree that indexes the arrays carries CRC-32C checksums; the zstd array chunks do not: bytes
    # overwritten inside a chunk are caught by the digests saved in the meta (jaxmem.io.checksum).
    "index overwritten": (lambda s: _overwrite_middle(s / "state" / "manifest.ocdbt"), "(state metadata: "),
    "array bytes overwritten": (lambda s: _overwrite_middle(_largest_array_file(s / "state")),
                                "(array "),
}


@pytest.fixture(autouse=True)
def _collect_abandoned_reads(request):
    """When one array read fails, orbax drops its other pending reads; Python reports them when they are
    collected. Collect them before the test ends, under its warning filter, instead of in a later test: after
    each test that reads an orbax checkpoint (those of the `saved` fixture, init_from), not after the others."""
    yield
    if "saved" in request.fixturenames or "init_from" in request.node.name:
        gc.collect()


# When one array read fails, orbax drops its other pending reads; Python reports them as they are collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage,fragment", CKPT_CASES.values(), ids=CKPT_CASES.keys())
def test_damaged_latest_checkpoint_says_which_step_dir_to_delete(saved, tmp_path, damage, fragment):
    shutil.copytree(saved["checkpoints"], tmp_path / "checkpoints")
    step_dir = tmp_path / "checkpoints" / "2"
    damage(step_dir)
    ckpts = Checkpoints(tmp_path / "checkpoints")
    try:
        _one_line_error(lambda: initial_state(saved["prog"], ckpts),
                        f"{step_dir}: checkpoint is incomplete or damaged {fragment}",
                        "; delete this directory to resume from step 1")
    finally:
        ckpts.close()


def test_checkpoint_holding_nan_is_damaged(saved, tmp_path):
    shutil.copytree(saved["checkpoints"], tmp_path / "checkpoints")
    ckpts = Checkpoints(tmp_path / "checkpoints", async_save=False)
    state = saved["state"]
    nan = dict(state, params=dict(state["params"], final_norm=state["params"]["final_norm"] * jnp.nan))
    ckpts.save(3, nan, run_meta(saved["cfg"], 3, 24, 8))
    try:
        _one_line_error(lambda: initial_state(saved["prog"], ckpts),
                        f"{tmp_path / 'checkpoints' / '3'}: checkpoint is incomplete or damaged "
                        "(it holds inf/NaN values); delete this directory to resume from step 2")
    finally:
        ckpts.close()


def test_unfinished_save_is_skipped_and_another_mesh_restores(saved, tmp_path, capsys):
    shutil.copytree(saved["checkpoints"], tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1700000000").mkdir()  # a save cut off mid-write
    # a different mesh and learning rate: restores, with a note that the curve will not continue exactly
    prog = build_program(_run_cfg(tmp_path, "parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp",
                                  "optimizer.lr=1e-3"))
    ckpts = Checkpoints(tmp_path / "checkpoints")
    try:
        state, start, position, resumed = initial_state(prog, ckpts)
    finally:
        ckpts.close()
    assert (start, position, resumed) == (2, 16, 2)
    np.testing.assert_array_equal(np.asarray(state["params"]["embed"]), np.asarray(saved["state"]["params"]["embed"]))
    assert "losses will not continue" in capsys.readouterr().err


@pytest.mark.parametrize("other,fragment", [
    ("wider MLP", "(params.layers.w_down has shape [4, 352, 128], this run's has [4, 384, 128])"),
    ("master weights", "(it has no master."),
])
def test_checkpoint_of_another_model(saved, other_prog, tmp_path, other, fragment):
    prog = other_prog if other == "wider MLP" else build_program(
        _run_cfg(tmp_path, "precision.param_dtype=bfloat16", "precision.master_weights=true"))
    ckpts = Checkpoints(saved["checkpoints"])
    try:
        _one_line_error(lambda: initial_state(prog, ckpts),
                        f"{saved['checkpoints'] / '2'}: holds a train state that does not fit this run ", fragment,
                        "use a new out_dir")
    finally:
        ckpts.close()


def test_checkpoints_path_that_is_a_file(tmp_path):
    (tmp_path / "checkpoints").write_bytes(GARBAGE)
    _one_line_error(lambda: Checkpoints(tmp_path / "checkpoints"), f"{tmp_path / 'checkpoints'}: is a file")


def test_damaged_resume_fails_the_run_before_anything_is_written(saved, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved["checkpoints"], out / "checkpoints")
    _cut(out / "checkpoints" / "2" / "state" / "_METADATA")
    before = sorted(p for p in out.rglob("*"))
    _one_line_error(lambda: run(_run_cfg(out)), f"{out / 'checkpoints' / '2'}: checkpoint is incomplete or damaged")
    assert sorted(p for p in out.rglob("*")) == before  # no config.yaml, metrics.jsonl or new step


def _params_copy(saved, tmp_path):
    shutil.copytree(saved["hf"], tmp_path / "hf")
    return tmp_path / "hf"


def _other_params(other_prog, tmp_path):
    """import-hf output whose params are of another model (and whose model.json does not say so)."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "hf" / "params", _random_state(other_prog)["params"])
    (tmp_path / "hf" / "model.json").write_text("{}")


INIT_FROM_CASES = {  # damage to a copy of an import-hf output dir -> (file named, what the error says)
    "a garbage file": (lambda d: [shutil.rmtree(d), d.write_bytes(GARBAGE)], "model.json", "model.json not found"),
    "model.json garbage": (lambda d: (d / "model.json").write_bytes(GARBAGE), "model.json", ": not JSON text"),
    "model.json is a list": (lambda d: (d / "model.json").write_text("[]"), "model.json", "expected a JSON object"),
    "params missing": (lambda d: shutil.rmtree(d / "params"), "params", "params not found"),
    "params metadata garbage": (lambda d: (d / "params" / "_METADATA").write_bytes(GARBAGE), "params",
                                "is incomplete or damaged ("),
    "params array file truncated": (lambda d: _cut(_largest_array_file(d / "params")), "params",
                                    "is incomplete or damaged ("),
}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
@pytest.mark.parametrize("damage,named,fragment", INIT_FROM_CASES.values(), ids=INIT_FROM_CASES.keys())
def test_damaged_init_from(saved, tmp_path, damage, named, fragment):
    path = _params_copy(saved, tmp_path)
    damage(path)
    _one_line_error(lambda: init_from(saved["prog"], path), f"{path / named}", fragment)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned reads
def test_init_from_params_of_another_model(saved, other_prog, tmp_path):
    _other_params(other_prog, tmp_path)
    _one_line_error(lambda: init_from(saved["prog"], tmp_path / "hf"),
                    f"checkpoint.init_from: {tmp_path / 'hf' / 'params'} does not match the model's params "
                    "(layers.w_down has shape [4, 384, 128], this run's has [4, 352, 128])")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned reads
def test_bad_init_from_fails_the_run_before_anything_is_written(tmp_path):
    (tmp_path / "garbage").write_bytes(GARBAGE)
    _one_line_error(lambda: run(_run_cfg(tmp_path / "run", f"checkpoint.init_from={tmp_path / 'garbage'}")),
                    f"checkpoint.init_from: {tmp_path / 'garbage'} is not a folder (expected a Hugging Face folder")
    assert not (tmp_path / "run").exists()  # not even an empty checkpoints/
