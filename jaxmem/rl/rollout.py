"""A GRPO rollout with the current weights: each of rl.prompts_per_step prompts repeated rl.group_size times,
completions sampled by the decode loop (jaxmem.generation, through the program's plug-in hooks: a LoRA run
decodes with its adapters unmerged) with a key folded from train.seed and the rollout's index (a resume draws
the same completions), scored by the reward functions on the host, advantages taken within each group; then one
pass of the policy (the old log-probs the importance ratio divides by) and, with rl.beta > 0, of the reference,
both stored in the training batch (jaxmem.rl.objective) so every update on the rollout reuses them."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.config.schema import ConfigError
from jaxmem.core.plugins import FROZEN, REFERENCE_KEY
from jaxmem.core.program import stage_fn
from jaxmem.generation.decoder import Decoder
from jaxmem.generation.loop import generate_fn, left_pad
from jaxmem.generation.sampling import Sampling
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.rl.advantages import group_advantages
from jaxmem.rl.objective import ADVANTAGE, OLD, REFERENCE, abstract_batch
from jaxmem.rl.rewards import score


@dataclasses.dataclass
class Rollout:
    batch: dict  # the training batch: inputs, labels [A, rows, T] int32, REFERENCE_KEY [A, rows, T, 3] float32
    metrics: dict  # reward and completion figures of the rollout
    samples: list  # per completion: prompt record index, completion text, rewards


def training_rows(prompt_ids: list, completions: np.ndarray, lengths: np.ndarray, seq_len: int, pad: int):
    """(inputs [N, T], labels [N, T]): each row a prompt then its completion (its stop token included),
    right-padded; labels (the next token) only on the completion's tokens."""
    n = len(prompt_ids)
    inputs = np.full((n, seq_len), pad, np.int32)
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int32)
    for row, (prompt, completion, length) in enumerate(zip(prompt_ids, completions, lengths)):
        seq = np.concatenate([np.asarray(prompt, np.int32), completion[:length]])[:seq_len + 1]
        inputs[row, :len(seq) - 1] = seq[:-1]
        start = len(prompt) - 1
        labels[row, start:len(seq) - 1] = seq[len(prompt):]
    return inputs, labels


def on_mesh(x: np.ndarray, sharding) -> jax.Array:
    """A host array that every process holds whole, as one global array laid out by `sharding` (with several
    processes, each places the pieces its own devices hold)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def whole(x: jax.Array) -> np.ndarray:
    """A global array whole on this host: fetched, or gathered from every process where it spans several."""
    if not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def logprob_fns(prog):
    """(policy, reference), each jitted fn(params, frozen, inputs [B, T], labels [B, T]) -> the per-token
    log-probs of the labels [B, T] under the sampling temperature (rl.temperature, as TRL takes them): the current
    policy's, and the reference's on the plug-in's reference_inputs (the LoRA base with the adapters off, or a
    full fine-tune's frozen copy)."""
    logprob_fn = stage_fn(prog, logprobs=True, temperature=prog.cfg.rl.temperature)  # the sampling's, as the loss's

    def reference(params, frozen, inputs, labels):
        ref_params, ref_frozen = prog.plugin.reference_inputs(params, frozen)
        return logprob_fn(ref_params, inputs, labels, base=ref_frozen)

    return jax.jit(lambda p, f, x, y: logprob_fn(p, x, y, base=f)), jax.jit(reference)


class Rollouts:
    """collect(state, rollout) -> Rollout for a TrainProgram `prog` of a grpo config."""

    def __init__(self, prog, codec, prompts, rewards):
        cfg, rl = prog.cfg, prog.cfg.rl
        self.prog, self.codec, self.prompts, self.rewards = prog, codec, prompts, rewards
        self.n = rl.completions
        if self.n != prog.grad_accum * prog.rows:
            raise ConfigError(f"train.global_batch: a rollout trains on rl.prompts_per_step x rl.group_size = "
                              f"{self.n} completions; set train.global_batch={self.n} (now "
                              f"{prog.grad_accum * prog.rows})")
        sampling = Sampling(temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p)
        cache_dtype = None if cfg.generate.cache_dtype == "auto" else cfg.generate.cache_dtype
        self.generate = jax.jit(generate_fn(Decoder.from_program(prog), max_new=rl.max_completion_len,
                                            sampling=sampling, stop_ids=codec.stop_ids, pad_id=codec.pad_id,
                                            cache_dtype=cache_dtype))
        self.chunk = rl.rollout_rows
        self.replicated = NamedSharding(prog.mesh, P())  # the rollout's host rows, whole on every device
        self.policy_logprobs, self.reference_logprobs = logprob_fns(prog)

    def key(self, rollout: int):
        return jax.random.fold_in(jax.random.key(self.prog.cfg.train.seed), rollout)

    def collect(self, state: dict, rollout: int) -> Rollout:
        cfg, rl = self.prog.cfg, self.prog.cfg.rl
        chosen = self.prompts.at_rollout(rollout, rl.prompts_per_step, cfg.train.seed)
        rows = np.repeat(chosen, rl.group_size)
        prompt_ids = [self.prompts.ids[i] for i in rows]
        tokens, starts = left_pad(prompt_ids, rl.max_prompt_len, self.codec.pad_id)
        weights = (state["params"], state.get(FROZEN))
        completions, lengths = self._decode(weights, tokens, starts, self.key(rollout))
        texts = [self.codec.decode(c[:n].tolist()) for c, n in zip(completions, lengths)]
        records = [self.prompts.records[i] for i in rows]
        prompts = [r.get("prompt", r.get("messages")) for r in records]
        per_function = score(self.rewards, prompts, texts, records)
        advantages, total, no_signal = group_advantages(per_function, [r.weight for r in self.rewards],
                                                        rl.group_size)
        inputs, labels = training_rows(prompt_ids, completions, lengths, cfg.train.seq_len, self.codec.pad_id)
        stored = self._stored(state, inputs, labels, advantages)
        shape = (self.prog.grad_accum, self.prog.rows)
        host = {"inputs": inputs.reshape(shape + inputs.shape[1:]), "labels": labels.reshape(shape + labels.shape[1:]),
                REFERENCE_KEY: stored.reshape(shape + stored.shape[1:])}
        layout = abstract_batch(self.prog)
        batch = {key: on_mesh(value, layout[key].sharding) for key, value in host.items()}
        metrics = self._metrics(per_function, total, lengths, completions, no_signal)
        samples = [{"record": int(i), "prompt": p, "completion": t, "rewards": dict(zip(
            [r.name for r in self.rewards], map(float, f))), "advantage": float(a)}
            for i, p, t, f, a in zip(rows, prompts, texts, per_function, advantages)]
        return Rollout(batch, metrics, samples)

    def _decode(self, weights, tokens, starts, key):
        """(tokens [N, max_completion_len], lengths [N]): chunks of rl.generation_batch rows, chunk c drawing with
        fold_in(key, c) (one chunk: the key itself)."""
        outs = []
        for c, lo in enumerate(range(0, self.n, self.chunk)):
            chunk_key = key if self.chunk == self.n else jax.random.fold_in(key, c)
            rows = (on_mesh(a[lo:lo + self.chunk], self.replicated) for a in (tokens, starts))
            out = self.generate(weights, *rows, chunk_key)
            outs.append((whole(out.tokens), whole(out.lengths)))
        return np.concatenate([t for t, _ in outs]), np.concatenate([n for _, n in outs])

    def _stored(self, state, inputs, labels, advantages):
        """[N, T, 3] float32: the old policy's log-probs, the reference's (0 with rl.beta 0), the advantage."""
        params, frozen = state["params"], state.get(FROZEN)
        stored = np.zeros(inputs.shape + (3,), np.float32)
        stored[..., ADVANTAGE] = advantages[:, None]
        step = self.prog.rows
        for lo in range(0, len(inputs), step):
            x, y = (on_mesh(a[lo:lo + step], self.replicated) for a in (inputs, labels))
            stored[lo:lo + step, :, OLD] = whole(self.policy_logprobs(params, frozen, x, y))
            if self.prog.cfg.rl.beta > 0:
                stored[lo:lo + step, :, REFERENCE] = whole(self.reference_logprobs(params, frozen, x, y))
        return stored

    def _metrics(self, per_function, total, lengths, completions, no_signal) -> dict:
        """TRL's names; standard deviations with Bessel's correction, as TRL takes them."""
        stopped = np.isin(completions, np.asarray(self.codec.stop_ids or (-1,))).any(axis=1)
        metrics = {"reward": float(total.mean()), "reward_std": float(total.std(ddof=1)),
                   "frac_reward_zero_std": no_signal, "completions/mean_length": float(lengths.mean()),
                   "completions/min_length": float(lengths.min()), "completions/max_length": float(lengths.max()),
                   "completions/clipped_ratio": float(1.0 - stopped.mean())}
        for j, reward in enumerate(self.rewards):
            metrics[f"rewards/{reward.name}/mean"] = float(per_function[:, j].mean())
            metrics[f"rewards/{reward.name}/std"] = float(per_function[:, j].std(ddof=1))
        return metrics


def jit_train_step(prog):
    """The program's objective step jitted for a rollout's batch (jaxmem.rl.objective.abstract_batch)."""
    return prog.jit_step()
