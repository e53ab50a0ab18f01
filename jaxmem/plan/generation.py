"""The plan of generation (the `generate:` section): the key/value cache's bytes per device and the compiled
generation program's device peak (the prefill and the decode loop, one program over the run's weights)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxmem.config.schema import Config, ConfigError
from jaxmem.registry import build_program
from jaxmem.generation.buckets import batch_bucket, bucket
from jaxmem.generation.decoder import Decoder
from jaxmem.generation.loop import generate_fn
from jaxmem.model import kv_cache
from jaxmem.runtime.aot import Topology
from jaxmem.runtime.compiled_memory import captured_stderr, device_bytes, read_fields

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def check(cfg: Config) -> None:
    """One-line errors for a generate: section a plan cannot size."""
    g = cfg.generate
    if g.batch and cfg.parallel.pp > 1:
        raise ConfigError("generate.batch: planning generation over pipeline stages (parallel.pp > 1) is not "
                          "supported yet; plan it with parallel.pp=1 (a run's folder decodes on one program)")
    for key, value, low in (("batch", g.batch, 0), ("prompt_len", g.prompt_len, 1),
                            ("max_new_tokens", g.max_new_tokens, 1)):
        if value < low:
            raise ConfigError(f"generate.{key}: {value} must be >= {low}")


def cache_dtype(cfg: Config) -> str:
    return cfg.precision.compute_dtype if cfg.generate.cache_dtype == "auto" else cfg.generate.cache_dtype


def shapes(cfg: Config) -> tuple[int, int, int]:
    """(rows, prompt bucket, new-token bucket) the program is compiled for."""
    g = cfg.generate
    return g.batch, bucket(g.prompt_len), bucket(g.max_new_tokens)


def cache_bytes(cfg: Config, batch_ways: int = 1, head_ways: int = 1, rows: int | None = None) -> int:
    """Bytes of the key/value cache per device (analytic): per layer kind 2 x L x B x C x K x H x itemsize (+ the
    int8 scales, 4 bytes per token and head), `rows` (default generate.batch) split over `batch_ways`, kv heads
    over `head_ways`."""
    m = cfg.model
    batch, prompt, new = shapes(cfg)
    rows = batch if rows is None else rows
    dtype = cache_dtype(cfg)
    per_slot = m.head_dim * _ITEMSIZE[dtype] + (4 if dtype == "int8" else 0)
    rows_here = -(-rows // batch_ways)
    heads_here = -(-m.n_kv_heads // head_ways)
    total = 0
    for kind, layers in kv_cache.kinds(m).items():
        total += 2 * layers * rows_here * kv_cache.capacities(m, prompt + new)[kind] * heads_here * per_slot
    return total


def plan_generation(cfg: Config, topo: Topology, compile: bool = True, bucket_rows: bool = True) -> dict:
    """{"cache_bytes": analytic per device, "device_peak": the compiled program's (None without compile),
    "label": how the peak was obtained, and the shapes}; `bucket_rows`: generate.batch padded to its bucket as
    `jaxmem generate` pads a batch (a GRPO rollout decodes its chunks as they are: False)."""
    check(cfg)
    rows, prompt, new = shapes(cfg)
    out = {"batch": rows, "prompt_bucket": prompt, "new_bucket": new, "cache_dtype": cache_dtype(cfg),
           "device_peak": None, "label": "estimated"}
    start = time.perf_counter()
    with captured_stderr():
        prog = build_program(cfg, devices=list(topo.devices()))
    sizes = prog.layout.mesh_sizes
    if bucket_rows:
        rows = out["batch"] = batch_bucket(rows, prog.layout.data_ways)
    out["cache_bytes"] = cache_bytes(cfg, prog.layout.data_ways, sizes.get("tp", 1), rows)
    if not compile:
        return out
    if rows % prog.layout.data_ways:
        raise ConfigError(f"generate.batch: {rows} rows do not split over the mesh's {prog.layout.data_ways} data "
                          "ways; use a multiple")
    fn = generate_fn(Decoder.from_program(prog), max_new=new, cache_dtype=out["cache_dtype"])
    weights = (prog.abstract_state["params"], prog.abstract_state.get("base"))
    prompts = jax.ShapeDtypeStruct((rows, prompt), jnp.int32)
    starts = jax.ShapeDtypeStruct((rows,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    with captured_stderr(), prog.lowering():
        compiled = jax.jit(fn).lower(weights, prompts, starts, key).compile()
    fields = read_fields(compiled)
    where = f"{topo.label} (deviceless)" if topo.name else f"{topo.label} (attached devices)"
    out.update(device_peak=device_bytes(fields), fields=fields, label=f"compiled for {where}",
               compile_seconds=round(time.perf_counter() - start, 2))
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def render_lines(result: dict) -> list[str]:
    lines = [f"generation: {result['batch']} prompts of up to {result['prompt_bucket']} tokens + "
             f"{result['new_bucket']} new (buckets), {result['cache_dtype']} KV cache "
             f"{_size(result['cache_bytes'])} per device (analytic)"]
    if result["device_peak"] is not None:
        lines.append(f"generation program (prefill + decode loop) peak {_size(result['device_peak'])} per "
                     f"device ({result['label']})")
    return lines
