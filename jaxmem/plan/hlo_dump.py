"""Reading XLA dumps: the optimized HLO text (instructions, metadata, stack-frame tables) and the
live-range file's buffers at the peak. Used by `jaxmem explain`."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_META = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_PEAK_LINE = re.compile(r"^\s*([\w.\-]+)(\{[\d,]*\}): (\d+) bytes")
_RANGE_LINE = re.compile(r"^\s*([\w.\-]+)(\{[\d,]*\}):(\d+)-(\d+)\s*$")


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # e.g. "f32[4,8]{1,0}" or a tuple "(s32[], f32[..])"
    opcode: str
    operands: list[str]
    op_name: str
    frame: int | None
    body: str | None  # while body computation
    computation: str
    calls: tuple[str, ...] = ()  # computations it runs: fusion/async bodies, while body and condition, to_apply
    tuple_index: int | None = None  # get-tuple-element's index


@dataclasses.dataclass
class Frame:
    file: str
    line: int
    function: str


def _split_top(text: str) -> list[str]:
    """Splits a comma list at depth 0 (tuple element types, operand lists)."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return [re.sub(r"/\*index=\d+\*/", "", x).strip() for x in out]


def _matching(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    return len(text) - 1


def _parse_instr(line: str, computation: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.groups()
    if rest.startswith("("):
        end = _matching(rest, 0)
        type_, rest = rest[: end + 1], rest[end + 1:].strip()
    else:
        type_, _, rest = rest.partition(" ")
    opcode, _, args = rest.partition("(")
    operands = [o.lstrip("%") for o in _split_top(args[: _matching("(" + args, 0) - 1])]
    meta = _META.search(rest)
    frame = _FRAME.search(rest)
    body = re.search(r"body=%?([\w.\-]+)", rest)
    calls = tuple(re.findall(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)", rest))
    index = re.search(r"\bindex=(\d+)", rest) if opcode.strip() == "get-tuple-element" else None
    return Instr(name, type_, opcode.strip(), [o.split(" ")[-1].lstrip("%") for o in operands],
                 meta.group(1).replace("\\'", "'") if meta else "", int(frame.group(1)) if frame else None,
                 body.group(1) if body else None, computation, calls, int(index.group(1)) if index else None)


class HloModuleText:
    """The optimized HLO of one module: instructions by name, ROOTs by computation, stack frames, who calls
    each computation and who uses each instruction."""

    def __init__(self, text: str):
        self.instrs: dict[str, Instr] = {}
        self.roots: dict[str, str] = {}
        self.entry = ""
        self.frames = self._frames(text)
        computation = ""
        for line in text.splitlines():
            if not line.startswith(" ") and "{" in line and not line.startswith("HloModule"):
                computation = line.split(" ")[1 if line.startswith("ENTRY") else 0].lstrip("%")
                if line.startswith("ENTRY"):
                    self.entry = computation
                continue
            ins = _parse_instr(line, computation) if line.startswith("  ") else None
            if ins:
                self._add_element_reads(ins)
                self.instrs[ins.name] = ins
                if line.lstrip().startswith("ROOT "):
                    self.roots[computation] = ins.name
        self.computations: dict[str, list[str]] = {}  # computation -> its instructions, in text order
        self.callers: dict[str, list[str]] = {}  # computation -> the instructions that run it
        self.users: dict[str, list[str]] = {}  # instruction -> the instructions that read it
        for ins in self.instrs.values():
            self.computations.setdefault(ins.computation, []).append(ins.name)
            for c in ins.calls:
                self.callers.setdefault(c, []).append(ins.name)
            for o in dict.fromkeys(ins.operands):
                self.users.setdefault(o, []).append(ins.name)

    def _add_element_reads(self, ins: Instr) -> None:
        """XLA in jax >= 0.12 prints no get-tuple-element ops: a reader names the element as `%op#3`. Each
        such operand becomes the get-tuple-element it stands for (placed before its first reader, without
        op_name like XLA's own), so the walks through loop elements and multi-output ops read both forms."""
        for operand in ins.operands:
            source, sep, index = operand.rpartition("#")
            if not sep or operand in self.instrs or source not in self.instrs or not index.isdigit():
                continue
            tuple_op = self.instrs[source]
            self.instrs[operand] = Instr(operand, element_type(tuple_op.type, "{" + index + "}"),
                                         "get-tuple-element", [source], "", None, None, tuple_op.computation,
                                         tuple_index=int(index))

    @staticmethod
    def _table(text: str, name: str) -> list[str]:
        m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
        return m.group(1).splitlines() if m else []

    def _frames(self, text: str) -> dict[int, tuple[Frame, int]]:
        files = {int(a): b.strip('"') for a, b in (line.split(" ", 1) for line in self._table(text, "FileNames"))}
        funcs = {int(a): b.strip('"') for a, b in (line.split(" ", 1) for line in self._table(text, "FunctionNames"))}
        locs = {}
        for line in self._table(text, "FileLocations"):
            d = dict(re.findall(r"(\w+)=(\d+)", line))
            locs[int(line.split()[0])] = Frame(files.get(int(d["file_name_id"]), "?"), int(d["line"]),
                                              funcs.get(int(d["function_name_id"]), "?"))
        frames = {}
        for line in self._table(text, "StackFrames"):
            d = dict(re.findall(r"(\w+)=(\d+)", line))
            # The text form prints parent ids shifted by one (1 = no parent).
            frames[int(line.split()[0])] = (locs[int(d["file_location_id"])], int(d["parent_frame_id"]) - 1)
        return frames

    def stack(self, frame_id: int | None) -> list[Frame]:
        """Innermost first."""
        out, seen = [], set()
        while frame_id and frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            frame, frame_id = self.frames[frame_id]
            out.append(frame)
        return out


def element_type(type_: str, index: str) -> str:
    """The array type at a tuple index path like "{3}" or "{1,0}" (or the type itself for "{}")."""
    for i in [int(x) for x in index.strip("{}").split(",") if x]:
        if not type_.startswith("("):
            break
        type_ = _split_top(type_[1:-1])[i]
    return type_


def parse_array_type(type_: str) -> tuple[str, tuple[int, ...]]:
    m = re.match(r"(\w+)\[([\d,]*)\]", type_)
    if not m:
        return type_, ()
    return m.group(1), tuple(int(x) for x in m.group(2).split(",") if x)


def peak_buffers(live_range_text: str) -> list[tuple[str, str, int]]:
    """(instruction, tuple index, bytes) of every buffer live at the peak."""
    out, inside = [], False
    for line in live_range_text.splitlines():
        if "Live ranges at" in line and "(peak)" in line:
            inside = True
            continue
        if inside:
            m = _PEAK_LINE.match(line)
            if not m:
                break
            out.append((m.group(1), m.group(2), int(m.group(3))))
    return out


_VALUE_LINE = re.compile(r"^\s*value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @(\d+)> "
                         r"\(size=(\d+),offset=(\d+)\)")
_ALLOCATION_LINE = re.compile(r"^allocation (\d+):")
HOST_COLOR = "5"  # XLA's memory space (color) of pinned-host buffers


@dataclasses.dataclass(frozen=True)
class Region:
    """Bytes of one allocation that a set of aliased values occupy (a loop's carry, its body parameter and
    the in-place update all live at the same offset)."""

    allocation: int
    offset: int
    bytes: int
    host: bool


def value_regions(buffer_assignment_text: str) -> dict[str, Region]:
    """"instruction{index}" -> where XLA's buffer assignment put that value."""
    out, allocation = {}, -1
    for line in buffer_assignment_text.splitlines():
        if m := _ALLOCATION_LINE.match(line):
            allocation = int(m.group(1))
        elif m := _VALUE_LINE.match(line):
            name, index, color, size, offset = m.groups()
            out[name + (index or "{}")] = Region(allocation, int(offset), int(size), color == HOST_COLOR)
    return out


def live_ranges(live_range_text: str) -> list[tuple[str, str, int, int]]:
    """(instruction, tuple index, first, last position) of each value of the BufferLiveRange table."""
    start = live_range_text.find("BufferLiveRange:")
    out = []
    for line in live_range_text[start:].splitlines()[1:] if start >= 0 else []:
        m = _RANGE_LINE.match(line)
        if not m:
            break
        out.append((m.group(1), m.group(2), int(m.group(3)), int(m.group(4))))
    return out


def device_peak_buffers(live_range_text: str, buffer_assignment_text: str) -> tuple[list[tuple[str, str, int]], int]:
    """(instruction, tuple index, bytes) of every device buffer live at the device peak, and the pinned-host
    bytes live then. XLA's own "(peak)" counts host buffers too, so in an offloaded program it can be another
    moment than the device's. Values that share bytes (aliases) count once. Without a buffer assignment the
    peak is XLA's own list."""
    regions = value_regions(buffer_assignment_text)
    ranges = [(n, i, a, b, regions[n + i]) for n, i, a, b in live_ranges(live_range_text) if n + i in regions]
    if not ranges:
        return peak_buffers(live_range_text), 0
    spans: dict[Region, list[tuple[int, int]]] = {}
    for _, _, first, last, region in ranges:
        spans.setdefault(region, []).append((first, last))
    device = [0] * (max(last for _, _, _, last, _ in ranges) + 2)
    for region, intervals in spans.items():
        if not region.host:
            for first, last in _merged(intervals):
                device[first] += region.bytes
                device[last + 1] -= region.bytes
    live, best, moment = 0, -1, 0
    for t, change in enumerate(device):
        live += change
        if live > best:
            best, moment = live, t
    at_peak: dict[Region, tuple[str, str]] = {}
    for name, index, first, last, region in ranges:
        if first <= moment <= last:
            at_peak.setdefault(region, (name, index))  # the value named first in the table stands for its aliases
    host = sum(r.bytes for r in at_peak if r.host)
    return [(n, i, r.bytes) for r, (n, i) in at_peak.items() if not r.host], host


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for first, last in sorted(intervals):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def buffer_assignment_path(live_range_path: Path) -> Path:
    return live_range_path.with_name(live_range_path.name.replace("-live-range.txt", "-buffer-assignment.txt"))


def find_dump(dump_dir: Path, module: str = "jit_step") -> tuple[Path, Path, Path | None]:
    """(optimized HLO, live-range, memory-usage report) files of the named module's device compile."""
    hlo = sorted(p for p in dump_dir.glob(f"*{module}*after_optimizations.txt"))
    live = sorted(dump_dir.glob(f"*{module}*after_optimizations-live-range.txt"))
    if not hlo or not live:
        raise FileNotFoundError(f"{dump_dir}: no optimized HLO / live-range dump for module {module}")
    usage = sorted(dump_dir.glob(f"*{module}*after_optimizations-memory-usage-report.txt"))
    return hlo[-1], live[-1], usage[-1] if usage else None
