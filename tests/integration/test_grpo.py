"""GRPO vs TRL on CPU: for a tiny Hugging Face Llama made offline (bf16-representable weights, fp32 compute), a
fixed batch of 2 prompts x 4 completions, fixed rewards and old log-probs off the current policy (so the ratio
clips), jaxmem's GRPO loss and its LoRA adapters' gradient equal TRL's GRPOTrainer._compute_loss on the PEFT
model within 1e-4, for each loss normalization (grpo, dr_grpo, dapo), with and without the KL to the base,
and at a sampling temperature of 0.7 (every log-prob of the logits over it, as TRL takes them); the group
advantages equal TRL's; reward functions that fail are refused in one line."""
import dataclasses
import json
import types
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chat_fixtures import write_tokenizer
from jaxmem.config import ConfigError
from jaxmem.core import objective as core_objective
from jaxmem.core.program import stage_fn
from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.io.hf import save_hf
from jaxmem.model import init_model
from jaxmem.rl.advantages import group_advantages
from jaxmem.rl.objective import GRPOObjective
from jaxmem.rl.rewards import RewardError, load_rewards, score
from test_preference import MODEL, _adapter_grads, _assert_close, _peft_model, _random_adapters

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

GROUPS, GROUP, PROMPT, COMPLETION, SEQ = 2, 4, 6, 10, 32
REWARDS = """
def length(prompts, completions, **fields):
    return [float(len(c)) for c in completions]

def wrong_count(prompts, completions, **fields):
    return [0.0]

def nan(prompts, completions, **fields):
    return [float("nan")] * len(completions)

def raises(prompts, completions, **fields):
    raise KeyError("answer")
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    tokenizer = write_tokenizer(root / "tok")
    save_hf(init_model(load_config("configs/tiny.yaml", MODEL).model, seed=3), root / "hf", dtype="bfloat16")
    (root / "rewards.py").write_text(REWARDS)
    prompts = ["the cat", "a dog sat", "why is it blue", "tell me", "the sea", "what is the sky"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n" for p in prompts))
    return root, tokenizer


def _cfg(folder, *extra):
    return load_config("configs/tiny.yaml", _overrides(folder, *extra))


def _overrides(folder, *extra):
    root, tokenizer = folder
    return MODEL + [
        f"checkpoint.init_from={root / 'hf'}", "lora.rank=4", "lora.alpha=16", "lora.targets=q_proj,v_proj",
        f"data.tokenizer={tokenizer}", "train.objective=grpo", f"rl.prompts={root / 'prompts.jsonl'}",
        f"rl.rewards={root / 'rewards.py'}:length", f"rl.group_size={GROUP}", f"rl.prompts_per_step={GROUPS}",
        f"rl.max_prompt_len={PROMPT}", f"rl.max_completion_len={COMPLETION}", f"train.micro_batch={GROUPS * GROUP}",
        f"train.seq_len={SEQ}", "parallel.fsdp=1", "precision.compute_dtype=float32", *extra]


def _fixed_batch():
    """prompt ids [N, PROMPT], completion ids [N, COMPLETION], completion mask, rewards [N]."""
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(3, 64, (GROUPS, PROMPT)), GROUP, axis=0)
    completions = rng.integers(3, 64, (GROUPS * GROUP, COMPLETION))
    lengths = np.array([10, 4, 7, 10, 2, 9, 10, 5])
    mask = (np.arange(COMPLETION)[None] < lengths[:, None]).astype(np.int64)
    rewards = np.array([1.0, 0.0, 0.5, 1.0, 2.0, -1.0, 0.0, 0.3], np.float32)
    return prompts, completions, mask, rewards


def _torch_logps(model, prompt_ids, completion_ids, completion_mask, temperature=1.0):
    """The completion's per-token log-probs under `temperature`, by TRL's own selective_log_softmax."""
    from trl.trainer.utils import selective_log_softmax

    ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, PROMPT - 1:-1]
    return selective_log_softmax(logits, completion_ids, temperature=temperature)


def _trl_loss(model, loss_type, beta, inputs, temperature=1.0, epsilon_high=0.28, level="token"):
    """GRPOTrainer._compute_loss on our inputs: its log-prob pass replaced by the same torch computation."""
    from trl import GRPOTrainer

    def logps(_model, input_ids, attention_mask, logits_to_keep, **_):
        out = _torch_logps(model, input_ids[:, :PROMPT], input_ids[:, PROMPT:], attention_mask[:, PROMPT:],
                           temperature)
        return out, torch.zeros_like(out), None

    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                        reduce=lambda x, reduction: x, sync_gradients=True)
    stub = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=logps, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, get_gamma_weights=GRPOTrainer.get_gamma_weights, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1,
                                   sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0,
                                   vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0),
        use_vllm=False, model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=COMPLETION, accelerator=accelerator, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    loss = GRPOTrainer._compute_loss(stub, model, inputs)
    loss.backward()
    return float(loss), {k: v[-1] for k, v in stub._metrics["train"].items()}


def _trl_advantages(rewards):
    from trl.trainer.utils import nanstd

    grouped = torch.tensor(rewards).view(-1, GROUP)
    std = nanstd(grouped, dim=1).repeat_interleave(GROUP)
    advantages = (torch.tensor(rewards) - grouped.mean(1).repeat_interleave(GROUP)) / (std + 1e-4)
    return advantages.numpy(), float(torch.isclose(std, torch.zeros_like(std)).float().mean())


@pytest.fixture(scope="module")
def program(folder):
    cfg = _cfg(folder)
    prog = build_program(cfg, devices=jax.devices()[:1])
    state = prog.init_from(cfg.checkpoint.init_from)
    return cfg, prog, state, _random_adapters(state["params"])


@pytest.mark.slow
@pytest.mark.parametrize("loss_type,beta,temperature,level", [
    ("grpo", 0.04, 1.0, "token"), ("dr_grpo", 0.04, 1.0, "token"), ("dapo", 0.04, 1.0, "token"),
    ("dapo", 0.0, 1.0, "token"), ("grpo", 0.04, 0.7, "token"), ("bnpo", 0.04, 1.0, "token"),
    ("cispo", 0.0, 1.0, "token"), ("sapo", 0.04, 1.0, "token"), ("vespo", 0.04, 1.0, "token"),
    ("luspo", 0.04, 1.0, "sequence"), ("dapo", 0.0, 1.0, "sequence")])  # the last two: GSPO's sequence ratio
def test_loss_and_adapter_gradients_equal_trl(folder, program, loss_type, beta, temperature, level, tmp_path):
    cfg, prog, state, adapters = program
    prompts, completions, mask, rewards = _fixed_batch()
    advantages, _, _ = group_advantages(rewards[:, None], [1.0], GROUP)
    model = _peft_model(folder, cfg, adapters, tmp_path)
    p, c, m = torch.tensor(prompts), torch.tensor(completions), torch.tensor(mask)
    with torch.no_grad():
        policy = _torch_logps(model, p, c, m, temperature)
        old = policy + torch.tensor(np.random.default_rng(1).normal(0, 0.3, policy.shape), dtype=torch.float32)
        with model.disable_adapter():
            ref = _torch_logps(model, p, c, m, temperature)
    inputs = {"prompt_ids": p, "prompt_mask": torch.ones_like(p), "completion_ids": c, "completion_mask": m,
              "advantages": torch.tensor(advantages), "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": m.sum().float()}
    epsilon_high = 1.1 if loss_type == "cispo" else 0.28  # cispo's cap on the ratio itself: some tokens over it
    ref_loss, ref_metrics = _trl_loss(model, loss_type, beta, inputs, temperature, epsilon_high, level)

    seq = np.concatenate([prompts, completions], 1)
    n, width = seq.shape
    x = np.zeros((n, SEQ), np.int32)
    x[:, :width - 1] = seq[:, :-1]
    labels = np.full((n, SEQ), -100, np.int32)
    labels[:, PROMPT - 1:width - 1] = np.where(mask > 0, completions, -100)
    stored = np.zeros((n, SEQ, 3), np.float32)
    stored[:, PROMPT - 1:width - 1, 0], stored[:, PROMPT - 1:width - 1, 1] = old.numpy(), ref.numpy()
    stored[..., 2] = advantages[:, None]
    chosen = GRPOObjective(dataclasses.replace(cfg, rl=dataclasses.replace(
        cfg.rl, loss_type=loss_type, beta=beta, epsilon_high=epsilon_high, temperature=temperature,
        importance_sampling_level=level)))
    logprob_fn = stage_fn(prog, logprobs=True, temperature=chosen.temperature)  # as the program's step takes it
    grad_fn = jax.jit(core_objective.micro_grad_fn(prog, chosen, logprob_fn))
    y = jnp.asarray(labels)
    totals = dict(chosen.totals(y[None]), scale=jnp.float32(1.0))
    grads, (loss, metrics) = grad_fn(adapters, (jnp.asarray(x), y, None, None, jnp.asarray(stored)), totals,
                                     state["base"], None)
    _assert_close(float(loss), ref_loss, "loss")
    clips = {"cispo": {"clip_ratio/high_mean": "cispo_clip_ratio"}, "sapo": {}, "vespo": {}}.get(loss_type, {
        k: k for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")})
    for ours, theirs in dict(clips, **({"kl": "kl"} if beta else {})).items():
        _assert_close(float(metrics[ours]), ref_metrics[theirs], ours, tol=1e-4 if ref_metrics[theirs] > 1e-3 else 1e-2)
    # the noise makes a token's ratio clip (a completion's mean ratio stays inside the clip here)
    assert loss_type in ("sapo", "vespo") or level == "sequence" or ref_metrics[next(reversed(clips.values()))] > 0
    ref_grads = _adapter_grads(model, cfg, tmp_path)
    for name, layer in grads["layers"].items():
        for part in ("a", "b"):
            _assert_close(layer[part], ref_grads["layers"][name][part], f"{name}.{part}")


def test_group_advantages_equal_trl():
    rewards = np.array([1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0], np.float32)
    advantages, total, no_signal = group_advantages(rewards[:, None], [1.0], GROUP)
    expected, expected_flat = _trl_advantages(rewards)
    np.testing.assert_allclose(advantages, expected, atol=1e-6)
    assert no_signal == expected_flat == 0.5
    weighted, _, _ = group_advantages(np.stack([rewards, 2 * rewards], 1), [1.0, 0.5], GROUP)
    np.testing.assert_allclose(weighted, _trl_advantages(2 * rewards)[0], atol=1e-6)


def test_rewards_are_refused_in_one_line(folder):
    root = folder[0]
    with pytest.raises(ConfigError, match="cannot be imported"):
        load_rewards("no_such_module_anywhere:f", "")
    with pytest.raises(ConfigError, match="has no function"):
        load_rewards(f"{root / 'rewards.py'}:missing", "")
    with pytest.raises(ConfigError, match="no file"):
        _cfg(folder, f"rl.rewards={root / 'absent.py'}:length")
    record = [{"prompt": "the cat", "answer": "4"}] * 2
    for name, words in (("wrong_count", "returned 1 values for 2"), ("nan", "returned nan"),
                        ("raises", "raised KeyError")):
        with pytest.raises(RewardError, match=f"{name}.*{words}.*answer"):
            score(load_rewards(f"{root / 'rewards.py'}:{name}", ""), ["the cat"] * 2, ["a", "b"], record)
    out = score(load_rewards(f"{root / 'rewards.py'}:length", ""), ["p", "p"], ["ab", "abc"], record)
    np.testing.assert_array_equal(out[:, 0], [2.0, 3.0])


def _run_cfg(folder, out_dir, *extra):
    return _cfg(folder, *_run_overrides(out_dir, *extra))


def _run_overrides(out_dir, *extra):
    return [f"out_dir={out_dir}", "train.steps=4", "train.log_every=1", "train.progress=false",
            "optimizer.warmup_steps=0", "optimizer.lr=1e-2", "checkpoint.every=0", "rl.samples_every=1",
            "rl.beta=0.04", "rl.updates_per_rollout=2", "rl.top_k=20", "rl.generation_batch=4", "parallel.fsdp=-1",
            f"train.micro_batch={GROUPS * GROUP // jax.device_count()}", *extra]


@pytest.mark.slow
def test_resume_after_sigint_equals_a_straight_run(folder, tmp_path, monkeypatch):
    """A run stopped by SIGINT during step 2 saves step 2; its resume to step 4 draws the same prompts and
    completions and gives the same metrics as a straight run; samples.jsonl holds completions and rewards."""
    import os
    import signal

    from jaxmem.train import rl_loop, run

    straight = run(_run_cfg(folder, tmp_path / "straight"))["records"]
    assert [r["step"] for r in straight] == [1, 2, 3, 4] and all(0 < r["completions/mean_length"] for r in straight)
    collect = rl_loop.Rollouts.collect

    def interrupted(self, state, rollout):
        if rollout == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return collect(self, state, rollout)

    monkeypatch.setattr(rl_loop.Rollouts, "collect", interrupted)
    first = run(_run_cfg(folder, tmp_path / "resumed"))
    assert first["stopped_by"] == "SIGINT" and first["final_step"] == 2
    monkeypatch.setattr(rl_loop.Rollouts, "collect", collect)
    second = run(_run_cfg(folder, tmp_path / "resumed"))
    assert second["start_step"] == 2
    for a, b in zip(straight[2:], second["records"]):
        for key in ("loss", "grad_norm", "reward", "kl", "completions/mean_length", "clip_ratio/region_mean"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    samples = [json.loads(line) for line in (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * GROUPS * GROUP and {s["step"] for s in samples} == {1, 2, 3, 4}
    assert (tmp_path / "resumed" / "samples.jsonl").read_text() == (tmp_path / "straight" / "samples.jsonl").read_text()
    assert all(s["rewards"]["length"] == len(s["completion"]) for s in samples)
    for record in straight:  # every completion of a step is sampled here (8 of them)
        lengths = [s["rewards"]["length"] for s in samples if s["step"] == record["step"]]
        assert record["reward"] == pytest.approx(np.mean(lengths)) and record["reward_std"] == pytest.approx(
            np.std(lengths, ddof=1))


@pytest.mark.slow
def test_a_failing_reward_stops_the_run_in_one_line(folder, tmp_path):
    from jaxmem.train import TrainError, run

    with pytest.raises(TrainError, match=r"^step 1: reward .*rewards.py:raises raised KeyError.*record"):
        run(_run_cfg(folder, tmp_path / "fails", f"rl.rewards={folder[0] / 'rewards.py'}:raises"))


def test_samples_are_never_written_through_a_link(tmp_path):
    from jaxmem.train.rl_loop import _write_samples

    target = tmp_path / "elsewhere.txt"
    target.write_text("keep")
    (tmp_path / "samples.jsonl").symlink_to(target)
    cfg = types.SimpleNamespace(out_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="symbolic link"):
        _write_samples(cfg, 1, [{"completion": "x"}])
    assert target.read_text() == "keep"


@pytest.mark.slow
def test_plan_compiles_both_phases(folder):
    """jaxmem plan of a grpo config: the training step, the rollout's generation program and the log-prob pass
    compiled, the train state live across them (its bytes per device from the abstract state), the run's peak
    the largest phase."""
    from jaxmem.plan import plan
    from jaxmem.runtime.aot import resolve_topology

    cfg = _cfg(folder, "parallel.fsdp=-1", f"train.micro_batch={GROUPS * GROUP // jax.device_count()}")
    result = plan(cfg, resolve_topology(cfg))
    rl, phases = result["rl"], result["rl"]["phases"]
    prog = build_program(cfg)
    state = sum(a.dtype.itemsize * np.prod(a.sharding.shard_shape(a.shape))
                for a in jax.tree.leaves(prog.abstract_state))
    assert rl["live_across"] == state
    assert phases["rollout"]["peak"] > state + rl["cache_bytes"] // 2
    assert phases["training"]["peak"] > state
    logprobs = phases["logprobs"]  # rl.beta 0 here: the old policy's pass alone
    assert list(logprobs["passes"]) == ["old"] and logprobs["rows"] == GROUPS * GROUP
    assert state < logprobs["peak"] < phases["training"]["peak"]  # no backward, no moments touched
    assert rl["run_peak"] == max(p["peak"] for p in phases.values()) == result["device_need_bytes"]
    assert result["peak_phase"] == max(phases, key=lambda k: phases[k]["peak"])
    assert {p["label"] for p in phases.values()} == {f"compiled for {resolve_topology(cfg).label} (attached devices)"}
    lines = "\n".join(result["lines"])
    assert "  log-prob phase: the forward passes of the old log-probs" in lines and "s per step" not in lines  # no GPU
    # without compile each phase is estimated from the step's bill and the analytic KV cache, within 2x of the
    # compiled figure on this tiny model (the bill's working set is coarse at its sizes), and the plan says so
    estimated = plan(cfg, resolve_topology(cfg), compile=False)
    assert estimated["fits_basis"] == "analytic" and estimated["rl"]["label"] == "estimated (analytic)"
    for name, phase in estimated["rl"]["phases"].items():
        assert 0.5 < phase["peak"] / phases[name]["peak"] < 2, (name, phase["peak"], phases[name]["peak"])
    assert estimated["analytic"]["device_total"] == estimated["device_need_bytes"] == estimated["rl"]["run_peak"]
    assert result["cost"]["step_seconds"] == estimated["cost"]["step_seconds"]


def test_kl_term_equals_a_float64_reference():
    """per_token_terms' loss and k3 KL on fixed log-probs equal numpy's in float64 (within float32's rounding)."""
    from jaxmem.rl.objective import per_token_terms

    rng = np.random.default_rng(2)
    policy, old, ref = (rng.normal(-2.0, 0.5, (4, 6)) for _ in range(3))
    advantage = np.repeat(rng.normal(0, 1, (4, 1)), 6, axis=1)
    loss, kl, _, _ = per_token_terms(*(jnp.asarray(a, jnp.float32) for a in (policy, old, ref, advantage)),
                                     beta=0.04, epsilon_low=0.2, epsilon_high=0.28)
    expected_kl = np.exp(ref - policy) - (ref - policy) - 1.0
    ratio = np.exp(policy - old)
    expected = -np.minimum(ratio * advantage, np.clip(ratio, 0.8, 1.28) * advantage) + 0.04 * expected_kl
    np.testing.assert_allclose(np.asarray(kl), expected_kl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), expected, rtol=1e-5, atol=1e-6)
    assert expected_kl.min() > 0


@pytest.mark.slow
def test_a_full_fine_tune_takes_its_kl_to_a_frozen_copy(folder, tmp_path):
    """rl.beta > 0 without LoRA: the state holds a bf16 copy of the initial weights; the KL is 0 on the first
    rollout's one update (the policy is the copy), then grows as the weights move away from it."""
    from jaxmem.core.plugins import FROZEN
    from jaxmem.train import run

    cfg = _run_cfg(folder, tmp_path / "full", "lora.rank=0", "train.steps=2", "rl.updates_per_rollout=1")
    prog = build_program(cfg)
    frozen = jax.tree.leaves(prog.abstract_state[FROZEN])
    assert frozen and all(a.dtype == jnp.bfloat16 for a in frozen)
    assert len(frozen) == len(jax.tree.leaves(prog.abstract_state["params"]))
    assert not prog.layout.freezes_model  # the copy is a reference: the model is trained (and exported) whole
    records = run(cfg)["records"]
    assert [r["step"] for r in records] == [1, 2]
    assert abs(records[0]["kl"]) < 1e-6 and records[1]["kl"] > 1e-5, [r["kl"] for r in records]


@pytest.mark.slow
def test_an_export_of_a_lora_grpo_run_loads_in_transformers(folder, tmp_path):
    """export-hf and merge-lora --peft of a 2-step LoRA GRPO run: the merged folder loads alone in transformers,
    the PEFT adapters load on the base folder, and both give jaxmem's logits for one batch."""
    import peft
    import transformers

    from jaxmem import cli
    from test_export_hf import _run_logits

    overrides = _overrides(folder, *_run_overrides(tmp_path / "run", "train.steps=2", "rl.updates_per_rollout=1"))
    from jaxmem.train import run

    run(load_config("configs/tiny.yaml", overrides))
    assert cli.main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    assert cli.main(["merge-lora", "configs/tiny.yaml", *overrides, "--out", str(tmp_path / "merged"),
                     "--peft", str(tmp_path / "adapters"), "--dtype", "float32"]) == 0
    tokens = np.random.default_rng(1).integers(3, 64, (2, 16)).astype(np.int32)
    ours = _run_logits(tmp_path / "run", tokens)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder[0] / "hf", dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapters")
        models = {"export-hf": transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32),
                  "merge-lora": transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                                                  dtype=torch.float32),
                  "peft": adapted}
        for name, model in models.items():
            theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
            assert np.abs(theirs - ours).max() < 1e-4, (name, np.abs(theirs - ours).max())
    assert np.abs(base_logits - ours).max() > 1e-4  # the two GRPO steps moved the adapters


@pytest.mark.slow
def test_explain_reads_the_training_phase(folder, tmp_path, capsys):
    """explain of a grpo config: the training phase's step (the objective's batch, not next-token tokens),
    named as such on its first line and in the JSON, its buffers listed."""
    from jaxmem import cli

    out = tmp_path / "explain.json"
    assert cli.main(["explain", "configs/tiny.yaml", *_overrides(folder), "--top", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("train.objective=grpo: explained is the training phase"), text[:200]
    result = json.loads(out.read_text())
    assert result["program"].startswith("train.objective=grpo: explained is the training phase")
    assert len(result["buffers"]) == 3 and result["peak_live_bytes"] <= result["compiled_device_bytes"]
    assert {b["category"] for b in result["buffers"]} <= {"param", "grad", "optimizer", "activation", "logits", "temp"}


def test_sweep_plans_each_rollout_batch(folder, tmp_path, capsys):
    """sweep of a grpo config (estimated, --no-compile): each point the run's peak, its largest phase named;
    a larger rollout batch holds a larger cache, so a larger peak where the rollout is the largest phase."""
    from jaxmem import cli

    out = tmp_path / "sweep"
    assert cli.main(["sweep", "configs/tiny.yaml", *_overrides(folder, *ROLLOUT_HEAVY), "--grid",
                     "rl.generation_batch=64,8", "--no-compile", "--target", "h100-80g", "--gpus-per-host", "1",
                     "--out", str(out), "--workers", "0"]) == 0
    rows = {r["rl.generation_batch"]: r for r in json.loads((out / "sweep.json").read_text())}
    assert rows["64"]["peak_phase"] == "rollout" and rows["64"]["device_bytes_basis"] == "analytic"
    assert rows["64"]["device_bytes"] > rows["8"]["device_bytes"]
    assert rows["64"]["step_seconds_estimated"] < rows["8"]["step_seconds_estimated"]  # fewer decode loops


# a rollout whose cache outweighs the training step's micro-batch: 64 completions of up to 112 tokens
ROLLOUT_HEAVY = ["rl.prompts_per_step=16", "train.global_batch=64", "train.micro_batch=1", "rl.max_prompt_len=16",
                 "rl.max_completion_len=112", "train.seq_len=128"]


@pytest.mark.slow
def test_tune_picks_a_rollout_batch_that_fits(folder, tmp_path, capsys):
    """tune on a grpo config whose default rollout (all 64 completions at once) does not fit a tight target (a
    usable memory of TIGHT_BYTES) while 32 at a time do: it chooses rl.generation_batch=32, says the 64's
    rollout phase is over the usable memory (compiled deviceless for the target), and prints each phase of the
    winner with how it was obtained. Recomputation is pinned off so the flow compiles few candidates."""
    from jaxmem import cli
    from jaxmem.config.targets import TARGETS

    headroom = 1 - TIGHT_BYTES / TARGETS["h100-80g"].hbm_bytes
    user = [o for o in _overrides(folder, *ROLLOUT_HEAVY) if not o.startswith("train.micro_batch=")]
    out = tmp_path / "tuned.yaml"
    code = cli.main(["tune", "configs/tiny.yaml", *user, *PINNED_REMAT, f"target.headroom={headroom}",
                     "--target", "h100-80g", "--gpus-per-host", "1", "--workers", "0", "--out", str(out),
                     "--json", str(tmp_path / "tune.json"), "--cache", str(tmp_path / "cache")])
    text = capsys.readouterr().out
    print(text)
    assert code == 0, text
    result = json.loads((tmp_path / "tune.json").read_text())
    assert "rl.generation_batch=32" in result["best"]["overrides"]
    assert load_config(out).rl.generation_batch == 32
    rejected = [c for c in result["candidates"] if "rl.generation_batch=64" in c["overrides"]]
    assert rejected and not any(c["fits"] for c in rejected)
    # pruned by its estimate or compiled: either way the path names its rollout phase as what does not fit
    assert all((c["compiled"] or c["analytic"])["peak_phase"] == "rollout" for c in rejected)
    assert "generation_batch=64: does not fit: its rollout phase" in "\n".join(result["path"])
    assert "  rollout phase: generation of 32 completions at a time" in text
    winner = text[text.index("GRPO plan per device"):]
    assert "run peak: " in winner and ": fits in " in winner
    for phase in ("rollout phase: ", "log-prob phase: ", "training phase: "):  # each says how it was obtained
        line = next(line for line in winner.splitlines() if line.startswith("  " + phase))
        assert "(compiled for 1 x h100-80g (deviceless)); " in line and " s per step (estimated)" in line, line


TIGHT_BYTES = 3_500_000  # compiled deviceless for h100-80g: the rollout phase of 64 rows ~5.9 MB, of 32 ~3.0 MB
PINNED_REMAT = ["remat.preset=none", "remat.granularity=layer", "remat.names={}"]  # every recomputing lever undone
