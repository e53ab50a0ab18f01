"""The memory timeline of the compiled train step: every buffer of XLA's buffer assignment with its live range
over the step's schedule, stacked by category, device and pinned-host pools apart. One dict (documented in
docs/plan_schema.md, "timeline"); `jaxmem explain --html` draws it (jaxmem.plan.timeline_html), `--plot`
as a PNG (jaxmem.plan.timeline_plot).

Where the figures come from (all read from the dump of one compile, deviceless for a named target):
  * x: XLA's schedule, the live-range file's InstructionSequence (loop bodies appear once, flattened);
  * a band: one stretch of bytes of one allocation (offset, size) over a merged live range: the values XLA put
    there that alias each other (a loop's carry, an in-place update) count once, as `explain` counts them;
  * its category, source line, checkpoint name and lever: `jaxmem.plan.buffer_kinds.classify` (explain's),
    except that a device buffer filled from or for pinned host memory (copy-start / copy-done / a slice of a
    host array) is filed as `host_copy`;
  * the peak list: `explain`'s, the same buffers in the same order.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jaxmem.kernels.cross_entropy
import jaxmem.core.remat
from jaxmem.config import Config
from jaxmem.plan import hlo_dump
from jaxmem.plan.attribution import in_files, module_path
from jaxmem.plan.buffer_kinds import _phase, classify, state_shapes
from jaxmem.plan.categories import EXPLAIN_CATEGORIES

SCHEMA = "jaxmem.timeline/1"
HOST_COPY = "host_copy"
# Bottom to top in the stacked chart: what lives all step first, one op's working memory last.
CATEGORIES = ("param", "optimizer", "grad", "activation", "logits", "temp", HOST_COPY)
assert set(EXPLAIN_CATEGORIES) <= set(CATEGORIES)
_LOSS_OP = re.compile(r"\bloss")  # the loss kernels' name scopes (loss_chunked, ...)
_SEQ_LINE = re.compile(r"^\s*(\d+):(\S+)\s*$")
_HOST = ":S(5)"
_SCAN_CODE = (module_path(jaxmem.core.remat),)
_LOSS_CODE = (module_path(jaxmem.kernels.cross_entropy),)
# Ops that name or regroup buffers without computing: they take the part of the op before them (a loop's
# results are read out with get-tuple-element under the loop's name stack wherever the reader is).
_BOOKKEEPING = ("get-tuple-element", "bitcast", "tuple", "parameter", "constant")
_TRANSFERS = ("copy-start", "copy-done", "copy", "dynamic-slice", "async-start", "async-done", "fusion")


def schedule(live_range_text: str) -> list[str]:
    """The instruction at each position of the live-range file's InstructionSequence."""
    start = live_range_text.find("InstructionSequence:")
    end = live_range_text.find("BufferLiveRange:")
    out: list[str] = []
    for line in live_range_text[start:end].splitlines()[1:] if start >= 0 else []:
        m = _SEQ_LINE.match(line)
        if m:
            position, name = int(m.group(1)), m.group(2)
            out.extend([""] * (position - len(out)))
            out.append(name)
    return out


@dataclasses.dataclass
class Band:
    """One stretch of one allocation's bytes over a merged live range, and the values XLA placed there."""

    region: hlo_dump.Region
    first: int
    last: int
    values: list[tuple[str, str]]  # (instruction, tuple index) in the live-range table's order


def bands(live_range_text: str, buffer_assignment_text: str) -> list[Band]:
    """Every buffer of the assignment over its live range. Values of one region whose ranges touch or overlap
    merge into one band (as `hlo_dump.device_peak_buffers` counts them); a region reused later is a new band."""
    regions = hlo_dump.value_regions(buffer_assignment_text)
    by_region: dict[hlo_dump.Region, list[tuple[int, int, str, str]]] = {}
    for name, index, first, last in hlo_dump.live_ranges(live_range_text):
        region = regions.get(name + index)
        if region is not None:
            by_region.setdefault(region, []).append((first, last, name, index))
    out = []
    for region, ranges in by_region.items():
        order = {(n, i): k for k, (_, _, n, i) in enumerate(ranges)}
        mine: list[Band] = []
        for first, last, name, index in sorted(ranges, key=lambda r: (r[0], r[1])):
            if mine and first <= mine[-1].last + 1:
                mine[-1].last = max(mine[-1].last, last)
                mine[-1].values.append((name, index))
            else:
                mine.append(Band(region, first, last, [(name, index)]))
        for band in mine:
            band.values.sort(key=lambda v: order[v])
        out.extend(mine)
    return sorted(out, key=lambda b: (b.first, b.last, b.region.allocation, b.region.offset))


def _is_host_transfer(module: hlo_dump.HloModuleText, name: str) -> bool:
    """A device value that an op moved out of pinned host memory, or staged for a move into it."""
    ins = module.instrs.get(name)
    for _ in range(3):
        if ins is None:
            return False
        if ins.opcode == "get-tuple-element" and ins.operands:
            ins = module.instrs.get(ins.operands[0])
            continue
        break
    if ins is None or ins.opcode not in _TRANSFERS:
        return False
    if ins.opcode == "copy-start" and _HOST in ins.type:
        return True
    operands = [module.instrs[o] for o in ins.operands if o in module.instrs]
    if ins.opcode == "copy-done":
        return any(_HOST in o.type for o in operands)
    if ins.opcode == "fusion":  # XLA's host-offload fusions: a dynamic slice of a host array
        return any(_HOST in o.type for o in operands) and _HOST not in ins.type
    return any(_HOST in o.type for o in operands)


def _labels(module: hlo_dump.HloModuleText, names: list[str]) -> list[str]:
    """The part of the step each scheduled instruction belongs to: forward layers, loss, backward layers,
    update (and forward / backward for the rest of those passes, grad accumulation), from the op's name stack
    (explain's phases), its source frames (the layer scan in jaxmem/core/remat.py, the loss kernels) and, for an op
    without metadata, the loop that runs its computation, else the instruction before it."""
    loop_of: dict[str, hlo_dump.Instr] = {}  # computation -> the while loop running it (innermost)
    for comp, callers in module.callers.items():
        for c in callers:
            if module.instrs[c].opcode == "while":
                loop_of[comp] = module.instrs[c]

    def in_layer_scan(ins) -> bool:
        comp, seen = ins.computation, set()
        while comp in loop_of and comp not in seen:
            seen.add(comp)
            loop = loop_of[comp]
            if any(in_files(f.file, _SCAN_CODE) for f in module.stack(loop.frame)):
                return True
            comp = loop.computation
        return False

    def label(ins) -> str:
        if ins.opcode in _BOOKKEEPING:
            return ""
        op = ins.op_name
        src = ins
        if not op and ins.computation in loop_of:
            src = loop_of[ins.computation]
            op = src.op_name
        op = op.split(":")[0]  # XLA joins the names of merged ops with ":"; the first one's op runs first
        phase = _phase(op)
        if phase is None:
            return ""
        if phase == "update":
            return "update"
        if phase == "grads":
            return "grad accumulation"
        if _LOSS_OP.search(op) or any(in_files(f.file, _LOSS_CODE) for f in module.stack(src.frame)):
            return "loss"
        return f"{phase} layers" if in_layer_scan(ins) else phase

    out, previous = [], "start"
    for name in names:
        ins = module.instrs.get(name)
        here = label(ins) if ins is not None else ""
        previous = here or previous
        out.append(previous)
    return out


def phases(labels: list[str], min_run: int | None = None) -> list[dict]:
    """Runs of one label, [{"name", "first", "last"}]; runs shorter than `min_run` positions (1/100 of the
    step by default) join the run before them, so a stray op does not split a pass."""
    min_run = max(2, len(labels) // 100) if min_run is None else min_run
    runs: list[list] = []
    for i, lab in enumerate(labels):
        if runs and runs[-1][0] == lab:
            runs[-1][2] = i
        else:
            runs.append([lab, i, i])
    merged: list[list] = []
    for run in runs:
        if merged and (run[2] - run[1] + 1 < min_run or merged[-1][0] == run[0]):
            merged[-1][2] = run[2]
        else:
            merged.append(run)
    return [{"name": n, "first": a, "last": b} for n, a, b in merged]


def _defining_value(module, values: list) -> tuple:
    """The value a band is classified by: a step argument where one shares the region (a parameter updated in
    place is the parameter, not the update's output that XLA writes over it), else the region's first."""
    for name, index in values:
        ins = module.instrs.get(name)
        if ins is not None and ins.opcode == "parameter" and ins.computation == module.entry:
            return name, index
    return values[0]


def build(cfg: Config, dump_dir: Path, label: str = "", config: str = "") -> dict:
    """The timeline of the step compiled into `dump_dir` (see the module docstring and docs/plan_schema.md)."""
    hlo_path, live_path, _ = hlo_dump.find_dump(Path(dump_dir))
    module = hlo_dump.HloModuleText(hlo_path.read_text())
    live_text = live_path.read_text()
    assignment_path = hlo_dump.buffer_assignment_path(live_path)
    if not assignment_path.exists():
        raise FileNotFoundError(f"{assignment_path}: the timeline needs XLA's buffer assignment dump")
    assignment_text = assignment_path.read_text()
    names = schedule(live_text)
    state = state_shapes(cfg, module)
    found = bands(live_text, assignment_text)
    n = max([len(names)] + [b.last + 1 for b in found])
    names += [""] * (n - len(names))
    device = {c: [0] * (n + 1) for c in CATEGORIES}
    host = {c: [0] * (n + 1) for c in CATEGORIES}
    out_bands = []
    for band in found:
        name, index = _defining_value(module, band.values)
        info = classify(cfg, module, name, index, band.region.bytes, state)
        cat = info["category"]
        if not band.region.host and any(_is_host_transfer(module, v) for v, _ in band.values):
            cat = HOST_COPY
        pool = host if band.region.host else device
        pool[cat][band.first] += band.region.bytes
        pool[cat][band.last + 1] -= band.region.bytes
        out_bands.append({**info, "category": cat, "explain_category": info["category"],
                          "memory": "host" if band.region.host else "device", "first": band.first,
                          "last": band.last, "values": [v + i for v, i in band.values]})
    series = {pool_name: {c: _running(d)[:n] for c, d in pool.items()} for pool_name, pool in
              (("device", device), ("host", host))}
    device_total = [sum(col) for col in zip(*series["device"].values())]
    host_total = [sum(col) for col in zip(*series["host"].values())]
    peak_at = max(range(n), key=lambda t: (device_total[t], -t)) if n else 0
    peak_list, host_at_peak = hlo_dump.device_peak_buffers(live_text, assignment_text)
    peak_buffers = sorted((classify(cfg, module, v, i, b, state) for v, i, b in peak_list),
                          key=lambda b: -b["bytes"])
    parts = phases(_labels(module, names))
    peak_phase = next((p["name"] for p in parts if p["first"] <= peak_at <= p["last"]), "")
    return {
        "schema": SCHEMA,
        "config": config,
        "label": label,
        "positions": n,
        "instructions": names,
        "phases": parts,
        "categories": list(CATEGORIES),
        "bands": out_bands,
        "device": {"total": device_total, "by_category": series["device"]},
        "host": {"total": host_total, "by_category": series["host"]},
        "peak": {"position": peak_at, "instruction": names[peak_at] if n else "",
                 "phase": peak_phase, "device_bytes": device_total[peak_at] if n else 0,
                 "host_bytes": host_at_peak, "buffers": peak_buffers},
        "host_peak_bytes": max(host_total, default=0),
    }


def _running(changes: list[int]) -> list[int]:
    out, live = [], 0
    for c in changes:
        live += c
        out.append(live)
    return out


def live_at(timeline: dict, position: int, memory: str = "device") -> list[dict]:
    """The bands of one pool live at a schedule position."""
    return [b for b in timeline["bands"] if b["memory"] == memory and b["first"] <= position <= b["last"]]

