"""lm-evaluation-harness' ``local-completions`` against `specjax serve`: a loglikelihood task and a
generate task on a small local data file (``benchmarks/lm_eval_serve.py``), its loglikelihoods
checked against ``specjax.logits``. Slow, and skipped where lm-eval is not installed (it is no
dependency of specjax: ``pip install lm-eval==0.4.13``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lm_eval_scores_and_generates_through_the_server():
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lm_eval_serve.py"), "--pair", "embedded", "--slots", "2"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "specjax_mc" in run.stdout and "specjax_gen" in run.stdout and "largest difference" in run.stdout
