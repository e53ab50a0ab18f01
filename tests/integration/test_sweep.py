"""`jaxmem sweep`: grid points compiled (here in-process; in worker processes by test_tune's flows, through the same
plan_points), the init compile shared, cached by config hash, CSV/JSON/Pareto PNG."""
import csv
import json
import os

import pytest

from jaxmem.config import ConfigError
from jaxmem.cli.sweep import main, pareto_front, parse_grid, points, read_sweep_file


def test_grid_is_a_cross_product():
    grid = parse_grid(["remat.preset=full,none", "train.micro_batch=1,2,4"])
    pts = points(grid)
    assert len(pts) == 6 and ["remat.preset=none", "train.micro_batch=4"] in pts
    with pytest.raises(ConfigError, match="--grid"):
        parse_grid(["remat.preset"])


def test_pareto_front_keeps_only_undominated_points():
    rows = [{"point": "a", "device_bytes": 1, "step_seconds_estimated": 3.0},
            {"point": "b", "device_bytes": 2, "step_seconds_estimated": 2.0},
            {"point": "c", "device_bytes": 3, "step_seconds_estimated": 2.5}]
    assert [r["point"] for r in pareto_front(rows)] == ["a", "b"]


def test_shipped_remat_sweep_names_real_presets():
    from jaxmem.core import remat

    spec = read_sweep_file(__import__("pathlib").Path("configs/sweeps/llama3-8b-remat-8xh100.yaml"))
    assert set(spec["grid"]["remat.preset"]) <= set(remat.PRESETS) and len(spec["grid"]["remat.preset"]) >= 5
    assert spec["target"]["name"] == "h100-80g"


@pytest.mark.slow
def test_sweep_shares_the_init_compile_then_hits_the_cache(tmp_path, capsys, monkeypatch):
    # with no figure cache of the user's, the sweep keeps one in its cache folder: two remat presets lower the same
    # step-0 state program, so the second point reads the first one's init figures instead of compiling again; a
    # second run reads every point back from the sweep's cache. In this process (--workers 0): the points' worker
    # processes (plan_points' process pool, the same function) are test_tune's, whose flows compile in them
    monkeypatch.delenv("JAXMEM_FIGURE_CACHE", raising=False)
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["configs/tiny.yaml", "parallel.fsdp=8", "--grid", "remat.preset=full,none", "--target", "h100-80g",
            "--out", str(out), "--cache", str(cache), "--workers", "0"]
    assert main(args) == 0
    first = json.loads((out / "sweep.json").read_text())
    assert [r["cached"] for r in first] == [False, False]
    assert all(r["device_bytes_basis"] == "compiled" and r["fits"] is True for r in first)
    none, full = sorted(first, key=lambda r: r["remat.preset"] == "full")
    assert full["device_bytes"] < none["device_bytes"]  # remat saves activations in the compiled step
    assert len(list(cache.glob("*.json"))) == 2
    figures = cache / "figures"
    assert len(list(figures.glob("*.json"))) == 3  # two steps and one init
    assert len((figures / "hits.log").read_text().splitlines()) == 1
    assert main(args) == 0
    second = json.loads((out / "sweep.json").read_text())
    assert [r["cached"] for r in second] == [True, True]
    assert [r["device_bytes"] for r in second] == [r["device_bytes"] for r in first]
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert {r["remat.preset"] for r in rows} == {"full", "none"}
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "[cached]" in text and "best under the budget" in text and "FAILED" not in text
    assert [r["status"] for r in second] == ["planned", "planned"] and sum(r["best"] for r in second) == 1
    assert "JAXMEM_FIGURE_CACHE" not in os.environ  # handed back as it was


def test_failed_points_are_failures_not_planned(tmp_path, capsys, monkeypatch):
    """Without the `aot` extra every compile fails: the points are marked failed (table, CSV, JSON), left out of
    the plot, the first error shown once, and the exit status is non-zero."""
    from jaxmem.runtime import aot, compat

    def missing_plugin(*a, **k):
        raise compat.UnsupportedVersion("deviceless GPU compiles need jax-cuda12-plugin\nsecond line")

    monkeypatch.setattr(aot, "target_devices", missing_plugin)
    out = tmp_path / "out"
    args = ["configs/tiny.yaml", "parallel.fsdp=8", "--grid", "remat.preset=full,none", "--target", "h100-80g",
            "--out", str(out), "--workers", "0"]  # --workers 0: in this process, where the patch applies
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "planned" not in text and text.count("FAILED") == 4  # progress lines + table lines
    assert text.count("UnsupportedVersion: deviceless GPU compiles need jax-cuda12-plugin") == 1
    assert "second line" not in text and "2 of 2 points failed" in text
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["status"] for r in rows] == ["failed", "failed"] and all(r["error"] for r in rows)
    assert not any(r["best"] for r in rows)
    csv_rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert {r["status"] for r in csv_rows} == {"failed"} and all(r["error"] for r in csv_rows)
    assert not list((out / "cache").glob("*.json"))  # failures are not cached
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_best_point_rule_and_legible_figures(tmp_path, capsys):
    from jaxmem.cli.sweep import best_point, format_row, mark_best, plot_pareto, print_summary

    def row(point, dev, step, fits):
        return {"point": point, "device_bytes": dev, "step_seconds_estimated": step, "fits": fits, "cached": False,
                "device_bytes_basis": "compiled", "usable_device_bytes": 10 * 2**20, "devices": 8,
                "target": "h100-80g", "status": "planned", "error": None}

    rows = [row("remat.preset=none", 12 * 2**20, 1e-3, False),  # fastest, but does not fit
            row("remat.preset=full", 3 * 2**20, 2e-3, True),
            row("remat.preset=selective", 2 * 2**20, 2e-3, True),  # same time, more headroom: best
            row("remat.preset=dots", 1 * 2**20, 3e-3, True),
            {"point": "remat.preset=bad", "cached": False, "status": "failed", "error": "ValueError: boom"}]
    assert best_point(rows)["point"] == "remat.preset=selective"
    assert best_point([rows[0], rows[4]]) is None
    assert best_point([dict(rows[1], fits=None), rows[3]])["point"] == "remat.preset=dots"  # fits beats unknown
    mark_best(rows)
    assert [r["best"] for r in rows] == [False, False, True, False, False]
    line = format_row(rows[2])
    assert "2.00 MiB" in line and "2.00 ms" in line and "best" in line  # GiB would print 0.00
    assert "1.23 us" in format_row(dict(rows[3], step_seconds_estimated=1.234e-6))
    print_summary(rows)
    text = capsys.readouterr().out
    assert "best under the budget" in text and text.count("ValueError: boom") == 1
    plot_pareto(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 5000
