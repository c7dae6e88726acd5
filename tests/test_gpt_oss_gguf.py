"""gpt-oss from GGUF: the tiny checkpoint of ``test_gpt_oss.py`` written as llama.cpp's
``convert_hf_to_gguf.py`` writes GptOssForCausalLM (architecture ``gpt-oss``: gate and up
de-interleaved from ``gate_up_proj`` into ``ffn_gate_exps`` / ``ffn_up_exps``, ``down_proj``
transposed, the sinks as ``attn_sinks.weight``, the post-attention norm as ``post_attention_norm``;
F32 or MXFP4 experts), loaded by specjax and compared with transformers, and with llama.cpp itself
where llama-cpp-python is installed.

llama.cpp's gpt-oss graph hard-codes the clamped SwiGLU (alpha 1.702, limit 7) and the layer pattern
(sliding first, then full): the model here uses those (test_gpt_oss.py's uses limit 2)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from tests._gguf_files import assert_same_params, gguf_writer, write_tensors  # noqa: E402
from tests._hf_models import rel_err, torch_logits  # noqa: E402
from tests.test_gpt_oss import IDS, _hf_model  # noqa: E402

F32, MXFP4 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.MXFP4
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
# Hugging Face -> llama.cpp names inside a block (gguf/tensor_mapping.py's gpt-oss rows).
_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
          **{f"self_attn.{p}_proj.{k}": f"attn_{'output' if p == 'o' else p}.{k}"
             for p in "qkvo" for k in ("weight", "bias")}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny gpt-oss with llama.cpp's SwiGLU limit (7), its transformers model."""
    directory = str(tmp_path_factory.mktemp("gpt_oss_gguf") / "float")
    hf_model = _hf_model(swiglu_limit=7.0)
    hf_model.save_pretrained(directory)
    return directory, hf_model


def write_gpt_oss_gguf(path, directory: str, *, experts=F32, fuse_gate_up=False, drop=(), skip_keys=(),
                       tokenizer=False, transform=None) -> None:
    """The Hugging Face gpt-oss checkpoint in ``directory`` as llama.cpp's converter writes it.

    ``experts``: the expert matrices' GGML type (F32, or MXFP4 as the converter keeps MXFP4
    experts); ``fuse_gate_up``: one ``ffn_gate_up_exps`` (gate rows then up rows), the converter's
    ``--fuse-gate-up-exps``; ``drop``: GGUF tensors left out; ``skip_keys``: metadata keys (without
    ``gpt-oss.``) left out; ``tokenizer``: True, a 96-token byte-level vocabulary (llama.cpp wants
    one), or ``(tokens, merges, pre)``; ``transform(gguf_name, array)``: a change before writing.
    """
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    rope = c.get("rope_parameters") or c.get("rope_scaling")
    keys = {  # TextModel.set_gguf_parameters, then GptOssModel's
        "block_count": c["num_hidden_layers"], "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": c["num_key_value_heads"],
        "rope.freq_base": float(rope["rope_theta"]), "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "expert_count": c["num_local_experts"], "expert_used_count": c["num_experts_per_tok"],
        "attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"],
        "attention.sliding_window": c["sliding_window"], "expert_feed_forward_length": c["intermediate_size"],
        "rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
    }
    writer = gguf_writer(path, "gpt-oss", keys, skip_keys=skip_keys, tokenizer=tokenizer,
                         vocab_size=c["vocab_size"])
    out: dict[str, np.ndarray] = {}
    for name, w in load_file(os.path.join(directory, "model.safetensors")).items():
        w = w.astype(np.float32)
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], gate rows even, up rows odd
            w = w.transpose(0, 2, 1)
            gate, up = w[:, 0::2], w[:, 1::2]
        elif rest == "mlp.experts.gate_up_proj_bias":
            gate, up = w[:, 0::2], w[:, 1::2]
        elif rest == "mlp.experts.down_proj":
            out[blk + "ffn_down_exps.weight"] = w.transpose(0, 2, 1)
            continue
        else:
            out[blk + _BLOCK[rest]] = w
            continue
        kind = rest.rsplit("_", 1)[-1].replace("proj", "weight")
        if fuse_gate_up:
            out[f"{blk}ffn_gate_up_exps.{kind}"] = np.concatenate([gate, up], axis=1)
        else:
            out[f"{blk}ffn_gate_exps.{kind}"], out[f"{blk}ffn_up_exps.{kind}"] = gate, up
    write_tensors(writer, out, drop=drop, transform=transform,
                  qtype_of=lambda name, w: experts if experts != F32 and name.endswith("_exps.weight") else None)


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_gpt_oss_gguf_gives_the_transformers_logits(fuse_gate_up, checkpoint, tmp_path):
    directory, hf_model = checkpoint
    write_gpt_oss_gguf(tmp_path / "g.gguf", directory, fuse_gate_up=fuse_gate_up)
    model = specjax.load(str(tmp_path / "g.gguf"), dtype="float32")
    cfg = model.module.config
    assert (cfg.model_type, cfg.layer_types, cfg.sliding_window, cfg.swiglu_limit, cfg.swiglu_alpha) == (
        "gpt_oss", ("sliding_attention", "full_attention"), 4, 7.0, 1.702)
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate
    # The same params, bit for bit, as from the Hugging Face directory the file was written from.
    assert_same_params(specjax.load(directory, dtype="float32").params, model.params)
    want = torch_logits(hf_model, IDS)
    got = np.asarray(specjax.logits(model, IDS))
    print(f"gpt-oss GGUF (fused gate_up {fuse_gate_up}): rel |specjax - transformers| = {rel_err(got, want):.2e}")
    assert rel_err(got, want) < 1e-4


def test_gpt_oss_gguf_greedy_decoding_matches_transformers(checkpoint, tmp_path):
    directory, hf_model = checkpoint
    write_gpt_oss_gguf(tmp_path / "g.gguf", directory)
    model = specjax.load(str(tmp_path / "g.gguf"), dtype="float32")
    prompt, new = IDS[:1, :6], 8  # the window (4) slides over prompt and new tokens alike
    with torch.no_grad():
        want = hf_model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=new, do_sample=False,
                                 pad_token_id=0)[:, 6:].numpy()
    got = specjax.generate(model, prompt, max_new_tokens=new, temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(got.tokens), want)


def _with_experts_of(hf_model, path):
    """``hf_model`` with the expert matrices the GGUF file at ``path`` holds (dequantized)."""
    import copy

    reader = gguf.GGUFReader(str(path))
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up = stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]
            fused = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])  # rows interleaved
            layer.mlp.experts.gate_up_proj.copy_(torch.as_tensor(fused.transpose(0, 2, 1).copy()))
            down = stored[f"blk.{i}.ffn_down_exps.weight"].transpose(0, 2, 1).copy()
            layer.mlp.experts.down_proj.copy_(torch.as_tensor(down))
    return model


def test_mxfp4_gpt_oss_gguf_gives_the_transformers_logits_of_its_experts(checkpoint, tmp_path):
    """MXFP4 experts (GGML's MXFP4 blocks, as the converter keeps the Hub's): specjax's logits equal
    transformers' with the experts the file holds; those differ from the float model's."""
    directory, hf_model = checkpoint
    path = tmp_path / "mx.gguf"
    write_gpt_oss_gguf(path, directory, experts=MXFP4)
    assert {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors if "_exps.weight" in t.name} == {MXFP4}
    got = np.asarray(specjax.logits(specjax.load(str(path), dtype="float32"), IDS))
    want = torch_logits(_with_experts_of(hf_model, path), IDS)
    print(f"MXFP4 gpt-oss GGUF: rel |specjax - transformers| = {rel_err(got, want):.2e}")
    assert rel_err(got, want) < 1e-4
    assert rel_err(got, torch_logits(hf_model, IDS)) > 1e-3  # the check sees the quantized experts


@pytest.mark.parametrize("wrong", ["gate_up_swapped", "sinks_dropped", "down_untransposed"])
def test_gpt_oss_gguf_negative_controls(wrong, checkpoint, tmp_path):
    """The parity check sees which stack is gate and which up, the sinks, and down's orientation."""
    directory, hf_model = checkpoint

    def transform(name, w):
        if wrong == "gate_up_swapped" and "_exps" in name and ("gate" in name or "up" in name):
            other = name.replace("gate", "UP").replace("up", "gate").replace("UP", "up")
            return swapped[other]
        if wrong == "sinks_dropped" and name.endswith("attn_sinks.weight"):
            return np.full_like(w, -1e4)  # exp(-1e4) = 0: no sink
        if wrong == "down_untransposed" and name.endswith("ffn_down_exps.weight"):
            return w.reshape(w.shape[0], w.shape[2], w.shape[1]).transpose(0, 2, 1)
        return w

    swapped = {}
    if wrong == "gate_up_swapped":
        write_gpt_oss_gguf(tmp_path / "ref.gguf", directory)
        swapped = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "ref.gguf")).tensors}
    write_gpt_oss_gguf(tmp_path / "w.gguf", directory, transform=transform)
    got = specjax.logits(specjax.load(str(tmp_path / "w.gguf"), dtype="float32"), IDS)
    assert rel_err(got, torch_logits(hf_model, IDS)) > 1e-3


@pytest.mark.parametrize("change, match", [
    (dict(skip_keys=("attention.sliding_window",)), r"lacks the metadata key gpt-oss.attention.sliding_window"),
    (dict(skip_keys=("expert_feed_forward_length",)), r"lacks the metadata key gpt-oss.expert_feed_forward_length"),
    (dict(drop=("blk.1.attn_sinks.weight",)), r"lacks the tensor blk.1.attn_sinks.weight"),
    (dict(drop=("blk.0.ffn_up_exps.bias",)), r"lacks the tensor blk.0.ffn_up_exps.bias"),
    (dict(drop=("blk.1.ffn_gate_inp.bias",)), r"lacks the tensor blk.1.ffn_gate_inp.bias"),
    (dict(drop=("blk.0.attn_q.bias",)), r"self_attn.q_proj.bias"),
])
def test_gpt_oss_gguf_missing_keys_and_tensors_are_named(change, match, checkpoint, tmp_path):
    directory, _ = checkpoint
    write_gpt_oss_gguf(tmp_path / "m.gguf", directory, **change)
    with pytest.raises(ValueError, match=match):
        specjax.load(str(tmp_path / "m.gguf"))


@pytest.mark.parametrize("experts", [F32, MXFP4])
def test_gpt_oss_gguf_against_llama_cpp(experts, checkpoint, tmp_path):
    """llama.cpp reads the same file: its logits (float32 KV cache) equal specjax's with YaRN's ramp
    ends rounded outwards (``truncate``), as llama.cpp's ``ggml_rope_yarn_corr_dims`` rounds them.
    specjax loads the file with transformers' gpt-oss YaRN (``truncate: false``, the Hub config's and
    OpenAI's reference), so that the GGUF and Hugging Face copies give the same model: llama.cpp's
    logits differ from those by the ramp alone (here 9e-3 over 12 positions, 0 at position 0)."""
    import dataclasses

    llama_cpp = pytest.importorskip("llama_cpp")
    directory, hf_model = checkpoint
    path = str(tmp_path / "l.gguf")
    write_gpt_oss_gguf(path, directory, experts=experts, tokenizer=True)
    try:
        llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, verbose=False, type_k=0, type_v=0,
                              n_threads=1)
    except Exception as e:  # llama.cpp refuses the file (tiny dims, an older llama.cpp)
        pytest.skip(f"llama.cpp does not load this tiny gpt-oss file: {e}")
    ids = [int(t) for t in IDS[0]]
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)], np.float32)
    model = specjax.load(path, dtype="float32")
    cfg = model.module.config
    truncated = specjax.Model(model.params, specjax.Decoder(cfg.replace(
        rope_scaling=dataclasses.replace(cfg.rope_scaling, truncate=True))))
    ours, rounded = (np.asarray(specjax.logits(m, IDS[:1]))[0] for m in (model, truncated))
    print(f"llama.cpp vs specjax ({experts.name} experts): rel {rel_err(theirs, rounded):.2e} with the ramp "
          f"rounded, {rel_err(theirs, ours):.2e} as loaded")
    if experts == MXFP4:  # ggml-cpu multiplies MXFP4 by Q8_0-rounded activations (3.9e-2 here)
        assert rel_err(theirs, rounded) < 0.1
        return
    assert rel_err(theirs, rounded) < 1e-4
    assert rel_err(theirs[0], ours[0]) < 1e-4 < rel_err(theirs, ours) < 3e-2


def test_gpt4o_pre_tokenizer_splits_as_llama_cpp(checkpoint, tmp_path):
    """``tokenizer.ggml.pre`` "gpt-4o" (gpt-oss's o200k split: words with their case run and
    contraction, digits in threes, punctuation with a trailing slash or newlines): on a byte-level
    vocabulary whose merges would cross those splits, specjax's token ids equal llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tokenizers.pre_tokenizers import ByteLevel

    from specjax._src.models import gguf as gguf_lib

    byte_chars = sorted(ByteLevel.alphabet(), key=lambda ch: ch.encode("utf-8"))
    merges = ["3 4", "1 2", "12 3", "a B", "B c", "' s", "x '", ". /", "/ a", "Ġ a", "Ċ Ċ"]
    tokens = byte_chars + [m.replace(" ", "") for m in merges]
    directory = str(tmp_path / "v")
    _hf_model(vocab_size=len(tokens)).save_pretrained(directory)
    path = str(tmp_path / "t.gguf")
    write_gpt_oss_gguf(path, directory, tokenizer=(tokens, merges, "gpt-4o"))
    ours = gguf_lib.read_gguf(path).tokenizer
    try:
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    except Exception as e:
        pytest.skip(f"llama.cpp does not load this vocabulary: {e}")
    for text in ["12345", "aBc aBBc x's", "ab 77 \u65e5\u672c\u8a9ex", "x\n\n  y!!./a", "HELLO's wORLD ./a"]:
        theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert ours.encode(text).ids == theirs, text
