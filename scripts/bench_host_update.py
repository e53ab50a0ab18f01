"""Host-side AdamW update throughput on this machine's CPU: jaxmem's update under XLA host compute against
torch.optim.AdamW(fused=True).

The jax candidates run what the train step runs for `offload.optimizer=host, offload.optimizer_update=host`:
`jaxmem.core.offload.run_update` (compat.host_compute, state and fp32 master in pinned host memory, the state
donated as the step donates it) over fp32 gradients, fp32 master weights, m and v, writing bf16 params:
- layerwise: the update as it ran before (jaxmem.optim.layerwise.layerwise_update, a lax.scan over the layers);
- whole: jaxmem.optim.host_update.whole_update (the layers vmapped): XLA:CPU's code, what the step runs on the host
  with kernels.host_update=xla, and by default in a GPU program or over several devices;
- whole_fused: the same step through the one-pass C++ kernel (jaxmem.kernels.host_adamw), what a one-device CPU
  program runs by default (kernels.host_update=auto);
- whole_int8, whole_int4: the same with AdamW's m and v block-quantized (precision.moment_dtype=int8 / int4; no
  torch counterpart here: its fused AdamW keeps fp32 moments); whole_int8_fused, whole_int4_fused: those
  through the kernel's block-quantized variant (the default for them in a one-device CPU program);
- whole_plain (a diagnostic): whole_update jitted on its own, no host compute, so without the copies of the
  gradients to the host and of the new params back that run_update makes (transfers over PCIe on a GPU box);
- adamw_only (a diagnostic, not an update jaxmem runs): optax AdamW on the fp32 master alone, no clip, no bf16
  params, no host compute: XLA:CPU's code for the fused step torch_step runs;
- fused_only (a diagnostic): the kernel alone on every tensor, no clip, no host compute: torch_step's work plus
  the bf16 params it writes.
torch, same tensors: torch_step is the fused AdamW step alone; torch_same_work adds what the jax update also
does, clip_grad_norm_ (foreach) and the copy into bf16 params.

Each XLA flag set runs in its own process (flags are read once); inside it every round runs every candidate
once, interleaved, so load from other processes falls on all alike; best and median over the rounds.
`ratio_vs_torch` = params/s of the fastest jax candidate / params/s of torch_same_work in the same process.

Usage: python scripts/bench_host_update.py --params 48e6 --json benchmarks/host_update.json
       [--md benchmarks/host_update.md] [--rounds 7]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time

DEFAULT_UPDATE = "whole_fused"  # what a one-device CPU program's host update runs (kernels.host_update=auto)
FLAG_SETS = {"default": "", "region_analysis": "--xla_cpu_copy_insertion_use_region_analysis=true"}
OVERRIDES = ["precision.param_dtype=bfloat16", "precision.master_weights=true", "optimizer.warmup_steps=0",
             "offload.optimizer=host", "offload.optimizer_update=host"]


def shapes(n_params: float, d: int = 1024, vocab: int = 8192) -> dict:
    """A Llama-like tree of about n_params: an embedding and a stack of layers of 10 d^2 (norm, wq, wo, MLP)."""
    layers = max(1, round((n_params - vocab * d) / (10 * d * d)))
    stack = lambda *s: (layers,) + s  # noqa: E731
    return {"embed": (vocab, d), "final_norm": (d,),
            "layers": {"attn_norm": stack(d), "wq": stack(d, d), "wo": stack(d, d), "w_up": stack(d, 4 * d),
                       "w_down": stack(4 * d, d)}}


def _jax_candidates(tree_shapes: dict):
    """{name: (step, state)}: step(grads, state) -> state, jitted with the state donated."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmem.loader import load_config
    from jaxmem.core import offload
    from jaxmem.kernels.host_adamw import host_adamw, register
    from jaxmem.optim import adamw_lowbit, choice, fused_host, host_update, layerwise

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"), OVERRIDES)
    opt = choice.make_optimizer(cfg)
    rng = np.random.default_rng(0)
    draw = lambda scale: jax.tree.map(  # noqa: E731
        lambda s: jnp.asarray(scale * rng.standard_normal(s, dtype=np.float32)), tree_shapes,
        is_leaf=lambda x: isinstance(x, tuple))
    grads = draw(1e-3)
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_host = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, host if x.ndim else jax.sharding.SingleDeviceSharding(device)), t)
    if jax.default_backend() == "gpu":  # whole_fused: the kernel in a GPU program's host computation
        register("gpu")
    kw = dict(clip_norm=cfg.optimizer.clip_norm, param_dtype=jnp.bfloat16, skip_nonfinite=False)
    updates = {"layerwise": functools.partial(layerwise.layerwise_update, opt, **kw),
               "whole": functools.partial(host_update.whole_update, opt, **kw),
               "whole_fused": functools.partial(host_update.whole_update, opt,
                                                fused=fused_host.FusedAdamW.from_config(cfg), **kw)}
    lowbit = {f"whole_int{bits}": adamw_lowbit.make_lowbit_adamw(cfg, f"int{bits}") for bits in (8, 4)}
    updates.update({name: functools.partial(host_update.whole_update, low, **kw) for name, low in lowbit.items()})
    fused = fused_host.FusedAdamW.from_config(cfg)
    updates.update({f"{name}_fused": functools.partial(host_update.whole_update, low, fused=fused, **kw)
                    for name, low in lowbit.items()})
    lowbit.update({f"{name}_fused": low for name, low in list(lowbit.items())})
    optimizers = dict(dict.fromkeys(updates, opt), **lowbit)
    out = {}
    for name, update in updates.items():
        def step(g, state, update=update):
            params, opt_state, master, _ = offload.run_update(cfg, update, g, state["opt"], state["master"], None,
                                                              jnp.float32(1.0))
            return {"params": params, "opt": opt_state, "master": master}

        master = draw(1.0)
        state = {"params": jax.tree.map(lambda x: x.astype(jnp.bfloat16), master),
                 "opt": on_host(layerwise.init_opt_state(optimizers[name], master)), "master": on_host(master)}
        out[name] = (jax.jit(step, donate_argnums=(1,), keep_unused=True), state)

    def whole_plain(g, state):
        params, opt_state, master, _ = updates["whole"](g, state["opt"], state["master"], None, jnp.float32(1.0))
        return {"params": params, "opt": opt_state, "master": master}

    def fused_only(g, state):
        scalars = jnp.array([1e-3, 0.1, 0.05, 1.0, 0.0], jnp.float32)
        out = jax.tree.map(lambda g, w, m, v: host_adamw(g, w, m, v, scalars, b1=0.9, b2=0.95, eps=1e-8, decay=0.1),
                           g, state["master"], state["m"], state["v"])
        pick = lambda i: jax.tree.map(lambda _, o: o[i], g, out)  # noqa: E731
        return {"master": pick(0), "m": pick(1), "v": pick(2), "params": pick(3)}

    def adamw_only(g, state):
        updates, opt_state = opt.update(g, state["opt"], state["master"])
        return {"opt": opt_state, "master": jax.tree.map(jnp.add, state["master"], updates)}

    if jax.default_backend() == "cpu":  # elsewhere these would run on the accelerator, not the host
        master = draw(1.0)
        state = {"params": jax.tree.map(lambda x: x.astype(jnp.bfloat16), master),
                 "opt": layerwise.init_opt_state(opt, master), "master": master}
        out["whole_plain"] = (jax.jit(whole_plain, donate_argnums=(1,), keep_unused=True), state)
        master = draw(1.0)
        out["adamw_only"] = (jax.jit(adamw_only, donate_argnums=(1,)), {"opt": opt.init(master), "master": master})
        zeros = lambda dtype: jax.tree.map(lambda x: jnp.zeros_like(x, dtype), master)  # noqa: E731
        state = {"master": draw(1.0), "m": zeros(jnp.float32), "v": zeros(jnp.float32), "params": zeros(jnp.bfloat16)}
        out["fused_only"] = (jax.jit(fused_only, donate_argnums=(1,), keep_unused=True), state)
    return grads, out


def hlo_counts(step, grads, state) -> dict:
    """What the compiled update is made of: its loop fusions, whole-array copies and while loops."""
    import re

    text = step.lower(grads, state).compile().as_text()
    copies = [line for line in text.splitlines() if re.search(r"= \S+\[\d[^\]]*\]\S* copy\(", line)]
    return {"fusions": len(re.findall(r"= \S+ fusion\(", text)), "array_copies": len(copies),
            "while_loops": len(re.findall(r"= \(.*\) while\(", text))}


def _torch_candidates(tree_shapes: dict, clip_norm: float):
    import numpy as np
    import torch

    torch.set_num_threads(os.cpu_count())
    rng = np.random.default_rng(0)
    sizes = _leaves(tree_shapes)
    params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s, dtype=np.float32))) for s in sizes]
    for p, s in zip(params, sizes):
        p.grad = torch.from_numpy(1e-3 * rng.standard_normal(s, dtype=np.float32))
    bf16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    adamw = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)

    def same_work():
        torch.nn.utils.clip_grad_norm_(params, clip_norm, foreach=True)
        adamw.step()
        for b, p in zip(bf16, params):
            b.copy_(p)

    return {"torch_step": adamw.step, "torch_same_work": same_work}


def _leaves(tree):
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _leaves(v)]
    return [tree]


def child(flag_set: str, n_params: float, rounds: int) -> dict:
    """One flag set's figures: every candidate once per round, interleaved; seconds per update."""
    import jax

    tree_shapes = shapes(n_params)
    n = sum(math.prod(s) for s in _leaves(tree_shapes))
    grads, jax_runs = _jax_candidates(tree_shapes)
    torch_runs = _torch_candidates(tree_shapes, clip_norm=1.0)
    states, counts = {}, {}
    for name, (step, state) in jax_runs.items():
        counts[name] = hlo_counts(step, grads, state)
        states[name] = jax.block_until_ready(step(grads, state))  # compile + one warm step
    for run in torch_runs.values():
        run()
    seconds = {name: [] for name in list(jax_runs) + list(torch_runs)}
    for _ in range(rounds):
        for name, (step, _) in jax_runs.items():
            start = time.perf_counter()
            states[name] = jax.block_until_ready(step(grads, states[name]))
            seconds[name].append(time.perf_counter() - start)
        for name, run in torch_runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    figures = {name: {"best_s": min(s), "median_s": sorted(s)[len(s) // 2], "params_per_s": n / min(s)}
               for name, s in seconds.items()}
    torch_same = figures["torch_same_work"]["params_per_s"]
    for name in jax_runs:  # the low-bit updates do more work than torch's: their ratios are for scale only
        figures[name].update(counts[name])
        figures[name]["ratio_vs_torch_same_work"] = figures[name]["params_per_s"] / torch_same
        figures[name]["ratio_vs_torch_step"] = figures[name]["params_per_s"] / figures["torch_step"]["params_per_s"]
    return {"flags": FLAG_SETS[flag_set], "params": n, "layers": tree_shapes["layers"]["wq"][0],
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "figures": figures}


def _run_child(flag_set: str, args) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=args.platform, XLA_FLAGS=FLAG_SETS[flag_set])
    cmd = [sys.executable, __file__, "--child", flag_set, "--params", str(args.params), "--rounds", str(args.rounds),
           "--platform", args.platform]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench_host_update: the {flag_set} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("jax", "jaxlib", "optax", "torch")}


def _row(flag_set: str, name: str, f: dict) -> str:
    ratio = lambda key: "" if key not in f else f"{f[key]:.2f}x"  # noqa: E731
    hlo = "" if "fusions" not in f else f"{f['fusions']} / {f['array_copies']} / {f['while_loops']}"
    return (f"| {flag_set} | {name} | {1e3 * f['best_s']:.1f} | {1e3 * f['median_s']:.1f} | {f['params_per_s']:.3g} "
            f"| {ratio('ratio_vs_torch_same_work')} | {ratio('ratio_vs_torch_step')} | {hlo} |")


FINDINGS = """
## What limits XLA:CPU here

- The layer scan. `layerwise_update` walks the stacked layers with `lax.scan`; XLA:CPU emits each
  iteration's dynamic-update-slice of the stacked state as a pass over the whole stack, and its copy insertion
  adds whole-stack copies of master, m and v inside the loop (the `array copies` column), so the update costs
  about layers x stack. `--xla_cpu_copy_insertion_use_region_analysis=true` removes the copies but not the
  whole-stack passes. Updating the stack at once (`whole`: the per-layer optimizer vmapped, no loop) removes
  both; on the host the scan saves nothing (it bounds device temporaries).
- No multi-output fusion. XLA:CPU writes m, v, the master and the bf16 params from four separate loop
  fusions, each reading back what the previous one wrote (about 50 bytes per parameter with the norm pass,
  against 28 for torch's one fused loop), so `adamw_only`, XLA's code for torch's fused step, stays below
  torch_step. No XLA:CPU flag of this jaxlib turns multi-output fusion on, and cache-sized pieces in a loop
  did not help either (a fori_loop over 256K-value slices: slower than whole tensors, and a bf16
  dynamic-update-slice becomes a whole-array fp32 pass).
- What closes it: `whole_fused` runs each tensor through one C++ loop (jaxmem/kernels/host_adamw, through
  XLA's FFI, split over XLA's intra-op threads): it reads the gradient, master, m and v once and writes
  master, m, v and the bf16 params once (30 bytes per parameter, plus the norm pass XLA runs before it).
  `fused_only` is that kernel alone, torch_step's work plus the bf16 params. Its block-quantized variant
  (`whole_int8_fused`, `whole_int4_fused`) dequantizes a block of m and v, updates it, and requantizes it
  from a block-sized buffer, one pass over the codes. The kernel is the default in one-device CPU programs;
  a GPU program's host compute is compiled by the CUDA plugin's own XLA:CPU, where jaxmem registers it too
  (`kernels.host_update=fused`; compiled, not yet run on a GPU, so there the default update stays `whole`).
- Not threads: each fusion is split over the cores (`outer_dimension_partitions` in the compiled HLO), and
  the update is bound by memory traffic, not arithmetic (`--xla_cpu_enable_fast_math` changes nothing).
- The host-compute boundary: run_update moves the gradients to host memory and the new params back; on CPU
  jax both spaces are host memory and `whole_plain` (the same update without host compute) shows what that
  costs here; on a GPU box these are PCIe transfers, not measured here.
- Donation matters: without it every update writes fresh buffers, and first-touch page faults cost more than
  the arithmetic. The train step donates its state, params included, and so does every candidate here
  (`keep_unused=True`, so the old params' buffer, which the update does not read, stays an input that the
  new params can be written into, as in the step where the forward pass reads it).
"""


def markdown(result: dict) -> str:
    m = result["machine"]
    where = "Measured on CPU" if m["jax_backend"] == "cpu" else (
        f"Measured on the host CPU of a {m['jax_device']} machine (the jax update under XLA host compute inside a "
        f"{m['jax_backend']} program, gradients on the GPU; torch on the same CPU)")
    lines = [
        "# Host-side AdamW update: XLA host compute vs torch fused AdamW",
        "",
        f"{where}: {m['cpu_count']} cores ({m['cpu_model']}), load average {m['load_before']} before and "
        f"{m['load_after']} after (the machine is shared, so absolute figures move run to run; the ratios are "
        f"taken inside one process, interleaved); {result['params']:,} parameters ({result['layers']} layers of "
        "d=1024 plus an 8192 x 1024 embedding), fp32 gradients, master, m and v, bf16 params; "
        f"{result['rounds']} rounds, best of them. " + ", ".join(f"{k} {v}" for k, v in result["versions"].items())
        + ".",
        ("Regenerate: `python scripts/bench_host_update.py --params N --json benchmarks/host_update.json "
         "--md benchmarks/host_update.md`." if m["jax_backend"] == "cpu" else
         "Regenerate on a GPU machine: `bash scripts/gpu_optimizer_states.sh OUT` (`--platform cuda`); "
         "`--from-json FILE --md FILE` rewrites this page."),
        "",
        "| XLA flags | candidate | best ms | median ms | params/s | vs torch same work | vs torch step "
        "| fusions / array copies / while loops |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [_row(flag_set, name, f) for flag_set, run in result["runs"].items() for name, f in run["figures"].items()]
    lines += ["", f"**ratio_vs_torch** (fastest jaxmem update, {result['best_jax']}, over torch doing the same work): "
                  f"{result['ratio_vs_torch']:.2f}x; over torch's fused step alone: "
                  f"{result['ratio_vs_torch_step']:.2f}x. The update a one-device CPU program runs on the host "
                  f"(whole_fused, default flags): {result['default_ratio_vs_torch']:.2f}x of torch's same work, "
                  f"{result['default_ratio_vs_torch_step']:.2f}x of its step; XLA's code for it, which a GPU "
                  f"program's host compute runs (whole, default flags): {result['xla_ratio_vs_torch']:.2f}x and "
                  f"{result['xla_ratio_vs_torch_step']:.2f}x; the layer scan before it (layerwise, default flags): "
                  f"{result['today_ratio_vs_torch']:.2f}x. With int8 / int4 moments (whole_int8, "
                  "whole_int4: XLA's code; whole_int8_fused, whole_int4_fused: the kernel) the update does more "
                  "per parameter (dequantize, requantize) and moves fewer bytes; torch's fused AdamW has no such "
                  "state, so their ratios only give the scale.",
              FINDINGS if m["jax_backend"] == "cpu" else ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=48e6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS of the measuring processes (cuda: the "
                                                          "update under host compute inside a GPU program)")
    parser.add_argument("--from-json", default=None, help="write --md from this earlier --json, measuring nothing")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f, open(args.md, "w") as out:
            out.write(markdown(json.load(f)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.params, args.rounds)))
        return
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    runs = {name: _run_child(name, args) for name in FLAG_SETS}
    best_flags, best_name = max(((f, c) for f, r in runs.items() for c in ("layerwise", "whole", "whole_fused")),
                                key=lambda fc: runs[fc[0]]["figures"][fc[1]]["params_per_s"])
    best = runs[best_flags]["figures"][best_name]
    cpu_model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
                     platform.processor())
    result = {"machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model, "load_before": load_before,
                          "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
                          "jax_backend": runs["default"]["backend"], "jax_device": runs["default"]["device"]},
              "params": runs["default"]["params"], "layers": runs["default"]["layers"], "rounds": args.rounds,
              "versions": _versions(), "runs": runs, "best_jax": f"{best_name} ({best_flags} flags)",
              "ratio_vs_torch": best["ratio_vs_torch_same_work"], "ratio_vs_torch_step": best["ratio_vs_torch_step"],
              "today_ratio_vs_torch": runs["default"]["figures"]["layerwise"]["ratio_vs_torch_same_work"],
              "default_ratio_vs_torch": runs["default"]["figures"][DEFAULT_UPDATE]["ratio_vs_torch_same_work"],
              "default_ratio_vs_torch_step": runs["default"]["figures"][DEFAULT_UPDATE]["ratio_vs_torch_step"],
              "xla_ratio_vs_torch": runs["default"]["figures"]["whole"]["ratio_vs_torch_same_work"],
              "xla_ratio_vs_torch_step": runs["default"]["figures"]["whole"]["ratio_vs_torch_step"],
              "seconds_per_param": {name: 1 / runs["default"]["figures"][name]["params_per_s"]
                                    for name in ("whole", "whole_fused", "whole_int8", "whole_int4",
                                                 "whole_int8_fused", "whole_int4_fused")}}
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
