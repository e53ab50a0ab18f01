"""The memory timeline as one self-contained HTML page: `jaxmem explain --html` (one config, or two side by
side with --compare) and `jaxmem bench --html` (the measured per-step memory next to the planned peak).

The page is one view of the timeline JSON (jaxmem.plan.timeline, docs/plan_schema.md), embedded in the file
and drawn as SVG by a small inline script (jaxmem.plan.timeline_script): no charting library and no
network fetch, so the file opens offline, stays small (the data is most of it) and the drawing is ours to
test. Each buffer is its own band, stacked by category; hover shows it, click pins it under the chart.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from jaxmem.plan.timeline import CATEGORIES
from jaxmem.plan.timeline_script import SCRIPT

COLORS = {"param": "#4e79a7", "optimizer": "#9c755f", "grad": "#e15759", "activation": "#59a14f",
          "logits": "#edc948", "temp": "#bab0ac", "host_copy": "#b07aa1"}
assert set(COLORS) == set(CATEGORIES)
_BAND_KEYS = ("buffer", "bytes", "shape", "dtype", "category", "explain_category", "checkpoint_name", "source",
              "why", "suggestion", "memory", "first", "last")

_STYLE = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:18px;margin:0 0 4px} h2{font-size:15px;margin:6px 0 2px}
.sub{color:#555;margin:0 0 10px} .panels{display:flex;flex-wrap:wrap;gap:18px}
.panel{flex:1 1 560px;min-width:480px;border:1px solid #ddd;border-radius:6px;padding:8px 10px}
svg{display:block;width:100%;height:auto;font:11px system-ui,sans-serif}
.legend span{display:inline-block;margin:2px 10px 2px 0} .sw{display:inline-block;width:11px;height:11px;
vertical-align:-1px;margin-right:4px;border-radius:2px}
#tip{position:fixed;pointer-events:none;background:#fffffe;border:1px solid #888;border-radius:4px;
padding:6px 8px;max-width:460px;box-shadow:0 2px 8px #0003;display:none;z-index:9;font-size:12px}
.pin{background:#f6f6f2;border:1px solid #ccc;border-radius:4px;padding:6px 8px;margin:6px 0;min-height:18px}
table{border-collapse:collapse;font-size:12px;width:100%} td,th{border-bottom:1px solid #eee;padding:2px 5px;
text-align:left;vertical-align:top} td.n{text-align:right;white-space:nowrap}
.peaklist{max-height:340px;overflow:auto} .lever{font-size:11px;color:#555}
.readout{color:#333;min-height:17px;font-size:12px}
.err{color:#b00;font-weight:bold} .note{color:#555;font-size:12px}
"""


_INTRO = ('<p class="sub">jaxmem memory timeline. x: the compiled step\'s schedule (XLA\'s instruction order); '
          "y: bytes live per device. Each band is one buffer, stacked by category; hover for its shape, source "
          "line and lever, click to pin it. The dashed line marks the device peak; its live set is listed under "
          "each chart (the list <code>jaxmem explain --top</code> prints).</p>")


def slim(timeline: dict) -> dict:
    """What the page draws from a timeline: the bands (without alias lists), totals, phases and the peak."""
    return {"config": timeline.get("config", ""), "label": timeline.get("label", ""),
            "positions": timeline["positions"], "instructions": timeline["instructions"],
            "phases": timeline["phases"], "peak": timeline["peak"],
            "compiled_device_bytes": timeline.get("compiled_device_bytes"),
            "device_total": timeline["device"]["total"], "host_total": timeline["host"]["total"],
            "bands": [{k: b[k] for k in _BAND_KEYS} for b in timeline["bands"]]}


# JSON's \u escapes for the characters that can end or change an HTML <script> block ("</script>", "<!--",
# "<script"): the embedded text then holds no "<", ">" or "&" and parses to the same data.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def script_json(data) -> str:
    """`data` as JSON text safe inside <script type="application/json">, whatever strings it holds."""
    return json.dumps(data, separators=(",", ":")).translate(_SCRIPT_SAFE)


def page(timelines: list[dict], title: str = "", measured: dict | None = None) -> str:
    """The HTML text: one panel per timeline (side by side), then the measured panel when given."""
    data = {"categories": list(CATEGORIES), "colors": COLORS, "panels": [slim(t) for t in timelines],
            "measured": measured}
    payload = script_json(data)
    title = title or ("memory timeline: " + " vs ".join(t.get("config") or "step" for t in timelines)
                      if timelines else "measured device memory")
    return "\n".join([
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>", f"<style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _INTRO if timelines else "",
        '<div id="root"></div><div id="tip"></div>',
        f'<script type="application/json" id="data">{payload}</script>',
        f"<script>{SCRIPT}</script>", "</body></html>", ""])


def write(path: str | Path, timelines: list[dict], title: str = "", measured: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(timelines, title, measured))
    return path


# ------------------------------------------------------------------ measured memory (bench / train telemetry)


def measured_from_rows(rows: list[dict], planned_bytes: int | None, source: str, planned_label: str = "") -> dict:
    """The measured panel's data from metrics rows (jaxmem.train.telemetry's keys: step, mem/bytes_in_use,
    mem/peak_bytes_in_use, plan/device_bytes). `source` says where the rows come from ("measured on GPU ...",
    "synthetic"): the figure prints it."""
    points = [{"step": int(r.get("step", i)), "bytes_in_use": r.get("mem/bytes_in_use"),
               "peak_bytes_in_use": r.get("mem/peak_bytes_in_use")}
              for i, r in enumerate(rows) if "mem/bytes_in_use" in r or "mem/peak_bytes_in_use" in r]
    if planned_bytes is None:
        planned_bytes = next((r["plan/device_bytes"] for r in rows if r.get("plan/device_bytes")), None)
    return {"source": source, "points": points, "planned_device_bytes": planned_bytes,
            "planned_label": planned_label or "compiled: XLA memory analysis of the step (argument + output - "
                                              "alias + temp)"}


def measured_from_metrics(path: str | Path, source: str = "") -> dict:
    """The measured panel from a run's metrics.jsonl (`jaxmem train`'s telemetry rows)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return measured_from_rows(rows, None, source or f"measured: allocator telemetry from {path}")
