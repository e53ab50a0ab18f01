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

from jaxmem.features import load_config  # noqa: E402
from jaxmem.io.hf import save_hf  # noqa: E402
from jaxmem.model import init_model  # noqa: E402

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = ("user assistant the a cat dog sat on mat why how what is it blue red sky sea fish runs jumps yes no "
         "please tell me about").split()
TEMPLATE = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
            "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": TEMPLATE}))


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
