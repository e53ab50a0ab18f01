"""The library surface for your own training script: thin wrappers over what `jaxmem train` runs.

Everything here is the framework's own code, so a loop written from these pieces trains exactly like
`jaxmem train` (docs/library.md shows two complete loops: scripts/train_own_loop.py and
scripts/train_own_optimizer.py).

Shapes: B rows, T = train.seq_len, V = model.vocab_size, A = grad_accum micro-batches per step.

    load_config(path, overrides)       Config from YAML plus "key=value" overrides
    build_program(cfg)                 TrainProgram: mesh, shardings, jaxmem's optimizer, step; allocates nothing
    train_state(prog, params=None)     the train state dict (step, params, opt, ...) on its shardings
    train_step(prog)                   jitted step(state, {"tokens": [A, B, T+1]}) -> (state, metrics)
    batches(cfg, prog)                 iterator of {"tokens": [A, B, T+1]} sharded batches (the config's data)
    Checkpoints, run_meta              orbax save / restore of the train state (resumable by `jaxmem train`)
    place_params(prog, params)         params (nnx.State / nnx.Module / dict) on the program's shardings
    place_tokens(prog, tokens)         int tokens [..., B, T+1] (numpy) as a global array, rows over data axes
    loss_fn(prog)                      loss(params, tokens [..., B, T+1]) -> (mean loss, n_valid)
    optimizer(cfg)                     jaxmem's optax AdamW (warmup + cosine), as the train step uses it
    generate(source, prompts, ...)     completions of prompts by a run's checkpoint or a Hugging Face folder
    generator(source)                  the loaded Generator, to complete many batches without reloading
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.core import offload

from jaxmem.mesh import sharding
from jaxmem.core.checkpoint import Checkpoints
from jaxmem.loader import load_config
from jaxmem.io.data import batches
from jaxmem.optim.choice import make_optimizer
from jaxmem.core.program import TrainProgram, loss_sum_fn
from jaxmem.registry import build_program, run_meta  # with what the config's features record (LoRA: its base)
from jaxmem.config.schema import Config
from jaxmem.cli.generate import open_source
from jaxmem.generation.sampling import Sampling
from jaxmem.generation.text import Generator

__all__ = ["Checkpoints", "TrainProgram", "batches", "build_program", "generate", "generator", "load_config",
           "loss_fn", "optimizer", "place_params", "place_tokens", "run_meta", "train_state", "train_step"]


def _pure_params(params: Any) -> dict:
    """A pure dict of arrays from an nnx.Module, an nnx.State or a (pure) dict."""
    if isinstance(params, nnx.Module):
        params = nnx.split(params)[1]
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if not isinstance(params, dict):
        raise TypeError(f"params: expected an nnx.Module, nnx.State or dict, got {type(params).__name__}")
    return params


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _check_params(params: dict, abstract: dict) -> None:
    got = {_name(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(abstract)}
    for key, shape in want.items():
        if key not in got:
            raise ValueError(f"params: no {key} (this program's model has {len(want)} arrays)")
        if got[key] != shape:
            raise ValueError(f"params: {key} has shape {list(got[key])}, this program's model has {list(shape)}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise ValueError(f"params: {extra[0]} is not a parameter of this program's model")


def place_params(prog: TrainProgram, params: Any) -> dict:
    """The params as a pure dict of global arrays on `prog.state_shardings["params"]`, in the program's
    param dtype (precision.param_dtype).

    `params`: an nnx.Module (e.g. from jaxmem.load_hf or jaxmem.model.init_model), its nnx.State, or a pure
    dict (nnx.to_pure_dict, a restored checkpoint's state["params"], numpy arrays) with the model's shapes:
    embed [V, D], layers.* stacked over the layer axis [L, ...], final_norm [D], ... A wrong key or shape is a
    one-line ValueError. Numpy inputs must be the full global arrays (the same on every process).
    """
    params = _pure_params(params)
    abstract = prog.abstract_state["params"]
    _check_params(params, abstract)
    shardings = prog.state_shardings["params"]
    placed = jax.device_put(params, shardings)
    if all(x.dtype == a.dtype for x, a in zip(jax.tree.leaves(placed), jax.tree.leaves(abstract))):
        return placed
    cast = lambda tree: jax.tree.map(lambda x, a: x.astype(a.dtype), tree, abstract)  # noqa: E731
    return jax.jit(cast, out_shardings=shardings)(placed)  # no donation: `placed` may be the caller's arrays


def train_state(prog: TrainProgram, params: Any = None, seed: int | None = None) -> dict:
    """The train state {"step", "params", "opt", ["master"], ["loss_scale"]} on `prog.state_shardings`:
    freshly initialized from `seed` (default train.seed) when `params` is None, else a step-0 state (new
    optimizer state) around `params` (anything place_params takes)."""
    if params is None:
        return prog.init_state(seed)
    assemble = jax.jit(prog.state_from_params, out_shardings=prog.state_shardings)  # `params` stay valid
    return assemble(place_params(prog, params))


def train_step(prog: TrainProgram) -> Callable:
    """The framework's jitted train step: step(state, {"tokens": int32 [A, B, T+1]}) -> (state, metrics); for
    record data (data.kind jsonl / parquet / hf) the batch is {"inputs", "labels"[, "segment_ids",
    "positions"]}, each int32 [A, B, T] (prog.batch_keys; jaxmem.io.data builds them, docs/data.md).

    It accumulates gradients over the A = train.grad_accum micro-batches, clips, and applies jaxmem's
    optimizer layer by layer. metrics: loss (mean over the step's valid tokens), grad_norm, lr, tokens,
    update_skipped, loss_scale (scalars). `state` is donated: use only the returned one.
    """
    return prog.jit_step()


def place_tokens(prog: TrainProgram, tokens) -> jax.Array:
    """int tokens [..., B, T+1] (numpy, the whole global batch) as a jax.Array with the rows B split over the
    program's data axes (dp, fsdp). B must be a multiple of the data ways. For `train_step`, the batch is
    {"tokens": place_tokens(prog, tokens [A, B, T+1])}."""
    tokens = np.asarray(tokens, np.int32)
    data = sharding.batch_spec(prog.mesh)[0]
    spec = P(*([None] * (tokens.ndim - 2)), data, None)
    return jax.device_put(tokens, NamedSharding(prog.mesh, spec))


def loss_fn(prog: TrainProgram) -> Callable:
    """loss(params, tokens) -> (mean loss, n_valid), differentiable in params; jit it yourself.

    params: the pure dict of place_params (or prog's state["params"]); tokens: int32 [B, T+1] or
    [A, B, T+1] (place_tokens): inputs are tokens[..., :-1], labels tokens[..., 1:]. The mean is the summed
    next-token cross-entropy over the labels that are not IGNORE_INDEX (-100) divided by their count
    n_valid (float32, at least 1). It runs the same function the train step differentiates (the config's
    loss / attention / norm kernels, compute dtype, remat and activation sharding), so on a step's batch it
    equals that step's metrics["loss"]. Params offloaded to the host (offload.params=host) are not supported.
    """
    cfg, prec = prog.cfg, prog.precision
    token_loss = loss_sum_fn(prog)

    def loss(params, tokens):
        params = offload.cast_for_grad(cfg, _pure_params(params), prec.grad_reduce)
        tokens = tokens.reshape(-1, tokens.shape[-1])
        loss_sum, n_valid = token_loss(params, tokens[:, :-1], tokens[:, 1:])
        n_valid = jnp.maximum(n_valid, 1).astype(jnp.float32)
        return loss_sum / n_valid, n_valid

    return loss


def optimizer(cfg: Config) -> optax.GradientTransformation:
    """jaxmem's optax optimizer for `cfg`: AdamW with the optimizer.* settings, warmup + cosine schedule,
    no weight decay on norms and biases, moments in precision.moment_dtype. Gradient clipping
    (optimizer.clip_norm) is not part of it: the train step clips first (prepend
    optax.clip_by_global_norm for the same effect in your own step)."""
    return make_optimizer(cfg)


def generator(source, *, step: int | None = None, dtype: str = "float32") -> Generator:
    """A run's folder (its checkpoint at `step`, default the latest; a LoRA run with its adapters unmerged) or a
    Hugging Face folder, loaded for generation: `.complete(prompts, ...)` as `generate` takes them."""
    return open_source(source, step=step, dtype=dtype)


def generate(source, prompts, *, chat: bool = False, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, cache_dtype: str | None = None,
             step: int | None = None) -> list[str]:
    """Completions of `prompts` (strings; with `chat` strings or lists of {"role", "content"} messages) by
    `source` (a Generator, a run's folder or a Hugging Face folder), as `jaxmem generate` prints them: greedy
    at temperature 0, else sampled with top-p / top-k from `seed`; each stops at its stop token."""
    sampling = Sampling(temperature, top_k, top_p)  # a bad setting: one line, before anything loads
    gen = source if isinstance(source, Generator) else generator(source, step=step)
    return gen.complete(list(prompts), chat=chat, max_new_tokens=max_new_tokens, seed=seed, cache_dtype=cache_dtype,
                        sampling=sampling)
