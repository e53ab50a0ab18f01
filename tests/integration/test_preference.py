"""Preference tuning vs TRL on CPU: for a tiny Hugging Face Llama made offline (bf16-representable weights, fp32
compute) and 16 pairs, jaxmem's loss, rewards/chosen, rewards/rejected and the gradient of its LoRA adapters equal
TRL's (DPOTrainer for dpo and ipo; CPOTrainer's simpo loss and ORPOTrainer's odds-ratio term on the torch model's
log-probs for simpo and orpo) within 1e-4; the references agree (base, precompute, model); bad pairs are
refused in one line."""
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chat_fixtures import sentence, write_tokenizer
from jaxmem.config import ConfigError
from jaxmem.core import objective as core_objective
from jaxmem.core.program import stage_fn
from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.io.data import make_source
from jaxmem.io.hf import save_hf
from jaxmem.lora.peft_format import load_peft, save_peft
from jaxmem.model import init_model

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

PAIRS, SEQ = 16, 48
MODEL = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=8", "model.d_ff=64"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Hugging Face Llama folder (weights stored bf16: the LoRA base holds them exactly) with its tokenizer,
    and a file of PAIRS string pairs plus the records a run skips."""
    root = tmp_path_factory.mktemp("pref")
    tokenizer = write_tokenizer(root / "tok")
    cfg = load_config("configs/tiny.yaml", MODEL)
    save_hf(init_model(cfg.model, seed=3), root / "hf", dtype="bfloat16")
    rng = np.random.default_rng(0)
    records = [{"prompt": sentence(rng), "chosen": sentence(rng), "rejected": sentence(rng)} for _ in range(PAIRS)]
    records += [{"prompt": "the cat", "chosen": "yes", "rejected": "yes"}, {"prompt": "the cat", "chosen": "no"}]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root, tokenizer


def _cfg(folder, objective, *extra):
    return load_config("configs/tiny.yaml", _cli_overrides(folder, objective) + list(extra))


def _random_adapters(params, seed=0):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def _jaxmem(cfg):
    """(loss, metrics, adapter gradients, rows, the program) of one micro-batch of all PAIRS pairs."""
    prog = build_program(cfg, devices=jax.devices()[:1])
    state = prog.init_from(cfg.checkpoint.init_from)
    adapters = _random_adapters(state["params"])
    source = make_source(cfg)
    batch = source.samples(np.arange(2 * PAIRS), SEQ)
    chosen = prog.features.objective(cfg)
    grad_fn = jax.jit(core_objective.micro_grad_fn(prog, chosen, stage_fn(prog, logprobs=True)))
    labels = jnp.asarray(batch["labels"])
    micro = (jnp.asarray(batch["inputs"]), labels, None, None, None)
    totals = dict(chosen.totals(labels[None]), scale=jnp.float32(1.0))
    grads, (loss, metrics) = grad_fn(adapters, micro, totals, state["base"], None)
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads, adapters, source.rows, prog


def _trl_inputs(rows):
    """TRL's batch for our rows: chosen sequences first, then the rejected, right-padded, with the completion
    mask."""
    seqs = [rows.sequence(n) for n in list(range(0, 2 * PAIRS, 2)) + list(range(1, 2 * PAIRS, 2))]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (seq, n_prompt) in enumerate(seqs):
        ids[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        completion[i, n_prompt:len(seq)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _peft_model(folder, cfg, adapters, tmp_path):
    import peft
    import transformers

    save_peft(adapters, cfg.model, tmp_path / "adapter", rank=4, alpha=16.0)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder[0] / "hf", torch_dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)


def _adapter_grads(model, cfg, tmp_path):
    """The PEFT model's adapter gradients in our tree (written as a PEFT file, read back by load_peft)."""
    from safetensors.torch import save_file

    out = tmp_path / "grads"
    out.mkdir()
    tensors = {n.replace(".default", ""): p.grad.detach().contiguous() for n, p in model.named_parameters()
               if "lora_" in n and ".default." in n}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((tmp_path / "adapter" / "adapter_config.json").read_text())
    return load_peft(out, cfg.model)[0]


def _assert_close(a, b, what, tol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
    assert err < tol, f"{what}: relative error {err:.2e} (max |ref| {np.max(np.abs(b)):.3e})"


def _trl_dpo(model, inputs, loss_type, tmp_path, tokenizer):
    from trl import DPOConfig, DPOTrainer
    from datasets import Dataset

    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.2, loss_type=[loss_type], report_to=[], use_cpu=True,
                     bf16=False)
    trainer = DPOTrainer(model=model, args=args, processing_class=_hf_tokenizer(tokenizer),
                         train_dataset=Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    with torch.no_grad():  # TRL's reference is the adapter it was handed; a fresh LoRA run's is zero (the base)
        for name, param in trainer.model.named_parameters():
            if ".ref." in name:
                param.zero_()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss), metrics


def _hf_tokenizer(path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="[UNK]")


def _torch_logps(model, inputs):
    """Per-sequence (sum, token count) of the completion's log-probs under the torch model."""
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, :-1]
    labels, mask = inputs["input_ids"][:, 1:], inputs["completion_mask"][:, 1:].bool()
    logp = torch.gather(logits.log_softmax(-1), 2, labels[..., None])[..., 0]
    return (logp * mask).sum(-1), mask.sum(-1)


def _trl_reference_free(model, inputs, kind):
    """simpo: CPOTrainer's loss (cpo_alpha 0); orpo: ORPOTrainer's odds-ratio term plus the chosen completions'
    NLL per token (jaxmem's: TRL's NLL also covers the prompt), on the torch model's log-probs."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    sums, counts = _torch_logps(model, inputs)
    mean = sums / counts
    stub = types.SimpleNamespace(beta=0.2, label_smoothing=0.0, alpha=0.0, loss_type="simpo", simpo_gamma=0.5,
                                 accelerator=types.SimpleNamespace(device="cpu"))
    if kind == "simpo":
        losses, r_c, r_r = CPOTrainer.cpo_loss(stub, mean[:PAIRS], mean[PAIRS:])
        loss = losses.mean()
    else:
        stub.beta = 0.1  # ORPO's lambda (preference.orpo_lambda)
        losses, r_c, r_r, _, _ = ORPOTrainer.odds_ratio_loss(stub, mean[:PAIRS], mean[PAIRS:])
        loss = -sums[:PAIRS].sum() / counts[:PAIRS].sum() - losses.mean()
    loss.backward()
    return float(loss), {"rewards/chosen": float(r_c.mean()), "rewards/rejected": float(r_r.mean())}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo"])
def test_loss_rewards_and_adapter_gradients_equal_trl(folder, objective, tmp_path):
    cfg = _cfg(folder, objective, "precision.compute_dtype=float32")
    loss, metrics, grads, adapters, rows, _ = _jaxmem(cfg)
    model = _peft_model(folder, cfg, adapters, tmp_path)
    inputs = _trl_inputs(rows)
    if objective in ("dpo", "ipo"):
        ref_loss, ref_metrics = _trl_dpo(model, inputs, {"dpo": "sigmoid"}.get(objective, objective), tmp_path,
                                         folder[1])
    else:
        ref_loss, ref_metrics = _trl_reference_free(model, inputs, objective)
    _assert_close(loss, ref_loss, "loss")
    for key in ("rewards/chosen", "rewards/rejected"):
        _assert_close(metrics[key], ref_metrics[key], key, tol=1e-4 if abs(ref_metrics[key]) > 1e-3 else 1e-2)
    ref_grads = _adapter_grads(model, cfg, tmp_path)
    for name, layer in grads["layers"].items():
        for part in ("a", "b"):
            _assert_close(layer[part], ref_grads["layers"][name][part], f"{name}.{part}")


def _run_cfg(folder, out_dir, *extra):
    return _cfg(folder, "dpo", f"out_dir={out_dir}", "train.steps=3", "train.log_every=1", "train.progress=false",
                "train.micro_batch=2", "parallel.fsdp=-1", "optimizer.warmup_steps=0", "optimizer.lr=1e-2",
                "checkpoint.every=0", *extra)


@pytest.mark.slow
@pytest.mark.parametrize(("lora", "references"), [(True, ("base", "precompute")), (False, ("model", "precompute"))])
def test_references_give_the_same_losses(folder, tmp_path, lora, references):
    """The frozen base (adapters off), the stored log-probs and a frozen copy are one reference: the same loss at
    every step of the same run to 1e-5 (the weights are bf16 values, so the bf16 copy is exact)."""
    from jaxmem.train import run

    extra = [] if lora else ["lora.rank=0"]
    losses = {}
    for ref in references:
        summary = run(_run_cfg(folder, tmp_path / ref, f"preference.reference={ref}", *extra))
        losses[ref] = [r["loss"] for r in summary["records"]]
        assert len(losses[ref]) == 3 and losses[ref][-1] < losses[ref][0]  # it trains
    np.testing.assert_allclose(losses[references[0]], losses[references[1]], rtol=1e-5, atol=1e-6)
    if lora:  # the fsdp mesh (8 devices, 2 rows each) trains like one device holding the 16 rows
        np.testing.assert_allclose(_one_device_losses(folder, tmp_path / "one"), losses["base"], rtol=1e-5,
                                   atol=1e-6)
    if "precompute" in references:  # a run that finds the stored values reuses them (checksum verified)
        stored = tmp_path / "precompute" / "reference_logps.npy"
        before = stored.stat().st_mtime_ns
        again = run(_run_cfg(folder, tmp_path / "precompute", "preference.reference=precompute", "train.steps=4",
                             *extra))
        assert stored.stat().st_mtime_ns == before and again["start_step"] == 3


def _one_device_losses(folder, out):
    """The losses of _run_cfg's LoRA run on one device (a process of its own), the 16 rows in one micro-batch."""
    import subprocess
    import sys

    from cpu_env import cpu_env
    from jaxmem.train.metrics import read_jsonl

    argv = _cli_overrides(folder, "dpo") + [f"out_dir={out}", "train.steps=3", "train.log_every=1",
                                            "train.progress=false", "train.micro_batch=16", "parallel.fsdp=1",
                                            "optimizer.warmup_steps=0", "optimizer.lr=1e-2", "checkpoint.every=0"]
    done = subprocess.run([sys.executable, "-m", "jaxmem.cli", "train", "configs/tiny.yaml", *argv], env=cpu_env(1),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]


def test_bad_pairs_are_counted_and_skipped_or_refused_in_one_line(folder, tmp_path, capsys):
    """Missing fields, chosen == rejected, a prompt over the budget, a completion cut to nothing: counted and
    skipped in one line; a file with nothing trainable left: one line naming its file and first record."""
    rows = make_source(_cfg(folder, "dpo", "data.max_prompt_len=4")).rows
    assert rows.stats["skipped_missing"] == 1 and rows.stats["skipped_identical"] == 1
    assert rows.stats["skipped_long_prompt"] > 0 and rows.stats["pairs"] + rows.stats["skipped_long_prompt"] == PAIRS
    line = [x for x in capsys.readouterr().err.splitlines() if "pairs of" in x]
    assert len(line) == 1 and "skipped 1 for a missing or mistyped field, 1 for chosen equal to rejected" in line[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "the cat", "chosen": "yes"}) + "\n"
                   + json.dumps({"prompt": "a", "chosen": "no", "rejected": "no"}) + "\n")
    with pytest.raises(ConfigError, match=rf"^data.path: {bad}:1: no trainable pair in {bad} .*missing") as e:
        make_source(_cfg(folder, "dpo", f"data.path={bad}"))
    assert "\n" not in str(e.value)
    # a completion cut to nothing: the prompt fills the row
    with pytest.raises(ConfigError, match="empty after truncation"):
        make_source(_cfg(folder, "dpo", "train.seq_len=4", "data.max_prompt_len=8", f"data.path={_one_pair(tmp_path)}"))


def _one_pair(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "why is the sky", "chosen": "blue", "rejected": "red"}) + "\n")
    return path


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["data.format=text", "data.kind=synthetic"], "train.objective: dpo trains on preference pairs"),
    (["train.micro_batch=3"], "train.micro_batch: 3 must be even"),
    (["lora.rank=0", "preference.reference=precompute", "parallel.pp=2"],
     "parallel.pp: pipeline stages do not run train.objective=dpo"),
    (["lora.rank=0", "preference.reference=base"], "preference.reference: base is the frozen LoRA base"),
    (["preference.reference=model"], "preference.reference: model would copy the LoRA base"),
    (["train.objective=simpo", "preference.reference=base"], "compares with no reference policy"),
    (["preference.beta=0"], "preference.beta: 0.0 must be > 0"),
    (["preference.label_smoothing=0.5"], "preference.label_smoothing: 0.5 must be in [0, 0.5)"),
])
def test_bad_preference_settings_are_refused_in_one_line(folder, overrides, fragment):
    with pytest.raises(ConfigError) as e:
        _cfg(folder, "dpo", *overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_dpo_run_resumes_exactly_after_ctrl_c(folder, tmp_path):
    """SIGINT saves the current step; the resume's losses and adapters equal the uninterrupted run's."""
    import signal
    import subprocess
    import sys
    import time

    from cpu_env import cpu_env
    from jaxmem.core.checkpoint import Checkpoints
    from jaxmem.train import run
    from jaxmem.train.signals import EXIT_SAVED

    steps = 6
    def overrides(out):
        return [f"out_dir={out}", f"train.steps={steps}", "train.log_every=1", "train.progress=false",
                "checkpoint.every=0", "train.micro_batch=2", "parallel.fsdp=-1"]

    straight = run(_cfg(folder, "dpo", *overrides(tmp_path / "straight")))
    out = tmp_path / "run"
    argv = _cli_overrides(folder, "dpo") + overrides(out)
    proc = subprocess.Popen([sys.executable, "-m", "jaxmem.cli", "train", "configs/tiny.yaml", *argv],
                            env=cpu_env(8, JAXMEM_TEST_STEP_SLEEP="0.4"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_SAVED, err[-3000:]
    saved = Checkpoints(out / "checkpoints").all_steps()
    assert len(saved) == 1 and 2 <= saved[0] < steps
    resumed = run(_cfg(folder, "dpo", *overrides(out)))
    assert resumed["resumed_from"] == saved[0]
    want = {r["step"]: (r["loss"], r["rewards/chosen"]) for r in straight["records"]}
    assert {r["step"]: (r["loss"], r["rewards/chosen"]) for r in resumed["records"]} == \
        {s: want[s] for s in range(saved[0] + 1, steps + 1)}


def _cli_overrides(folder, objective):
    """_cfg's overrides, as a command line gives them."""
    root, tokenizer = folder
    return MODEL + [f"checkpoint.init_from={root / 'hf'}", "lora.rank=4", "lora.alpha=16", "lora.targets=q_proj,v_proj",
                    "data.kind=jsonl", f"data.path={root / 'pairs.jsonl'}", f"data.tokenizer={tokenizer}",
                    "data.format=preference", f"data.cache_dir={root / 'cache'}", f"train.objective={objective}",
                    f"train.micro_batch={2 * PAIRS}", f"train.seq_len={SEQ}", "parallel.fsdp=1", "preference.beta=0.2",
                    "data.packing=none"]  # a sequence a row (packed pairs: test_preference_packing.py)
