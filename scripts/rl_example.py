"""Writes the files docs/rl.md starts from, made offline: a tiny Hugging Face Llama folder (random weights of the
`tiny` preset, a 32-token vocabulary) with a word-level tokenizer (digits, a few words, Llama-3-style special tokens and chat template)
and a prompts file of sums "a plus b" (a + b <= 9) with each record's `answer`, the field configs/rl/rewards.py
checks.

    python scripts/rl_example.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxmem.loader import load_config  # noqa: E402
from jaxmem.io.hf import save_hf  # noqa: E402
from jaxmem.model import init_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from word_tokenizer import write_word_tokenizer  # noqa: E402

WORDS = [str(d) for d in range(10)] + "plus equals user assistant the answer is what".split()


VOCAB = 32  # the tokenizer's 23 ids, padded: a random model's completions are mostly real words


def write_tokenizer(folder: Path) -> None:
    write_word_tokenizer(folder, WORDS)


def write_prompts(path: Path) -> None:
    lines = [json.dumps({"prompt": f"{a} plus {b}", "answer": str(a + b)}) for a in range(10) for b in range(10 - a)]
    path.write_text("\n".join(lines) + "\n")


def main(out: str) -> None:
    folder = Path(out)
    (folder / "hf").mkdir(parents=True, exist_ok=True)
    cfg = load_config("configs/tiny.yaml", ["model.preset=tiny", f"model.vocab_size={VOCAB}"])
    save_hf(init_model(cfg.model, seed=0), folder / "hf", dtype="float32")
    write_tokenizer(folder / "hf")
    write_prompts(folder / "prompts.jsonl")
    print(f"wrote {folder / 'hf'} (tiny Llama, random weights, tokenizer) and {folder / 'prompts.jsonl'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "rl_example")
