"""A catalogue of bad inputs: each is a one-line error naming the key or file, or exact recovery; never a
traceback, never a user's file written over."""
import hashlib

import pytest

from jaxmem import cli
from jaxmem.config import ConfigError
from jaxmem.train.run_folder import check_out_dir

from tiny_config import TINY


def _md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_run_never_writes_into_its_config_files_folder(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text(f"# my notes\nmodel:\n  preset: tiny\nout_dir: .\ntrain:\n  steps: 1\n")
    before = _md5(config)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "config.yaml"]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem train: config error: out_dir: {tmp_path} is the folder of the config file config.yaml; a run "
        "writes its outputs into out_dir: name a folder of its own (e.g. out_dir=runs/NAME)")
    assert _md5(config) == before and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_an_empty_out_dir_is_refused_at_load(tmp_path, capsys):
    assert cli.main(["train", str(TINY), "out_dir=''"]) == 2
    assert _one_error_line(capsys) == ("jaxmem train: config error: out_dir: empty; name the folder for the run's "
                                       "outputs (e.g. out_dir=runs/NAME)")


def test_a_folder_of_someone_elses_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "config.yaml").write_text("mine too")  # an older run's name, but without that run's outputs
    assert cli.main(["train", str(TINY), f"out_dir={tmp_path}", "train.steps=1"]) == 2
    assert _one_error_line(capsys) == (
        f"jaxmem train: config error: out_dir: {tmp_path} holds files that are not a jaxmem run's (config.yaml, "
        "notes.txt); name a new or empty folder, or a jaxmem run's to resume it")
    assert (tmp_path / "config.yaml").read_text() == "mine too"


def test_out_dir_rules_without_a_run(tmp_path):
    check_out_dir(tmp_path / "new" / "deeper")  # not there yet: fine
    check_out_dir(tmp_path)  # empty: fine
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.resolved.yaml", "metrics.jsonl", "allocator.json", "memory_profile_step3.prof"):
        (run / name).write_text("")
    check_out_dir(run)  # a jaxmem run's folder: resumable
    (run / "config.yaml").write_text("")  # an older run wrote its resolved config under this name
    check_out_dir(run)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^out_dir: .*/file is a file; name a folder"):
        check_out_dir(tmp_path / "file")
    with pytest.raises(ConfigError, match=r"^out_dir: .*/file/run cannot be written: .*/file is not a folder$"):
        check_out_dir(tmp_path / "file" / "run")
