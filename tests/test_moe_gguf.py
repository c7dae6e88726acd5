"""Mixtures of experts from GGUF: the tiny Mixtral and Qwen3-MoE checkpoints of
``test_moe.py`` written as llama.cpp's ``convert_hf_to_gguf.py`` writes them
(Mixtral as a ``llama`` file with its q/k rows permuted, Qwen3-MoE as
``qwen3moe``; each block's experts stacked into ``ffn_{gate,up,down}_exps``),
loaded by specjax and compared with the transformers model they came from."""

from __future__ import annotations

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from specjax._src.kernels import quant  # noqa: E402
from specjax._src.models import gguf as gguf_lib  # noqa: E402
from tests._gguf_files import assert_same_params, write_tensors  # noqa: E402
from tests._hf_models import rel_err, torch_logits  # noqa: E402
from tests.test_moe import _make  # noqa: E402

F32 = gguf.GGMLQuantizationType.F32
_ATTENTION = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp"}
# The converter's stacking: Mixtral's w1 / w3 / w2 and Qwen's gate / up / down projections.
_EXPERTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def write_moe_gguf(path, directory: str, *, qtype=F32, stacked: bool = True, metadata=None, drop=(),
                   extra=None) -> None:
    """The Hugging Face checkpoint in ``directory`` as llama.cpp's converter writes it.

    ``qtype``: the type of every matrix whose rows hold whole 32-value blocks (the
    others F32, as the converter falls back); ``stacked=False``: one tensor per
    expert (``blk.N.ffn_gate.J.weight``), as files written before April 2024;
    ``metadata``: extra ``{key: value}`` pairs; ``drop``: GGUF tensor names left out;
    ``extra``: more ``{gguf_name: array}`` tensors.
    """
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    arch = "llama" if c["model_type"] == "mixtral" else "qwen3moe"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta"))))
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c.get("num_local_experts") or c["num_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_vocab_size(c["vocab_size"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    for key, value in (metadata or {}).items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
        w = w.astype(np.float32)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        inner = rest.rsplit(".", 1)[0]
        if ".experts." in inner:  # block_sparse_moe.experts.J.w1 / mlp.experts.J.gate_proj
            expert, proj = inner.split(".experts.")[1].split(".")
            stacks.setdefault((layer, _EXPERTS[proj]), {})[int(expert)] = w
            continue
        if arch == "llama" and inner == "self_attn.q_proj":  # LlamaModel.permute, Mixtral included
            w = gguf_lib.permute_rotary(w, c["num_attention_heads"])
        elif arch == "llama" and inner == "self_attn.k_proj":
            w = gguf_lib.permute_rotary(w, c["num_key_value_heads"])
        out[f"blk.{layer}.{_ATTENTION[inner]}.weight"] = w
    for (layer, proj), experts in stacks.items():
        if stacked:
            out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([experts[j] for j in sorted(experts)])
        else:
            out.update({f"blk.{layer}.ffn_{proj}.{j}.weight": experts[j] for j in sorted(experts)})
    write_tensors(writer, {**out, **(extra or {})}, drop=drop,
                  qtype_of=lambda name, w: qtype if w.ndim >= 2 and qtype != F32 and w.shape[-1] % 32 == 0 else None)


def _ids():
    return np.random.default_rng(0).integers(3, 96, (2, 12)).astype(np.int32)


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_moe_gguf_gives_the_transformers_logits(case, tmp_path, monkeypatch):
    directory, hf_model = _make(case, tmp_path)
    write_moe_gguf(tmp_path / "m.gguf", directory)
    model = specjax.load(str(tmp_path / "m.gguf"), dtype="float32")
    cfg = model.module.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (case, 4, 2, True)
    # The same params, bit for bit, as from the Hugging Face directory the file was written from.
    assert_same_params(specjax.load(directory, dtype="float32").params, model.params)
    ids = _ids()
    want = torch_logits(hf_model, ids)
    got = np.asarray(specjax.logits(model, ids))
    print(f"{case}: max |specjax - transformers| = {np.max(np.abs(got - want)):.2e}, rel {rel_err(got, want):.2e}")
    assert rel_err(got, want) < 1e-4
    # GGUF -> Hugging Face: transformers reads the export back with the same logits.
    specjax.export_hf(model, str(tmp_path / "hf"))
    exported = getattr(transformers, hf_model.__class__.__name__).from_pretrained(str(tmp_path / "hf"),
                                                                                 dtype=torch.float32)
    exported.config._attn_implementation = "eager"
    assert rel_err(torch_logits(exported.eval(), ids), want) < 1e-6
    # Negative controls: routing to the top 1, and (Mixtral) q/k rows left in llama.cpp's order.
    top1 = specjax.Model(model.params, specjax.Decoder(cfg.replace(num_experts_per_tok=1)))
    assert rel_err(specjax.logits(top1, ids), want) > 1e-3
    if case == "mixtral":
        monkeypatch.setattr(gguf_lib, "unpermute_rotary", lambda w, heads: w)
        unpermuted = specjax.load(str(tmp_path / "m.gguf"), dtype="float32")
        assert rel_err(specjax.logits(unpermuted, ids), want) > 1e-3


def test_qwen3_moe_gguf_against_transformers_gguf_loader(tmp_path, monkeypatch):
    """transformers reads qwen3moe GGUFs itself (its loader knows llama.cpp always
    renormalises the top-k weights): an independent reading of the same file. It does
    not read ``qwen3moe.expert_feed_forward_length`` (it keeps Qwen3MoeConfig's default
    expert width, 768), so this model's experts are 768 wide."""
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    from tests import test_moe

    name, model, fields = test_moe.CONFIGS["qwen3_moe"]
    monkeypatch.setitem(test_moe.CONFIGS, "qwen3_moe_768", (name, model, {**fields, "moe_intermediate_size": 768}))
    directory, _ = _make("qwen3_moe_768", tmp_path)
    write_moe_gguf(tmp_path / "q.gguf", directory)
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf",
                                                                   dtype=torch.float32)
    except (ValueError, RuntimeError, KeyError) as e:  # a transformers without qwen3moe GGUF support
        pytest.skip(f"transformers cannot read this qwen3moe GGUF: {e}")
    theirs.config._attn_implementation = "eager"
    ids = _ids()
    want = torch_logits(theirs.eval(), ids)
    got = np.asarray(specjax.logits(specjax.load(str(tmp_path / "q.gguf"), dtype="float32"), ids))
    print(f"qwen3moe vs transformers' GGUF loader: max |diff| = {np.max(np.abs(got - want)):.2e}")
    assert rel_err(got, want) < 1e-4


def test_quantized_mixtral_gguf_keeps_every_block_with_its_experts(tmp_path):
    """``quantize="gguf"`` on a Q8_0 Mixtral: attention matrices, routers and each expert
    keep their Q8_0 blocks bit for bit (the experts as ``[E, out, in]`` stacks, one
    product per expert), in about a quarter of float32's bytes, and give the logits of the
    same values loaded as floats. Files with one tensor per expert load the same."""
    directory, hf_model = _make("mixtral", tmp_path)
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_moe_gguf(tmp_path / "q8.gguf", directory, qtype=q8)
    write_moe_gguf(tmp_path / "q8_per_expert.gguf", directory, qtype=q8, stacked=False)
    floats = specjax.load(str(tmp_path / "q8.gguf"), dtype="float32")
    assert_same_params(floats.params, specjax.load(str(tmp_path / "q8_per_expert.gguf"), dtype="float32").params)
    model = specjax.load(str(tmp_path / "q8.gguf"), quantize="gguf")
    assert_same_params(model.params, specjax.load(str(tmp_path / "q8_per_expert.gguf"), quantize="gguf").params)
    assert model.module.config.quantization == "int8/32"
    mlp = model.params["layer_0"]["mlp"]
    assert quant.is_quantized(mlp["router"]["kernel"]) and quant.is_quantized(mlp["experts_gate"])
    from safetensors.numpy import load_file

    w1 = load_file(os.path.join(directory, "model.safetensors"))["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    blocks = gguf.quants.quantize(w1, q8).reshape(w1.shape[0], -1, 34)  # [out, blocks, 2 + 32] bytes
    np.testing.assert_array_equal(np.asarray(mlp["experts_gate"]["qweight"][2]),
                                  blocks[..., 2:].view(np.int8).reshape(w1.shape))
    np.testing.assert_array_equal(np.asarray(mlp["experts_gate"]["qscale"][2]),
                                  np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0])
    experts = lambda m: sum(quant.nbytes(m.params[f"layer_{i}"]["mlp"][f"experts_{p}"])  # noqa: E731
                            for i in range(2) for p in ("gate", "up", "down"))
    assert experts(model) / experts(floats) < 0.3, experts(model) / experts(floats)
    ids = _ids()
    got = np.asarray(specjax.logits(model, ids))
    want = np.asarray(specjax.logits(floats, ids))
    print(f"Q8_0 Mixtral, experts as blocks vs as floats: rel {rel_err(got, want):.2e}")
    assert rel_err(got, want) < 1e-5  # the same Q8_0 values, kept as blocks
    assert rel_err(got, torch_logits(hf_model, ids)) < 0.1  # and still the model (Q8_0 rounding: 5.1e-2)
    # Negative control: experts 0 and 1 swapped in every stack.
    swap = lambda x: x.at[jnp.array([0, 1])].set(x[jnp.array([1, 0])])  # noqa: E731
    params = {k: ({**v, "mlp": {**v["mlp"], **{f"experts_{p}": jax.tree.map(swap, v["mlp"][f"experts_{p}"])
                                               for p in ("gate", "up", "down")}}} if k.startswith("layer_") else v)
              for k, v in model.params.items()}
    assert rel_err(specjax.logits(model.replace(params=params), ids), want) > 1e-3


# int8 is slow-only (about 13 s): q4 stores the experts the same way (per expert, per matrix) and
# adds the block-width check; the int8 format itself is tested by default in test_quant.py.
@pytest.mark.parametrize("fmt", [pytest.param("int8", marks=pytest.mark.slow), "q4"])
def test_quantize_a_mixture_of_experts(fmt, tmp_path, monkeypatch):
    """``specjax.quantize`` stores each expert of a Qwen3-MoE (experts 32 wide, a q4
    block) in ``fmt``: logits equal the dequantized model's (the same values as floats),
    greedy speculative decoding equals the quantized target's own greedy output, and
    Orbax keeps it."""
    from tests import test_moe

    name, hf_class, fields = test_moe.CONFIGS["qwen3_moe"]
    monkeypatch.setitem(test_moe.CONFIGS, "qwen3_moe_32", (name, hf_class, {**fields, "moe_intermediate_size": 32}))
    directory, _ = _make("qwen3_moe_32", tmp_path)
    model = specjax.quantize(specjax.load(directory, dtype="float32"), fmt)
    assert quant.is_quantized(model.params["layer_0"]["mlp"]["experts_down"])
    ids = _ids()
    got = np.asarray(specjax.logits(model, ids))
    floats = specjax.dequantize(model)
    assert floats.params["layer_0"]["mlp"]["experts_down"].shape == (4, 32, 32)
    want = np.asarray(specjax.logits(floats, ids))
    print(f"{fmt} Qwen3-MoE vs its dequantized floats: rel {rel_err(got, want):.2e}")
    assert rel_err(got, want) < 1e-5
    prompt = [[5, 9, 3, 17]]
    greedy = specjax.generate(model, prompt, max_new_tokens=12, temperature=0.0, max_length=32).to_lists()
    out = specjax.decode(specjax.pair(model, floats), prompt, num_draft=3, max_new_tokens=12, temperature=0.0,
                         max_length=32)
    assert out.to_lists() == greedy
    specjax.save_orbax(model, str(tmp_path / "orbax"))
    back = specjax.load(str(tmp_path / "orbax"))
    np.testing.assert_array_equal(np.asarray(specjax.logits(back, ids)), got)
    # Experts 16 wide cannot take q4's 32-input blocks: refused naming the matrix and the expert.
    narrow, _ = _make("qwen3_moe", tmp_path / "narrow")
    with pytest.raises(ValueError, match=r"layer_0/mlp/experts_down \(expert 0\) \(32 x 16 inputs\) as q4"):
        specjax.quantize(specjax.load(narrow, dtype="float32"), "q4")


@pytest.mark.parametrize("change, match", [
    (dict(metadata={"expert_shared_count": 1}), r"shared experts \(llama.expert_shared_count\)"),
    (dict(extra={"blk.0.ffn_up_shexp.weight": np.zeros((64, 32), np.float32)}),
     r"shared experts \(blk.0.ffn_up_shexp.weight\)"),
    (dict(metadata={"expert_weights_scale": 2.5}), r"llama.expert_weights_scale = 2.5"),
    (dict(drop=("blk.1.ffn_gate_inp.weight",)), r"block 1 has no router \(blk.1.ffn_gate_inp.weight\)"),
])
def test_moe_gguf_variants_specjax_does_not_run_are_named(change, match, tmp_path):
    directory, _ = _make("mixtral", tmp_path)
    write_moe_gguf(tmp_path / "v.gguf", directory, **change)
    with pytest.raises(ValueError, match=match):
        specjax.load(str(tmp_path / "v.gguf"))


def test_qwen3_moe_gguf_without_its_expert_width_is_named(tmp_path, monkeypatch):
    directory, _ = _make("qwen3_moe", tmp_path)
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_feed_forward_length", lambda self, n: None)
    write_moe_gguf(tmp_path / "w.gguf", directory)
    with pytest.raises(ValueError, match=r"lacks the metadata key qwen3moe.expert_feed_forward_length"):
        specjax.load(str(tmp_path / "w.gguf"))
