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
    if cfg.quantization is not None:
        params = quant.quantize_params(params, cfg.quant)
    return params, x


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
    mlp = moe.float_expert_mlp(jax.nn.silu, "auto")
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
    tiles = moe.routed_experts(x2, weights, picked, stack, moe.float_expert_mlp(jax.nn.silu, "xla"), tile=16)
    ragged = moe.ragged_experts(x2, weights, picked, stack["gate"], stack["up"], stack["down"], jax.nn.silu)
    scale = float(jnp.max(jnp.abs(tiles)))
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(tiles), atol=2e-6 * scale, rtol=0)


def test_an_unknown_experts_mode_is_refused():
    cfg = CASES["float"]
    params, x = _layer(cfg, 2)
    with pytest.raises(ValueError, match="'routed' or 'all'"):
        moe.MoE(cfg, experts="some").apply({"params": params}, x)


_MESH_SCRIPT = r"""
import json, re, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import specjax
from specjax import sharding
from specjax._src.models import moe, sharding as sharding_rules
from specjax.testing import llama_config, peaked_target_and_draft

cfg = llama_config(model_type="mixtral", num_kv_heads=4, num_experts=4, num_experts_per_tok=2)
target, _ = peaked_target_and_draft(cfg)
mesh = sharding.make_mesh(1, 4)
placed, _ = sharding_rules.prepare({"target": target}, 1, mesh)
prompt = [[3, 1, 4, 1, 5]]
alone = specjax.generate(target, prompt, max_new_tokens=8, temperature=0.0, eos_token_id=())
on_mesh = specjax.generate(sharding.shard_params(target, mesh), prompt, max_new_tokens=8, temperature=0.0,
                           eos_token_id=())
layer = target.params["layer_0"]["mlp"]
spec = {"router": {"kernel": P()}, **{f"experts_{p}": P("model", None, None) for p in ("gate", "up", "down")}}
layer = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), layer, spec)
x = jnp.ones((1, 2, cfg.hidden_size))
gathers = {}
for mode in ("routed", "all"):
    f = jax.jit(lambda p, x: moe.MoE(cfg, experts=mode).apply({"params": p}, x))
    gathers[mode] = len(re.findall(r"all-gather", f.lower(layer, x).compile().as_text()))
json.dump({"experts": placed["target"].module.experts, "match": alone.to_lists() == on_mesh.to_lists(),
           "gathers": gathers}, sys.stdout)
"""


def test_a_mesh_that_splits_the_experts_computes_each_devices_own():
    """On 4 host devices with the experts split over 'model': decoding runs every expert on
    its own device (``experts="all"``: no expert stack gathered, one all-reduce), and gives
    the single-device tokens. Control: the routed path, whose traced expert index makes XLA
    gather the stacks, is what the mesh avoids."""
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
    assert report["experts"] == "all"
    assert report["match"]
    assert report["gathers"]["all"] == 0 and report["gathers"]["routed"] > 0
