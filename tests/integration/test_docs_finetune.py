"""docs/finetune.md and the README's fine-tune run as written, block by block and in order, in a fresh folder:
the config the page asks the user to save, every `jaxmem` command (as its own process, as a user runs it) and
every Python snippet. The commands are read from the pages (tests/doc_blocks.py), never copied here.

What the test changes, and nothing else:
- the model behind the folder name `Llama-3.2-1B-Instruct`: a tiny Llama (2 layers, width 64) saved by
  transformers, with a word-level tokenizer, Llama-3-style special tokens and chat template
  (tests/chat_fixtures.py), made offline; `data/train.jsonl` and `data/eval.jsonl`: random chats over its words;
- the run's size: every `jaxmem train` line gets TRAIN_SIZE appended (the page's 500 steps of 2048-token rows
  would take hours on a CPU);
- the environment: one CPU device, no network, HOME in the test's folder (so the tokenization cache is too).

A line whose comment mentions Ctrl-C, followed by the same command, is interrupted the way a user would: SIGINT
once the run has started (the run then saves the step it is on and exits 75), and the rerun must resume from that
step.
Besides each command's exit code, the test checks what the page promises of it (EXPECT below)."""
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from chat_fixtures import chat, write_tokenizer
from cpu_env import cpu_env
from doc_blocks import REPO, blocks, section

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FOLDER = "Llama-3.2-1B-Instruct"
TRAIN_SIZE = ["train.steps=12", "train.seq_len=128"]
# What the page says each command does, checked on its output (stdout + stderr) besides its exit code.
EXPECT = {
    "data": ["⟦", "packing efficiency"],
    "plan": ["compiled for 1 x", "(deviceless)", "verdict: fits"],
    "export-hf": ["generate stops at <|eot_id|>"],
}


def _tiny_llama(root):
    """A Hugging Face folder as a user downloads one: weights, config, tokenizer and chat template."""
    folder = root / FOLDER
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=8192, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    write_tokenizer(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = "<|eot_id|>"  # as Llama-3.2-Instruct's own file writes it
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    rng = np.random.default_rng(0)
    (root / "data").mkdir()
    for name, count in (("train", 200), ("eval", 20)):
        (root / "data" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"messages": chat(rng)}) + "\n" for _ in range(count)))


@pytest.fixture
def workdir(tmp_path):
    _tiny_llama(tmp_path)
    return tmp_path


def _env(root):
    return cpu_env(1, HOME=str(root), PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONUNBUFFERED="1")


def _argv(command):
    argv = list(command.argv)
    assert argv[0] == "jaxmem", f"{command}: the page's bash blocks hold jaxmem commands only"
    extra = TRAIN_SIZE if argv[1] == "train" else []
    return [sys.executable, "-m", "jaxmem.cli", *argv[1:], *extra]


def _interrupt(command, root):
    """Runs `command`, sends SIGINT once the run has started, and returns (exit code, output)."""
    log = root / f"interrupted-{command.line}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_argv(command), cwd=root, env=_env(root), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "starting at step" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=300)
    return code, log.read_text()


def _run_page(page_blocks, root):
    """Runs the blocks in order in `root`; returns what ran, one line each, for the failure messages."""
    ran, resume_from = [], None
    for block in page_blocks:
        assert not block.gpu_only, f"{block}: a fine-tune walkthrough must run on CPU"
        if block.lang == "yaml":
            assert block.filename, f"{block}: a config block of the walkthrough names its file (# NAME.yaml)"
            (root / block.filename).write_text(block.text)
        elif block.lang == "python":
            done = subprocess.run([sys.executable, "-c", block.text], cwd=root, env=_env(root), capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, f"{block} failed:\n{done.stdout}\n{done.stderr}"
            ran.append((str(block), done.stdout))
        elif block.lang == "bash":
            commands = block.commands()
            for command, then in zip(commands, commands[1:] + [None]):
                if command.interrupted and then is not None and then.argv == command.argv:
                    code, out = _interrupt(command, root)
                    assert code == 75 and "SIGINT: saved step" in out, f"{command}: exit {code}\n{out}"
                    resume_from = int(out.split("SIGINT: saved step ")[1].split()[0])
                else:
                    done = subprocess.run(_argv(command), cwd=root, env=_env(root), capture_output=True, text=True,
                                          timeout=600)
                    out = done.stdout + done.stderr
                    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{out}"
                    if resume_from is not None:  # the line after an interrupted run resumes it
                        assert f"resuming at step {resume_from} of 12" in out, f"{command}\n{out}"
                        resume_from = None
                    for text in EXPECT.get(command.argv[1], []):
                        assert text in out, f"{command}: {text!r} not in its output\n{out}"
                ran.append((str(command), out))
    return ran


@pytest.mark.slow
def test_docs_finetune_runs_as_written(workdir):
    ran = _run_page(blocks("docs/finetune.md"), workdir)
    commands = [line for line, _ in ran]
    assert sum("jaxmem train" in c for c in commands) >= 3 and any("export-hf" in c for c in commands)
    # the evaluation snippet printed the held-out loss, the run wrote it, and the export loads alone
    evaluation = next(out for line, out in ran if "held-out loss" in out)
    assert evaluation.count("held-out loss") >= 1
    assert (workdir / "exported" / "sft" / "config.json").is_file()
    assert (workdir / "adapters" / "sft" / "adapter_config.json").is_file()
    records = [json.loads(line) for line in (workdir / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 12 and "eval_loss" in records[-1]
    for run in ("sft-qlora", "sft-full"):
        assert (workdir / "runs" / run / "checkpoints" / "12").is_dir(), run



@pytest.mark.slow
def test_readme_finetune_runs_as_written(workdir):
    page = blocks("README.md")
    ran = _run_page(section(page, "README.md", "Fine-tune a Hugging Face model"), workdir)
    assert any("jaxmem train" in line for line, _ in ran)
    assert (workdir / "exported" / "sft" / "config.json").is_file()
