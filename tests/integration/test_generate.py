"""Generation: greedy decoding equals transformers' `generate` token for token on tiny models of every family
made offline (4 prompts of different lengths, batched with left padding, 32 new tokens, fp32), sliding-window
layers through their ring buffer; stop tokens; sampling reproducible with a fixed seed; an int8 cache close to
the float one."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from chat_fixtures import LLAMA3_TEMPLATE
from tokenizers import Tokenizer

import jaxmem
from jaxmem.cli import main as cli_main
from jaxmem.io.documents.chat import ChatTemplate
from jaxmem.generation.decoder import Decoder
from jaxmem.generation.loop import generate_fn, left_pad
from jaxmem.generation.sampling import Sampling
from jaxmem.model import kv_cache

NEW = 32
LENGTHS = (5, 9, 3, 12)
WIDTH = 16  # the prompts' bucket
# Odd sizes, small: hidden 48 with 4 heads of 16 (head_dim != hidden / heads where set), vocab 97.
SHAPE = dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, initializer_range=0.2)
MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)
CASES = {
    "llama": (transformers.LlamaConfig, dict(SHAPE)),
    # jaxmem loads Mistral's window as full causal attention with the sequence capped at the window
    # (jaxmem.io.hf_families): a window above prompt + new tokens
    "mistral": (transformers.MistralConfig, dict(SHAPE, sliding_window=64)),
    "qwen2": (transformers.Qwen2Config, dict(SHAPE, rope_theta=1000000.0)),
    "qwen3": (transformers.Qwen3Config, dict(SHAPE, head_dim=16)),
    # layers local, local, global, local: a window of 5, linear RoPE scaling on the global layer
    "gemma3": (transformers.Gemma3TextConfig, dict(
        SHAPE, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=20, sliding_window=5,
        sliding_window_pattern=3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "mixtral": (transformers.MixtralConfig, dict(SHAPE, **MOE)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(SHAPE, head_dim=16, moe_intermediate_size=24, num_experts=4,
                                                    num_experts_per_tok=2, norm_topk_prob=True)),
    # local, global, local with a window of 5; sinks; YaRN
    "gpt_oss": (transformers.GptOssConfig, dict(
        SHAPE, **MOE, num_hidden_layers=3, head_dim=16, sliding_window=5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
}


def _hf_model(name):
    config_cls, kwargs = CASES[name]
    torch.manual_seed(list(CASES).index(name))
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), attn_implementation="eager")
    with torch.no_grad():  # non-trivial norms, biases, sinks and routers
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn_like(p) + (0.0 if name == "gemma3" else 1.0))
            elif "sinks" in pname:
                p.copy_(0.3 * torch.randn_like(p) + 2.0)
            elif pname.endswith("bias") or "router" in pname or pname.endswith("gate.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model.eval()


def _prompts(vocab, lengths=LENGTHS, seed=0):
    rng = np.random.RandomState(seed)
    return [[int(t) for t in rng.randint(1, vocab, n)] for n in lengths]


def hf_greedy(hf_model, prompts, new=NEW, **kwargs):
    """transformers' generate of left-padded prompts: the new tokens [B, new]."""
    tokens, starts = left_pad(prompts, WIDTH, 0)
    mask = (np.arange(WIDTH)[None] >= starts[:, None]).astype(np.int64)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                                max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
    return out[:, WIDTH:].numpy()


def ours(decoder, weights, prompts, new=NEW, seed=0, **kwargs):
    tokens, starts = left_pad(prompts, WIDTH, 0)
    fn = jax.jit(generate_fn(decoder, max_new=new, **kwargs))
    return fn(weights, jnp.asarray(tokens), jnp.asarray(starts), jax.random.key(seed))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (HF model, jaxmem model)} made on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            hf = _hf_model(name)
            hf.save_pretrained(directory, safe_serialization=True)
            cache[name] = (hf, jaxmem.load_hf(directory), directory)
        return cache[name]

    return get


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("qwen2", "mixtral") else n
                                  for n in CASES])
def test_greedy_equals_transformers(models, name):
    hf, model, _ = models(name)
    prompts = _prompts(model.cfg.vocab_size)
    got = ours(Decoder.from_model(model), Decoder.weights_of(model), prompts)
    want = hf_greedy(hf, prompts)
    np.testing.assert_array_equal(np.asarray(got.tokens), want)
    assert np.asarray(got.lengths).tolist() == [NEW] * len(prompts)


def test_sliding_window_layers_keep_only_their_window(models):
    _, model, _ = models("gemma3")
    cache = kv_cache.init_cache(model.cfg, jnp.zeros((2,), jnp.int32), WIDTH + NEW, jnp.float32)
    assert cache.stacks["local"].k.shape == (3, 2, 5, 2, 16)  # 3 local layers, a ring of the window (5 slots)
    assert cache.stacks["global"].k.shape == (1, 2, WIDTH + NEW, 2, 16)


def test_stop_tokens_end_rows_and_pad_after(models):
    hf, model, _ = models("llama")
    prompts = _prompts(model.cfg.vocab_size)
    free = hf_greedy(hf, prompts)
    stop = int(free[1, 3])  # a token the second row produces at its 4th step
    got = ours(Decoder.from_model(model), Decoder.weights_of(model), prompts, stop_ids=(stop,), pad_id=0)
    want = hf_greedy(hf, prompts, eos_token_id=stop)
    want = np.pad(want, ((0, 0), (0, NEW - want.shape[1])))  # transformers stops when every row has
    tokens, lengths = np.asarray(got.tokens), np.asarray(got.lengths)
    np.testing.assert_array_equal(tokens, want)
    for row in range(len(prompts)):
        hits = np.flatnonzero(free[row] == stop)
        assert lengths[row] == (hits[0] + 1 if hits.size else NEW)
    assert lengths[1] <= 4


def test_sampling_is_reproducible_and_seeded(models):
    _, model, _ = models("llama")
    prompts = _prompts(model.cfg.vocab_size)
    decoder, weights = Decoder.from_model(model), Decoder.weights_of(model)
    sampling = Sampling(temperature=1.3, top_k=20, top_p=0.9)
    a = np.asarray(ours(decoder, weights, prompts, new=16, seed=1, sampling=sampling).tokens)
    b = np.asarray(ours(decoder, weights, prompts, new=16, seed=1, sampling=sampling).tokens)
    c = np.asarray(ours(decoder, weights, prompts, new=16, seed=2, sampling=sampling).tokens)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    greedy = np.asarray(ours(decoder, weights, prompts, new=16).tokens)
    assert (a != greedy).any()


def test_int8_cache_follows_the_float_cache(models):
    """int8 keys and values (per token and head scales) change the logits a little: most greedy tokens agree."""
    _, model, _ = models("llama")
    prompts = _prompts(model.cfg.vocab_size)
    decoder, weights = Decoder.from_model(model), Decoder.weights_of(model)
    exact = np.asarray(ours(decoder, weights, prompts, new=16).tokens)
    int8 = np.asarray(ours(decoder, weights, prompts, new=16, cache_dtype="int8").tokens)
    assert (exact[:, :4] == int8[:, :4]).mean() >= 0.75


# ---------------------------------------------------------------- the command and the library


@pytest.fixture(scope="module")
def hf_folder(models):
    """The tiny Llama's folder with a word-level tokenizer, its chat template and generation_config.json."""
    from chat_fixtures import write_tokenizer

    hf, _, directory = models("llama")
    write_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    stop = tokenizer.token_to_id("<|eot_id|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop]}))
    return directory, hf, tokenizer, stop


def _hf_text(hf, tokenizer, stop, ids, new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=stop,
                          pad_token_id=stop)
    return tokenizer.decode([t for t in out[0, len(ids):].tolist() if t != stop])


def test_cli_completes_like_transformers(hf_folder, capsys):
    directory, hf, tokenizer, stop = hf_folder
    prompts = ["the cat sat on the mat", "why is the sky blue"]
    argv = ["generate", str(directory), "--max-new-tokens", "12", "--json"]
    assert cli_main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    for line, prompt in zip(lines, prompts):
        assert line["completion"] == _hf_text(hf, tokenizer, stop, tokenizer.encode(prompt).ids, 12)


def test_library_chat_and_prompt_file(hf_folder, tmp_path, capsys):
    """--chat renders the template with the generation prompt; --prompts reads a JSONL file; jaxmem.generate
    returns what the command prints."""
    directory, hf, tokenizer, stop = hf_folder
    chat = [{"role": "user", "content": "tell me about the sea"}]
    template = ChatTemplate(LLAMA3_TEMPLATE, "test", "<|begin_of_text|>", "<|eot_id|>")
    ids = tokenizer.encode(template.render(chat, add_generation_prompt=True), add_special_tokens=False).ids
    want = _hf_text(hf, tokenizer, stop, ids, 10)
    assert jaxmem.generate(directory, [chat], chat=True, max_new_tokens=10) == [want]
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps({"prompt": "yes"}) + "\n")
    assert cli_main(["generate", str(directory), "--prompts", str(tmp_path / "p.jsonl"), "--chat",
                     "--max-new-tokens", "10", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["completion"] == want and len(lines) == 2


@pytest.mark.parametrize("extra, key", [
    (["--temperature", "-1", "--prompt", "a"], "temperature"),
    (["--top-p", "0", "--prompt", "a"], "top_p"),
    (["--max-new-tokens", "0", "--prompt", "a"], "--max-new-tokens"),
    (["--max-new-tokens", "1000", "--prompt", "a"], "max_seq_len"),
    (["--prompt", "  "], "empty prompt"),
    ([], "--prompt or --prompts"),
    (["--prompts", "EMPTY"], "holds no prompt"),
])
def test_bad_input_is_one_line(hf_folder, tmp_path, capsys, extra, key):
    directory = hf_folder[0]
    (tmp_path / "empty.jsonl").write_text("\n")
    extra = [str(tmp_path / "empty.jsonl") if a == "EMPTY" else a for a in extra]
    assert cli_main(["generate", str(directory)] + extra) != 0
    err = capsys.readouterr().err.strip()
    assert key in err and len(err.splitlines()) == 1, err


def test_missing_folder_and_tokenizer_are_one_line(models, tmp_path, capsys):
    assert cli_main(["generate", str(tmp_path / "nope"), "--prompt", "a"]) != 0
    assert "no such folder" in capsys.readouterr().err
    _, _, directory = models("qwen3")  # saved without a tokenizer
    capsys.readouterr()
    assert cli_main(["generate", str(directory), "--prompt", "a"]) != 0
    err = capsys.readouterr().err.strip()
    assert "no tokenizer.json" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------- a LoRA / QLoRA run's folder


def _lora_run(folder, hf_dir, base_dtype):
    """3 steps of LoRA (rank 4 on every linear) on the tiny Llama's folder, over the 8 devices (fsdp)."""
    from jaxmem.train import run

    import yaml

    tiny = yaml.safe_load(open("configs/tiny.yaml"))
    tiny.pop("model")  # the folder gives the architecture
    (folder / "run.yaml").write_text(yaml.safe_dump(tiny))
    cfg = jaxmem.load_config(folder / "run.yaml", [
        f"out_dir={folder / 'run'}", "train.progress=false", f"checkpoint.init_from={hf_dir}", "lora.rank=4",
        "lora.alpha=8", "lora.targets=all-linear", f"lora.base_dtype={base_dtype}", "train.steps=3",
        "checkpoint.every=3", "train.seq_len=32", "optimizer.lr=3e-2", "optimizer.warmup_steps=0"])
    run(cfg)
    return folder / "run"


@pytest.fixture(scope="module")
def lora_runs(models, tmp_path_factory):
    _, _, hf_dir = models("llama")
    made = {}

    def get(base_dtype):
        if base_dtype not in made:
            made[base_dtype] = _lora_run(tmp_path_factory.mktemp(f"lora_{base_dtype}"), hf_dir, base_dtype)
        return made[base_dtype]

    return get


def _round_base_linears(hf_model):
    """The base's layer linears as a bfloat16 base stores them."""
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.startswith("model.layers.") and p.dim() == 2:
                p.copy_(p.bfloat16().float())
    return hf_model


def test_lora_run_decodes_like_transformers_with_peft(models, lora_runs, tmp_path):
    """The run's adapters applied unmerged, over the run's mesh (8 devices, the batch padded to the data ways),
    equal transformers + PEFT of the exported adapters on the same (bfloat16-stored) base."""
    import peft

    hf, model, hf_dir = models("llama")
    run_dir = lora_runs("bfloat16")
    assert cli_main(["merge-lora", str(run_dir / "config.resolved.yaml"), "--out", str(tmp_path / "merged"),
                     "--peft", str(tmp_path / "peft")]) == 0
    base = _round_base_linears(transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager"))
    base.generation_config.eos_token_id = None
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    prompts = _prompts(model.cfg.vocab_size)
    got = jaxmem.generator(run_dir).complete_ids(prompts, max_new_tokens=NEW, stop_ids=())
    want = hf_greedy(adapted, prompts)
    assert want.tolist() != hf_greedy(hf, prompts).tolist()  # the adapters change the completions
    assert got == want.tolist()


def test_qlora_run_decodes_its_4bit_base_like_the_merged_export(models, lora_runs, tmp_path):
    """An nf4 base dequantized per layer in the decode loop, adapters unmerged: transformers' generate of the
    merged export (the same dequantized base with the adapters folded in)."""
    _, model, _ = models("llama")
    run_dir = lora_runs("nf4")
    assert cli_main(["merge-lora", str(run_dir / "config.resolved.yaml"), "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    merged.generation_config.eos_token_id = None
    prompts = _prompts(model.cfg.vocab_size)
    got = jaxmem.generator(run_dir).complete_ids(prompts, max_new_tokens=NEW, stop_ids=())
    assert got == hf_greedy(merged.eval(), prompts).tolist()


# ---------------------------------------------------------------- over a mesh


def _program_tokens(overrides, devices):
    from jaxmem.generation.text import Generator

    cfg = jaxmem.load_config("configs/tiny-gemma3.yaml", ["train.progress=false", *overrides])
    prog = jaxmem.build_program(cfg, devices=devices)
    state = prog.init_state(seed=4)
    gen = Generator(Decoder.from_program(prog), Decoder.weights_of_state(state), None,
                    rows_multiple=prog.layout.data_ways)
    prompts = _prompts(cfg.model.vocab_size, lengths=(5, 20, 3, 12))  # one prompt past the window of 16
    return gen.complete_ids(prompts, max_new_tokens=24, stop_ids=()), gen.complete_ids(
        prompts, max_new_tokens=24, stop_ids=(), cache_dtype="bfloat16")


def test_fsdp_by_tp_decodes_like_one_device():
    """tiny Gemma 3 (local and global layers, a ring of 16 slots) on fsdp 2 x tp 2 with the fsdp_tp rules, and
    fsdp 4: the tokens of one device, with an fp32 and a bfloat16 cache."""
    one = _program_tokens(["parallel.fsdp=1"], jax.devices()[:1])
    assert _program_tokens(["parallel.fsdp=2", "parallel.tp=2", "parallel.rules=fsdp_tp"], jax.devices()[:4]) == one
    assert _program_tokens(["parallel.fsdp=4"], jax.devices()[:4]) == one


# ---------------------------------------------------------------- the plan


def test_plan_sizes_the_cache_and_compiles_the_generation_program(capsys):
    from jaxmem.plan import resolve_topology
    from jaxmem.plan.generation import cache_bytes, plan_generation

    cfg = jaxmem.load_config("configs/tiny-gemma3.yaml", ["parallel.fsdp=1", "generate.batch=2",
                                                           "generate.prompt_len=20", "generate.max_new_tokens=9"])
    cache = kv_cache.init_cache(cfg.model, jnp.zeros((2,), jnp.int32), 32 + 16, jnp.float32)
    assert cache_bytes(cfg) == sum(x.nbytes for x in jax.tree.leaves(cache.stacks))  # buckets 32 + 16
    int8 = jaxmem.load_config("configs/tiny-gemma3.yaml", ["generate.batch=2", "generate.prompt_len=20",
                                                            "generate.max_new_tokens=9", "generate.cache_dtype=int8"])
    int8_cache = kv_cache.init_cache(int8.model, jnp.zeros((2,), jnp.int32), 48, "int8")
    assert cache_bytes(int8) == sum(x.nbytes for x in jax.tree.leaves(int8_cache.stacks)) < cache_bytes(cfg) / 3
    topo = resolve_topology(cfg, None, None, None)
    result = plan_generation(cfg, topo)
    assert result["device_peak"] > result["cache_bytes"] and result["label"].startswith("compiled for")
    assert cli_main(["plan", "configs/tiny-gemma3.yaml", "parallel.fsdp=1", "generate.batch=2",
                     "generate.max_new_tokens=0", "--no-compile"]) != 0
    assert "generate.max_new_tokens: 0 must be >= 1" in capsys.readouterr().err


def test_new_lengths_within_a_bucket_reuse_the_compiled_program(models):
    from jaxmem.generation.text import Generator

    _, model, _ = models("llama")
    gen = Generator(Decoder.from_model(model), Decoder.weights_of(model), None)
    first = gen.complete_ids(_prompts(97, (5, 9)), max_new_tokens=10, stop_ids=())
    second = gen.complete_ids(_prompts(97, (3, 12, 7), seed=1), max_new_tokens=12, stop_ids=())
    assert [len(r) for r in first] == [10, 10] and [len(r) for r in second] == [12] * 3
    (fn,) = gen._compiled.values()  # one budget bucket (16) ...
    assert fn._cache_size() == 2  # ... and one compile per batch bucket: [2, 16] and [4, 16], not per length
    gen.complete_ids(_prompts(97, (2, 16), seed=2), max_new_tokens=16, stop_ids=())
    assert fn._cache_size() == 2
    # 3 and 4 prompts share the batch bucket 4: the 4 reuse the program the 3 compiled, and a row's greedy
    # completion does not depend on the filler rows beside it
    four = _prompts(97, (3, 12, 7, 5), seed=1)
    again = gen.complete_ids(four, max_new_tokens=12, stop_ids=())
    assert fn._cache_size() == 2 and again[:3] == second


def test_a_run_reads_its_tokenizer_template_and_stop_ids(hf_folder, lora_runs, capsys):
    """A run's codec: data.tokenizer, its chat template and end-of-turn token as the stop id (as export-hf
    writes them); a run without a tokenizer decodes token ids only, and text is refused in one line."""
    from jaxmem.generation.text import run_codec

    directory, _, tokenizer, stop = hf_folder
    codec = run_codec(jaxmem.load_config("configs/tiny.yaml", [f"data.tokenizer={directory / 'tokenizer.json'}"]))
    assert stop in codec.stop_ids and codec.template is not None
    ids = codec.encode("why is the sky blue", chat=True)
    text = tokenizer.decode(ids, skip_special_tokens=False).replace(" ", "")
    assert text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>whyistheskyblue<|eot_id|>" \
                   "<|start_header_id|>assistant<|end_header_id|>"  # the generation prompt's header last
    run_dir = lora_runs("bfloat16")
    capsys.readouterr()
    assert cli_main(["generate", str(run_dir), "--prompt", "a"]) != 0
    err = capsys.readouterr().err.strip()
    assert "needs a tokenizer" in err and len(err.splitlines()) == 1
