"""`jaxmem sweep`: grid points compiled in worker processes, cached by config hash, CSV/JSON/Pareto PNG."""
import csv
import json

import pytest

from jaxmem.config import ConfigError
from jaxmem.sweep import main, pareto_front, parse_grid, points, read_sweep_file


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
    from jaxmem import remat

    spec = read_sweep_file(__import__("pathlib").Path("configs/sweeps/llama3-8b-remat-8xh100.yaml"))
    assert set(spec["grid"]["remat.preset"]) <= set(remat.PRESETS) and len(spec["grid"]["remat.preset"]) >= 5
    assert spec["target"]["name"] == "h100-80g"


def test_sweep_compiles_in_workers_then_hits_the_cache(tmp_path, capsys):
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["configs/tiny.yaml", "parallel.fsdp=8", "--grid", "remat.preset=full,none", "--target", "h100-80g",
            "--out", str(out), "--cache", str(cache)]
    assert main(args) == 0
    first = json.loads((out / "sweep.json").read_text())
    assert [r["cached"] for r in first] == [False, False]
    assert all(r["device_bytes_basis"] == "compiled" and r["fits"] is True for r in first)
    none, full = sorted(first, key=lambda r: r["remat.preset"] == "full")
    assert full["device_bytes"] < none["device_bytes"]  # remat saves activations in the compiled step
    assert len(list(cache.glob("*.json"))) == 2
    assert main(args) == 0
    second = json.loads((out / "sweep.json").read_text())
    assert [r["cached"] for r in second] == [True, True]
    assert [r["device_bytes"] for r in second] == [r["device_bytes"] for r in first]
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert {r["remat.preset"] for r in rows} == {"full", "none"}
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "[cached]" in capsys.readouterr().out
