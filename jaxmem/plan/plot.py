"""PNG stacked-bar charts of plans: one bar per config, analytic categories stacked, compiled total marked."""
from __future__ import annotations

from pathlib import Path

from jaxmem.plan.bill import CATEGORIES

GIB = 1024**3


def _peak_parts(analytic: dict) -> dict[str, int]:
    """The categories that make up the estimated peak: the smaller of the two phases is not stacked."""
    parts = {k: analytic[k] for k in CATEGORIES}
    if analytic["logits"] > analytic["working_set"] + analytic["temporaries"]:
        parts["working_set"] = parts["temporaries"] = 0
    else:
        parts["logits"] = 0
    return parts


def plot_plans(plans: list[dict], path: str | Path, labels: list[str] | None = None) -> Path:
    """Writes the bill of each plan side by side (the "fp32 -> bf16 -> +remat -> +offload" ladder)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [p["config"] or p["model"] for p in plans]
    fig, ax = plt.subplots(figsize=(max(7.5, 1.6 * len(plans) + 4), 5.5))
    xs = range(len(plans))
    bottom = [0.0] * len(plans)
    colors = matplotlib.colormaps["tab20"]
    peak_parts = [_peak_parts(p["analytic"]) for p in plans]
    for i, cat in enumerate(CATEGORIES):
        heights = [parts[cat] / GIB for parts in peak_parts]
        if not any(heights):
            continue
        ax.bar(xs, heights, 0.55, bottom=bottom, label=cat, color=colors(i))
        bottom = [b + h for b, h in zip(bottom, heights)]
    host = [p["analytic"]["host_total"] / GIB for p in plans]
    if any(host):
        ax.bar([x + 0.3 for x in xs], host, 0.15, label="host, estimated (analytic)", color="0.6", hatch="//")
    compiled = [(x, p["compiled"]["device_total"] / GIB) for x, p in zip(xs, plans) if p.get("compiled")]
    if compiled:
        label = plans[0]["compiled"]["label"]
        ax.scatter([x for x, _ in compiled], [y for _, y in compiled], marker="D", color="black", zorder=5,
                   label=f"device total, {label}")
    usable = {p["usable_device_bytes"] for p in plans if p.get("usable_device_bytes")}
    for u in usable:
        ax.axhline(u / GIB, color="red", linestyle="--", linewidth=1, label="usable capacity (after headroom)")
    ax.set_xticks(list(xs), labels, rotation=15, ha="right")
    ax.set_ylabel("GiB per device")
    target = plans[0]["target"]["name"]
    ax.set_title(f"memory bill per device, {plans[0]['devices']} x {target}\n"
                 "bars: estimated (analytic) peak" + ("; diamonds: compiled device total" if compiled else ""),
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
