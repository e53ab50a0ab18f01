"""The memory timeline as a PNG (matplotlib): `jaxmem explain --plot`, for terminals and papers. Device bytes
stacked by category over the schedule, the step's parts shaded above, the device peak marked, and the
pinned-host pool as a second lane; with two timelines, two columns on the same y scale."""
from __future__ import annotations

from pathlib import Path

from jaxmem.plan.timeline import CATEGORIES
from jaxmem.plan.timeline_html import COLORS

_PHASE_COLORS = {"forward layers": "#dbe8f5", "forward": "#eaf1f8", "loss": "#fbeccd", "backward layers": "#f6dcdc",
                 "backward": "#f9ebeb", "update": "#e3d9ec", "grad accumulation": "#e2efe0", "start": "#f0f0f0"}


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return scale, name
    return 1, "B"


def _columns(total: list[int], columns: int) -> list[int]:
    """One schedule position per column: the one with the largest total (so the peak is drawn at its height)."""
    n = len(total)
    if n <= columns:
        return list(range(n))
    edges = [i * n // columns for i in range(columns + 1)]
    return [max(range(a, b), key=lambda t: (total[t], -t)) for a, b in zip(edges, edges[1:]) if b > a]


def _lane(ax, timeline: dict, pool: str, ymax: float, scale: float, unit: str) -> None:
    series = timeline[pool]["by_category"]
    xs = _columns(timeline[pool]["total"], 1200)
    ys = [[series[c][t] / scale for t in xs] for c in CATEGORIES]
    ax.stackplot(xs, ys, labels=list(CATEGORIES), colors=[COLORS[c] for c in CATEGORIES], step="mid",
                 linewidth=0)
    ax.set_ylim(0, ymax / scale)
    ax.set_xlim(0, timeline["positions"])
    ax.set_ylabel(f"{'device' if pool == 'device' else 'pinned host'} ({unit})", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(axis="y", color="0.9", linewidth=0.6)


def plot_timelines(timelines: list[dict], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device_max = max(max(t["device"]["total"], default=0) for t in timelines) * 1.06 or 1
    host_max = max(max(t["host"]["total"], default=0) for t in timelines) * 1.06
    scale, unit = _unit(device_max)
    hscale, hunit = _unit(host_max or 1)
    rows = 2 if host_max else 1
    fig, axes = plt.subplots(rows, len(timelines), figsize=(6.2 * len(timelines) + 1.4, 3.4 + 1.5 * (rows - 1)),
                             squeeze=False, sharex="col", gridspec_kw={"height_ratios": [3, 1][:rows]})
    for col, tl in enumerate(timelines):
        ax = axes[0][col]
        for ph in tl["phases"]:
            ax.axvspan(ph["first"], ph["last"] + 1, color=_PHASE_COLORS.get(ph["name"], "#eee"), zorder=0,
                       linewidth=0)
            if (ph["last"] - ph["first"]) > tl["positions"] / 12:
                ax.text((ph["first"] + ph["last"]) / 2, device_max / scale * 0.985, ph["name"], ha="center",
                        va="top", fontsize=7, color="0.3")
        _lane(ax, tl, "device", device_max, scale, unit)
        peak = tl["peak"]
        ax.axvline(peak["position"], color="#c00", linestyle="--", linewidth=0.9)
        ax.annotate(f"peak {peak['device_bytes'] / scale:.2f} {unit}", (peak["position"], peak["device_bytes"] / scale),
                    xytext=(4, -12), textcoords="offset points", color="#c00", fontsize=8, fontweight="bold",
                    bbox={"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1})
        ax.set_title(f"{tl.get('config') or 'train step'}\n{tl.get('label', '')}", fontsize=8)
        if rows == 2:
            _lane(axes[1][col], tl, "host", host_max, hscale, hunit)
            axes[1][col].axvline(peak["position"], color="#c00", linestyle="--", linewidth=0.9)
        axes[rows - 1][col].set_xlabel("schedule position (instruction order)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 1.2 / fig.get_figwidth(), 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
