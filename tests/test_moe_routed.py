"""Routed-only expert compute against the every-expert reference, float and quantized.

The layer reads only the routed experts (one tile per expert up to
``moe.GROUP_ROWS`` tokens, tiles of ``GROUP_ROWS`` rows beyond), and must give
what computing every expert and weighting the unpicked ones 0 gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax._src.kernels import quant
from specjax._src.models import moe
from specjax._src.models.config import ModelConfig


def _config(**changes) -> ModelConfig:
    fields = dict(
        model_type="qwen3_moe",
        vocab_size=64,
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
    )
    fields.update(changes)
    return ModelConfig(**fields)


def _layer(cfg: ModelConfig, tokens: int, seed: int = 0):
    """The layer's params (the float ones quantized when ``cfg`` is) and ``x [2, tokens / 2, H]``."""
    x = jax.random.normal(jax.random.key(seed), (2, tokens // 2, cfg.hidden_size), jnp.float32)
    params = moe.MoE(cfg.replace(quantization=None)).init(jax.random.key(seed + 1), x)["params"]
    # Weights larger than the 0.02 init, so that experts differ by more than rounding.
    params = jax.tree.map(lambda p: p * 20.0, params)
    if cfg.expert_bias:  # gpt-oss's router and expert biases, zero at init: random, so that they count
        keys = iter(jax.random.split(jax.random.key(seed + 2), 8))
        params = jax.tree_util.tree_map_with_path(
            lambda path, p: jax.random.normal(next(keys), p.shape, p.dtype) if str(path[-1].key).endswith("bias")
            else p, params)
    if cfg.quantization is not None:
        params = quant.quantize_params(params, cfg.quant)
    return params, x


# gpt-oss: a biased router, a softmax over the top-k logits, expert biases and the clamped SwiGLU.
_GPT_OSS = dict(model_type="gpt_oss", router_scores="topk_softmax", router_logit_bias=True, expert_bias=True,
                activation="swiglu_oai", attention_sinks=True)
CASES = {
    "float": _config(),
    "float_top1": _config(num_experts_per_tok=1),
    "shared_expert": _config(model_type="qwen2_moe", shared_expert_intermediate_size=96, shared_expert_gate=True),
    "deepseek_routing": _config(
        model_type="dots1",
        router_scores="sigmoid",
        router_bias=True,
        router_groups=2,
        router_top_groups=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        shared_expert_intermediate_size=64,
    ),
    "int8": _config(quantization="int8"),
    "q4": _config(quantization="q4"),
    "gpt_oss": _config(**_GPT_OSS),
    "gpt_oss_int8": _config(**_GPT_OSS, quantization="int8"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tokens", [2, 72])
def test_routed_experts_equal_every_expert(case, tokens):
    """2 tokens: one tile per routed expert; 72: tiles of 16 rows, with
    groups larger than a tile and partial tiles."""
    cfg = CASES[case]
    params, x = _layer(cfg, tokens)
    routed = moe.MoE(cfg).apply({"params": params}, x)
    every = moe.MoE(cfg, experts="all").apply({"params": params}, x)
    assert routed.shape == x.shape
    scale = float(jnp.max(jnp.abs(every)))
    assert scale > 1e-2
    np.testing.assert_allclose(np.asarray(routed), np.asarray(every), atol=2e-6 * scale, rtol=0)


def test_a_wrong_routing_is_detected():
    """Negative control: the same tiles with every token's experts shifted by one differ
    from the reference (so equality above is not vacuous)."""
    cfg = CASES["float"]
    params, x = _layer(cfg, 10)
    x2 = x.reshape(-1, cfg.hidden_size)
    logits = x2 @ params["router"]["kernel"]
    weights, picked = moe.route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    stack = {"gate": params["experts_gate"], "up": params["experts_up"], "down": params["experts_down"]}
    mlp = moe.float_expert_mlp(moe.gated(jax.nn.silu), "auto")
    want = moe.all_experts(x2, weights, picked, stack, mlp)
    right = moe.routed_experts(x2, weights, picked, stack, mlp, tile=10)
    wrong = moe.routed_experts(x2, weights, (picked + 1) % cfg.num_experts, stack, mlp, tile=10)
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(right - want))) < 2e-6 * scale
    assert float(jnp.max(jnp.abs(wrong - want))) > 1e-2 * scale


@pytest.mark.parametrize("tile", [1, 3, 16])
def test_the_tiles_cover_every_assignment_once(tile):
    """Each (token, expert) assignment lies in exactly one tile, of its own expert, and
    the tiles number the ceil(group / tile) the groups need, within the static bound."""
    rng = np.random.default_rng(0)
    num_experts, n, k = 8, 13, 3
    experts = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(np.int32)
    order, tile_expert, tile_start, tile_rows, num_tiles = map(
        np.asarray, moe.tile_schedule(jnp.asarray(experts), num_experts, tile)
    )
    flat = experts.reshape(-1)[order]
    seen = np.zeros(n * k, int)
    for j in range(int(num_tiles)):
        rows = slice(tile_start[j], tile_start[j] + tile_rows[j])
        assert (flat[rows] == tile_expert[j]).all()
        seen[rows] += 1
    assert (seen == 1).all()
    sizes = np.bincount(experts.reshape(-1), minlength=num_experts)
    assert int(num_tiles) == int(np.sum(-(-sizes // tile)))
    assert len(tile_expert) == min(num_experts, n * k) + n * k // tile


def test_ragged_dot_path_equals_the_tiles():
    """The GPU/TPU path for many tokens (jax.lax.ragged_dot over groups sorted by expert),
    run here through jax's CPU lowering, gives the tiles' result."""
    cfg = CASES["float"]
    params, x = _layer(cfg, 40)
    x2 = x.reshape(-1, cfg.hidden_size)
    weights, picked = moe.route(x2 @ params["router"]["kernel"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    stack = {"gate": params["experts_gate"], "up": params["experts_up"], "down": params["experts_down"]}
    tiles = moe.routed_experts(x2, weights, picked, stack, moe.float_expert_mlp(moe.gated(jax.nn.silu), "xla"), tile=16)
    ragged = moe.ragged_experts(x2, weights, picked, stack["gate"], stack["up"], stack["down"], moe.gated(jax.nn.silu))
    scale = float(jnp.max(jnp.abs(tiles)))
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(tiles), atol=2e-6 * scale, rtol=0)


def test_an_unknown_experts_mode_is_refused():
    cfg = CASES["float"]
    params, x = _layer(cfg, 2)
    with pytest.raises(ValueError, match="'routed', 'all' or a moe.ExpertMesh"):
        moe.MoE(cfg, experts="some").apply({"params": params}, x)


_MESH_SCRIPT = r"""
import json, re, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import specjax
from specjax import sharding
from specjax._src.models import moe, sharding as sharding_rules
from specjax.testing import llama_config, peaked_target_and_draft
sys.path.insert(0, "tests")
from test_moe_routed import CASES, _layer

report = {}
cfg = llama_config(model_type="mixtral", num_kv_heads=4, num_experts=8, num_experts_per_tok=2)
target, _ = peaked_target_and_draft(cfg)
mesh = sharding.make_mesh(1, 4)
placed, _ = sharding_rules.prepare({"target": target}, 1, mesh)
prompt = [[3, 1, 4, 1, 5]]
alone = specjax.generate(target, prompt, max_new_tokens=8, temperature=0.0, eos_token_id=())
on_mesh = specjax.generate(sharding.shard_params(target, mesh), prompt, max_new_tokens=8, temperature=0.0,
                           eos_token_id=())
report["decoder"] = {"mesh": isinstance(placed["target"].module.experts, moe.ExpertMesh),
                     "match": alone.to_lists() == on_mesh.to_lists()}


def on(mesh, params):
    def spec(path, leaf):
        split = any(str(getattr(k, "key", k)).startswith("experts_") for k in path)
        return NamedSharding(mesh, P("model") if split else P())
    return jax.tree_util.tree_map_with_path(lambda p, a: jax.device_put(a, spec(p, a)), params)


def run(cfg, params, x, experts):
    # The layer's output, and how many whole expert stacks [E, >= 16, >= 16] the program all-gathers.
    f = jax.jit(lambda p, x: moe.MoE(cfg, "xla", experts).apply({"params": p}, x))
    shapes = re.findall(r"= \w+\[(\d+),(\d+),(\d+)\]\S* all-gather\(", f.lower(params, x).compile().as_text())
    return np.asarray(f(params, x)), sum(int(e) == cfg.num_experts and min(int(a), int(b)) >= 16 for e, a, b in shapes)


layers = {}
split = sharding.make_mesh(2, 2)
# Many tokens (several tiles of an expert) for one float and one quantized stack; the other layouts at 2.
for case, counts in (("float", (2, 40)), ("int8", (2, 40)), ("deepseek_routing", (2,)), ("q4", (2,)),
                     ("gpt_oss", (2,))):
    for tokens in counts:
        params, x = _layer(CASES[case], tokens)
        ref, _ = run(CASES[case], params, x, "routed")
        got, gathers = run(CASES[case], on(split, params), x, moe.ExpertMesh(split))
        layers[f"{case}/{tokens}"] = {"error": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))),
                                      "gathers": gathers}
report["layers"] = layers
params, x = _layer(CASES["float"], 2)
mesh_layer = jax.jit(lambda p, x: moe.MoE(CASES["float"], "xla", moe.ExpertMesh(split)).apply({"params": p}, x))
report["kernel_in_place"] = "specjax_matmul_expert" in mesh_layer.lower(on(split, params), x).compile().as_text()
_, report["routed_gathers"] = run(CASES["float"], on(split, _layer(CASES["float"], 2)[0]), _layer(CASES["float"], 2)[1],
                                  "routed")

# Experts no token routes to, poisoned with NaN: reading one would show.
lone = CASES["float_top1"]
params, x = _layer(lone, 2)
picked = moe.route(x.reshape(-1, lone.hidden_size) @ params["router"]["kernel"], lone.num_experts_per_tok, False)[1]
unrouted = np.setdiff1d(np.arange(lone.num_experts), np.asarray(picked))
poisoned = {k: (v.at[unrouted].set(jnp.nan) if k.startswith("experts_") else v) for k, v in params.items()}
ref, _ = run(lone, poisoned, x, "routed")
got, _ = run(lone, on(split, poisoned), x, moe.ExpertMesh(split))
every, _ = run(lone, on(split, poisoned), x, "all")
report["poisoned"] = {"unrouted": len(unrouted), "finite": bool(np.isfinite(got).all()),
                      "match": bool(np.allclose(got, ref, rtol=1e-5, atol=1e-5)),
                      "every_expert_finite": bool(np.isfinite(every).all())}
json.dump(report, sys.stdout)
"""


def test_a_mesh_that_splits_the_experts_computes_each_devices_routed_experts():
    """On 4 host devices with the experts split over 'model': each device computes the routed
    tokens of the experts it holds (``moe.ExpertMesh``, one all-reduce, no expert stack
    gathered; each expert read in place by the CPU kernel), equal to one device's routed
    experts for float, DeepSeek-routed, int8 and q4 stacks, one to 40 tokens, tokens split over 'data' too; decoding gives the single-device
    tokens. Experts no token picked are poisoned with NaN and never read. Controls: every
    expert on every token reads the poison; the routed path left to XLA's partitioner gathers
    the stacks."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["decoder"] == {"mesh": True, "match": True}
    for name, layer in report["layers"].items():
        assert layer["error"] < 1e-5, (name, layer)
        assert layer["gathers"] == 0, (name, layer)
    assert report["routed_gathers"] > 0
    assert report["kernel_in_place"]  # each device reads its experts where they lie (a CPU kernel)
    poisoned = report["poisoned"]
    assert poisoned["unrouted"] >= 4 and poisoned["finite"] and poisoned["match"]
    assert not poisoned["every_expert_finite"]
