"""benchmarks/plot_auto_grid.py: which setting is a cell's best, and whether auto meets the aim there."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plot_auto_grid.py"


@pytest.fixture(scope="module")
def grid():
    spec = importlib.util.spec_from_file_location("plot_auto_grid", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(speedup, rounds=None, **more):
    return dict(speedup=speedup, rounds=rounds or [speedup, speedup], **more)


def cell(batch, contenders, weights="float32", temperature=0.0):
    return dict(weights=weights, batch=batch, temperature=temperature, prompts=16, rounds=2, contenders=contenders)


def test_a_cell_is_judged_against_its_fastest_fixed_setting(grid):
    c = cell(1, {"target-only": row(1.0), "fixed K=1": row(1.3), "fixed K=3": row(1.6),
                 "fixed K=2 + lookup": row(1.5), "auto (cap 3)": row(1.55, [1.5, 1.6], drafts_per_cycle=2.4),
                 "auto (cap 3) + lookup": row(1.9)})  # not a fixed setting: never the one to beat
    s = grid.summarise(c)
    assert (s["best"], s["auto"]) == ("fixed K=3", "auto (cap 3)")
    assert s["of_best"] == pytest.approx(1.55 / 1.6) and s["meets"]
    slower = grid.summarise(cell(1, {**c["contenders"], "auto (cap 3)": row(1.4, [1.35, 1.45])}))
    assert not slower["meets"] and slower["of_best"] == pytest.approx(1.4 / 1.6)


def test_where_every_fixed_setting_loses_target_only_is_the_one_to_beat(grid):
    rows = {"target-only": row(1.0), "fixed K=1": row(0.8), "fixed K=3": row(0.7)}
    held = grid.summarise(cell(16, {**rows, "auto (cap 3)": row(0.99, [0.97, 1.01])}))
    assert held["of_best"] == pytest.approx(0.99) and held["meets"]  # 1.0x within its rounds
    lost = grid.summarise(cell(16, {**rows, "auto (cap 3)": row(0.9, [0.88, 0.93], drafts_per_cycle=0.4)}))
    assert not lost["meets"]
    plain = grid.summarise(cell(16, {**rows, "auto (cap 3)": row(0.98, [0.97, 0.99], drafts_per_cycle=0.0)}))
    table = grid.markdown([held, lost, plain]).splitlines()
    assert "target-only (fixed K=1 0.80x)" in table[2] and table[2].endswith("| yes |")
    assert table[3].endswith("| **no** |")  # drafting, and slower than target-only
    assert table[4].endswith("| **no** (target-only's own program) |")  # said so, not counted as met


def test_a_run_without_an_auto_row_is_refused(grid, tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"cells": [cell(2, {"target-only": row(1.0), "fixed K=1": row(1.2)})]}))
    with pytest.raises(ValueError, match="no 'auto \\(cap N\\)' row"):
        grid.main([str(run)])


def test_a_file_that_is_not_a_grid_run_is_named(grid, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="other.json holds no 'cells' list"):
        grid.main([str(other)])
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="broken.json: not readable as JSON"):
        grid.main([str(broken)])
