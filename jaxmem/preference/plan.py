"""The plan's preference section (jaxmem.core.plugins.Feature.plan_section): with preference.reference=precompute,
the pass over the pairs before training that stores the reference log-probs (jaxmem.preference.precompute):
its time, estimated from the cost model's step (a forward's share of the step's FLOPs, per token, times the
pass's tokens), and the bytes it writes to the run folder."""
from __future__ import annotations

from pathlib import Path

from jaxmem.config.preference import resolved_reference
from jaxmem.config.schema import Config

NPY_HEADER = 128  # numpy's .npy header for a small 2-d fp32 array
CHECK_BYTES = 256  # reference_logps.json: a checksum, the identity hash and the count


def records_in(cfg: Config) -> int | None:
    """The records of data.path without tokenizing them (jsonl: its non-empty lines; parquet: its metadata), an
    upper bound on the pairs (skipped records drop out); None where unknown (a save_to_disk folder, no file)."""
    path = Path(cfg.data.path)
    try:
        if cfg.data.kind == "jsonl" and path.is_file():
            with path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        if cfg.data.kind == "parquet" and path.is_file():
            import pyarrow.parquet as pq  # lazy: only a parquet plan reads its metadata

            return pq.ParquetFile(path).metadata.num_rows
    except OSError:
        return None
    return None


def forward_seconds_per_token(cost, frozen_model: bool) -> float:
    """A forward's time per token: the step's compute time times a forward's share of its FLOPs (2 of the 6 per
    weight and token of a full fine-tune, 2 of 4 with a frozen model), over the step's tokens."""
    if not cost.compute_seconds or not cost.tokens_per_step:
        return 0.0
    share = (2.0 / (4.0 if frozen_model else 6.0)) * cost.model_flops / cost.hardware_flops
    return cost.compute_seconds * share / cost.tokens_per_step


def precompute_section(cfg: Config, bill, cost) -> dict | None:
    if resolved_reference(cfg) != "precompute":
        return None
    pairs = records_in(cfg)
    per_pair = forward_seconds_per_token(cost, bill.layout.freezes_model) * 2 * cfg.train.seq_len
    out = {"label": "estimated (cost model)", "pairs": pairs, "pairs_from": "the records of data.path (an upper "
           "bound: skipped records drop out)" if pairs is not None else "unknown (data.path not countable here)",
           "seconds_per_pair": per_pair, "bytes_per_pair": 8}
    out["seconds"] = per_pair * pairs if pairs is not None else None
    out["disk_bytes"] = NPY_HEADER + 8 * pairs + CHECK_BYTES if pairs is not None else None
    return out


def render(plan: dict, console) -> None:
    p = plan.get("preference")
    if not p:
        return
    if not p["seconds_per_pair"]:
        time = "no time without a GPU target (--target)"
    elif p["seconds"] is not None:
        time = f"{p['seconds']:.3g} s for {p['pairs']:,} pairs ({p['pairs_from']})"
    else:
        time = f"{p['seconds_per_pair'] * 1000:.3g} s per 1,000 pairs ({p['pairs_from']})"
    disk = f"{p['disk_bytes']:,} bytes" if p["disk_bytes"] is not None else "8 bytes a pair"
    console.print(f"preference.reference=precompute: one forward pass over the pairs before training, {time}, "
                  f"{p['label']}; stored log-probs on disk: {disk} (reference_logps.npy + .json)", highlight=False)
