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

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = [str(d) for d in range(10)] + "plus equals user assistant the answer is what".split()
TEMPLATE = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
            "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


VOCAB = 32  # the tokenizer's 23 ids, padded: a random model's completions are mostly real words


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
