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

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "accelerator.py"


def test_smoke_run_writes_every_section(tmp_path):
    spec = importlib.util.spec_from_file_location("accelerator_benchmark", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # One quantized format: q4 runs in the correctness section, and each format's timing is one code path.
    report = script.main(["--smoke", "--quantize", "int8", "--out", str(tmp_path)])

    assert json.loads((tmp_path / "accelerator.json").read_text())["smoke"] is True
    table = (tmp_path / "accelerator.md").read_text()
    assert "| tiny | 1 |" in table and "oracle" in table and "small" in table

    correctness = report["correctness"]
    assert correctness["random_llama_greedy"]["equal"]
    assert correctness["bigram_lossless_law"]["ok"], correctness["bigram_lossless_law"]
    assert report["copy_bandwidth_gb_s"] > 0

    (speed,) = report["speed"]
    assert [q["format"] for q in speed["quantized"]] == ["int8"] and speed["quantized"][0]["c_1"] > 0
    assert not speed.get("skipped") and not report["skipped_shapes"]
    assert speed["target_only"][0]["tok_s"] > 0 and speed["target_only"][0]["roofline_tok_s"] > 0
    oracle, small = speed["speculative"]
    assert oracle["draft"] == "oracle" and oracle["acceptance"] > 0.9  # the target drafting for itself
    assert small["draft"] == "small" and small["cycles"] > 0 and small["ideal"] > 0
    long = speed["long_cache"]  # 128 cached tokens: 192 slots, then 512 of which the CPU reads 192
    assert all(long[row]["ms"] > 0 for row in ("tight", "long", "long, prefix reads"))
    reads = [long[row]["kv_bytes_read"] for row in ("tight", "long", "long, prefix reads")]
    assert reads[0] == reads[1] == reads[2] < 512 * reads[0] // 192
