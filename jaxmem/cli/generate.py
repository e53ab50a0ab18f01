"""`jaxmem generate RUN_DIR | HF_DIR`: completions of prompts, decoded in JAX with a key/value cache.

A run's folder decodes its latest (or --step) checkpoint through its train program (a LoRA run: the adapters
applied unmerged on the base as it trains, a QLoRA base dequantized per layer); a Hugging Face folder loads
its weights. Stop tokens: generation_config.json's eos ids (a run: its tokenizer's eos and the chat template's
end-of-turn token, as export-hf writes them).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxmem.cli.export_hf import restored_step, run_config
from jaxmem.cli.help import HelpFormatter
from jaxmem.config.schema import ConfigError
from jaxmem.generation.decoder import Decoder
from jaxmem.generation.sampling import Sampling
from jaxmem.generation.text import CACHE_DTYPES, Generator, hf_codec, prompt_lines, run_codec
from jaxmem.io.hf import load_hf
from jaxmem.train.run_folder import resolved_config

_EXAMPLES = """\
examples:
  jaxmem generate exported/sft --prompt "why is the sky blue" --max-new-tokens 64
  jaxmem generate runs/sft --chat --prompt "tell me about the sea" --temperature 0.7 --top-p 0.9 --seed 1
  jaxmem generate runs/sft --prompts prompts.jsonl --chat --cache-dtype int8   # one {"prompt": ...} a line"""


def open_source(source: str | Path, *, step: int | None = None, dtype: str = "float32") -> Generator:
    """A Generator for a run's folder (its checkpoint at `step`, default the latest) or a Hugging Face folder
    (its weights in `dtype`)."""
    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"{source}: no such folder; give a run's out_dir or a Hugging Face folder")
    if resolved_config(path).is_file():
        cfg = run_config(path)
        prog, state, _ = restored_step(cfg, source, step, f"{source}: the run holds no finalized checkpoint")
        return Generator(Decoder.from_program(prog), Decoder.weights_of_state(state), run_codec(cfg),
                         rows_multiple=prog.layout.data_ways)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{source}: neither a run's folder (config.resolved.yaml) nor a Hugging Face folder "
                          "(config.json)")
    if step is not None:
        raise ConfigError("--step: only a run's folder has steps")
    codec = hf_codec(path)  # a missing tokenizer is refused before the weights load
    model = load_hf(path, dtype=dtype)
    return Generator(Decoder.from_model(model), Decoder.weights_of(model), codec)


def read_prompts(path: str | Path) -> list:
    """The prompts of a JSONL file: one object a line with "prompt" (a string) or "messages" (a chat)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts: {path} not found")
    prompts = []
    for number, record in prompt_lines(path, "--prompts"):
        value = record.get("prompt", record.get("messages")) if isinstance(record, dict) else None
        if not isinstance(value, (str, list)):
            raise ConfigError(f"--prompts: {path} line {number} has no \"prompt\" string or \"messages\" list")
        prompts.append(value)
    if not prompts:
        raise ConfigError(f"--prompts: {path} holds no prompt")
    return prompts


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="jaxmem generate", formatter_class=HelpFormatter, epilog=_EXAMPLES,
        description="Complete prompts with a run's checkpoint or a Hugging Face folder: a prefill, then a compiled "
                    "decode loop over a key/value cache that stops when every prompt has produced a stop token. "
                    "Greedy by default (--temperature 0); prompt lengths and the token budget are bucketed, so "
                    "a new length reuses the compiled program.")
    ap.add_argument("source", metavar="RUN_DIR|HF_DIR", help="a `jaxmem train` out_dir, or a Hugging Face folder")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    ap.add_argument("--prompts", default=None, help="a JSONL file: one {\"prompt\": ...} or {\"messages\": [...]} "
                                                    "a line")
    ap.add_argument("--chat", action="store_true", help="render each prompt as a user turn through the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass in (0, 1] (default 1: off)")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling key's seed (default 0)")
    ap.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the latest)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="a Hugging Face folder's weights dtype (default float32)")
    ap.add_argument("--cache-dtype", default=None, choices=CACHE_DTYPES,
                    help="the key/value cache's dtype (default the compute dtype; int8: per token and head scales)")
    ap.add_argument("--json", action="store_true", help="one JSON object a line: prompt, completion")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    prompts = list(args.prompt) + (read_prompts(args.prompts) if args.prompts else [])
    if not prompts:
        raise ConfigError("--prompt or --prompts: give at least one prompt")
    if any(isinstance(p, str) and not p.strip() for p in prompts):
        raise ConfigError("--prompt: an empty prompt; every prompt needs text")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)  # bad values: one line, before any load
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {args.max_new_tokens} must be >= 1")
    generator = open_source(args.source, step=args.step, dtype=args.dtype)
    texts = generator.complete(prompts, chat=args.chat, max_new_tokens=args.max_new_tokens, sampling=sampling,
                               seed=args.seed, cache_dtype=args.cache_dtype)
    for prompt, text in zip(prompts, texts):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text}, ensure_ascii=False))
        else:
            print(f"### {prompt if isinstance(prompt, str) else json.dumps(prompt)}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
