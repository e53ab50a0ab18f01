"""Nothing lost, and saves that fail, fail once (issue 52): an export never replaces or enters a run's folder; the
run never writes through a link; a run without checkpoints never cuts a saved run's metrics; a finished run
rerun with other model / data keys is refused and its config.resolved.yaml kept; a killed export's leftovers
are cleaned by the next; a checkpoint write that fails (a file-size limit, a read-only folder) stops the run
after the step in flight in one line, promptly, with no traceback and the last good checkpoint intact."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chat_fixtures import chat, write_tokenizer
from cpu_env import cpu_env
from jaxmem import cli
from jaxmem.config import ConfigError
from jaxmem.core.checkpoint import Checkpoints, _QuietOrbax
from jaxmem.io.no_follow import write_text
from jaxmem.train import run
from jaxmem.train.loop import _check_finite
from jaxmem.train.run_folder import saved_steps
from tiny_config import TINY, tiny_config

ROOT = Path(__file__).resolve().parents[2]
RUN = ["train.steps=2", "checkpoint.every=1", "train.log_every=1", "train.seq_len=32"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run saving steps 1 and 2."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run(tiny_config(out, *RUN))
    return out


def _copy(finished, tmp_path, name="run") -> Path:
    copy = tmp_path / name
    shutil.copytree(finished, copy)
    return copy


# ---------------------------------------------------------------- exports never touch a run


def test_an_export_never_replaces_enters_or_swallows_a_run(finished, tmp_path, capsys):
    runs = tmp_path / "runs"
    copy = _copy(finished, runs)
    before = _listing(copy)
    for out, fragment in ((copy, f"--out: {copy} is the training run {copy} (it holds checkpoints"),
                          (copy / "hf", f"--out: {copy / 'hf'} lies inside the training run {copy}"),
                          (copy / "checkpoints", f"lies inside the training run {copy}"),
                          (runs, f"--out: {runs} holds the training run {copy}; replacing it would delete that run")):
        assert cli.main(["export-hf", str(copy), "--out", str(out), "--overwrite"]) == 2
        line = _one_error_line(capsys)
        assert line.startswith("jaxmem export-hf: config error: ") and fragment in line, line
    assert _listing(copy) == before and sorted(p.name for p in runs.iterdir()) == ["run"]
    link = tmp_path / "link"
    link.symlink_to(copy)  # the run reached through a link is the run
    assert cli.main(["export-hf", str(copy), "--out", str(link), "--overwrite"]) == 2
    assert f"is the training run {copy}" in _one_error_line(capsys)
    assert cli.main(["import-hf", str(tmp_path / "any_hf_folder"), str(copy)]) == 2  # checked before the source
    assert _one_error_line(capsys).startswith(f"jaxmem import-hf: config error: OUT_DIR: {copy} is the training run")
    assert _listing(copy) == before


def test_a_killed_exports_leftovers_are_cleaned_and_a_live_ones_kept(finished, tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".hf.abc123.{dead_pid}.partial"
    (stale / "model.safetensors").parent.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    retired = tmp_path / f".hf.def456.{dead_pid}.old"
    retired.mkdir()
    live = tmp_path / f".hf.ghi789.{os.getpid()}.partial"  # another export still writing
    live.mkdir()
    assert cli.main(["export-hf", str(finished), "--out", str(tmp_path / "hf")]) == 0
    assert "written to" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", live.name])
    assert (tmp_path / "hf" / "config.json").is_file()


# ---------------------------------------------------------------- never through a link


def test_write_text_refuses_a_link_and_leaves_its_target(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ConfigError, match=r"link is a symbolic link; jaxmem never writes through a link"):
        write_text(tmp_path / "link", "overwritten")
    assert target.read_text() == "mine"
    write_text(tmp_path / "plain", "a\n")
    assert (tmp_path / "plain").read_text() == "a\n"


@pytest.mark.parametrize("name", ["config.resolved.yaml", "metrics.jsonl"])
def test_a_run_never_writes_through_a_link_in_its_folder(finished, tmp_path, capsys, name):
    copy = _copy(finished, tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (copy / name).unlink()
    (copy / name).symlink_to(target)
    assert cli.main(["train", str(TINY), f"out_dir={copy}", "train.progress=false", *RUN, "train.steps=3"]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem train: config error: out_dir: {copy / name} is a symbolic link; jaxmem never writes through a "
        "link (it would overwrite the file it points to): remove the link, or use a new out_dir")
    assert target.read_text() == "mine" and saved_steps(copy) == [1, 2]


# ---------------------------------------------------------------- a rerun never rewrites a finished run


def test_a_run_without_checkpoints_never_cuts_a_saved_runs_metrics(finished, tmp_path, capsys):
    copy = _copy(finished, tmp_path)
    before = _listing(copy)
    assert cli.main(["train", str(TINY), f"out_dir={copy}", "train.progress=false", *RUN,
                     "checkpoint.enabled=false"]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem train: config error: checkpoint.enabled=false: {copy / 'checkpoints'} holds a run saved up to "
        "step 2, whose metrics.jsonl a run without checkpoints would cut back to step 0; set "
        "checkpoint.enabled=true to resume it, or use a new out_dir")
    assert _listing(copy) == before and len((copy / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.fixture(scope="module")
def records_run(tmp_path_factory):
    """A finished 2-step chat run (records, an offline tokenizer) and the overrides that made it."""
    import numpy as np

    root = tmp_path_factory.mktemp("records")
    rng = np.random.default_rng(0)
    (root / "train.jsonl").write_text("".join(json.dumps({"messages": chat(rng)}) + "\n" for _ in range(16)))
    overrides = ["data.kind=jsonl", f"data.path={root / 'train.jsonl'}", "data.format=messages",
                 f"data.tokenizer={write_tokenizer(root / 'tok')}", f"data.cache_dir={root / 'cache'}",
                 "data.workers=1", "train.micro_batch=1", *RUN]
    run(tiny_config(root / "run", *overrides))
    write_tokenizer(root / "other")  # the same words: only the key differs
    return root, overrides


def test_a_finished_runs_rerun_with_another_tokenizer_is_refused_and_writes_nothing(records_run, tmp_path, capsys):
    root, overrides = records_run
    copy = _copy(root / "run", tmp_path)
    resolved = (copy / "config.resolved.yaml").read_bytes()
    other = [o for o in overrides if not o.startswith("data.tokenizer=")]
    args = ["train", str(TINY), f"out_dir={copy}", "train.progress=false", *other]
    assert cli.main([*args, f"data.tokenizer={root / 'other' / 'tokenizer.json'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"jaxmem train: {copy} holds a run finished at step 2, trained with other data.tokenizer "
                       "than this config's; nothing was trained or written: rerun with the run's own settings, or "
                       "use a new out_dir")
    assert not any("Traceback" in line for line in err)
    # a rerun that trains nothing (another log_every) leaves the resolved config as the trained run wrote it
    assert cli.main([*args, f"data.tokenizer={root / 'tok' / 'tokenizer.json'}", "train.log_every=2"]) == 0
    assert "already holds step 2 >= train.steps=2; nothing to train" in capsys.readouterr().err
    assert (copy / "config.resolved.yaml").read_bytes() == resolved


# ---------------------------------------------------------------- the stop messages say what is left


def test_the_nan_message_names_the_step_and_the_last_good_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path, *RUN)
    nan = [{"loss": float("nan"), "grad_norm": float("nan")}]
    with pytest.raises(RuntimeError) as info:
        _check_finite(cfg, [(1, None)], nan, None)
    assert str(info.value) == ("step 1: loss is nan (grad_norm nan); stopped without saving this state "
                               "(checkpoint.enabled=false: nothing was saved); lower optimizer.lr or check the data")
    ckpts = Checkpoints(tmp_path / "checkpoints")
    try:
        with pytest.raises(RuntimeError, match=r"\(no checkpoint was saved before it\); lower optimizer.lr"):
            _check_finite(cfg, [(3, None)], nan, ckpts)
    finally:
        ckpts.close()


def _train_cli(out, *extra, limit_bytes=None):
    """`jaxmem train` in a subprocess (one CPU device); `limit_bytes`: RLIMIT_FSIZE, so a checkpoint's data
    file fails to be written (EFBIG) as on a full disk, while the small files still are. A process that hangs
    in orbax's threads after a failed save (their barriers wait 300 s) fails the test by the timeout."""
    start = [sys.executable, "-m", "jaxmem.cli"]
    if limit_bytes is not None:  # set in the child before it becomes jaxmem (no fork of this threaded process)
        start = [sys.executable, "-c", f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
                 f"({limit_bytes}, {limit_bytes})); os.execv(sys.executable, [sys.executable, '-m', 'jaxmem.cli', "
                 "*sys.argv[1:]])"]
    cmd = [*start, "train", str(TINY), f"out_dir={out}", "train.progress=false", *RUN, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=cpu_env(1), capture_output=True, text=True, timeout=240)


def _jaxmem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jaxmem")]


def test_both_checkpoints_damaged_with_previous_set_says_so_in_one_line(finished, tmp_path):
    copy = _copy(finished, tmp_path)
    for step in (1, 2):
        (copy / "checkpoints" / str(step) / "state" / "manifest.ocdbt").unlink()
    proc = _train_cli(copy, "train.steps=3", "checkpoint.on_corrupt=previous")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = _jaxmem_lines(proc.stderr)[-1]
    assert line.startswith(f"jaxmem train: config error: {copy / 'checkpoints'}: no checkpoint is intact "
                           "(checkpoint.on_corrupt=previous tried steps 2, 1; step 2: "), line
    assert line.endswith("delete the step directories to start from scratch, or use a new out_dir")
    assert "set checkpoint.on_corrupt=previous" not in line and saved_steps(copy) == [1, 2]


# ---------------------------------------------------------------- saves that fail, fail once


def _assert_failed_once(proc, copy, last_good):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    failed = [line for line in _jaxmem_lines(proc.stderr) if "writing a checkpoint" in line]
    assert len(failed) == 1 and failed == _jaxmem_lines(proc.stderr)[-1:], proc.stderr
    assert f"in {copy / 'checkpoints'} failed (" in failed[0]
    assert failed[0].endswith(" free") and f"the last good checkpoint is step {last_good}; " in failed[0]
    assert not (copy / ".jaxmem.lock").exists()


def test_a_checkpoint_that_cannot_be_written_stops_after_the_step_in_flight(finished, tmp_path):
    copy = _copy(finished, tmp_path)
    proc = _train_cli(copy, "train.steps=6", limit_bytes=2**20)
    _assert_failed_once(proc, copy, last_good=2)
    assert "File too large" in proc.stderr
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps[:2] == [1, 2] and max(steps) <= 4  # step 3's save failed: at most the step in flight after it
    assert saved_steps(copy) == [1, 2]
    # the last good checkpoint is untouched: the next run resumes from it
    summary = run(tiny_config(copy, *RUN, "train.steps=3"))
    assert summary["resumed_from"] == 2 and [r["step"] for r in summary["records"]] == [3]


def test_a_read_only_checkpoint_folder_fails_the_final_save_in_one_line_and_exits(finished, tmp_path):
    copy = _copy(finished, tmp_path)
    folder = copy / "checkpoints"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("needs a tmpfs mount (root in a container that allows it) for a really read-only folder")
    try:
        shutil.copytree(finished / "checkpoints", folder, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        proc = _train_cli(copy, "train.steps=3", "checkpoint.every=0")
        _assert_failed_once(proc, copy, last_good=2)
        assert "Read-only file system" in proc.stderr
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_closed_event_loop_report_is_dropped_and_others_pass(monkeypatch):
    import asyncio

    seen = []
    monkeypatch.setattr(_QuietOrbax, "saved_hook", seen.append)
    loop = asyncio.new_event_loop()
    loop.close()
    for make in (lambda: loop.call_soon_threadsafe(print), lambda: 1 / 0):
        try:
            make()
        except Exception as e:
            _QuietOrbax.hook(type("U", (), {"exc_type": type(e), "exc_value": e, "exc_traceback": e.__traceback__})())
    assert [type(u.exc_value) for u in seen] == [ZeroDivisionError]
