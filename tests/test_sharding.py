"""Sharded decoding on 8 fake CPU devices, and the sharding rules.

The multi-device checks run in ONE subprocess (``tests/_sharding_worker.py``):
``--xla_force_host_platform_device_count=8`` must be set before JAX starts,
and one process bounds compile time (one tiny model, one batch shape, about
ten decode programs). This file asserts on the worker's JSON report; the
rule tests below run in-process on abstract shapes (nothing compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

import specjax
from specjax import ModelConfig, sharding

HERE = os.path.dirname(os.path.abspath(__file__))
# The per-mesh checks run on two meshes by default: (4, 2), data-parallel with
# a replicated draft, and (1, 8), all eight devices on the model axis. The
# other two are slow-only: (2, 4) is the mesh the worker's trees, copied
# drafts, narrow verification, generate and loading sections run on (their
# tests run by default), and (8, 1)'s data-only split is (4, 2)'s data split
# with the model axis of one device. Each mesh compiles its own programs
# (about 15 s of the worker's time on a 2-core CPU).
DEFAULT_MESHES = ("4x2", "1x8")
MESHES = (pytest.param("8x1", marks=pytest.mark.slow), "4x2",
          pytest.param("2x4", marks=pytest.mark.slow), "1x8")
# Worker sections that only slow tests read, computed only when one of them is selected: the
# experts split over 'model' (tests/test_moe_routed.py decodes a mixture of experts on a mesh by
# default), and a head's dynamic tree with penalties (a head and penalties each run by default).
SLOW_SECTIONS = {"experts": "test_experts_split_over_the_model_axis_decode_as_on_one_device",
                 "head_tree_penalties": "head_tree_penalties"}


def _selected(request) -> list:
    return [item for item in request.session.items if getattr(item, "module", None) is request.module]


def _meshes_to_run(request) -> list[str]:
    """The default meshes and any other that this run's selected tests check
    (``-m slow`` selects the other two), so the worker compiles no mesh that
    no test reads."""
    meshes = set(DEFAULT_MESHES)
    for item in _selected(request):
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "mesh" in callspec.params:
            meshes.add(callspec.params["mesh"])
    return sorted(meshes)


def _sections_to_skip(request) -> list[str]:
    """The slow-only sections that no selected test reads (by test name or case)."""
    names = {item.originalname for item in _selected(request)}
    cases = {str(item.callspec.params.get("case")) for item in _selected(request) if hasattr(item, "callspec")}
    return sorted(s for s, reader in SLOW_SECTIONS.items() if reader not in names | cases)


@pytest.fixture(scope="module")
def report(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("sharding") / "report.json"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_sharding_worker.py"), str(out), ",".join(_meshes_to_run(request)),
         ",".join(_sections_to_skip(request))],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def test_worker_has_eight_devices(report):
    assert report["devices"] == 8


@pytest.mark.parametrize("mesh", MESHES)
def test_greedy_matches_single_device_token_for_token(report, mesh):
    assert report["meshes"][mesh]["greedy"] == report["reference"]["greedy"]
    assert any(len(seq) > 1 for seq in report["reference"]["greedy"])


@pytest.mark.parametrize("mesh", MESHES)
def test_sampling_at_temperature_one_matches_for_a_fixed_key(report, mesh):
    entry = report["meshes"][mesh]
    assert entry["t1"] == report["reference"]["t1"]
    # A real sampling run: some drafts were accepted and some rejected.
    assert 0.0 < report["reference"]["t1_accept_rate"] < 1.0


def test_draft_replicated_or_sharded(report):
    # (4, 2) runs with a replicated draft, every other mesh with a sharded one.
    kinds = {entry["t1_draft"] for entry in report["meshes"].values()}
    assert kinds == {"replicated", "sharded"}


@pytest.mark.parametrize("mesh", MESHES)
def test_params_are_split_over_the_model_axis(report, mesh):
    data, model = map(int, mesh.split("x"))
    entry = report["meshes"][mesh]
    assert entry["q_kernel_shard"] == [32, 64 // model]  # q kernel [H=32, heads*D=64]
    assert entry["q_kernel_spec"] == str(P(None, "model"))
    assert entry["out_replicated"]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("which", ["greedy_hlo", "t1_hlo"])
def test_compiled_decode_never_all_gathers_a_weight_or_a_cache(report, mesh, which):
    hlo = report["meshes"][mesh][which]
    assert hlo["weight_gathers"] == [], hlo
    assert hlo["cache_gathers"] == [], hlo
    if mesh != "8x1":  # tensor parallel: the row-parallel projections all-reduce activations
        assert hlo["counts"].get("all-reduce", 0) >= 2 * 2  # >= 2 per layer


def test_the_hlo_check_catches_a_weight_all_gather(report):
    good, bad = report["generate"], report["generate_gathering"]
    assert good["hlo"]["weight_gathers"] == []
    # The deliberately replicated-constraint variant all-gathers every kernel shape.
    assert len(bad["hlo"]["weight_gathers"]) == 6, bad["hlo"]
    assert bad["greedy"] == good["greedy"] == report["reference"]["greedy"]


@pytest.mark.parametrize("which", ["static_greedy", "dynamic_mars_t1"])
def test_trees_on_a_mesh_match_one_device_without_gathering_weights(report, which):
    entry = report["trees"][which]
    assert entry["match"] and entry["tau"] > 1.0
    assert entry["hlo"]["weight_gathers"] == [] and entry["hlo"]["cache_gathers"] == [], entry["hlo"]


def test_copied_drafts_on_a_mesh_match_one_device(report):
    entry = report["lookup"]
    assert entry["match"] and entry["copied"] == entry["copied_ref"] > 0
    assert entry["hlo"]["weight_gathers"] == [] and entry["hlo"]["cache_gathers"] == [], entry["hlo"]


def test_narrow_verification_on_a_mesh_matches_one_device(report):
    entry = report["narrow"]
    assert entry["match"] and entry["verified"] < entry["full"]
    assert entry["hlo"]["weight_gathers"] == [] and entry["hlo"]["cache_gathers"] == [], entry["hlo"]


def test_any_language_model_runs_replicated_on_a_mesh(report):
    assert report["bigram"]["match"] and sum(report["bigram"]["lengths"]) > 0


@pytest.mark.parametrize("mesh", MESHES)
def test_second_call_on_a_mesh_compiles_nothing(report, mesh):
    assert report["meshes"][mesh]["recompiles"] == 0


@pytest.mark.slow
def test_experts_split_over_the_model_axis_decode_as_on_one_device(report):
    experts = report["experts"]
    assert experts["match"]
    assert experts["expert_shard"][0] == experts["experts"] // 4  # each of 4 'model' devices holds 1 expert
    assert "num_experts=3 is not divisible by it (3 % 2 = 1)" in experts["indivisible"]


@pytest.mark.parametrize("case", ["head_t1", pytest.param("head_tree_penalties", marks=pytest.mark.slow),
                                  "penalties_t1"])
def test_feature_heads_and_penalties_on_a_mesh_match_one_device(report, case):
    entry = report["heads_and_controls"][case]
    assert entry["match"] and entry["accepted"] == entry["accepted_ref"] and sum(entry["accepted"]) > 0, entry
    assert entry["hlo"]["weight_gathers"] == [] and entry["hlo"]["cache_gathers"] == [], entry["hlo"]
    assert report["heads_and_controls"]["penalties_changed_the_output"]


def test_mesh_errors_are_clear_and_raised_before_tracing(report):
    e = report["errors"]
    assert e["traced_or_compiled"] == 0
    assert "ValueError" in e["batch"] and "batch of 6" in e["batch"] and "'data' axis of 4" in e["batch"]
    assert "batch of 5" in e["generate_batch"] and "'data' axis of 2" in e["generate_batch"]
    assert "num_kv_heads=2" in e["kv_heads"] and "'model' axis has 4" in e["kv_heads"]
    assert "num_heads=6" in e["heads"] and "intermediate_size=90" in e["heads"]
    assert e["decode_draft"].startswith("ValueError: draft:") and "num_heads=4" in e["decode_draft"]
    assert "'model' axis has 8" in e["decode_draft"]
    assert e["decode_target_kv"].startswith("ValueError: target:") and "num_kv_heads=2" in e["decode_target_kv"]
    assert "'data' and 'model'" in e["mesh_axes"]


@pytest.mark.parametrize("kind", ["orbax", "hf"])
def test_load_straight_into_the_sharded_layout(report, kind):
    got = report["loading"][kind]
    assert got["shardings_match"] and got["values_match"]
    assert got["q_shard"] == [32, 16]  # mesh (2, 4): q kernel [32, 64] split 4 ways
    assert got["embed_shard"] == [32, 32]  # embedding [128, 32] split over the vocabulary
    assert report["loading"]["orbax_bf16"] == {"dtype": "bfloat16", "spec": str(P("model", None))}


# ---------------------------------------------------------------------------
# In-process: rules on abstract shapes, mesh construction
# ---------------------------------------------------------------------------


def _llama(**kw):
    base = dict(model_type="llama", vocab_size=128, hidden_size=32, num_layers=1, num_heads=4,
                num_kv_heads=2, head_dim=8, intermediate_size=64)
    base.update(kw)
    return ModelConfig(**base)


def test_rules_llama():
    specs = sharding.param_specs(_llama(qk_norm=True, attention_bias=True), model_axis_size=2)
    layer = specs["layer_0"]
    assert specs["embed"]["embedding"] == P("model", None)
    assert specs["lm_head"] == P(None, "model")
    for name in ("q", "k", "v"):
        assert layer["attn"][name]["kernel"] == P(None, "model")
        assert layer["attn"][name]["bias"] == P()
    assert layer["attn"]["o"]["kernel"] == P("model", None)
    assert layer["mlp"]["gate"]["kernel"] == layer["mlp"]["up"]["kernel"] == P(None, "model")
    assert layer["mlp"]["down"]["kernel"] == P("model", None)
    assert layer["attn"]["q_norm"]["scale"] == layer["attn_norm"]["scale"] == specs["final_norm"]["scale"] == P()


def test_rules_gpt2_and_vocab_fallback():
    cfg = ModelConfig(model_type="gpt2", vocab_size=50257, hidden_size=32, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=8, intermediate_size=128, tie_word_embeddings=True,
                      activation="gelu_new", attention_bias=True)
    specs = sharding.param_specs(cfg, model_axis_size=4)
    layer = specs["layer_0"]
    assert layer["attn"]["qkv"]["kernel"] == layer["mlp"]["fc"]["kernel"] == P(None, "model")
    assert layer["attn"]["o"]["kernel"] == layer["mlp"]["proj"]["kernel"] == P("model", None)
    assert specs["pos_embed"]["embedding"] == P()
    # 50257 does not divide 4: the table is split over the hidden axis instead.
    assert specs["embed"]["embedding"] == P(None, "model")
    untied = sharding.param_specs(_llama(vocab_size=97), model_axis_size=4)
    assert untied["lm_head"] == P("model", None)


def test_cache_spec_and_one_device_mesh():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == ("data", "model")
    assert sharding.cache_spec(_llama(), mesh) == P("data", "model", None, None)
    sharding.check_divisible(_llama(), mesh, batch=3)  # a (1, 1) mesh divides everything


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="needs 4 devices"):
        sharding.make_mesh(2, 2)
    with pytest.raises(ValueError, match="positive integer"):
        sharding.make_mesh(0)
    with pytest.raises(TypeError, match="Decoder"):
        sharding.param_shardings(object(), sharding.make_mesh())


def test_public_api():
    assert specjax.sharding is sharding
    for name in sharding.__all__:
        assert hasattr(sharding, name)
