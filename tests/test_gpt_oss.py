"""gpt-oss (``gpt_oss``: attention sinks, biased q/k/v/o, alternating sliding and full layers, YaRN,
a biased top-k-softmax router, experts with biases and a clamped SwiGLU, MXFP4 experts) against
transformers' GptOssForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from specjax._src.models import gpt_oss, hf, moe, sharding  # noqa: E402
from specjax._src.models.attention_ops import rope_attention_factor, rope_inv_freq  # noqa: E402
from tests._hf_models import rel_err, torch_logits  # noqa: E402

# Two layers (sliding window 4, then full), 8 experts of width 32 of which 2 are routed, and
# gpt-oss's own YaRN (factor 32, betas 32 and 1, untruncated ramp, 4096 original positions, base
# 150000: the ramp covers rotary frequencies 2 to 4 of the 8). swiglu_limit 2 (gpt-oss: 7) so that
# the clamp bites at these weights.
_COMMON = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=96,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=131072,
    swiglu_limit=2.0,
    rope_parameters=dict(gpt_oss.DEFAULT_ROPE, rope_theta=150000.0),
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
IDS = np.random.default_rng(0).integers(3, 96, (2, 12)).astype(np.int32)  # 12 tokens: 3 windows


def _hf_model(**fields):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**_COMMON, **fields}))
    with torch.no_grad():  # norms near 1, sinks and biases large enough for a wrong layout to show
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else
                    (1.0 if name.endswith("sinks") else 0.3) * torch.randn_like(p))
    model = model.to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    model.set_experts_implementation("eager")  # transformers' reference loop over the experts
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny gpt-oss, its transformers model and its logits on ``IDS``."""
    directory = str(tmp_path_factory.mktemp("gpt_oss") / "float")
    hf_model = _hf_model()
    hf_model.save_pretrained(directory)
    return directory, hf_model, torch_logits(hf_model, IDS)


def _variant(model, params=None, **changes):
    """``model`` with its config changed and/or other params."""
    return specjax.Model(model.params if params is None else params,
                         specjax.Decoder(model.module.config.replace(**changes)))


def test_logits_match_transformers_and_each_part_shows(checkpoint):
    directory, hf_model, want = checkpoint
    model = specjax.load(directory, dtype="float32")
    cfg = model.module.config
    assert (cfg.layer_types, cfg.sliding_window, cfg.router_scores, cfg.activation) == (
        ("sliding_attention", "full_attention"), 4, "topk_softmax", "swiglu_oai")
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate
    assert rel_err(specjax.logits(model, IDS), want) < 1e-4
    # Negative controls: the parity check sees the sinks, the top-k softmax, the clamp and the
    # de-interleaving of gate and up.
    assert rel_err(specjax.logits(_variant(model, attention_sinks=False), IDS), want) > 1e-3
    all_experts = _variant(model, router_scores="softmax", norm_topk_prob=False)
    assert rel_err(specjax.logits(all_experts, IDS), want) > 1e-3
    assert rel_err(specjax.logits(_variant(model, swiglu_limit=None), IDS), want) > 1e-3
    params = jax.tree.map(lambda a: a, model.params)
    for i in range(cfg.num_layers):  # gate and up read as the fused tensor's halves, not its interleaved columns
        experts = hf_model.model.layers[i].mlp.experts
        fused, bias = experts.gate_up_proj.detach().numpy(), experts.gate_up_proj_bias.detach().numpy()
        mlp = params[f"layer_{i}"]["mlp"]
        inner = cfg.moe_intermediate_size
        mlp.update(experts_gate=jnp.asarray(fused[..., :inner]), experts_up=jnp.asarray(fused[..., inner:]),
                   experts_gate_bias=jnp.asarray(bias[:, :inner]), experts_up_bias=jnp.asarray(bias[:, inner:]))
    assert rel_err(specjax.logits(_variant(model, params), IDS), want) > 1e-3


def test_yarn_matches_transformers_rope():
    """gpt-oss's YaRN: transformers' inverse frequencies and attention factor (0.1 ln 32 + 1)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.GptOssConfig(**_COMMON)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    cfg = hf.from_hf_config(hf_config.to_dict())
    np.testing.assert_allclose(rope_inv_freq(cfg), inv_freq.numpy(), rtol=1e-6)
    assert abs(rope_attention_factor(cfg.rope_scaling) - factor) < 1e-9 and abs(factor - 1.3466) < 1e-4


def test_greedy_decoding_with_the_cache_matches_transformers(checkpoint):
    directory, hf_model, _ = checkpoint
    model = specjax.load(directory, dtype="float32")
    prompt, new = IDS[:1, :6], 8  # the window (4) slides over prompt and new tokens alike
    with torch.no_grad():
        hf_greedy = hf_model.generate(
            torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=new, do_sample=False, pad_token_id=0
        )[:, 6:].numpy()
    alone = specjax.generate(model, prompt, max_new_tokens=new, temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(alone.tokens), hf_greedy)
    # A verification block: the first 5 greedy tokens fed at once after the prompt's cache.
    decoder = model.module
    cache = decoder.apply(model.params, prompt, decoder.init_cache(1, 32)).cache
    block = decoder.apply(model.params, hf_greedy[:, :5], cache)
    np.testing.assert_array_equal(np.argmax(np.asarray(block.logits), -1), hf_greedy[:, 1:6])


def test_export_is_read_back_by_transformers(checkpoint, tmp_path):
    directory, _, want = checkpoint
    model = specjax.load(directory, dtype="float32")
    specjax.export_hf(model, str(tmp_path / "out"))
    exported = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    exported.config._attn_implementation = "eager"
    assert rel_err(torch_logits(exported.eval(), IDS), want) < 1e-5
    assert specjax.load(str(tmp_path / "out")).module.config == model.module.config


def test_an_int8_model_stays_close_to_its_float_logits(checkpoint):
    directory, _, _ = checkpoint
    full = np.asarray(specjax.logits(specjax.load(directory, dtype="float32"), IDS))
    q = specjax.load(directory, dtype="float32", quantize="int8")
    mlp = q.params["layer_0"]["mlp"]
    assert str(mlp["experts_gate"].fmt) == "int8" and mlp["experts_gate_bias"].dtype == jnp.float32
    got = np.asarray(specjax.logits(q, IDS))
    np.testing.assert_allclose(
        got, np.asarray(specjax.logits(specjax.dequantize(q), IDS)), atol=1e-4 * np.abs(got).max()
    )
    # 8.4% measured (DeepSeek-V3's tiny model: under 5%): a rounded router logit flips some of these
    # large-weight tokens' top-2 of 8 experts; 5 of 6 greedy tokens agree.
    assert np.linalg.norm(got - full) / np.linalg.norm(full) < 0.12
    assert np.mean(got.argmax(-1) == full.argmax(-1)) > 0.75


def _random_mxfp4(rng, experts: int, rows: int, inputs: int):
    """Random MXFP4 ``(blocks [E, rows, inputs / 32, 16], scales [E, rows, inputs / 32])``: values up
    to 6 times 2 ** -2 .. 2 ** 0."""
    blocks = rng.integers(0, 256, (experts, rows, inputs // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(125, 128, (experts, rows, inputs // 32), dtype=np.uint8)


def test_mxfp4_dequantizes_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks, scales = _random_mxfp4(rng, 3, 10, 64)
    scales[0, 0, 0] = 0  # a tiny power of two, and a large one
    scales[1, 2, 1] = 140
    want = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=torch.float32)
    got = gpt_oss.dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 64, 10)
    np.testing.assert_array_equal(got, want.numpy())


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_twin(checkpoint, tmp_path):
    """The Hub's layout: gate_up_proj and down_proj as *_blocks / *_scales, quantization_config mxfp4.
    Its logits equal those of the float checkpoint holding transformers' dequantized weights, and
    transformers' own model of that twin."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory, _, _ = checkpoint
    tensors = load_file(f"{directory}/model.safetensors")
    config = json.loads(open(f"{directory}/config.json").read())
    rng = np.random.default_rng(1)
    packed, twin = dict(tensors), dict(tensors)
    e, h, inner = 8, 64, 32
    for i in range(2):
        for name, rows, inputs in (("gate_up_proj", 2 * inner, h), ("down_proj", h, inner)):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = _random_mxfp4(rng, e, rows, inputs)
            del packed[key]
            packed.update({f"{key}_blocks": blocks, f"{key}_scales": scales})
            twin[key] = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales),
                                                   dtype=torch.float32).numpy()
    for name, tensors_, extra in (("packed", packed, {"quantization_config": {"quant_method": "mxfp4"}}),
                                  ("twin", twin, {})):
        (tmp_path / name).mkdir()
        save_file(tensors_, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    got = np.asarray(specjax.logits(specjax.load(str(tmp_path / "packed"), dtype="float32"), IDS))
    twin_logits = np.asarray(specjax.logits(specjax.load(str(tmp_path / "twin"), dtype="float32"), IDS))
    np.testing.assert_array_equal(got, twin_logits)
    hf_twin = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "twin"), dtype=torch.float32)
    hf_twin.config._attn_implementation = "eager"
    assert rel_err(got, torch_logits(hf_twin.eval(), IDS)) < 1e-4
    # Half a pair is named, with what to do.
    del packed["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(packed, str(tmp_path / "packed" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj_blocks' but not '.*down_proj_scales'"):
        specjax.load(str(tmp_path / "packed"))


def test_bad_gpt_oss_configs_are_named(checkpoint, tmp_path):
    directory, _, _ = checkpoint
    config = json.loads(open(f"{directory}/config.json").read())
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").symlink_to(f"{directory}/model.safetensors")
    path = tmp_path / "d" / "config.json"
    # A missing swiglu_limit takes transformers' default (7).
    path.write_text(json.dumps({k: v for k, v in config.items() if k != "swiglu_limit"}))
    assert specjax.load(str(tmp_path / "d")).module.config.swiglu_limit == 7.0
    for change, message in [
        ({"swiglu_limit": -1.0}, "'swiglu_limit' must be a positive number"),
        ({"quantization_config": {"quant_method": "fp8"}}, "'quantization_config' has quant_method 'fp8'"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "'layer_types'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    ]:
        path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            specjax.load(str(tmp_path / "d"))
    cfg = specjax.load(directory).module.config
    with pytest.raises(ValueError, match="'swiglu_oai' is gpt-oss's expert activation"):
        cfg.replace(dense_mlp_layers=(0,))
    with pytest.raises(ValueError, match="router_scores must be one of"):
        cfg.replace(router_scores="top1")
    with pytest.raises(ValueError, match="cannot be written.*gpt_oss has attention sinks"):
        specjax.export_hf(_variant(specjax.load(directory), attention_sinks=False), str(tmp_path / "x"))


def test_the_expert_paths_agree_with_biases_and_the_clamped_glu(checkpoint):
    """On a gpt-oss layer: the routed tiles (1 and 16 rows a tile), jax.lax.ragged_dot (the GPU/TPU
    path) and every expert for every token give one result; dropping the biases changes it. The
    expert bias stacks split over 'model' with their experts."""
    directory, _, _ = checkpoint
    model = specjax.load(directory, dtype="float32")
    cfg = model.module.config
    mlp = model.params["layer_0"]["mlp"]
    x = jax.random.normal(jax.random.key(0), (40, cfg.hidden_size), jnp.float32)
    weights, picked = moe.route(x @ mlp["router"]["kernel"] + mlp["router"]["bias"], 2, True, scores="topk_softmax")
    stack = {"gate": mlp["experts_gate"], "up": mlp["experts_up"], "down": mlp["experts_down"],
             **{f"{p}_bias": mlp[f"experts_{p}_bias"] for p in ("gate", "up", "down")}}
    glu = moe.glu_of(cfg)
    want = moe.all_float_experts(x, weights, picked, stack["gate"], stack["up"], stack["down"], glu, stack)
    scale = float(jnp.max(jnp.abs(want)))
    for tile in (1, 16):
        got = moe.routed_experts(x, weights, picked, stack, moe.float_expert_mlp(glu, "auto"), tile)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6 * scale, rtol=0)
    ragged = moe.ragged_experts(x, weights, picked, stack["gate"], stack["up"], stack["down"], glu, stack)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(want), atol=2e-6 * scale, rtol=0)
    unbiased = moe.all_float_experts(x, weights, picked, stack["gate"], stack["up"], stack["down"], glu)
    assert float(jnp.max(jnp.abs(unbiased - want))) > 1e-2 * scale
    specs = sharding.param_specs(cfg, 2)["layer_0"]["mlp"]
    assert specs["experts_gate_bias"] == jax.sharding.PartitionSpec("model", None)
    assert specs["experts_gate"] == jax.sharding.PartitionSpec("model", None, None)
    assert specs["router"]["bias"] == jax.sharding.PartitionSpec()
