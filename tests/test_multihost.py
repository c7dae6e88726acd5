"""Decoding across two JAX processes (multi-host, on one machine) equals one device.

Two processes on 127.0.0.1 (``jax.distributed.initialize``, gloo collectives),
2 CPU devices each, run ``tests/_multihost_worker.py`` on two 2 x 2 meshes:
one whose ``'data'`` axis spans the processes and one whose ``'model'`` axis
does. Checked: sampled decoding with a fixed key equals the single-device
output; ``key=None`` gives every process one seed (process 0's)
and the run replays on one device from the recorded key, also where the
model axis spans processes (a seed per process hangs there); ``save_orbax``
from both processes and ``load(mesh=)`` give the same values, its checksums
pass, and decoding with it matches; different prompts or settings on the two
processes raise the same clear error on both. A second job adds greedy
decoding, generate, a token tree and the lookup.

The whole file is slow-only (``-m slow``): its two jobs start two JAX processes each, about 30 s
and 60 s of a 2-core CPU, and the meshes of one process run by default in tests/test_sharding.py.
The processes are bounded by a timeout and ended by their PIDs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(out_dir, part: str) -> list[dict]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    port = str(_free_port())
    logs = [open(out_dir / f"process{i}.log", "w") for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, "_multihost_worker.py"), str(i), port, str(out_dir), part],
                         env=env, stdout=logs[i], stderr=subprocess.STDOUT)
        for i in range(2)
    ]
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by its PID: the worker this test started, nothing else
                p.wait()
        for f in logs:
            f.close()
    reports = []
    for i in range(2):
        path = out_dir / f"process{i}.json"
        log = (out_dir / f"process{i}.log").read_text()[-4000:]
        assert path.exists(), f"process {i} wrote no report (exit {procs[i].returncode}):\n{log}"
        with open(path) as f:
            reports.append(json.load(f))
        # A process that hung (and was ended) or crashed keeps the checks it recorded;
        # each test asserts on its own, and a missing check names this.
        reports[i]["unfinished"] = None if reports[i].get("done") else (
            f"process {i} did not finish (exit {procs[i].returncode}; a hang is ended after {TIMEOUT_S} s) "
            f"after {list(reports[i])[-1]!r}\n{log[-2000:]}"
        )
    return reports


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return _run_job(tmp_path_factory.mktemp("multihost"), "small")


def _check(report: dict, name: str):
    """The value check ``name`` recorded, failing the test with its error or the process's fate."""
    assert name in report, report["unfinished"]
    value = report[name]
    assert not (isinstance(value, dict) and "error" in value), value.get("traceback", value)
    return value


def test_the_job_has_two_processes_of_two_devices_and_finishes(job):
    assert [r["process"] for r in job] == [0, 1]
    assert all(r["unfinished"] is None for r in job), [r["unfinished"] for r in job]
    assert all(r["devices"] == 4 and r["local_devices"] == 2 for r in job)
    assert all(r["data_axis_spans_processes"] and r["model_axis_spans_processes"] for r in job)


def test_sampling_across_processes_with_a_key_equals_one_device(job):
    for r in job:
        assert _check(r, "model_across_t1") == _check(r, "reference_t1")
    assert any(len(seq) > 1 for seq in job[0]["reference_t1"])


@pytest.mark.parametrize("mesh", ["data_across", "model_across"])
def test_key_none_draws_one_seed_for_every_process(job, mesh):
    first, second = (_check(r, f"{mesh}_key_none") for r in job)
    assert first["seed"] == second["seed"]
    assert first["tokens"] == second["tokens"] == first["replayed_on_one_device"]


def test_save_and_load_orbax_from_every_process(job):
    for r in job:
        orbax = _check(r, "orbax")
        assert orbax["q_spans_processes"]  # the case the checksums must handle
        assert orbax["values_equal"]
        assert orbax["t1"] == r["reference_t1"]


def test_the_sharded_program_lowers_for_accelerators(job):
    """tests/test_export.py's check, on a mesh (this job is where one exists)."""
    for r in job:
        assert _check(r, "export_on_the_mesh")["sharded"]


@pytest.mark.parametrize("check", ["mismatched_prompts", "mismatched_temperature"])
def test_different_inputs_on_the_processes_are_refused_on_every_process(job, check):
    for r in job:
        assert check in r, r["unfinished"]
        assert isinstance(r[check], dict), r[check]
        assert r[check]["error"].startswith("ValueError"), r[check]["error"]
        assert "passed different inputs" in r[check]["error"] and "process(es) 1" in r[check]["error"]


@pytest.mark.slow
def test_generate_a_tree_and_the_lookup_across_processes(tmp_path):
    job = _run_job(tmp_path, "full")
    for r in job:
        assert _check(r, "data_across_greedy") == _check(r, "reference_greedy")
        for what in ("generate", "tree", "lookup"):
            assert _check(r, f"model_across_{what}") == _check(r, f"reference_{what}"), what
        assert r["unfinished"] is None, r["unfinished"]
