"""A Hugging Face folder checked against itself before any tensor is read: config.json's model against the
safetensors shards (every tensor it implies present with its shape and a float dtype, no tensor left unused).

`config.json` decides the model's shape; shards of another size or depth (a `num_hidden_layers: 2` over
4-layer weights) would otherwise load the part that fits and train a silently different model.
"""
from __future__ import annotations

import re
from pathlib import Path

from jaxmem.config.schema import ConfigError
from jaxmem.io.hf_safetensors import FLOAT_DTYPES
from jaxmem.io.hf_tensors import ParamMap, hf_shape

SHOWN = 3  # mismatches named in the error line; the rest are counted
# Tensors a checkpoint may hold that are no parameter: RoPE frequency buffers older exports saved per layer.
_BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _leaf_shape(abstract: dict, path: tuple[str, ...]) -> tuple[int, ...]:
    for key in path:
        abstract = abstract[key]
    return tuple(abstract.shape)


def _expected(maps: list[ParamMap], abstract: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape config.json implies, for every tensor the model reads."""
    out = {}
    for pm in maps:
        shape = _leaf_shape(abstract, pm.path)
        for name in map(pm.name_at, pm.keys(shape)):
            out[name] = hf_shape(pm.kind, shape[pm.lead:])
    return out


def _unused(reader, expected: dict, tied: bool) -> list[str]:
    """Tensors of the shards the model does not read (a tied model's stored lm_head.weight is ignored, as
    transformers ignores it)."""
    return [name for name in reader.names() if name not in expected and not _BUFFERS.search(name)
            and not (tied and name == "lm_head.weight")]


def _natural(name: str) -> list:
    """'model.layers.10.x' after 'model.layers.9.x': layer numbers compared as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _problems(reader, expected: dict[str, tuple[int, ...]]) -> list[str]:
    problems = []
    for name in sorted(expected, key=_natural):  # layer by layer, the first layers' first
        shape = expected[name]
        if name not in reader:
            problems.append(f"tensor {name} is missing")
        elif tuple(reader.shape(name)) != shape:
            problems.append(f"tensor {name} has shape {list(reader.shape(name))}, config.json implies {list(shape)} "
                            f"({reader.file_of(name)})")
        elif reader.dtype(name) not in FLOAT_DTYPES:
            problems.append(f"tensor {name} has dtype {reader.dtype(name)}; weights must be one of "
                            f"{', '.join(FLOAT_DTYPES)} ({reader.file_of(name)})")
    return problems


def check_tensors(reader, maps: list[ParamMap], abstract: dict, where: Path, tied: bool = False) -> None:
    """One ConfigError line naming the first mismatches between config.json's model and the shards in `where`:
    tensors missing, of another shape or dtype, or present but unused (shards of a bigger model)."""
    expected = _expected(maps, abstract)
    problems = _problems(reader, expected)
    unused = _unused(reader, expected, tied)
    if unused:
        problems.append(f"{len(unused)} tensor{'s' if len(unused) > 1 else ''} config.json does not use "
                        f"({', '.join(sorted(unused, key=_natural)[:SHOWN])}{', ...' if len(unused) > SHOWN else ''})")
    if not problems:
        return
    more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    raise ConfigError(f"{where}: config.json does not match the safetensors shards: "
                      f"{'; '.join(problems[:SHOWN])}{more}")
