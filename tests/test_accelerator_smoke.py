"""``benchmarks/accelerator.py --smoke``: the accelerator benchmark runs end to end on the CPU.

The script is meant for a GPU or TPU that is lent now and then; running its
smoke size here keeps it working between those times. The figures are not
checked (a tiny model on a shared CPU), only that every section produced
them and that the correctness checks passed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "accelerator.py"


def _script():
    spec = importlib.util.spec_from_file_location("accelerator_benchmark", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


# Slow: a minute on a 2-core CPU, and it sets the process's compilation cache (run it with -m slow,
# on its own or first).
@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path):
    script = _script()
    # One quantized format (and its Pallas row): each format's timing is one code path.
    report = script.main(
        [
            "--smoke",
            "--quantize",
            "int8",
            "--out",
            str(tmp_path / "out"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--budget-s",
            "3000",
        ]
    )

    assert json.loads((tmp_path / "out" / "accelerator.json").read_text())["smoke"] is True
    table = (tmp_path / "out" / "accelerator.md").read_text()
    assert "| tiny | int8 pallas | " in table and "Real pair (embedded-target" in table

    assert report["quantized_products"]["ok"], report["quantized_products"]
    assert all(r["equal"] for r in report["correctness"].values()) and report["correctness"]
    assert report["cache"] == str(tmp_path / "cache") and any((tmp_path / "cache").iterdir())
    assert report["programs"]["built"] > 0 and report["programs"]["seconds"] > 0

    (speed,) = report["speed"]
    assert not speed["skipped"] and not report["skipped_shapes"]
    assert [r["weights"] for r in speed["steps"]] == ["bf16", "int8", "int8 pallas"]
    for row in speed["steps"]:
        assert row["tok_s"] > 0 and row["roofline_tok_s"] > 0 and row["kernels"] > 0
    assert speed["steps"][1]["param_bytes"] < 0.6 * speed["steps"][0]["param_bytes"]  # int8 against bf16
    assert speed["programs"]["step bf16 batch 1"]["built"] > 0
    (small,) = speed["speculative"]
    assert small["draft"] == "small" and small["cycles"] > 0 and small["ideal"] > 0

    pair = report["real_pair"]
    assert pair["speedup"] > 0 and pair["prompts"] == 2 and pair["programs"]["decode"]["built"] > 0


def test_launches_are_counted_through_loops_and_not_inside_fusions():
    """The static launch count: a loop's body and condition count, a fusion's inside does not."""
    script = _script()
    hlo = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} sine(%p)
  ROOT %b = f32[4]{0} cosine(%a)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %f)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %c = pred[] compare(%i, %i), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} copy(%x)
  %t = (s32[], f32[4]{0}) tuple(%y, %y)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""
    assert script.kernels_in(hlo) == 3  # copy, the fusion, the compare
