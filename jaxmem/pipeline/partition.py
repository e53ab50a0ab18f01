"""Which layers and end params each pipeline stage holds, and moving params-shaped trees and train states
between the whole model's layout and the stages' (checkpoints, init_from, HF import/export)."""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxmem.config.schema import Config, ConfigError


def even_counts(n_layers: int, pp: int) -> tuple[int, ...]:
    """As equal as possible; the extra layers go to the middle-to-last stages (the first stage holds the
    embedding and, under 1F1B, the most micro-batches in flight)."""
    base, extra = divmod(n_layers, pp)
    return tuple(base + (1 if s >= pp - extra else 0) for s in range(pp))


def parse_counts(value) -> tuple[int, ...] | str:
    """parallel.pp_layers as written: "even", "auto", a comma-separated string or a list of counts."""
    if isinstance(value, str) and value.strip() in ("even", "auto"):
        return value.strip()
    items = value.split(",") if isinstance(value, str) else value
    try:
        return tuple(int(str(x).strip()) for x in items)
    except (TypeError, ValueError):
        raise ConfigError(f"parallel.pp_layers: {value!r} is not even, auto or a list of layer counts") from None


def layer_counts(cfg: Config) -> tuple[int, ...] | None:
    """Layers per stage; None for `auto` (the balancer decides: jaxmem.pipeline.balance)."""
    pp, n_layers = cfg.parallel.pp, cfg.model.n_layers
    counts = parse_counts(cfg.parallel.pp_layers)
    if counts == "auto":
        return None
    if counts == "even":
        if n_layers < pp:
            raise ConfigError(f"parallel.pp: {pp} stages need at least one layer each; model.n_layers={n_layers}")
        return even_counts(n_layers, pp)
    check_counts(counts, pp, n_layers)
    return counts


def check_counts(counts: Sequence[int], pp: int, n_layers: int) -> None:
    if len(counts) != pp or min(counts) < 1 or sum(counts) != n_layers:
        raise ConfigError(f"parallel.pp_layers: {list(counts)} must be {pp} counts >= 1 that sum to "
                          f"model.n_layers={n_layers}")


def stage_keys(cfg: Config, stage: int) -> tuple[str, ...]:
    """Top-level params of a stage: the layers; the embedding on the first; the final norm and the LM head on
    the last (with tied embeddings the last stage holds its own copy of the embedding; their gradients are
    summed and both copies take the same update)."""
    last = stage == cfg.parallel.pp - 1
    keys = ["layers"]
    if stage == 0 or (last and cfg.model.tie_embeddings):
        keys.append("embed")
    if last:
        keys += ["final_norm"] + ([] if cfg.model.tie_embeddings else ["lm_head"])
    return tuple(keys)


def stage_params(cfg: Config, params: dict, counts: Sequence[int], stage: int) -> dict:
    """A stage's cut of a whole-model params tree (arrays or ShapeDtypeStructs): its top-level params and
    its slice of the layer stack."""
    lo, hi = bounds(counts)[stage]
    cut = {k: v for k, v in params.items() if k in stage_keys(cfg, stage)}

    def rows(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((hi - lo, *x.shape[1:]), x.dtype)
        return x[lo:hi]

    cut["layers"] = jax.tree.map(rows, params["layers"])
    return cut


def bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(counts)
    return [(int(e - c), int(e)) for c, e in zip(counts, ends)]


# ---------------------------------------------------------------- moving trees between layouts
# A train state's leaves are addressed by path. Under a "layers" key every array has the layer axis first;
# a stage holds the slice [start, end) of it. Leaves elsewhere (end params, Adam's count, the step) are
# whole in every stage that holds them.


def _path_key(path) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _is_layer_leaf(key: tuple, leaf) -> bool:
    return "layers" in key and np.ndim(leaf) >= 1


def split_tree(whole, stage_templates: Sequence, counts: Sequence[int], take=lambda x, lo, hi: x[lo:hi]) -> list:
    """The stages' trees (shaped like `stage_templates`) cut from a whole-model tree (host arrays)."""
    source = {_path_key(p): x for p, x in jax.tree_util.tree_leaves_with_path(whole)}
    out = []
    for template, (lo, hi) in zip(stage_templates, bounds(counts)):
        def pick(path, t):
            key = _path_key(path)
            if key not in source:
                raise ConfigError(f"{'/'.join(key)}: not in the source state")
            x = source[key]
            return take(x, lo, hi) if _is_layer_leaf(key, t) else x
        out.append(jax.tree_util.tree_map_with_path(pick, template))
    return out


def merge_tree(stages: Sequence, whole_template) -> object:
    """The whole-model tree (shaped like `whole_template`) from the stages' trees (host arrays): layer leaves
    concatenated in stage order, the rest from the first stage that holds them."""
    leaves = [{_path_key(p): x for p, x in jax.tree_util.tree_leaves_with_path(t)} for t in stages]

    def pick(path, t):
        key = _path_key(path)
        held = [d[key] for d in leaves if key in d]
        if not held:
            raise ConfigError(f"{'/'.join(key)}: no stage holds it")
        return np.concatenate([np.asarray(x) for x in held]) if _is_layer_leaf(key, t) else held[0]

    return jax.tree_util.tree_map_with_path(pick, whole_template)
