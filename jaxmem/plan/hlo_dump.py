"""Reading XLA dumps: the optimized HLO text (instructions, metadata, stack-frame tables) and the
live-range file's buffers at the peak. Used by `jaxmem explain`."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_META = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_PEAK_LINE = re.compile(r"^\s*([\w.\-]+)(\{[\d,]*\}): (\d+) bytes")
_RANGE_LINE = re.compile(r"^\s*([\w.\-]+)(\{[\d,]*\}):(\d+)-(\d+)\s*$")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e8m0fnu": 1, "bf16": 2,
            "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8,
            "c128": 16, "s4": 0.5, "u4": 0.5, "token": 0}
HOST_SPACE = ":S(5)"  # the layout suffix of pinned-host buffers


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


@dataclasses.dataclass(frozen=True)
class LiveValue:
    name: str  # instruction
    index: str  # tuple index, e.g. "{}" or "{3}"
    start: int  # first and last position in the instruction sequence, inclusive
    end: int
    bytes: int
    host: bool


def live_values(live_range_text: str, module: HloModuleText) -> list[LiveValue]:
    """Every value of the live-range file's BufferLiveRange table, sized from its HLO type (a tuple is its
    table of addresses, 8 bytes an element) and placed by its layout's memory space."""
    start = live_range_text.find("BufferLiveRange:")
    values = []
    for line in live_range_text[start:].splitlines()[1:] if start >= 0 else []:
        m = _RANGE_LINE.match(line)
        if not m:
            if values:
                break
            continue
        ins = module.instrs.get(m.group(1))
        if ins is None:
            continue
        type_ = element_type(ins.type, m.group(2))
        if type_.startswith("("):
            size, host = 8 * len(_split_top(type_[1:-1])), False
        else:
            dtype, shape = parse_array_type(type_)
            size, host = int(math.prod(shape) * ITEMSIZE.get(dtype, 4)), HOST_SPACE in type_
        values.append(LiveValue(m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), size, host))
    return values


def device_peak_buffers(live_range_text: str, module: HloModuleText) -> tuple[list[tuple[str, str, int]], int]:
    """(instruction, tuple index, bytes) of every device buffer live at the device peak, and the host bytes live
    then. XLA's own "(peak)" counts pinned-host buffers too, so in an offloaded program it can be another
    moment than the device's. Falls back to XLA's peak list when the file has no live-range table."""
    values = live_values(live_range_text, module)
    if not values:
        return peak_buffers(live_range_text), 0
    length = max(v.end for v in values) + 2
    change = [0] * length
    for v in values:
        if not v.host:
            change[v.start] += v.bytes
            change[v.end + 1] -= v.bytes
    live, best, moment = 0, -1, 0
    for t, delta in enumerate(change):
        live += delta
        if live > best:
            best, moment = live, t
    at_peak = [v for v in values if v.start <= moment <= v.end]
    host = sum(v.bytes for v in at_peak if v.host)
    return [(v.name, v.index, v.bytes) for v in at_peak if not v.host], host


def find_dump(dump_dir: Path, module: str = "jit_step") -> tuple[Path, Path, Path | None]:
    """(optimized HLO, live-range, memory-usage report) files of the named module's device compile."""
    hlo = sorted(p for p in dump_dir.glob(f"*{module}*after_optimizations.txt"))
    live = sorted(dump_dir.glob(f"*{module}*after_optimizations-live-range.txt"))
    if not hlo or not live:
        raise FileNotFoundError(f"{dump_dir}: no optimized HLO / live-range dump for module {module}")
    usage = sorted(dump_dir.glob(f"*{module}*after_optimizations-memory-usage-report.txt"))
    return hlo[-1], live[-1], usage[-1] if usage else None
