"""preference.reference=precompute: one pass over every pair with the run's initial weights before training writes
each pair's reference log-probs (the sums over the chosen and the rejected completion's tokens, [pairs, 2] fp32)
into the run folder, with a sha256 of the values and what decided them; a run (a resume too) that finds a file
whose checksum and identity match reuses it. The batches then carry each sequence's sum (jaxmem.io.data.REFERENCE_KEY,
at the sequence's first position: a row's, or a packed segment's), so no reference weights exist during
training. Packed pairs are computed in their packed rows (the forward training runs); the stored values are per
pair either way.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxmem.config.schema import Config, ConfigError, to_dict
from jaxmem.core.plugins import FROZEN
from jaxmem.core.program import stage_fn
from jaxmem.io.data import REFERENCE_KEY, RecordSource, batch_keys
from jaxmem.io.documents.pair_packing import PackedPairRows
from jaxmem.mesh import sharding
from jaxmem.preference.objective import segment_sums

VALUES_FILE, CHECK_FILE = "reference_logps.npy", "reference_logps.json"


def identity(cfg: Config, pairs: int) -> str:
    """What decides the stored values: the data, the model and where its initial weights come from."""
    d = to_dict(cfg)
    decided = {"data": d["data"], "model": d["model"], "init_from": cfg.checkpoint.init_from, "seed": cfg.train.seed,
               "seq_len": cfg.train.seq_len, "lora": d["lora"], "precision": d["precision"], "pairs": pairs}
    return hashlib.sha256(json.dumps(decided, sort_keys=True, default=str).encode()).hexdigest()


def _stored(out_dir: Path, want: str) -> np.ndarray | None:
    """The stored values when their checksum and identity match, else None."""
    try:
        check = json.loads((out_dir / CHECK_FILE).read_text())
        raw = (out_dir / VALUES_FILE).read_bytes()
    except (OSError, ValueError):
        return None
    if check.get("identity") != want or check.get("sha256") != hashlib.sha256(raw).hexdigest():
        return None
    return np.load(out_dir / VALUES_FILE)


def _store(out_dir: Path, values: np.ndarray, ident: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (VALUES_FILE + ".tmp")
    with tmp.open("wb") as f:
        np.save(f, values)
    raw = tmp.read_bytes()
    tmp.replace(out_dir / VALUES_FILE)
    (out_dir / CHECK_FILE).write_text(json.dumps({"sha256": hashlib.sha256(raw).hexdigest(), "identity": ident,
                                                  "pairs": len(values)}) + "\n")


def _sums_fn(prog, keys: tuple, summed):
    """fn(params, frozen, host batch) -> numpy: `summed(per-token log-probs [B, T], the batch's arrays under
    `keys`)` of one global micro-batch, through the training forward (jitted once)."""
    if jax.process_count() > 1:
        raise ConfigError("preference.reference: precompute runs in one process; use model (or base with LoRA)")
    forward = stage_fn(prog, logprobs=True)
    shard = NamedSharding(prog.mesh, sharding.batch_spec(prog.mesh))
    sums = jax.jit(lambda p, f, *batch: summed(forward(p, *batch, base=f), batch), out_shardings=None)
    return lambda params, frozen, batch: np.asarray(sums(params, frozen, *(jax.device_put(batch[k], shard)
                                                                           for k in keys)))


def reference_sums(prog, params, frozen, rows) -> np.ndarray:
    """[pairs, 2] fp32: each pair's completion log-prob sums (chosen, rejected) under `params`, a global
    micro-batch of pairs at a time (the last one padded with pair 0)."""
    sums = _sums_fn(prog, ("inputs", "labels"), lambda logps, batch: jnp.sum(logps, axis=-1))
    per_batch = prog.rows // 2
    n = len(rows.pairs)
    out = np.zeros((n, 2), np.float32)
    with prog.lowering():
        for start in range(0, n, per_batch):
            ids = np.arange(start, start + per_batch) % n  # the last batch repeats the first pairs
            got = sums(params, frozen, rows.pair_rows(ids)).reshape(-1, 2)
            keep = min(per_batch, n - start)
            out[start:start + keep] = got[:keep]
    return out


def packed_reference_sums(prog, params, frozen, rows) -> np.ndarray:
    """reference_sums of packed rows (jaxmem.io.documents.pair_packing): the packed rows in their pack order, a
    global micro-batch of rows at a time (the last one padded with row 0), each segment's sum read back to its
    pair and side; the same forward (segments masked, positions restarting) as training's."""
    sums = _sums_fn(prog, ("inputs", "labels", "segment_ids", "positions"),
                    lambda logps, batch: segment_sums(logps, batch[2]))
    out = np.zeros((len(rows.pairs), 2), np.float32)
    with prog.lowering():
        for start in range(0, rows.n_rows, prog.rows):
            ids = np.arange(start, start + prog.rows) % rows.n_rows
            got = sums(params, frozen, rows.packed_rows(ids))
            for i in range(min(prog.rows, rows.n_rows - start)):
                for j, k in enumerate(rows.row_pairs(int(ids[i]))):
                    out[k] = got[i, 2 * j:2 * j + 2]
    return out


def prepare_source(cfg: Config, prog, state, source: RecordSource, resumed: bool) -> RecordSource:
    """The pairs with their stored reference sums: reused from the run folder, else computed now from the initial
    weights (`state` on a fresh run; on a resume without the file, the initial weights rebuilt)."""
    rows = source.rows
    out_dir, ident = Path(cfg.out_dir), identity(cfg, len(rows.pairs))
    values = _stored(out_dir, ident)
    if values is None:
        if resumed:  # the state has trained: the reference is the initial weights, rebuilt
            state = prog.init_from(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else prog.init_state()
        print(f"jaxmem train: preference.reference=precompute: one pass over {len(rows.pairs)} pairs with the "
              f"initial weights, stored in {out_dir / VALUES_FILE}", file=sys.stderr, flush=True)
        pass_over = packed_reference_sums if isinstance(rows, PackedPairRows) else reference_sums
        values = pass_over(prog, state["params"], state.get(FROZEN), rows)
        _store(out_dir, values, ident)
    else:
        print(f"jaxmem train: reusing the reference log-probs of {out_dir / VALUES_FILE} (checksum verified)",
              file=sys.stderr, flush=True)
    rows.reference = values
    return RecordSource(rows, batch_keys(cfg))
