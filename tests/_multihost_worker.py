"""One process of the two-process job of ``tests/test_multihost.py``.

Started twice by the test (process ids 0 and 1) with a coordinator port on
127.0.0.1; each process has 2 CPU devices, so the job has 4, and the CPU's
collectives go through gloo. Also runnable by hand::

    python tests/_multihost_worker.py 0 PORT OUT_DIR small & python tests/_multihost_worker.py 1 PORT OUT_DIR small

Each process writes ``OUT_DIR/process{i}.json``; the test compares the two
reports with each other and with the single-device references each process
computes first. ``part``: ``small`` (what CI runs: sampled decoding on two
meshes, ``key=None``, Orbax save and load, mismatched inputs) or ``full``
(adds greedy decoding, generate, a token tree and the lookup).

Every check records its result or its error, so one failing check does not
hide the others; the one that can hang on a broken engine (sampling with
``key=None`` while the model axis spans processes) runs last.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # two processes must compile the same programs
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=2"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    + " --xla_cpu_use_fusion_emitters=false"  # about half the compile time (tests/conftest.py)
)

import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

PROCESS, PORT, OUT_DIR, PART = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{PORT}", num_processes=2, process_id=PROCESS, initialization_timeout=60)

import specjax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from specjax import ModelConfig, sharding  # noqa: E402
from specjax.drafting import ngram_lookup  # noqa: E402
from specjax.testing import peaked_target_and_draft  # noqa: E402
from specjax.trees import static_tree  # noqa: E402

CFG = ModelConfig(
    model_type="llama", vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
    num_kv_heads=4, head_dim=8, intermediate_size=64, max_position_embeddings=64,
)
PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60], [7, 7], [100, 3, 1, 9]]
KW = dict(num_draft=3, max_new_tokens=10)
report: dict = {"process": PROCESS, "devices": jax.device_count(), "local_devices": jax.local_device_count()}


def record(name, fn):
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on what was recorded
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 2)
    write()


def write():
    with open(os.path.join(OUT_DIR, f"process{PROCESS}.json"), "w") as f:
        json.dump(report, f, indent=1)


def mesh_with(axis_across: str) -> Mesh:
    """A 2 x 2 ('data', 'model') mesh whose ``axis_across`` spans the two processes."""
    by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # p0d0 p0d1 p1d0 p1d1
    grid = np.array(by_process, dtype=object).reshape(2, 2)  # rows: processes
    if axis_across == "model":
        grid = grid.T
    return Mesh(grid, (sharding.DATA, sharding.MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def spans(mesh: Mesh, axis: str) -> bool:
    """Whether the devices along ``axis`` belong to more than one process."""
    processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
    line = np.take(processes, 0, axis=1 - mesh.axis_names.index(axis))
    return len(set(line.tolist())) > 1


def lists(out):
    return out.to_lists()


target, draft = peaked_target_and_draft(CFG)
pair = specjax.pair(target, draft)
T1 = dict(temperature=1.0, key=jax.random.key(3))

# Compile time bounds this job, so the small part compiles three decode programs:
# sampling at T=1 on one device (each process on its first device), on the
# data-across mesh and on the model-across mesh; every check reuses them.
record("reference_t1", lambda: lists(specjax.decode(pair, PROMPTS, **T1, **KW)))

data_across, model_across = mesh_with("data"), mesh_with("model")
report["data_axis_spans_processes"] = spans(data_across, "data")
report["model_axis_spans_processes"] = spans(model_across, "model")

record("model_across_t1", lambda: lists(specjax.decode(pair, PROMPTS, **T1, mesh=model_across, **KW)))


def seed_on(mesh):
    out = specjax.decode(pair, PROMPTS, temperature=1.0, mesh=mesh, **KW)
    again = specjax.decode(pair, PROMPTS, temperature=1.0, key=out.key, **KW)  # one device, the recorded key
    return {"seed": out.seed, "tokens": lists(out), "replayed_on_one_device": lists(again)}


record("data_across_key_none", lambda: seed_on(data_across))


def orbax_round_trip():
    path = os.path.join(OUT_DIR, "target-orbax")
    sharded = sharding.shard_params(target, model_across)
    specjax.save_orbax(sharded, path)  # every process, one shared directory
    loaded = specjax.load(path, mesh=model_across)
    q = loaded.params["layer_0"]["attn"]["q"]["kernel"]
    whole = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), loaded.params)
    same = jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, np.asarray(b))), whole, target.params))
    out = specjax.decode(specjax.pair(loaded, draft), PROMPTS, **T1, mesh=model_across, **KW)
    return {"q_spans_processes": not q.is_fully_addressable, "values_equal": same, "t1": lists(out)}


record("orbax", orbax_round_trip)


def export_on_the_mesh():
    """The sharded decode program lowers for CUDA and TPU too (tests/test_export.py's check)."""
    import test_export

    text = test_export.stablehlo_for(lambda: specjax.decode(pair, PROMPTS, **T1, mesh=model_across, **KW))
    test_export.assert_portable(text)
    return {"sharded": "mhlo.sharding" in text or "sdy.sharding" in text}


record("export_on_the_mesh", export_on_the_mesh)


def mismatched_prompts():
    mine = [list(p) for p in PROMPTS]
    mine[0][0] += PROCESS  # process 1's first prompt differs
    specjax.decode(pair, mine, **T1, mesh=data_across, **KW)
    return "no error"


record("mismatched_prompts", mismatched_prompts)
record(
    "mismatched_temperature",
    lambda: (specjax.decode(pair, PROMPTS, temperature=0.5 + PROCESS, key=jax.random.key(0), mesh=data_across, **KW),
             "no error")[1],
)

if PART == "full":
    record("reference_greedy", lambda: lists(specjax.decode(pair, PROMPTS, temperature=0.0, **KW)))
    record("data_across_greedy", lambda: lists(
        specjax.decode(pair, PROMPTS, temperature=0.0, mesh=data_across, **KW)))
    record("reference_generate", lambda: lists(specjax.generate(target, PROMPTS, temperature=0.0, max_new_tokens=10)))
    record("reference_tree", lambda: lists(specjax.decode(pair, PROMPTS, tree=static_tree((2, 2)), temperature=0.0,
                                                           max_new_tokens=10)))
    record("reference_lookup", lambda: lists(specjax.decode(pair, PROMPTS, lookup=ngram_lookup(1), temperature=0.0,
                                                             **KW)))
    record("model_across_generate", lambda: lists(
        specjax.generate(target, PROMPTS, temperature=0.0, max_new_tokens=10, mesh=model_across)))
    record("model_across_tree", lambda: lists(specjax.decode(
        pair, PROMPTS, tree=static_tree((2, 2)), temperature=0.0, max_new_tokens=10, mesh=model_across)))
    record("model_across_lookup", lambda: lists(specjax.decode(
        pair, PROMPTS, lookup=ngram_lookup(1), temperature=0.0, mesh=model_across, **KW)))

# Last: with a seed per process this hangs (the model shards of one sequence sample apart).
record("model_across_key_none", lambda: seed_on(model_across))
report["done"] = True
write()
jax.distributed.shutdown()
