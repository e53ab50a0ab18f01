"""The memory ladder for Llama-3-8B on 8 x H100: fp32 -> bf16 -> +kernels -> +remat -> +offload.

Runs `jaxmem plan` on configs/ladder/*.yaml (deviceless compiles) and writes benchmarks/ladder.json,
benchmarks/ladder.png and benchmarks/ladder.md.
"""
from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

GIB = 2**30
CONFIGS = sorted(glob.glob("configs/ladder/*.yaml"))


def main() -> None:
    out = Path("benchmarks")
    cmd = [sys.executable, "-m", "jaxmem.cli", "plan", *CONFIGS, "--json", str(out / "ladder.json"),
           "--plot", str(out / "ladder.png")]
    # exit status 1 means "some config does not fit", which the lower rungs are expected to say
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode not in (0, 1):
        raise SystemExit("jaxmem plan failed")
    plans = json.loads((out / "ladder.json").read_text())
    rows = []
    for path, p in zip(CONFIGS, plans):
        a, c = p["analytic"], p["compiled"]
        err = (a["device_total"] - c["device_total"]) / c["device_total"]
        rows.append(f"| {Path(path).stem} | {c['device_total'] / GIB:.2f} | {c['host_total'] / GIB:.2f} | "
                    f"{a['device_total'] / GIB:.2f} ({err:+.0%}) | {'yes' if p['fits'] else 'no'} | "
                    f"{p['cost']['step_seconds']:.2f} s, MFU {p['cost']['mfu']:.0%} |")
    label = plans[0]["compiled"]["label"]
    (out / "ladder.md").write_text(
        "# Memory ladder: Llama-3-8B full fine-tune, FSDP over 8 x h100-80g, seq 4096, micro-batch 1\n\n"
        f"Command: `python scripts/bench_ladder.py` (runs `jaxmem plan {' '.join(CONFIGS)} --plot ...`).\n"
        f"Device and host columns: {label}, GiB per GPU. Analytic: estimated (analytic bill), with its "
        "error against the compiled device total. Step time and MFU: estimated (cost model). Nothing here "
        "was measured on a GPU.\n\n"
        "| rung | device GiB | host GiB | analytic GiB | fits (90% of 80 GB) | step, MFU (estimated) |\n"
        "|---|---:|---:|---:|---|---|\n" + "\n".join(rows) + "\n\n"
        "Rungs: 1 fp32 everything, no remat, plain XLA attention and loss; 2 bf16 weights and compute with "
        "fp32 master weights; 3 flash attention (Pallas) and the chunked LM-head loss; 4 selective remat; "
        "5 layer inputs offloaded to pinned host memory and the optimizer state on the host, updated there.\n"
        "The analytic bill over-estimates rung 5: with the update on the host it still counts a "
        "device-side layer phase that XLA does not keep (see plan_accuracy.md).\n\n![ladder](ladder.png)\n")
    print((out / "ladder.md").read_text())


if __name__ == "__main__":
    main()
