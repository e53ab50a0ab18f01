"""What `jaxmem tune` writes of its search (jaxmem.cli.tune): the table of compiled candidates, the JSON record,
the winner's config file and phases, the Pareto plot, and `--verify`'s bench of the winner."""
from __future__ import annotations

import json
from pathlib import Path

from jaxmem.cli.bench import bench
from jaxmem.cli.sweep import plot_pareto
from jaxmem.config.schema import to_dict


def phase_lines(tuner: Tuner, best: Candidate) -> list[str]:
    """The winner's own summary where its plan is a run of several programs (GRPO: each phase, what it holds and
    how that was obtained), read back from the plan cache; [] for one program."""
    cached = tuner.cache_dir / f"{best.row.get('hash')}.json"
    return json.loads(cached.read_text()).get("lines", []) if cached.is_file() else []


def _gib(x) -> str:
    return f"{x / 2**30:,.2f}" if x is not None else "-"


LINE = 120  # the most characters a candidate's line takes


def table(tuner: Tuner) -> list[str]:
    """One line per compiled candidate (at most LINE characters): device and host GiB per GPU (compiled for the
    target), fits, tokens/s (estimated), levers (cut short with ... where longer; --json has them whole)."""
    lines = [f"{'device':>8} {'host':>7} {'fits':>4} {'tok/s':>11}  levers (GiB per GPU compiled for the target; "
             "tok/s estimated)"]
    for c in tuner.candidates:
        if c.row is None or c.row.get("status") == "failed":
            continue
        line = (f"{_gib(c.row['device_bytes']):>8} {_gib(c.row['host_bytes']):>7} {'yes' if c.fits() else 'no':>4} "
                f"{c.tokens_per_second():>11,.0f}  {c.label}")
        lines.append(line if len(line) <= LINE else line[:LINE - 3] + "...")
    return lines


def to_json(tuner: Tuner, best: Candidate | None, optimizer_note: str) -> dict:
    return {"config": tuner.config, "overrides": tuner.user, "target": tuner.topo.label,
            "global_batch": tuner.global_batch, "path": tuner.path, "lossy_optimizer": tuner.allow_lossy,
            "optimizer_note": optimizer_note,
            "best": None if best is None else {"overrides": best.overrides, "row": best.row,
                                               "tokens_per_second_estimated": best.tokens_per_second()},
            "candidates": [{"overrides": c.overrides, "stage": c.stage, "analytic": c.analytic, "compiled": c.row,
                            "fits": c.fits()} for c in tuner.candidates],
            "labels": {"device_bytes": "compiled for target (deviceless)", "analytic": "estimated (analytic)",
                       "tokens_per_second": "estimated (cost model)"}}


def write_yaml(tuner: Tuner, best: Candidate, path: Path) -> None:
    import yaml

    cfg = tuner._load(best.overrides)
    head = [f"# written by jaxmem tune from {tuner.config} for {tuner.topo.label}",
            f"# levers: {best.label}",
            f"# device {_gib(best.row['device_bytes'])} GiB per GPU, host {_gib(best.row['host_bytes'])} GiB per GPU "
            "(compiled for target, deviceless); "
            f"{best.tokens_per_second():,.0f} tokens/s (estimated by the cost model)"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False))


def plot(tuner: Tuner, best: Candidate | None, path: Path) -> None:
    rows = []
    for c in tuner.candidates:
        if c.row is not None and c.row.get("status") != "failed":
            rows.append({**c.row, "point": c.label, "best": c is best,
                         "fits": c.fits() if c.row["fits"] is not None else None})
    if rows:
        plot_pareto(rows, path)


def verify(tuner: Tuner, best: Candidate, steps: int = 6) -> dict:
    """`jaxmem bench` on the attached devices with the winner: planned vs measured."""
    r = bench(tuner._load(best.overrides), steps=steps, warmup=2, source=tuner.config,
              overrides=tuple(tuner.user + best.overrides))
    mem, st = r["memory"], r["step_time"]
    return {"planned_device_bytes": best.row["device_bytes"], "planned_label": "compiled for target (deviceless)",
            "compiled_here_bytes": mem["planned_device_bytes"]["value"],
            "measured_peak_bytes": mem["measured_peak_bytes"]["value"],
            "measured_label": mem["measured_peak_bytes"]["label"],
            "estimated_step_seconds": best.row["step_seconds_estimated"],
            "measured_step_seconds": st["measured_seconds"]["value"]}
