"""Every `jaxmem` command in README.md and docs/ runs as written on CPU, or is marked GPU-only; every code block
names its language, every config block holds known keys, every runnable snippet runs. The commands are read from
the pages (tests/doc_blocks.py); what is checked depends on the command, and the test id says which:

- `gpu-only`: a block or line marked `# GPU only`: skipped, with the page's reason in the skip message.
- `pip` / `make`: an install line names extras pyproject.toml defines; `make TARGET` is in the Makefile
  (`make -n`: the demo and the suite themselves are not run here).
- `walkthrough`: the blocks of docs/finetune.md and the README's fine-tune: run in order by
  tests/integration/test_docs_finetune.py, not again here.
- `reference`: an inline mention or a synopsis in a `text` block (`jaxmem plan CONFIG --json FILE`, `jaxmem
  bench --html`): the command exists, every `--flag` it names is one its parser accepts, and every file it names
  is in the repository or made on the same page (a config block saved under that name, or a command's --out).
- `run`: cheap on a CPU (`--help`, `list`, `config`, `doctor`, `plan --no-compile`, and any command whose configs
  are the tiny ones, `python scripts/...` included): run as written in its own process, in a folder that holds the
  repository's configs/ and scripts/, one CPU device, the page's earlier commands run before it in the same
  folder. Exit 0 (doctor: 0 or 1, its verdict on this machine; it must still print every check).
- `parses`: the rest (deviceless compiles of 8B-72B models take minutes each, training them hours): the
  command's parser accepts its arguments and its config loads with its overrides (the command is stopped at
  that point), and the analytic bill of the same configs, overrides and target builds (`jaxmem plan ...
  --no-compile`).
"""
import contextlib
import dataclasses
import importlib
import re
import shlex
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest
import yaml

from cpu_env import cpu_env
from doc_blocks import LANGUAGES, REPO, Block, Command, blocks, inline_commands, pages, section

from jaxmem import cli
from jaxmem.config import schema

WALKTHROUGHS = {"docs/finetune.md": None, "README.md": "Fine-tune a Hugging Face model"}
TINY = re.compile(r"^configs/(rl/)?tiny[\w-]*\.yaml$")
CHEAP_COMMANDS = {"list", "config", "doctor"}
PLACEHOLDER = re.compile(r"^(\[.*|.*\]|\.\.\.|[A-Z][A-Z_]*(=\S*)?|--[\w-]+=?[A-Z_]+)$|\|")


def _walkthrough_blocks() -> set[tuple[str, int]]:
    out = set()
    for page, heading in WALKTHROUGHS.items():
        page_blocks = blocks(page)
        chosen = page_blocks if heading is None else section(page_blocks, page, heading)
        out |= {(b.page, b.line) for b in chosen}
    return out


def _transcript_commands(block: Block) -> list[Command]:
    """`$ ...` lines of a text block (a transcript of a run): the command after any VAR=value prefixes."""
    out = []
    for i, line in enumerate(block.text.splitlines()):
        if line.startswith("$ "):
            words = [w for w in shlex.split(line[2:]) if not re.match(r"^[A-Z_]+=", w)]
            out.append(Command(block.page, block.line + 1 + i, tuple(words), "transcript"))
    return out


def _synopses(block: Block) -> list[Command]:
    """Lines of a text block that are a command's synopsis (`jaxmem bench CONFIG [key=value ...]`)."""
    out = []
    for i, line in enumerate(block.text.splitlines()):
        words = line.split()
        if len(words) > 1 and words[0] == "jaxmem" and not words[1].endswith(":"):  # `jaxmem train:` is output
            out.append(Command(block.page, block.line + 1 + i, tuple(words), "synopsis"))
    return out


def _collect():
    walkthrough = _walkthrough_blocks()
    cases = []
    for page in pages():
        for block in blocks(page):
            if block.lang == "bash":
                for command in block.commands():
                    if (block.page, block.line) in walkthrough:
                        kind = "walkthrough"
                    elif block.gpu_only or command.gpu_only:
                        kind = "gpu-only"
                    else:
                        kind = _kind(command)
                    cases.append((kind, command, block))
            elif block.lang == "text":
                cases += [(_kind(c), c, block) for c in _transcript_commands(block)]
                cases += [("reference", c, block) for c in _synopses(block)]
        for line, text in inline_commands(page):
            cases.append(("reference", Command(page, line, tuple(text.split()), "inline"), None))
    return cases


def _kind(command: Command) -> str:
    argv = command.argv
    if argv[0] in ("pip", "make"):
        return argv[0]
    if argv[0] != "jaxmem":
        return "run" if argv[0] == "python" and argv[1].startswith("scripts/") else "other"
    if len(argv) == 2 or any(PLACEHOLDER.search(w) for w in argv[2:]):
        return "reference"
    if argv[1] in CHEAP_COMMANDS or "--help" in argv or "-h" in argv or "--no-compile" in argv:
        return "run"
    configs = [w for w in argv[2:] if w.endswith(".yaml") and "=" not in w]
    if configs and all(TINY.match(c) for c in configs) and not _names_missing_file(argv, configs):
        return "run"
    if argv[1] == "export-hf" and _trained_earlier_on_page(command):
        return "run"
    return "parses"


def _trained_earlier_on_page(command: Command) -> bool:
    """Whether an earlier line of the page trains a tiny config into the run folder `command` reads (argv[2])."""
    before = (REPO / command.page).read_text().splitlines()[:command.line - 1]
    run_dir = re.escape(command.argv[2])
    trains = re.compile(rf"^jaxmem train configs/(rl/)?tiny[\w-]*\.yaml .*out_dir={run_dir}(\s|$)")
    return any(trains.match(line) for line in before)


def _names_missing_file(argv, configs) -> bool:
    return any(not (REPO / c).is_file() for c in configs)


CASES = _collect()


def _id(case) -> str:
    kind, command, _ = case
    return f"{kind}: {command}"[:150]


# ------------------------------------------------------------------------------------------------ the blocks


@pytest.mark.parametrize("page", pages())
def test_every_code_block_names_its_language(page):
    unnamed = [f"{b}" for b in blocks(page) if b.lang not in LANGUAGES]
    assert not unnamed, f"fenced blocks without one of {LANGUAGES} (tests/doc_blocks.py says which is which): {unnamed}"


def _config_keys(cls=schema.Config, prefix="") -> set[str]:
    """Every dotted key of the config schema; a dict-valued key takes any key below it."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            keys |= _config_keys(kind, f"{prefix}{field.name}.")
        else:
            keys.add(f"{prefix}{field.name}")
    return keys


def _dotted(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


@pytest.mark.parametrize("block", [b for p in pages() for b in blocks(p) if b.lang == "yaml"], ids=str)
def test_config_blocks_hold_known_keys(block):
    known = _config_keys() | {"base"}
    dict_keys = {k for k in known if not any(o.startswith(k + ".") for o in known)}
    unknown = [k for k in _dotted(yaml.safe_load(block.text))
               if k not in known and not any(k.startswith(d + ".") for d in dict_keys)]
    assert not unknown, f"{block}: keys the config does not have: {unknown}"


QUOTED_SCRIPT = re.compile(r"<!-- (scripts/[\w.]+\.py) -->\n$")


@pytest.mark.parametrize("block", [b for p in pages() for b in blocks(p) if b.lang == "python"], ids=str)
def test_python_blocks_run_or_are_run_elsewhere(block):
    if (block.page, block.line) in _walkthrough_blocks():
        pytest.skip("walkthrough: run by tests/integration/test_docs_finetune.py")
    if block.gpu_only:
        pytest.skip(f"GPU only: {block.first_line}")
    before = "\n".join((REPO / block.page).read_text().splitlines()[:block.line - 1]) + "\n"
    quoted = QUOTED_SCRIPT.search(before)
    assert quoted, f"{block}: a snippet outside the walkthroughs quotes a script (<!-- scripts/NAME.py -->)"
    # tests/integration/test_library.py checks the quote equals the file; the page's `python scripts/...`
    # line runs it (test_command below)
    runs = [c for c in CASES if c[1].page == block.page and c[1].argv[:2] == ("python", quoted.group(1))]
    assert runs, f"{block}: the page quotes {quoted.group(1)} but never runs it"


# ------------------------------------------------------------------------------------------------ the commands


def test_every_command_is_checked_somehow():
    other = [str(c) for kind, c, _ in CASES if kind == "other"]
    assert not other, f"commands the tests do not know how to check: {other}"
    assert {kind for kind, _, _ in CASES} >= {"run", "parses", "reference", "walkthrough", "gpu-only"}


def _help(name: str) -> str:
    done = subprocess.run([sys.executable, "-m", "jaxmem.cli", name, "--help"], cwd=REPO, capture_output=True,
                          text=True, env=cpu_env(1, PYTHONPATH=str(REPO)), timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


_HELP = {}


def _made_on_page(page: str, name: str) -> bool:
    """Whether `name` is a file the page makes: a yaml block saved under it, or a command's `--out NAME`."""
    return (any(block.filename == name for block in blocks(page))
            or re.search(rf"--out {re.escape(name)}\b", (REPO / page).read_text()) is not None)


def _check_reference(command: Command):
    argv = command.argv
    assert argv[0] == "jaxmem"
    if argv[1] in ("-h", "--help", "-V", "--version"):
        return
    name = argv[1]
    assert name in cli.COMMANDS, f"{command}: no command {name!r}"
    text = _HELP.get(name) or _HELP.setdefault(name, _help(name))
    for i, word in enumerate(argv[2:], start=2):
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", word):
            assert re.search(rf"(?<![\w-]){flag}(?![\w-])", text), f"{command}: `jaxmem {name}` has no {flag}"
        if re.fullmatch(r"[\w./-]+\.ya?ml", word) and argv[i - 1] != "--out":  # read, not written
            assert (REPO / word).is_file() or _made_on_page(command.page, word), \
                f"{command}: {word} is neither in the repository nor made on {command.page}"


_FOLDERS = {}


def _page_folder(page: str, tmp_path_factory) -> Path:
    """One folder per page, holding the repository's configs/ and scripts/: its commands run there in order."""
    if page not in _FOLDERS:
        folder = tmp_path_factory.mktemp(Path(page).stem)
        for name in ("configs", "scripts"):
            (folder / name).symlink_to(REPO / name)
        _FOLDERS[page] = folder
    return _FOLDERS[page]


def _run(command: Command, folder: Path):
    argv = list(command.argv)
    argv = [sys.executable, *argv[1:]] if argv[0] == "python" else [sys.executable, "-m", "jaxmem.cli", *argv[1:]]
    env = cpu_env(1, PYTHONPATH=str(REPO), HOME=str(folder))
    # a user's environment: without the suite's persistent compilation cache (with it, `jaxmem explain` on CPU
    # reads its step from the cache and XLA writes no HLO dump for it to read)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=600, env=env)
    out = done.stdout + done.stderr
    if command.argv[1] == "doctor":  # its verdict on this machine: every check printed, exit 1 when one fails
        assert done.returncode in (0, 1) and re.search(r"^(ok|skip|warn|fail) +jax ", out, re.M), out
    else:
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{out[-4000:]}"


class _Parsed(Exception):
    """Raised where the command's config has loaded: it parsed, and the work is not done."""


def _check_parses(command: Command, monkeypatch, capsys):
    argv = list(command.argv[1:])
    loaded = []

    def stop_after(path, overrides=(), *args, **kwargs):
        loaded.append(real(path, overrides, *args, **kwargs))
        raise _Parsed

    from jaxmem import loader

    real = loader.load_config
    for module in {m.partition(":")[0] for m, _ in cli.COMMANDS.values()}:
        mod = importlib.import_module(module)
        if hasattr(mod, "load_config"):
            monkeypatch.setattr(mod, "load_config", stop_after)
    with contextlib.suppress(_Parsed):
        code = cli.main(argv)
        pytest.fail(f"{command}: exit {code} before its config loaded\n{capsys.readouterr()}")
    assert loaded, command
    monkeypatch.undo()
    # the analytic bill of the same configs and overrides for the same target
    items = []
    for word in argv[1:]:
        if word.startswith("-"):
            break
        items.append(word)
    configs = [w for w in items if w.endswith(".yaml")]
    overrides = [w for w in items if "=" in w]
    target = []
    for flag in ("--target", "--gpus-per-host", "--hosts"):
        if flag in argv:
            target += [flag, argv[argv.index(flag) + 1]]
    capsys.readouterr()
    code = cli.main(["plan", *configs, *overrides, *target, "--no-compile"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "verdict:" in out, f"{command}: its analytic plan failed (exit {code})\n{out[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_command(case, tmp_path_factory, monkeypatch, capsys):
    kind, command, _ = case
    if kind == "gpu-only":
        pytest.skip(f"GPU only ({command.page}:{command.line}): {command.comment or 'the block is marked'}")
    if kind == "walkthrough":
        pytest.skip("run in order by tests/integration/test_docs_finetune.py")
    if kind == "pip":  # `pip install -e '.[extra,...]'`: every extra is one pyproject.toml defines
        extras = re.findall(r"\[([\w,-]+)\]", command.argv[-1])
        defined = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert command.argv[1:3] == ("install", "-e") and all(e in defined for x in extras for e in x.split(","))
    elif kind == "make":  # `make TARGET`: the Makefile has it (a dry run)
        done = subprocess.run(["make", "-n", *command.argv[1:]], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    elif kind == "reference":
        _check_reference(command)
    elif kind == "run":
        folder = _page_folder(command.page, tmp_path_factory)
        for earlier_kind, earlier, _ in CASES:  # the page's earlier commands first, in order, once each
            if earlier.page == command.page and earlier.line < command.line and earlier_kind == "run" \
                    and earlier not in _DONE:
                _run(earlier, folder)
                _DONE.add(earlier)
        if command not in _DONE:
            _run(command, folder)
            _DONE.add(command)
    else:
        _check_parses(command, monkeypatch, capsys)


_DONE = set()


# ------------------------------------------------------------------------------------------------ names in the prose

# Names that look like repository paths or modules and are not: other projects' files, a schema id, placeholders.
NOT_OURS = {"benchmarks/llama3_h100_202412_torchtitan.md", "jaxmem.timeline", "jaxmem/FILE",
            "benchmarks/bench_h200/run"}


def _module_exists(dotted: str) -> bool:
    """`jaxmem.a.b[.name]`: the longest prefix is a module of the package and the rest, if any, a name in it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            return i == len(parts) or re.search(rf"\b{parts[i]}\b", source.read_text()) is not None
    return False


@pytest.mark.parametrize("page", pages() + sorted(str(p.relative_to(REPO)) for p in (REPO / "benchmarks").glob("*.md"))
                         + ["STYLE.md"])
def test_the_paths_and_modules_a_page_names_exist(page):
    text = (REPO / page).read_text()
    missing = [p for p in set(re.findall(r"(?<![\w./-])((?:jaxmem|tests|scripts|configs|benchmarks|docs)/[\w./*-]*\w)", text))
               if p not in NOT_OURS and not (REPO / p).exists() and not list(REPO.glob(p))]
    missing += [m for m in set(re.findall(r"(?<![\w/.-])(jaxmem(?:\.\w+)+)", text))
                if m not in NOT_OURS and not _module_exists(m)]
    assert not missing, f"{page} names what the repository does not have (moved or renamed?): {sorted(missing)}"
    assert "../" not in re.sub(r"```.*?```", "", text, flags=re.S), f"{page} links outside the repository"


def test_the_readme_stays_a_first_page():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= 15_000, "README.md is over 15 KB: move the detail to docs/ or benchmarks/"
    assert not re.search(r"\bissue \d+", text, re.I), "README.md names an issue: say what it is instead"
    assert not re.search(r"(?<![\w-])[0-9a-f]{7,40}(?![\w-])", text), "README.md names a commit"
    rows = [line for line in text.split("## Headline results", 1)[1].split("\n## ", 1)[0].splitlines()
            if line.startswith("| ") and not line.startswith("| result")]
    assert 0 < len(rows) <= 10, "at most ten headline rows"
    assert all(re.search(r"measured on (GPU|CPU)|compiled deviceless|estimated", row) for row in rows), \
        "every headline row says how its figure was obtained"
