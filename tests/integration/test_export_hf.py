"""`jaxmem export-hf`: a chat fine-tune (tiny Llama, offline word-level tokenizer) leaves as a folder that
transformers loads alone, with logits matching the run's model, a tokenizer that encodes like the run's, and a
generation config that stops at the chat template's end-of-turn token; a LoRA run of a tiny Qwen2 exports
merged, like merge-lora, and matches the merged model's logits in transformers.

(transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer whatever tokenizer_config.json names, which
re-reads a word-level tokenizer.json as byte-level BPE; so the tokenizer round trip is checked on the Llama
folder, and the Qwen2 folder's tokenizer files are checked as files.)"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chat_fixtures import chat, write_tokenizer
from jaxmem import cli
from jaxmem.core.checkpoint import Checkpoints, restore_run
from jaxmem.loader import load_config
from jaxmem.cli.export_hf import run_config
from jaxmem.registry import build_program
from jaxmem.train import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = "configs/tiny.yaml"
TEMPLATE_END = "<|eot_id|>"  # what the Llama-3-style template writes after each turn
TOKENIZER_EOS = "<|end_of_text|>"  # the tokenizer's own eos: generation must stop at both


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    rng = np.random.default_rng(0)
    (root / "train.jsonl").write_text("".join(json.dumps({"messages": chat(rng)}) + "\n" for _ in range(64)))
    tokenizer = write_tokenizer(root / "tok")
    config = json.loads((root / "tok" / "tokenizer_config.json").read_text())
    config["eos_token"] = TOKENIZER_EOS  # a base tokenizer's eos differs from the chat template's end of turn
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    return root, tokenizer


def _train(chats, out_dir, *extra):
    root, tokenizer = chats
    cfg = load_config(TINY, [
        f"out_dir={out_dir}", "data.kind=jsonl", f"data.path={root / 'train.jsonl'}", f"data.tokenizer={tokenizer}",
        "data.format=messages", f"data.cache_dir={root / 'cache'}", "data.workers=1", "train.seq_len=32",
        "train.micro_batch=1", "train.steps=3", "train.progress=false", "checkpoint.every=0",
        "optimizer.lr=1e-2", "optimizer.warmup_steps=0", *extra])
    run(cfg)
    return cfg


@pytest.fixture(scope="module")
def full_run(chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    _train(chats, out)
    return out


def _run_logits(run_dir, tokens):
    """The run's model on `tokens`, in jaxmem (a LoRA run's adapters merged into its base)."""
    cfg = run_config(run_dir)
    ckpts = Checkpoints.for_run(cfg)
    prog = build_program(cfg)
    state, _ = restore_run(prog, ckpts)
    ckpts.close()
    params = state["params"]
    if prog.layout.part("lora") is not None:
        from jaxmem.lora.export import merged_params

        params = merged_params(prog, state)
    return np.asarray(jax.jit(lambda p, t: prog.model(p)(t))(params, jnp.asarray(tokens)))


@pytest.mark.slow
def test_export_loads_alone_in_transformers_and_matches_the_run(full_run, chats, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli.main(["export-hf", str(full_run), "--out", str(out), "--max-shard-size", "300KB"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"jaxmem export-hf: step 3 of {full_run} written to {out}")
    assert f"generate stops at {TOKENIZER_EOS}, {TEMPLATE_END}" in line
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()  # sharded, with its index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (out / name).is_file(), name

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    from tokenizers import Tokenizer

    run_tok = Tokenizer.from_file(chats[1])
    eot, eos = run_tok.token_to_id(TEMPLATE_END), run_tok.token_to_id(TOKENIZER_EOS)
    bos = run_tok.token_to_id("<|begin_of_text|>")
    assert (model.config.bos_token_id, model.config.eos_token_id) == (bos, eos)
    assert model.generation_config.eos_token_id == [eos, eot]
    messages = [{"role": "user", "content": "why is the sky blue"}, {"role": "assistant", "content": "the sea"}]
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    ids = ids["input_ids"] if isinstance(ids, dict) else list(ids)
    rendered = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nwhy is the sky blue<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nthe sea<|eot_id|>")
    assert ids == run_tok.encode(rendered, add_special_tokens=False).ids  # the template and tokens the run used

    tokens = np.asarray([ids], np.int32)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    ours = _run_logits(full_run, tokens)
    assert np.abs(theirs - ours).max() < 1e-4, np.abs(theirs - ours).max()
    assert np.abs(ours).max() > 1e-2  # a real comparison, not of zeros


class _Force(transformers.LogitsProcessor):
    """Makes the generated tokens `tokens[0], tokens[1], ...`: what stops generation is then only the eos ids."""

    def __init__(self, prompt_len, tokens):
        self.prompt_len, self.tokens = prompt_len, tokens

    def __call__(self, input_ids, scores):
        scores = torch.full_like(scores, -float("inf"))
        scores[:, self.tokens[input_ids.shape[1] - self.prompt_len]] = 0.0
        return scores


def test_generate_stops_at_the_chat_templates_end_of_turn(full_run, chats, tmp_path):
    out = tmp_path / "hf"
    assert cli.main(["export-hf", str(full_run), "--out", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "tell me about the cat"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    eot, word = tok.convert_tokens_to_ids(TEMPLATE_END), tok.convert_tokens_to_ids("cat")
    force = transformers.LogitsProcessorList([_Force(prompt.shape[1], [word, word, eot] + [word] * 9)])
    with torch.no_grad():
        stopped = model.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=force)
        eos_only = model.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=force,
                                  eos_token_id=tok.convert_tokens_to_ids(TOKENIZER_EOS))
    assert stopped.shape[1] == prompt.shape[1] + 3 and int(stopped[0, -1]) == eot  # stopped at the turn's end
    assert eos_only.shape[1] == prompt.shape[1] + 12  # the tokenizer's eos alone would not have stopped it


def test_export_of_a_missing_step_names_the_saved_ones(full_run, tmp_path, capsys):
    assert cli.main(["export-hf", str(full_run), "--out", str(tmp_path / "x"), "--step", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxmem export-hf: config error: --step: {full_run} holds no step 7; saved steps: 3"]
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_lora_run_exports_merged_like_merge_lora(chats, tmp_path):
    run_dir = tmp_path / "lora"
    cfg = _train(chats, run_dir, "model.qkv_bias=true", "lora.rank=4", "lora.alpha=8", "lora.base_dtype=bfloat16")
    assert cli.main(["export-hf", str(run_dir), "--out", str(tmp_path / "a"), "--dtype", "float32"]) == 0
    assert cli.main(["merge-lora", TINY, *[f"{k}" for k in _overrides_of(cfg)], "--out", str(tmp_path / "b"),
                     "--dtype", "float32"]) == 0
    from safetensors.numpy import load_file

    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # merge-lora's too
        assert (tmp_path / "b" / name).read_text() == (tmp_path / "a" / name).read_text(), name
    from tokenizers import Tokenizer

    eot = Tokenizer.from_file(chats[1]).token_to_id(TEMPLATE_END)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM" and eot in model.generation_config.eos_token_id
    tokens = np.random.default_rng(1).integers(0, 50, (2, 24)).astype(np.int32)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    assert np.abs(theirs - _run_logits(run_dir, tokens)).max() < 1e-4


def _overrides_of(cfg):
    """The run's config as overrides of the tiny config (merge-lora reads CONFIG + key=value)."""
    return [f"out_dir={cfg.out_dir}", "data.kind=jsonl", f"data.path={cfg.data.path}",
            f"data.tokenizer={cfg.data.tokenizer}", "data.format=messages", "train.seq_len=32", "train.micro_batch=1",
            "model.qkv_bias=true", "lora.rank=4", "lora.alpha=8", "lora.base_dtype=bfloat16"]


def test_an_export_imports_back_and_the_log_confirms_init_from(full_run, tmp_path, capsys):
    """export-hf -> import-hf -> checkpoint.init_from: the exported folder starts a new run, and the log names
    what was loaded and how many parameters it holds."""
    assert cli.main(["export-hf", str(full_run), "--out", str(tmp_path / "hf")]) == 0
    assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    cfg = run_config(full_run)
    from jaxmem.model.presets import param_count

    summary = run(load_config(TINY, [f"out_dir={tmp_path / 'again'}", f"checkpoint.init_from={tmp_path / 'ckpt'}",
                                     "train.steps=1", "train.progress=false", "train.seq_len=32"]))
    err = capsys.readouterr().err
    assert (f"jaxmem train: loaded checkpoint.init_from {tmp_path / 'ckpt'}: {param_count(cfg.model):,} model "
            "parameters (params only: the optimizer starts fresh at step 0)") in err
    assert summary["final_step"] == 1


def test_a_second_export_into_a_used_folder_is_refused_and_overwrite_replaces_it_whole(full_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli.main(["export-hf", str(full_run), "--out", str(out), "--max-shard-size", "300KB"]) == 0
    sharded = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in sharded
    capsys.readouterr()
    assert cli.main(["export-hf", str(full_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxmem export-hf: config error: --out: {out} is not empty; name a new folder, or pass "
                   "--overwrite to replace it whole"]
    assert sorted(p.name for p in out.iterdir()) == sharded  # untouched
    assert cli.main(["export-hf", str(full_run), "--out", str(out), "--overwrite"]) == 0
    whole = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in whole and not any(n.startswith("model-0") or n.endswith(".index.json")
                                                    for n in whole)  # no shard of the first export is left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no staging folder left behind


def test_an_export_never_writes_over_a_users_files(full_run, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    assert cli.main(["export-hf", str(full_run), "--out", str(out)]) == 2
    assert (out / "config.json").read_text() == '{"mine": true}' and len(list(out.iterdir())) == 1
    (tmp_path / "file").write_text("x")
    assert cli.main(["export-hf", str(full_run), "--out", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"jaxmem export-hf: config error: --out: {tmp_path / 'file'} is a file; name a folder")
    assert (tmp_path / "file").read_text() == "x"
