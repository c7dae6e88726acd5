"""Runs every multi-device check of ``tests/test_sharding.py`` in one process.

Started by the test as a subprocess because ``--xla_force_host_platform_device_count``
must be set before JAX initialises. Also runnable alone::

    python tests/_sharding_worker.py /tmp/result.json [8x1,4x2,2x4,1x8]

The optional second argument names the meshes of the per-mesh loop (default:
all four); ``tests/test_sharding.py`` passes the ones its selected tests check.

Writes a JSON report; the test asserts on it. Compile time bounds this file
(about ten decode programs), so every mesh shares one tiny model and one batch
shape, and XLA's CPU backend is asked for its cheapest optimisation level
(numerics are the same for the reference and the sharded runs: one process).
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
# Its checks count compilations; programs loaded from the suite's disk cache
# (tests/conftest.py) would not be counted.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    + " --xla_cpu_use_fusion_emitters=false"  # about half the compile time (tests/conftest.py)
)

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import specjax  # noqa: E402
from specjax import Decoder, Model, ModelConfig, sharding  # noqa: E402
from specjax._src.engine import loop as decode_lib  # noqa: E402
from tiny_models import peaked_target_and_draft  # noqa: E402

MESHES = ((8, 1), (4, 2), (2, 4), (1, 8))
BATCH, NUM_DRAFT, NEW = 8, 3, 12
# Shapes chosen so that no activation can be mistaken for a weight matrix:
# weights are [128, 32], [32, 64], [64, 32], [32, 96], [96, 32], [32, 128].
CFG = ModelConfig(
    model_type="llama", vocab_size=128, hidden_size=32, num_layers=2, num_heads=8,
    num_kv_heads=8, head_dim=8, intermediate_size=96, max_position_embeddings=64,
)


def tiny_pair():
    """Peaked heads (tests/tiny_models.py) so greedy choices are not near-ties."""
    return specjax.pair(*peaked_target_and_draft(CFG))


@dataclasses.dataclass(frozen=True)
class GatheringDecoder(Decoder):
    """A deliberately bad variant: constrains its params to be replicated inside
    the step, so XLA must all-gather every sharded weight. The HLO check must flag it."""

    mesh: Any = None

    def apply(self, params, tokens, cache=None, **kwargs):
        params = jax.lax.with_sharding_constraint(params, NamedSharding(self.mesh, P()))
        return super().apply(params, tokens, cache, **kwargs)


# --------------------------------------------------------------------------- #
# HLO inspection
# --------------------------------------------------------------------------- #

_SHAPE = re.compile(r"\b(?:f32|bf16|f16|s32|u32|pred|s8|u8)\[([\d,]*)\]")


def collectives(hlo: str) -> dict:
    """Result shapes of every all-gather, and counts of each collective kind."""
    gathers = []
    counts = {}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", line)
        if not m:
            continue
        kind = m.group(2)
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "all-gather":
            for dims in _SHAPE.findall(m.group(1)):
                gathers.append(tuple(int(d) for d in dims.split(",") if d))
    return {"all_gather_shapes": gathers, "counts": counts}


def weight_shapes(*models) -> set:
    shapes = set()
    for m in models:
        for leaf in jax.tree_util.tree_leaves(m.params):
            if leaf.ndim >= 2:
                shapes.add(tuple(int(d) for d in leaf.shape))
    return shapes


class Spy:
    """Records the last call of a module-level jitted function, to read back
    its compiled program (``lower(...).compile()`` hits the jit cache)."""

    def __init__(self, name):
        self.name = name
        self.orig = getattr(decode_lib, name)
        self.last = None
        setattr(decode_lib, name, self)

    def __call__(self, *args, **kwargs):
        self.last = (args, kwargs)
        return self.orig(*args, **kwargs)

    def hlo(self) -> str:
        args, kwargs = self.last
        return self.orig.lower(*args, **kwargs).compile().as_text()


def check_hlo(spy: Spy, weights: set, cache_dims: tuple) -> dict:
    """Collectives of the spied program; ``cache_gathers``: all-gathers of a
    whole KV-cache buffer ``[B, KVH, L, D]``, with L the bucketed cache length
    the engine chose for that call (read from its static config)."""
    info = collectives(spy.hlo())
    kv_heads, head_dim = cache_dims
    length = spy.last[1]["cfg"].cache_length
    info["weight_gathers"] = sorted({s for s in info["all_gather_shapes"] if s in weights})
    info["cache_gathers"] = sorted({s for s in info["all_gather_shapes"]
                                    if len(s) == 4 and s[1:] == (kv_heads, length, head_dim)})
    info["all_gather_shapes"] = sorted(set(info["all_gather_shapes"]))
    return info


# --------------------------------------------------------------------------- #
# Checks
# --------------------------------------------------------------------------- #


def compiles():
    counter = {"trace": 0, "compile": 0}

    def listener(event, duration, **kwargs):
        if event.endswith("jaxpr_trace_duration"):
            counter["trace"] += 1
        elif event.endswith("backend_compile_duration"):
            counter["compile"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    return counter


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def errors(pair, prompts, kw) -> dict:
    """Every mesh error, and proof that each was raised before anything was traced."""
    out = {}
    mesh24, mesh18 = sharding.make_mesh(2, 4), sharding.make_mesh(1, 8)
    kv2 = CFG.replace(num_heads=8, num_kv_heads=2)
    kv2_model = Model(Decoder(kv2).init(jax.random.key(0)), Decoder(kv2))
    h6 = CFG.replace(num_heads=6, num_kv_heads=6, intermediate_size=90)
    h6_model = Model(Decoder(h6).init(jax.random.key(0)), Decoder(h6))
    h4 = CFG.replace(num_heads=4, num_kv_heads=4, num_layers=1)
    h4_draft = Model(Decoder(h4).init(jax.random.key(1)), Decoder(h4))
    for cfg in (CFG, kv2, h6, h4):
        Decoder(cfg).param_shapes()  # the rules read these abstract shapes (an eval_shape trace)
    counter = compiles()
    out["batch"] = error_of(
        lambda: specjax.decode(pair, prompts[:6], temperature=0.0, mesh=sharding.make_mesh(4, 2), **kw)
    )
    out["generate_batch"] = error_of(
        lambda: specjax.generate(pair.target, prompts[:5], temperature=0.0, mesh=mesh24, max_new_tokens=4)
    )
    out["kv_heads"] = error_of(lambda: sharding.shard_params(kv2_model, mesh24))
    out["heads"] = error_of(lambda: sharding.param_shardings(h6_model, mesh24))
    out["decode_draft"] = error_of(
        lambda: specjax.decode(specjax.pair(pair.target, h4_draft), prompts, temperature=0.0, mesh=mesh18, **kw)
    )
    out["decode_target_kv"] = error_of(
        lambda: specjax.decode(specjax.pair(kv2_model, pair.draft), prompts, temperature=0.0, mesh=mesh24, **kw)
    )
    out["mesh_axes"] = error_of(
        lambda: sharding.shard_params(pair.target, jax.make_mesh((8,), ("x",)))
    )
    out["traced_or_compiled"] = counter["trace"] + counter["compile"]
    return out


def main(path: str, meshes=MESHES, skip=()) -> None:
    t0 = time.time()
    report: dict = {"devices": jax.device_count()}
    pair = tiny_pair()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, size=int(rng.integers(1, 9))).tolist() for _ in range(BATCH)]
    key = jax.random.key(7)
    kw = dict(num_draft=NUM_DRAFT, max_new_tokens=NEW)
    weights = weight_shapes(pair.target, pair.draft)
    caches = (CFG.num_kv_heads, CFG.head_dim)
    report["errors"] = errors(pair, prompts, kw)

    spy_decode, spy_generate = Spy("_decode_jit"), Spy("_generate_jit")
    ref_greedy = specjax.decode(pair, prompts, temperature=0.0, **kw)
    ref_t1 = specjax.decode(pair, prompts, temperature=1.0, key=key, **kw)
    report["reference"] = {
        "greedy": ref_greedy.to_lists(),
        "t1": ref_t1.to_lists(),
        "t1_accept_rate": float(np.sum(ref_t1.stats.accepted) / max(1, np.sum(ref_t1.stats.drafted))),
    }
    report["meshes"] = {}
    for data, model in meshes:
        mesh = sharding.make_mesh(data, model)
        name = f"{data}x{model}"
        entry: dict = {}
        target = sharding.shard_params(pair.target, mesh)
        # (4, 2) runs T=1 with a replicated draft: the draft "may be replicated or sharded".
        draft_t1 = sharding.replicate(pair.draft, mesh) if (data, model) == (4, 2) else None
        greedy = specjax.decode(pair.replace(target=target), prompts, temperature=0.0, mesh=mesh, **kw)
        entry["greedy"] = greedy.to_lists()
        entry["greedy_hlo"] = check_hlo(spy_decode, weights, caches)
        t1_pair = pair if draft_t1 is None else pair.replace(draft=draft_t1)
        t1 = specjax.decode(t1_pair, prompts, temperature=1.0, key=key, mesh=mesh, **kw)
        entry["t1"] = t1.to_lists()
        entry["t1_draft"] = "replicated" if draft_t1 is not None else "sharded"
        entry["t1_hlo"] = check_hlo(spy_decode, weights, caches)
        q = target.params["layer_0"]["attn"]["q"]["kernel"]
        entry["q_kernel_shard"] = list(q.addressable_shards[0].data.shape)
        entry["q_kernel_spec"] = str(q.sharding.spec)
        entry["out_replicated"] = bool(greedy.tokens.sharding.is_fully_replicated)
        # A second call with new prompts of the same shape compiles nothing; here the
        # whole pair is placed by shard_params and decode finds the mesh on the params.
        counter = compiles()
        placed = sharding.shard_params(pair.replace(target=target), mesh)
        again = specjax.decode(placed, [p[::-1] for p in prompts], temperature=0.0, **kw)
        entry["recompiles"] = counter["compile"]
        entry["second_call_lengths"] = again.lengths.tolist()
        report["meshes"][name] = entry

    # generate on a mesh, and the deliberately gathering variant (positive control).
    mesh = sharding.make_mesh(2, 4)
    gen = specjax.generate(pair.target, prompts, temperature=0.0, max_new_tokens=NEW, mesh=mesh)
    report["generate"] = {"greedy": gen.to_lists(), "hlo": check_hlo(spy_generate, weights, caches)}
    bad_target = sharding.shard_params(pair.target, mesh).replace(module=GatheringDecoder(CFG, mesh=mesh))
    gen_bad = specjax.generate(bad_target, prompts, temperature=0.0, max_new_tokens=NEW, mesh=mesh)
    report["generate_gathering"] = {"greedy": gen_bad.to_lists(), "hlo": check_hlo(spy_generate, weights, caches)}

    report["trees"] = trees_on_mesh(pair, prompts, key, spy_decode, weights, caches)
    report["lookup"] = lookup_on_mesh(pair, prompts, key, spy_decode, weights, caches)
    report["narrow"] = narrow_verification_on_mesh(pair, prompts, key, spy_decode, weights, caches)
    report["bigram"] = bigram_on_mesh()
    if "experts" not in skip:
        report["experts"] = experts_on_mesh(prompts, kw)
    report["heads_and_controls"] = heads_and_controls_on_mesh(pair, prompts, key, spy_decode, weights, caches,
                                                              skip)
    report["loading"] = loading(pair.target, mesh)
    report["seconds"] = round(time.time() - t0, 1)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def trees_on_mesh(pair, prompts, key, spy, weights, caches) -> dict:
    """Token trees on a tensor-parallel mesh (2, 4): a static tree greedy and a
    dynamic tree sampled with MARS (children drawn from the draft's sharded
    logits), against one device; their programs' HLO."""
    from specjax.rules import mars
    from specjax.trees import dynamic_tree, static_tree

    mesh = sharding.make_mesh(2, 4)
    target = sharding.shard_params(pair.target, mesh)
    out = {}
    for name, kw in (("static_greedy", dict(tree=static_tree((2, 2)), temperature=0.0)),
                     ("dynamic_mars_t1", dict(tree=dynamic_tree(2, 2, 3, sampled=True), temperature=1.0,
                                              rule=mars(0.5), key=key))):
        ref = specjax.decode(pair, prompts, max_new_tokens=NEW, **kw)
        got = specjax.decode(pair.replace(target=target), prompts, max_new_tokens=NEW, mesh=mesh, **kw)
        out[name] = {"match": got.to_lists() == ref.to_lists(), "tau": float(got.stats.tau),
                     "hlo": check_hlo(spy, weights, caches)}
    return out


def heads_and_controls_on_mesh(pair, prompts, key, spy, weights, caches, skip=()) -> dict:
    """A feature head (reduced draft vocabulary) on tensor-parallel meshes,
    replicated beside the sharded target: a chain on (2, 4), and a dynamic tree
    with penalties on (4, 2); and penalties on a chain with the sharded draft
    model. All at T=1 with one key, where the tokens depend on the draft's
    distribution (its draws, the acceptance ratio, the residual), so equal
    tokens and acceptance counts show the head computed the same on the mesh.
    Each against one device, with its programs' HLO."""
    from specjax.engine import GenerationControls
    from specjax.trees import dynamic_tree

    head = specjax.heads.init_from_target(pair.target, jax.random.key(1), np.arange(80)[::-1])
    head_pair = specjax.pair(pair.target, head)
    penalties = GenerationControls(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3,
                                   logit_bias={1: 1.0, 6: -2.0})
    out = {}
    for name, (data, model), p, kw in (
        ("head_t1", (2, 4), head_pair, dict(num_draft=NUM_DRAFT, temperature=1.0, key=key)),
        ("head_tree_penalties", (4, 2), head_pair,
         dict(tree=dynamic_tree(2, 2, 3, sampled=True), temperature=1.0, key=key, controls=penalties)),
        ("penalties_t1", (2, 4), pair, dict(num_draft=NUM_DRAFT, temperature=1.0, key=key, controls=penalties)),
    ):
        if name in skip:
            continue
        mesh = sharding.make_mesh(data, model)
        ref = specjax.decode(p, prompts, max_new_tokens=NEW, **kw)
        got = specjax.decode(p.replace(target=sharding.shard_params(p.target, mesh)), prompts, max_new_tokens=NEW,
                             mesh=mesh, **kw)
        out[name] = {"match": got.to_lists() == ref.to_lists(), "tau": float(got.stats.tau),
                     "accepted": np.asarray(got.stats.accepted).tolist(),
                     "accepted_ref": np.asarray(ref.stats.accepted).tolist(), "hlo": check_hlo(spy, weights, caches)}
    plain = specjax.decode(pair, prompts, max_new_tokens=NEW, num_draft=NUM_DRAFT, temperature=1.0, key=key)
    out["penalties_changed_the_output"] = plain.to_lists() != ref.to_lists()
    return out


def lookup_on_mesh(pair, prompts, key, spy, weights, caches) -> dict:
    """Drafts copied from the context (``lookup=``) on a (2, 4) mesh at T=1, against one device."""
    from specjax.drafting import ngram_lookup

    mesh = sharding.make_mesh(2, 4)
    target = sharding.shard_params(pair.target, mesh)
    repetitive = [(p * 4)[:12] for p in prompts]
    kw = dict(num_draft=NUM_DRAFT, max_new_tokens=NEW, temperature=1.0, key=key, lookup=ngram_lookup(1))
    ref = specjax.decode(pair, repetitive, **kw)
    got = specjax.decode(pair.replace(target=target), repetitive, mesh=mesh, **kw)
    return {"match": got.to_lists() == ref.to_lists(), "copied": int(np.sum(got.stats.copied)),
            "copied_ref": int(np.sum(ref.stats.copied)), "hlo": check_hlo(spy, weights, caches)}


def narrow_verification_on_mesh(pair, prompts, key, spy, weights, caches) -> dict:
    """A drafting policy that stops early, so cycles verify at widths 2 or 4
    of K + 1 = 4 (``lax.switch`` over sharded forwards), on a (2, 4) mesh at T=1."""
    from specjax.drafting import confidence

    mesh = sharding.make_mesh(2, 4)
    target = sharding.shard_params(pair.target, mesh)
    kw = dict(num_draft=NUM_DRAFT, max_new_tokens=NEW, temperature=1.0, key=key, drafting=confidence(0.9))
    ref = specjax.decode(pair, prompts, **kw)
    got = specjax.decode(pair.replace(target=target), prompts, mesh=mesh, **kw)
    return {"match": got.to_lists() == ref.to_lists(), "verified": int(np.sum(got.stats.verified)),
            "full": (NUM_DRAFT + 1) * int(np.sum(got.stats.cycles)), "hlo": check_hlo(spy, weights, caches)}


def experts_on_mesh(prompts, kw) -> dict:
    """A mixture of experts with its experts split over 'model' (2 of 4 per device)
    decodes what it decodes on one device."""
    from specjax.testing import peaked_target_and_draft

    cfg = CFG.replace(model_type="mixtral", num_experts=4, num_experts_per_tok=2)
    target, draft = peaked_target_and_draft(cfg)
    pair = specjax.pair(target, draft)
    ref = specjax.decode(pair, prompts, temperature=0.0, **kw)
    mesh = sharding.make_mesh(2, 4)
    sharded = sharding.shard_params(pair, mesh)
    out = specjax.decode(sharded, prompts, temperature=0.0, **kw)
    gate = sharded.target.params["layer_0"]["mlp"]["experts_gate"]
    odd = cfg.replace(num_experts=3)
    return {"match": ref.to_lists() == out.to_lists(), "expert_shard": list(gate.addressable_shards[0].data.shape),
            "experts": cfg.num_experts,
            "indivisible": error_of(lambda: sharding.check_divisible(odd, sharding.make_mesh(4, 2)))}


def bigram_on_mesh() -> dict:
    """Any LanguageModel (here a bigram table, no KV buffers) runs on a mesh,
    replicated; one PRNG key per sequence is split over 'data' with the batch."""
    from bigram import bigram_model, random_table

    pair = specjax.pair(bigram_model(random_table(0, 8)), bigram_model(random_table(1, 8)))
    prompts = [[1, 2, 3], [4], [5, 6], [7, 1, 2, 3]]
    keys = jax.random.split(jax.random.key(4), len(prompts))
    ref = specjax.decode(pair, prompts, temperature=1.0, key=keys, max_new_tokens=6)
    out = specjax.decode(pair, prompts, temperature=1.0, key=keys, max_new_tokens=6, mesh=sharding.make_mesh(4, 2))
    return {"match": ref.to_lists() == out.to_lists(), "lengths": out.lengths.tolist()}


def loading(model: Model, mesh) -> dict:
    out = {}
    want = sharding.param_shardings(model, mesh)
    with tempfile.TemporaryDirectory() as tmp:
        orbax_dir, hf_dir = os.path.join(tmp, "orbax"), os.path.join(tmp, "hf")
        specjax.save_orbax(model, orbax_dir)
        specjax.export_hf(model, hf_dir)
        for kind, path in (("orbax", orbax_dir), ("hf", hf_dir)):
            loaded = specjax.load(path, mesh=mesh)
            got = jax.tree.leaves(loaded.params)
            ref = jax.tree.leaves(model.params)
            specs = jax.tree.leaves(want)
            out[kind] = {
                "shardings_match": all(g.sharding.is_equivalent_to(s, g.ndim) for g, s in zip(got, specs)),
                "values_match": all(np.array_equal(np.asarray(g), np.asarray(r)) for g, r in zip(got, ref)),
                "q_shard": list(loaded.params["layer_0"]["attn"]["q"]["kernel"].addressable_shards[0].data.shape),
                "embed_shard": list(loaded.params["embed"]["embedding"].addressable_shards[0].data.shape),
            }
        loaded16 = specjax.load(orbax_dir, dtype="bfloat16", mesh=mesh)
        leaf = loaded16.params["layer_0"]["mlp"]["down"]["kernel"]
        out["orbax_bf16"] = {"dtype": str(leaf.dtype), "spec": str(leaf.sharding.spec)}
    return out


if __name__ == "__main__":
    try:
        chosen = MESHES
        if len(sys.argv) > 2:
            chosen = tuple(tuple(map(int, m.split("x"))) for m in sys.argv[2].split(",") if m)
        skipped = tuple(s for s in sys.argv[3].split(",") if s) if len(sys.argv) > 3 else ()
        main(sys.argv[1], chosen, skipped)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
