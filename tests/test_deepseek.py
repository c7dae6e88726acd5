"""DeepSeek-V3 (``deepseek_v3``: multi-head latent attention, yarn rope, DeepSeek's mixture of experts)
against transformers' DeepseekV3ForCausalLM on tiny random checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from specjax._src.models.config import RopeScaling  # noqa: E402
from tests._hf_models import rel_err, torch_logits  # noqa: E402

# Two layers: a dense one (first_k_dense_replace=1), then 8 experts of which 2 are routed, from the
# best 1 of 2 groups, beside one shared expert.
_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=96,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
)
# A yarn whose ramp covers some of the 4 rotary frequencies and whose attention factor (mscale over
# mscale_all_dim) and softmax factor (mscale_all_dim) are both other than 1.
_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,
    mscale=1.0,
    mscale_all_dim=0.7,
)
CASES = {
    "q_lora": {},  # DeepSeek-V3: q through a 32-wide latent, interleaved rotary pairs
    # DeepSeek-V2-Lite's plain q_proj, and values narrower than the query/key head (zero-padded in the cache)
    "q_proj_narrow_values": dict(q_lora_rank=None, v_head_dim=8),
    "rope_halves": dict(rope_interleave=False),
    "yarn": dict(rope_parameters=_YARN),
}
IDS = np.random.default_rng(0).integers(3, 96, (2, 12)).astype(np.int32)


def _make(tmp_path, case: str, **fields):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**_COMMON, **CASES[case], **fields})
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms near 1, weights large enough for a wrong layout to show
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model = model.to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    directory = str(tmp_path / case)
    model.save_pretrained(directory)
    return directory, model


def _variant(model, **changes):
    """``model`` with its config changed (same params)."""
    return specjax.Model(model.params, specjax.Decoder(model.module.config.replace(**changes)))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_export_match_transformers(case, tmp_path):
    directory, hf_model = _make(tmp_path, case)
    model = specjax.load(directory, dtype="float32")
    cfg = model.module.config
    # The cache holds one decompressed key per head, [nope | rope] wide, and values padded to it.
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.dense_mlp_layers, cfg.router_groups) == (4, 24, (0,), 2)
    assert model.module.init_cache(1, 16).keys[0].shape == (1, 4, 16, 24)
    want = torch_logits(hf_model, IDS)
    assert rel_err(specjax.logits(model, IDS), want) < 1e-4
    # Negative controls: the parity check sees each part of the attention's math.
    if case == "q_lora":
        assert rel_err(specjax.logits(_variant(model, rope_interleave=False), IDS), want) > 1e-3
    if case == "yarn":
        scaling = cfg.rope_scaling
        for wrong in (dict(mscale_all_dim=None), dict(attention_factor=1.0), dict(factor=2.0)):
            rope = type(scaling)(**{**scaling.__dict__, **wrong})
            assert rel_err(specjax.logits(_variant(model, rope_scaling=rope), IDS), want) > 1e-3, wrong
    # Export: transformers reads the layout back (the yarn settings and rope_interleave included).
    specjax.export_hf(model, str(tmp_path / "out"))
    exported = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    exported.config._attn_implementation = "eager"
    assert rel_err(torch_logits(exported.eval(), IDS), want) < 1e-5
    assert specjax.load(str(tmp_path / "out")).module.config == cfg


@pytest.mark.parametrize("case", ["q_lora", "yarn"])
def test_greedy_decoding_with_the_cache_matches_transformers(case, tmp_path):
    directory, hf_model = _make(tmp_path, case)
    model = specjax.load(directory, dtype="float32")
    prompt, new = IDS[:1, :5], 8
    with torch.no_grad():
        hf_greedy = hf_model.generate(
            torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=new, do_sample=False, pad_token_id=0
        )[:, 5:].numpy()
    # Prefill, then one-token steps through the cache.
    alone = specjax.generate(model, prompt, max_new_tokens=new, temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(alone.tokens), hf_greedy)
    # A verification block: the first 4 greedy tokens fed at once after the prompt's cache; each
    # position's argmax is the next greedy token.
    decoder = model.module
    cache = decoder.apply(model.params, prompt, decoder.init_cache(1, 32)).cache
    block = decoder.apply(model.params, hf_greedy[:, :4], cache)
    np.testing.assert_array_equal(np.argmax(np.asarray(block.logits), -1), hf_greedy[:, 1:5])


def test_an_int8_model_decodes_close_to_its_float_logits(tmp_path):
    directory, _ = _make(tmp_path, "q_lora")
    model = specjax.load(directory, dtype="float32")
    q = specjax.load(directory, dtype="float32", quantize="int8")
    attn = q.params["layer_1"]["attn"]
    assert all(str(attn[p]["kernel"].fmt) == "int8" for p in ("q_a", "q_b", "kv_a", "kv_b", "o"))
    full = np.asarray(specjax.logits(model, IDS))
    got = np.asarray(specjax.logits(q, IDS))
    # The quantized forward is its dequantized model's, and close to the float one it came from.
    np.testing.assert_allclose(
        got, np.asarray(specjax.logits(specjax.dequantize(q), IDS)), atol=1e-4 * np.abs(got).max()
    )
    assert np.linalg.norm(got - full) / np.linalg.norm(full) < 0.05


def test_bad_latent_attention_configs_are_named(tmp_path):
    cfg = specjax.ModelConfig(
        model_type="deepseek_v3",
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    for change, message in [
        (dict(qk_rope_head_dim=0), "needs qk_rope_head_dim >= 1"),
        (dict(v_head_dim=32), "v_head_dim=32 wider"),
        (dict(head_dim=16), "head_dim must be"),
        (dict(kv_lora_rank=None), "needs multi-head latent attention"),
    ]:
        with pytest.raises(ValueError, match=message):
            cfg.replace(**change)
    yarn = RopeScaling(factor=4.0, original_max_position_embeddings=32, rope_type="yarn")
    llama = specjax.ModelConfig(
        model_type="llama",
        vocab_size=96,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        intermediate_size=64,
    )
    with pytest.raises(ValueError, match="'yarn' is supported for multi-head latent attention"):
        llama.replace(rope_scaling=yarn)

    directory, _ = _make(tmp_path, "q_lora")
    path = tmp_path / "q_lora" / "config.json"
    config = json.loads(path.read_text())
    for change, message in [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "field 'factor'"),
        ({"kv_lora_rank": None}, "required field.*'kv_lora_rank'"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ]:
        path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            specjax.load(directory)
    path.write_text(json.dumps(config))
    # DeepSeek-V3's multi-token-prediction layer (after the last one) is skipped; other strays are not.
    from safetensors.numpy import load_file, save_file

    weights = tmp_path / "q_lora" / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "model.layers.2.eh_proj.weight": np.zeros((4, 4), np.float32)}, str(weights))
    specjax.load(directory)
    save_file({**tensors, "model.layers.1.self_attn.k_proj.weight": np.zeros((4, 4), np.float32)}, str(weights))
    with pytest.raises(ValueError, match="k_proj"):
        specjax.load(directory)


def test_a_deepseek2_gguf_without_its_metadata_is_named(tmp_path):
    """``deepseek2`` GGUF files are read (``test_deepseek_gguf.py``); one lacking a required key is named."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "deepseek2.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="lacks the metadata key deepseek2.embedding_length"):
        specjax.load(str(path))


_MESH_SCRIPT = r"""
import json, sys
import specjax
from specjax import sharding

directory = sys.argv[1]
model = specjax.load(directory)
prompts = [[5, 9, 11, 3], [7, 2]]
kw = dict(max_new_tokens=8, temperature=0.0, eos_token_id=())
alone = specjax.generate(model, prompts, **kw)
mesh = sharding.make_mesh(2, 2)
placed = sharding.shard_params(model, mesh)
on_mesh = specjax.generate(placed, prompts, **kw)
attn, mlp = placed.params["layer_1"]["attn"], placed.params["layer_1"]["mlp"]
json.dump({"match": alone.to_lists() == on_mesh.to_lists(),
           "kv_b": list(attn["kv_b"]["kernel"].addressable_shards[0].data.shape),
           "kv_b_whole": list(attn["kv_b"]["kernel"].shape),
           "experts": list(mlp["experts_gate"].addressable_shards[0].data.shape)}, sys.stdout)
"""


def test_a_deepseek_model_decodes_on_a_mesh_as_on_one_device(tmp_path):
    """On a (2, 2) mesh of host devices: the latent attention's per-head projections split over
    'model' with the heads, the experts split and routed per device; greedy tokens equal one
    device's."""
    import os
    import subprocess
    import sys

    directory, _ = _make(tmp_path, "q_lora")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, directory], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["match"]
    assert report["kv_b"] == [report["kv_b_whole"][0], report["kv_b_whole"][1] // 2]
    assert report["experts"][0] == 8 // 2
