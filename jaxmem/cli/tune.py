"""`jaxmem tune CONFIG --target T`: the memory decision flow, automated.

The flow practitioners run by hand, one OOM at a time: start in bf16 mixed precision; if it does not fit,
recompute activations; then (only with --allow-lossy-optimizer) shrink the optimizer state itself; then
offload the optimizer state, then the activations, then the parameters; once
it fits, raise the micro-batch as far as memory allows; then accumulate gradients up to the target global
batch. Here every step is planned instead of run: each candidate's analytic bill prunes what clearly does
not fit, the survivors are compiled for the target (deviceless, in worker processes, cached by config hash
as `sweep` does) in the order of the cost model's step time, and only a compiled figure within the usable
memory (and a host side within the node's RAM) counts as fitting. The winner is the fitting candidate with
the most tokens per second (estimated), ties broken by headroom; so a candidate whose estimate cannot beat a
fitting one already found is never compiled, and a larger micro-batch whose analytic bill, scaled by the
compiled/analytic ratio of the micro-batch it grows from, is clearly over the usable memory is not either.
A run of several programs (GRPO) is planned whole, its figure the largest phase, and a feature's own settings
(its rollout batch: Feature.search_variants) are tried with every lever.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem import registry
from jaxmem.mesh.sharding import batch_ways, mesh_shape
from jaxmem.optim import states
from jaxmem.runtime.aot import add_target_args
from jaxmem.cli.help import HelpFormatter
from jaxmem.plan import resolve_topology
from jaxmem.plan import plan
from jaxmem.cli.sweep import plan_points
from jaxmem.cli.tune_report import _gib, phase_lines, plot, table, to_json, verify, write_yaml

# How far above the usable memory an analytic bill may be and still be worth a compile: above the analytic
# bill's error against the compiled figure (benchmarks/plan_accuracy.md, benchmarks/long_context.md).
ANALYTIC_SLACK = 1.35
# A larger micro-batch is compiled only if its analytic bill times the compiled/analytic ratio of the fitting
# micro-batch it grows from is within this much of the usable memory (the ratio drifts as activations grow).
CALIBRATED_SLACK = 1.1
# A candidate whose analytic bill is within this share of the usable memory is compiled alone; above it, the
# next candidates are compiled beside it (worker processes), as it may well not fit.
SURE_SHARE = 0.9

LONG_SEQ = 32768
# The flow: each stage adds the levers of the previous ones (every candidate starts in bf16 mixed precision).
# Recomputation, then host offload, then the stages a feature brings (jaxmem.core.plugins.Feature.search_axes).
BASE_STAGES = (
    ("bf16 mixed precision", [[]]),
    ("activation recomputation", [["remat.preset=selective"], ["remat.preset=save_qkv_proj"],
                                  ["remat.preset=selective", "remat.granularity=segments"], ["remat.preset=full"],
                                  # per name: keep the attention output, so the flash kernel does not rerun
                                  ["remat.preset=full", "remat.names.attn_context=device"]]),
)
# Once recomputation is not enough: the optimizer state, then the activations, then the parameters in pinned host
# memory (jaxmem.core.offload).
OFFLOAD_STAGES = (
    ("optimizer state offloaded", [[r, "offload.optimizer=host", f"offload.optimizer_update={u}"]
                                   for r in ("remat.preset=selective", "remat.preset=full")
                                   for u in ("device", "host")]),
    ("activations offloaded", [["remat.preset=offload_layer_inputs", "offload.optimizer=host",
                                f"offload.optimizer_update={u}"] for u in ("device", "host")]),
    ("parameters offloaded", [["remat.preset=offload_layer_inputs", "offload.optimizer=host",
                               "offload.optimizer_update=device", "offload.params=host"]]),
)
STAGES = BASE_STAGES + OFFLOAD_STAGES + tuple(stage for feature in registry.FEATURES for stage in feature.search_axes)
# With --allow-lossy-optimizer, after recomputation and before any offload: the optimizer state itself, smaller
# but lossy (docs/optimizers.md): the state kinds tune may pick (jaxmem.optim.states), largest first, each with
# the fp32 master, then bf16 weights rounded stochastically without a master; the smallest only in the last
# form (full recomputation, no master).
LOSSY_KINDS = sorted((k for k in states.KINDS if k.tune_may_pick), key=lambda k: -k.bytes_per_value(k.default_block))
_LOSSY_NAMES = " / ".join(kind.name for kind in LOSSY_KINDS)
LOSSY_STAGE = ("optimizer state quantized (lossy)", [
    [r, f"precision.moment_dtype={kind.name}"] + extra for kind in LOSSY_KINDS[:-1]
    for extra in ([], ["precision.master_weights=false"]) for r in ("remat.preset=selective", "remat.preset=full")
] + [["remat.preset=full", f"precision.moment_dtype={LOSSY_KINDS[-1].name}", "precision.master_weights=false"]])
# Without the flag the config's own optimizer state is kept; with it tune decides, from the lossless default.
LOSSLESS_RESET = [f"precision.moment_dtype={states.KINDS[0].name}", "precision.moment_block=0"]


def stages(allow_lossy: bool) -> tuple:
    """The flow's stages: the lossy optimizer-state stage after recomputation only where allowed."""
    return STAGES[:len(BASE_STAGES)] + ((LOSSY_STAGE,) if allow_lossy else ()) + STAGES[len(BASE_STAGES):]


def optimizer_note(allow_lossy: bool) -> str:
    """tune's first line: whether the optimizer state was searched (lossy kinds change the numerics)."""
    if allow_lossy:
        return f"optimizer state: searched (--allow-lossy-optimizer): {_LOSSY_NAMES} moments, no fp32 master; lossy"
    return (f"optimizer state: not searched, kept as configured (--allow-lossy-optimizer tries {_LOSSY_NAMES}, "
            "no master)")


BF16 = ["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "precision.master_weights=true",
        "kernels.loss=chunked"]
# The memory levers tune decides, reset in every candidate (the config's own choices do not carry over;
# command-line overrides do, and win).
RESET = ["remat.preset=none", "remat.granularity=layer", "remat.seq_tile=0", "remat.names={}",
         "offload.optimizer=device", "offload.optimizer_update=host", "offload.params=device",
         "optimizer.update_in_backward=false"]
_UNLABELED = set(BF16 + RESET + LOSSLESS_RESET + ["train.global_batch=0"])
_IMPLIED = {"parallel.dp=1", "parallel.sp=1", "parallel.tp=1", "parallel.ep=1", "parallel.rules=fsdp",
            "parallel.rules=fsdp_tp"}
_SHORT = {"offload.optimizer_update": "update"}


@dataclasses.dataclass
class Candidate:
    overrides: list[str]  # levers on top of the user's config
    stage: str
    analytic: dict | None = None  # plan(compile=False) figures
    row: dict | None = None  # the compiled plan's sweep row

    @property
    def label(self) -> str:
        """The levers beyond bf16, the mesh and the batch split, e.g. `preset=selective fsdp=8 zero_stage=3
        micro_batch=1 grad_accum=4`; the mesh axes at 1 and the rules the axes imply are left out."""
        kept = [o.split("=", 1) for o in self.overrides if o not in _UNLABELED and o not in _IMPLIED]
        return " ".join(f"{_SHORT.get(k, k.rsplit('.', 1)[-1])}={v}" for k, v in kept) or "(bf16 only)"

    def estimated_tokens_per_second(self) -> float:
        """The cost model's tokens/s from the analytic plan (the compiled plan's estimate is the same)."""
        a = self.analytic or {}
        return a["tokens_per_step"] / a["step_seconds"] if a.get("step_seconds") else 0.0

    def fits(self) -> bool:
        return bool(self.row and self.row.get("fits") is True and self.row.get("host_fits") is not False)

    def tokens_per_second(self) -> float:
        row = self.row or {}
        step = row.get("step_seconds_estimated") or 0.0
        return row.get("tokens_per_step", 0) / step if step else 0.0


def mesh_options(cfg, n_devices: int) -> list[list[str]]:
    """The splits to try when the config leaves the mesh free (an axis at -1): all-fsdp with ZeRO-3, 2 and 1;
    fsdp x tp with tp = 2, 4, 8 dividing the devices and the kv heads; for sequences of 32K tokens and more,
    sequence parallelism over every device. Else the config's own mesh."""
    par, m = cfg.parallel, cfg.model
    if -1 not in (par.dp, par.fsdp, par.sp, par.tp):
        return [[]]
    one = ["parallel.dp=1", "parallel.sp=1", "parallel.tp=1", "parallel.rules=fsdp"]
    out = [one + [f"parallel.fsdp={n_devices}", f"parallel.zero_stage={z}"] for z in (3, 2, 1)]
    for tp in (2, 4, 8):
        if n_devices % tp == 0 and tp < n_devices and m.n_kv_heads % tp == 0:
            out.append(["parallel.dp=1", f"parallel.fsdp={n_devices // tp}", "parallel.sp=1", f"parallel.tp={tp}",
                        "parallel.rules=fsdp_tp", "parallel.zero_stage=3"])
    if n_devices > 1 and cfg.train.seq_len >= LONG_SEQ and m.n_heads % n_devices == 0:
        out.append(["parallel.dp=1", "parallel.fsdp=1", f"parallel.sp={n_devices}", "parallel.tp=1",
                    "parallel.rules=fsdp", "parallel.zero_stage=3"])
    return out


def long_sequence_levers(cfg, levers: list[list[str]]) -> list[list[str]]:
    """For sequences of 32K tokens and more, each recomputing lever also with sequence tiling."""
    seq = cfg.train.seq_len
    if seq < LONG_SEQ:
        return levers
    tile = next(t for t in (16384, 8192, 4096, 2048, 1024) if seq % t == 0 or t == 1024)
    return levers + [lever + [f"remat.seq_tile={tile}"] for lever in levers if lever]


def batch_overrides(micro_batch: int, data_ways: int, global_batch: int) -> list[str] | None:
    """micro_batch and grad_accum reaching `global_batch` sequences per step, or None if they cannot."""
    rows = micro_batch * data_ways
    if global_batch % rows:
        return None
    return [f"train.micro_batch={micro_batch}", f"train.grad_accum={global_batch // rows}", "train.global_batch=0"]


class Tuner:
    def __init__(self, config: str, overrides: list[str], target: dict, global_batch: int | None,
                 budget_s: float, cache_dir: Path, workers: int, allow_lossy: bool = False):
        self.config, self.user, self.target = config, list(overrides), target
        self.allow_lossy = allow_lossy
        self.stages = stages(allow_lossy)
        self.reset = RESET + (LOSSLESS_RESET if allow_lossy else [])
        self.budget_end = time.monotonic() + budget_s
        self.cache_dir, self.workers = cache_dir, workers
        base = load_config(config, overrides)
        registry.for_config(base).refuse_unsupported(base, "tune")
        self.topo = resolve_topology(base, target.get("name"), target.get("gpus_per_host"), target.get("hosts"))
        if not self.topo.name:
            raise ConfigError("jaxmem tune: needs a GPU target (--target or target.name): it plans for the GPU")
        self.n = self.topo.n_devices
        self.global_batch = global_batch or base.train.global_batch or (
            base.train.micro_batch * _data_ways(base, self.n) * max(base.train.grad_accum, 1))
        # the smallest micro-batch the active features take (preference pairs: 2 rows)
        self.unit = max([1] + [f.micro_batch_unit(base) for f in registry.FEATURES if f.applies(base)])
        self.meshes = mesh_options(base, self.n)
        if self.meshes != [[]]:  # a free mesh: a feature may add its own (a mixture of experts: ep)
            self.meshes += [m for f in registry.FEATURES for m in f.search_meshes(self._load, base, self.n)]
        # an active feature's own settings every candidate is also tried with (GRPO: its rollout batch)
        self.variants = [[]]
        for feature in registry.for_config(base).active:
            self.variants = [a + b for a in self.variants for b in feature.search_variants(base, self.n) or [[]]]
        self.candidates: list[Candidate] = []
        self.misses: list[Candidate] = []  # compiled, not fitting, with the phase of their peak (said in the path)
        self.path: list[str] = []

    # ------------------------------------------------------------ planning
    def _load(self, overrides: list[str]):
        return load_config(self.config, overrides + self.user)

    def analytic(self, cand: Candidate) -> bool:
        """Plans `cand` without compiling; False when it is not a valid config or clearly does not fit."""
        try:
            p = plan(self._load(cand.overrides), self.topo, compile=False)
        except ConfigError as e:
            cand.analytic = {"error": str(e)}
            return False
        usable = p["usable_device_bytes"]
        cand.analytic = {"device_total": p["analytic"]["device_total"], "usable": usable,
                         "step_seconds": p["cost"]["step_seconds"], "tokens_per_step": p["cost"]["tokens_per_step"],
                         "peak_phase": p.get("peak_phase")}
        return p["analytic"]["device_total"] <= ANALYTIC_SLACK * usable

    def compile(self, cands: list[Candidate]) -> None:
        """Compiles `cands` for the target (worker processes, cached), while the budget lasts."""
        todo = [c for c in cands if c.row is None]
        if todo and time.monotonic() < self.budget_end:
            rows = plan_points(self.config, [c.overrides + self.user for c in todo], [], self.target, self.cache_dir,
                               self.workers, compile=True, names=[c.label for c in todo])
            for c, row in zip(todo, rows, strict=True):
                c.row = row

    def best(self, fitting: list[Candidate]) -> Candidate | None:
        """The winner so far: the most tokens/s (estimated), ties broken by headroom."""
        return max(fitting, key=lambda c: (c.tokens_per_second(), -c.row["device_bytes"]), default=None)

    @staticmethod
    def could_win(cand: Candidate, best: Candidate | None) -> bool:
        """Whether `cand`, should it fit, would beat `best` (faster, or as fast with less memory)."""
        if best is None:
            return True
        mine, theirs = cand.estimated_tokens_per_second(), best.tokens_per_second()
        return mine > theirs or (mine == theirs and cand.analytic["device_total"] < best.row["device_bytes"])

    def first_fitting(self, cands: list[Candidate], best: Candidate | None) -> Candidate | None:
        """Compiles the candidates that pass the analytic bill and could beat `best`, fastest first (then the
        least memory), until one fits; a doubtful one (over SURE_SHARE of the usable memory) is compiled with
        the next ones beside it, up to the worker count."""
        alive = [c for c in cands if self.analytic(c)]
        self.misses += [c for c in cands if c not in alive and (c.analytic or {}).get("peak_phase")]
        alive = [c for c in sorted(alive, key=lambda c: (c.analytic["step_seconds"], c.analytic["device_total"]))
                 if self.could_win(c, best)]
        while alive and time.monotonic() < self.budget_end:
            first = alive[0]
            width = 1 if first.analytic["device_total"] <= SURE_SHARE * first.analytic["usable"] else \
                max(1, self.workers)
            batch, alive = alive[:width], alive[width:]
            self.compile(batch)
            self.misses += [c for c in batch if c.row is not None and not c.fits() and c.row.get("peak_phase")]
            hit = next((c for c in batch if c.fits()), None)
            if hit is not None:
                return hit
        return None

    def stage_candidates(self, name: str, levers: list[list[str]]) -> list[Candidate]:
        out = []
        for lever in long_sequence_levers(self._load([]), levers):
            for mesh in self.meshes:
                ways = _data_ways(self._load(mesh) if mesh else self._load([]), self.n)
                # params on the host take the whole global batch in one micro-batch (no accumulation there)
                micro = self.global_batch // ways if "offload.params=host" in lever else self.unit
                batch = batch_overrides(max(micro, self.unit), ways, self.global_batch)
                if batch is not None:
                    out += [Candidate(BF16 + self.reset + lever + mesh + batch + v, name) for v in self.variants]
        return out

    # ------------------------------------------------------------ the flow
    def run(self) -> Candidate | None:
        """Escalates stage by stage until a candidate fits, then looks one stage further (more recomputation
        with a better mesh or a larger micro-batch can be faster than less with a worse one)."""
        fitting: list[Candidate] = []
        first_fit = None
        for index, (name, levers) in enumerate(self.stages):
            if first_fit is not None and index > first_fit + 1:
                break
            cands = self.stage_candidates(name, levers)
            self.candidates += cands
            best = self.best(fitting)
            hit = self.first_fitting(cands, best)
            if hit is not None:
                fitting.append(hit)
                first_fit = index if first_fit is None else first_fit
            self.path.append(f"{name}: " + self.stage_outcome(cands, hit, best))
            self.path += [f"  {c.label}: {why_not(c)}" for c in self.misses]
            self.misses = []
            if time.monotonic() >= self.budget_end:
                self.path.append("budget spent")
                break
        if not fitting:
            return None
        for c in sorted(fitting, key=lambda c: -c.tokens_per_second()):  # raise the micro-batch where it may win
            fitting += self.raise_micro_batch(c, fitting)
        best = self.best(fitting)
        self.path.append(f"best: {best.label} at {best.tokens_per_second():,.0f} tokens/s (estimated)")
        return best

    @staticmethod
    def stage_outcome(cands: list[Candidate], hit: Candidate | None, best: Candidate | None) -> str:
        compiled = sum(c.row is not None for c in cands)
        if hit is not None:
            return f"fits ({hit.label})"
        if best is not None and compiled == 0:
            return f"none could beat {best.label} ({len(cands)} planned, none compiled)"
        return f"no candidate fits ({len(cands)} planned, {compiled} compiled)"

    def raise_micro_batch(self, cand: Candidate, fitting: list[Candidate]) -> list[Candidate]:
        """`cand` with the micro-batch doubled while memory allows; a larger one is compiled only where it could
        win and its analytic bill, scaled by `cand`'s compiled/analytic ratio, is near the usable memory."""
        out, micro = [], self.unit
        ways = _data_ways(self._load(cand.overrides), self.n)
        ratio = cand.row["device_bytes"] / cand.row["analytic_device_bytes"]
        while time.monotonic() < self.budget_end:
            micro *= 2
            batch = batch_overrides(micro, ways, self.global_batch)
            if batch is None:
                break
            bigger = Candidate([o for o in cand.overrides if not o.startswith("train.")] + batch,
                               cand.stage + " + larger micro-batch")
            self.candidates.append(bigger)
            if not self.analytic(bigger):
                self.path.append(f"micro-batch {micro} with {cand.label}: does not fit (analytic)")
                break
            if bigger.analytic["device_total"] * ratio > CALIBRATED_SLACK * bigger.analytic["usable"]:
                self.path.append(f"micro-batch {micro} with {cand.label}: does not fit (analytic x {ratio:.2f}, "
                                 "the compiled/analytic ratio of the smaller micro-batch)")
                break
            if not self.could_win(bigger, self.best(fitting + out)):
                continue  # slower than a winner already found; a larger one may still be faster
            self.compile([bigger])
            if not bigger.fits():
                self.path.append(f"micro-batch {micro} with {cand.label}: does not fit (compiled)")
                break
            out.append(bigger)
            self.path.append(f"micro-batch {micro}: fits ({bigger.row['device_bytes'] / 2**30:.2f} GiB compiled)")
        return out

    def closest(self) -> Candidate | None:
        """The candidate nearest to fitting, by compiled bytes where compiled, else analytic."""
        def need(c):
            if c.row and c.row.get("device_bytes"):
                return c.row["device_bytes"] / c.row["usable_device_bytes"]
            return c.analytic["device_total"] / c.analytic["usable"] if c.analytic and "usable" in c.analytic \
                else float("inf")
        ranked = sorted(self.candidates, key=need)
        return ranked[0] if ranked else None


def why_not(cand: Candidate) -> str:
    """Why a candidate of a run of several programs does not fit: its largest phase against the usable memory,
    compiled for the target or (not compiled) estimated well over it."""
    row, est = cand.row, cand.analytic
    if row is not None:
        return (f"does not fit: its {row['peak_phase']} phase {_size(row['device_bytes'])} > "
                f"{_size(row['usable_device_bytes'])} usable (compiled for the target)")
    return (f"does not fit: its {est['peak_phase']} phase {_size(est['device_total'])} (estimated) > "
            f"{ANALYTIC_SLACK} x the {_size(est['usable'])} usable (not compiled)")


def _size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def _data_ways(cfg, n_devices: int) -> int:
    return batch_ways(mesh_shape(cfg.parallel, n_devices))  # dp x fsdp x ep: ep devices hold different tokens


# ---------------------------------------------------------------- the command

def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(
        prog="jaxmem tune", formatter_class=HelpFormatter,
        description="Walk the memory decision flow for a config on a GPU target you may not have: bf16 mixed "
                    "precision, then activation recomputation, then offloading the optimizer state, the "
                    "activations and the parameters, then the largest micro-batch that fits, then gradient "
                    "accumulation up to the global batch. Analytic bills prune, deviceless compiles (cached, in "
                    "worker processes) confirm, the cost model ranks; writes the fastest config that fits as "
                    "YAML (`jaxmem train` loads it as is).",
        epilog="examples:\n"
               "  jaxmem tune configs/llama3-8b-8xh100.yaml --target h100-80g --gpus-per-host 8 --global-batch 64\n"
               "  jaxmem tune configs/tiny.yaml --target rtx4090-24g --gpus-per-host 1 --out tuned.yaml --json t.json")
    ap.add_argument("config", help="a config YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides (kept in every candidate)")
    add_target_args(ap)
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default: the "
                                                                   "config's)")
    ap.add_argument("--budget-s", type=float, default=900.0, help="stop compiling after this many seconds "
                                                                 "(default: 900)")
    ap.add_argument("--out", default="tuned.yaml", help="where to write the chosen config (default: tuned.yaml)")
    ap.add_argument("--json", dest="json_path", default=None, help="also write every candidate as JSON")
    ap.add_argument("--plot", default=None, help="Pareto plot of the compiled candidates (PNG)")
    ap.add_argument("--cache", default=".cache/jaxmem-tune", help="plan cache folder (default: .cache/jaxmem-tune)")
    ap.add_argument("--workers", type=int, default=2, help="compile worker processes (a candidate that may not fit is "
                                                            "compiled beside the next ones); 0: in this process")
    ap.add_argument("--allow-lossy-optimizer", action="store_true",
                    help="also search the optimizer state: int8 / int4 AdamW moments and bf16 weights without an fp32 "
                         "master (smaller, but lossy: docs/optimizers.md); without it the config's own is kept")
    ap.add_argument("--verify", action="store_true", help="run `jaxmem bench` on the winner on the attached "
                                                          "devices and print planned vs measured")
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.config).is_file():
        raise ConfigError(f"{args.config}: config file not found")
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError(f"--global-batch: must be >= 1, got {args.global_batch}")
    target = {k: v for k, v in (("name", args.target), ("gpus_per_host", args.gpus_per_host),
                                ("hosts", args.hosts)) if v is not None}
    tuner = Tuner(args.config, args.overrides, target, args.global_batch, args.budget_s, Path(args.cache),
                  args.workers, allow_lossy=args.allow_lossy_optimizer)
    print(optimizer_note(tuner.allow_lossy))
    best = tuner.run()
    print("\n".join(table(tuner)))
    print("path:\n" + "\n".join(f"  {step}" for step in tuner.path))
    if args.json_path:
        record = to_json(tuner, best, optimizer_note(tuner.allow_lossy))
        Path(args.json_path).write_text(json.dumps(record, indent=2, default=str))
    if args.plot:
        plot(tuner, best, Path(args.plot))
    if best is None:
        near = tuner.closest()
        print(f"nothing fits on {tuner.topo.label} within the budget; closest: "
              f"{near.label if near else '-'}" + (f" at {_gib(near.row['device_bytes'])} GiB compiled"
                                                    if near and near.row else ""))
        return 1
    write_yaml(tuner, best, Path(args.out))
    for line in phase_lines(tuner, best):  # a run of several programs: each phase of the winner
        print(line)
    print(f"chose {best.label}: {_gib(best.row['device_bytes'])} GiB per GPU (compiled for target), "
          f"{best.tokens_per_second():,.0f} tokens/s (estimated); wrote {args.out}")
    if args.verify:
        v = verify(tuner, best)
        print(f"verify: planned {_gib(v['planned_device_bytes'])} GiB ({v['planned_label']}), compiled here "
              f"{_gib(v['compiled_here_bytes'])} GiB, measured peak {_gib(v['measured_peak_bytes'])} GiB "
              f"({v['measured_label']}); step {v['measured_step_seconds']:.3f} s measured vs "
              f"{v['estimated_step_seconds']:.3f} s estimated")
    return 0
