"""Writes the files docs/preference.md starts from, made offline: a tiny Hugging Face Llama folder (random weights
of the `tiny` preset) with a word-level tokenizer and a Llama-3-style chat template, and a pairs file
(prompt / chosen / rejected: plain strings and TRL's conversational form) whose chosen answers follow one rule.

    python scripts/preference_example.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxmem.loader import load_config  # noqa: E402
from jaxmem.io.hf import save_hf  # noqa: E402
from jaxmem.model import init_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from word_tokenizer import write_word_tokenizer  # noqa: E402

WORDS = ("user assistant the a cat dog sat on mat why how what is it blue red sky sea fish runs jumps yes no "
         "please tell me about").split()


def write_tokenizer(folder: Path) -> None:
    write_word_tokenizer(folder, WORDS)


def write_pairs(path: Path, n: int = 64) -> None:
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS[2:], int(rng.integers(2, 8))))
        k = int(rng.integers(1, 4))
        chosen, rejected = " ".join(["yes the cat"] * k), " ".join(["no a dog"] * k)
        if i % 4 == 3:  # TRL's conversational form
            lines.append({"prompt": [{"role": "user", "content": prompt}],
                          "chosen": [{"role": "assistant", "content": chosen}],
                          "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            lines.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    (out / "hf").mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, ["model.preset=tiny"])
    save_hf(init_model(cfg.model, seed=0), out / "hf", dtype="bfloat16")
    write_tokenizer(out / "hf")
    write_pairs(out / "pairs.jsonl")
    print(f"wrote {out / 'hf'} (a tiny Llama, its tokenizer and chat template) and {out / 'pairs.jsonl'} (64 pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
