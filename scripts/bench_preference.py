"""Preference tuning benchmarks. Writes benchmarks/preference.json and benchmarks/preference.md.

1. Measured on CPU: a DPO LoRA run of a tiny Llama-style model made offline (word-level tokenizer, random
   weights) on 64 pairs whose chosen completions follow one rule and rejected ones another: the steps until
   rewards/accuracies (the share of a step's pairs whose chosen reward beats the rejected) goes above 0.9.
2. Compiled deviceless for one H100 80GB: Llama-3-8B at seq 4096, LoRA (bf16 base) and QLoRA (nf4), one pair per
   micro-batch: DPO's compiled device peak against an SFT step on the same two sequences, and the ten largest
   buffers at DPO's peak (`jaxmem explain`), none of them [tokens, vocab].

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_preference.py [--cpu-only | --compiled-only]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny tokenizer the tests make offline (tests/chat_fixtures.py)
OUT = ROOT / "benchmarks"
GIB = 1024**3
RECIPE = "configs/preference/llama3-8b-dpo-lora-1xh100.yaml"
PAIR = ["train.micro_batch=2", "train.global_batch=2", "train.seq_len=4096", "target.name=h100-80g",
        "checkpoint.init_from=''"]
QLORA = ["lora.base_dtype=nf4", "lora.double_quant=true"]
SFT = ["train.objective=sft", "data.kind=synthetic", "data.format=text"]
STEPS, TARGET = 200, 0.9


def _pairs(path: Path, n: int = 64) -> None:
    """Pairs whose chosen completion answers with 'yes' words and whose rejected one with 'no' words."""
    import numpy as np
    from chat_fixtures import sentence

    rng = np.random.default_rng(0)
    lines = []
    for _ in range(n):
        k = int(rng.integers(2, 6))
        lines.append(json.dumps({"prompt": sentence(rng), "chosen": " ".join(["yes", "the", "cat"] * k),
                                 "rejected": " ".join(["no", "a", "dog"] * k)}))
    path.write_text("\n".join(lines) + "\n")


def cpu_run() -> dict:
    """The DPO run, measured on CPU: rewards/accuracies per logged step."""
    from chat_fixtures import write_tokenizer
    from jaxmem.features import load_config
    from jaxmem.train import run

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = write_tokenizer(tmp / "tok")
        _pairs(tmp / "pairs.jsonl")
        cfg = load_config("configs/tiny.yaml", [
            f"out_dir={tmp / 'run'}", "data.kind=jsonl", f"data.path={tmp / 'pairs.jsonl'}",
            f"data.tokenizer={tokenizer}", "data.format=preference", "train.objective=dpo", "lora.rank=8",
            "lora.alpha=16", "parallel.fsdp=1", "train.micro_batch=8", "train.seq_len=64", f"train.steps={STEPS}",
            "train.log_every=1", "train.progress=false", "optimizer.lr=2e-3", "optimizer.warmup_steps=10",
            "checkpoint.every=0", "preference.beta=0.1"])
        summary = run(cfg)
    records = [{"step": r["step"], "loss": r["loss"], "accuracy": r["rewards/accuracies"],
                "margin": r["rewards/margins"]} for r in summary["records"]]
    window = 10  # the mean over the last ten steps (4 pairs a step)
    means = [sum(r["accuracy"] for r in records[i - window:i]) / window for i in range(window, len(records) + 1)]
    first = next((records[i + window - 1]["step"] for i, m in enumerate(means) if m > TARGET), None)
    return {"label": "measured on CPU", "steps": STEPS, "pairs_per_step": 4, "first_step_over_target": first,
            "target": TARGET, "window": window, "final_mean_accuracy": means[-1], "records": records}


def _compiled(overrides: list[str], explain: bool) -> dict:
    from jaxmem.features import load_config
    from jaxmem.plan import plan, resolve_topology
    from jaxmem.plan.explain import explain as explain_peak

    cfg = load_config(ROOT / RECIPE, overrides)
    topo = resolve_topology(cfg)
    p = plan(cfg, topo, compile=True, source=RECIPE)
    out = {"device_total": p["compiled"]["device_total"], "label": p["compiled"]["label"],
           "analytic": p["analytic"]["device_total"]}
    if explain:
        result = explain_peak(cfg, topo, top=10)
        tokens, vocab = cfg.train.micro_batch * cfg.train.seq_len, cfg.model.vocab_size
        out["top_buffers"] = [{k: b.get(k) for k in ("bytes", "shape", "kind", "name") if k in b}
                              for b in result["buffers"]]
        out["largest_buffer"] = max(b["bytes"] for b in result["buffers"])
        out["token_vocab_bytes"] = tokens * vocab * 2  # the smallest [tokens, vocab] buffer (bf16)
    return out


def compiled_rows() -> list[dict]:
    rows = []
    for name, base in (("LoRA (bf16 base)", []), ("QLoRA (nf4)", QLORA)):
        dpo = _compiled(PAIR + base, explain=True)
        sft = _compiled(PAIR + base + SFT, explain=False)
        rows.append({"name": f"Llama-3-8B {name}, seq 4096, 1 x H100 80GB", "dpo": dpo, "sft": sft,
                     "ratio": dpo["device_total"] / sft["device_total"]})
        print(f"{name}: DPO {dpo['device_total'] / GIB:.2f} GiB, SFT {sft['device_total'] / GIB:.2f} GiB", flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = ["# Preference tuning (DPO)", "",
             "Written by `scripts/bench_preference.py`; docs/preference.md explains the levers.", ""]
    cpu = result.get("cpu")
    if cpu:
        lines += ["## A tiny DPO run learns its pairs (measured on CPU)", "",
                  f"A DPO LoRA run (rank 8) of the `tiny` preset (random weights, a word-level tokenizer made "
                  f"offline) on 64 pairs, {cpu['pairs_per_step']} pairs a step, {cpu['steps']} steps: "
                  f"rewards/accuracies averaged over {cpu['window']} steps first went above {cpu['target']} at "
                  f"step **{cpu['first_step_over_target']}**; over the last {cpu['window']} steps it was "
                  f"{cpu['final_mean_accuracy']:.2f}.", ""]
    rows = result.get("compiled")
    if rows:
        lines += ["## A pair costs what two SFT sequences cost (compiled deviceless for h100-80g)", "",
                  "One pair per micro-batch (its chosen and rejected sequences, 4096 tokens each), "
                  f"`{RECIPE}` with `train.global_batch=2`; the SFT row is the same config with "
                  "`train.objective=sft` on two 4096-token sequences. Device GiB per GPU, XLA's memory analysis "
                  "of the train step compiled for the GPU on this CPU-only machine; nothing here ran on a GPU.", "",
                  "| run | DPO GiB | SFT GiB | DPO / SFT | largest buffer at DPO's peak | [tokens, vocab] bf16 |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            d = r["dpo"]
            lines.append(f"| {r['name']} | **{d['device_total'] / GIB:.2f}** | {r['sft']['device_total'] / GIB:.2f} "
                         f"| **{r['ratio']:.3f}** | {d['largest_buffer'] / GIB:.3f} GiB | "
                         f"{d['token_vocab_bytes'] / GIB:.2f} GiB (none in the top ten) |"
                         if d["largest_buffer"] < d["token_vocab_bytes"] else
                         f"| {r['name']} | {d['device_total'] / GIB:.2f} | {r['sft']['device_total'] / GIB:.2f} | "
                         f"{r['ratio']:.3f} | {d['largest_buffer'] / GIB:.3f} GiB | a [tokens, vocab]-sized buffer |")
        lines += ["", "The reference is the frozen base with the adapters off: one more forward without the "
                  "adapters' terms, under stop_gradient, so it keeps no residual for the backward; the log-probs "
                  "come per token from the chunked LM head + loss, so no [tokens, vocab] logits exist."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    path = OUT / "preference.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    if "--compiled-only" not in argv:
        result["cpu"] = cpu_run()
        print(f"cpu: first step over {TARGET}: {result['cpu']['first_step_over_target']}", flush=True)
    if "--cpu-only" not in argv:
        result["compiled"] = compiled_rows()
    path.write_text(json.dumps(result, indent=1) + "\n")
    (OUT / "preference.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
