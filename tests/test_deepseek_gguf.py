"""DeepSeek-V3 from GGUF: the tiny checkpoints of ``test_deepseek.py`` written as llama.cpp's
``convert_hf_to_gguf.py`` writes DeepseekV3ForCausalLM (architecture ``deepseek2``: q/k rows as they
are, kv_b_proj split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, the experts stacked),
loaded by specjax and compared with transformers, and with llama.cpp itself where llama-cpp-python
is installed."""

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
from tests.test_deepseek import IDS, _make  # noqa: E402

F32 = gguf.GGMLQuantizationType.F32
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
# Hugging Face -> llama.cpp names inside a block (gguf/tensor_mapping.py's deepseek2 rows).
_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
          "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def write_deepseek2_gguf(path, directory: str, *, split_kv_b: bool = True, qtype=F32, drop=(), skip_keys=(),
                         tokenizer: bool = False, transform=None) -> None:
    """The Hugging Face DeepSeek-V3 checkpoint in ``directory`` as llama.cpp's converter writes it.

    ``split_kv_b``: kv_b_proj as ``attn_k_b`` + ``attn_v_b`` with the absorbed form's metadata
    (``head_count_kv`` 1, ``key_length_mla``), as the current converter; False: one ``attn_kv_b``, as
    files written before 2025-04. ``drop``: GGUF tensors left out; ``skip_keys``: metadata keys (without
    the ``deepseek2.`` prefix) left out; ``tokenizer``: True, a 96-token byte-level vocabulary (llama.cpp
    wants one), or ``(tokens, merges, pre)``; ``transform(gguf_name, array)``: a change to a tensor before it is written.
    """
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    heads, nope, rope_dim, v = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                c["v_head_dim"])
    rank = c["kv_lora_rank"]
    keys = {
        "block_count": c["num_hidden_layers"], "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": 1 if split_kv_b else heads,
        "rope.freq_base": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "expert_count": c["n_routed_experts"], "expert_used_count": c["num_experts_per_tok"],
        "expert_gating_func": 2, "expert_group_count": c["n_group"], "expert_group_used_count": c["topk_group"],
        "leading_dense_block_count": c["first_k_dense_replace"], "vocab_size": c["vocab_size"],
        "attention.kv_lora_rank": rank, "expert_feed_forward_length": c["moe_intermediate_size"],
        "expert_shared_count": c["n_shared_experts"], "expert_weights_scale": float(c["routed_scaling_factor"]),
        "rope.dimension_count": rope_dim,
    }
    if c.get("q_lora_rank") is not None:
        keys["attention.q_lora_rank"] = c["q_lora_rank"]
    if c.get("norm_topk_prob"):
        keys["expert_weights_norm"] = True
    if split_kv_b:  # the absorbed form: one latent "head" of kv_lora_rank + rope
        keys.update({"attention.key_length": rank + rope_dim, "attention.value_length": rank,
                     "attention.key_length_mla": nope + rope_dim, "attention.value_length_mla": v})
    else:
        keys.update({"attention.key_length": nope + rope_dim, "attention.value_length": v})
    if rope.get("rope_type") == "yarn":
        keys.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                     "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
                     "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"]})
    writer = gguf_writer(path, "deepseek2", keys, skip_keys=skip_keys, tokenizer=tokenizer,
                         vocab_size=c["vocab_size"])
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
        w = w.astype(np.float32)
        if name in _TOP:
            out[_TOP[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.endswith("e_score_correction_bias"):  # the converter renames it ...e_score_correction.bias
            out[f"blk.{layer}.exp_probs_b.bias"] = w
            continue
        inner = rest.rsplit(".", 1)[0]
        if ".experts." in inner:
            expert, proj = inner.split(".experts.")[1].split(".")
            stacks.setdefault((layer, proj[:-5]), {})[int(expert)] = w
            continue
        if inner == "self_attn.kv_b_proj" and split_kv_b:  # DeepseekV2Model.modify_tensors
            kv_b = w.reshape(heads, nope + v, w.shape[-1])
            out[f"blk.{layer}.attn_k_b.weight"] = kv_b[:, :nope].transpose(0, 2, 1)
            out[f"blk.{layer}.attn_v_b.weight"] = kv_b[:, nope:]
            continue
        out[f"blk.{layer}.{_BLOCK[inner]}.weight"] = w
    for (layer, proj), experts in stacks.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([experts[j] for j in sorted(experts)])
    write_tensors(writer, out, drop=drop, transform=transform,
                  qtype_of=lambda name, w: qtype if w.ndim >= 2 and qtype != F32 and w.shape[-1] % 32 == 0 else None)


@pytest.mark.parametrize("case, split_kv_b", [("q_lora", True), ("q_proj_narrow_values", True), ("q_lora", False)])
def test_deepseek2_gguf_gives_the_transformers_logits(case, split_kv_b, tmp_path):
    directory, hf_model = _make(tmp_path, case)
    write_deepseek2_gguf(tmp_path / "d.gguf", directory, split_kv_b=split_kv_b)
    model = specjax.load(str(tmp_path / "d.gguf"), dtype="float32")
    cfg = model.module.config
    assert (cfg.model_type, cfg.q_lora_rank, cfg.rope_interleave, cfg.router_scores, cfg.router_groups) == (
        "deepseek_v3", hf_model.config.q_lora_rank, True, "sigmoid", 2)
    # The same params, bit for bit, as from the Hugging Face directory the file was written from.
    assert_same_params(specjax.load(directory, dtype="float32").params, model.params)
    want = torch_logits(hf_model, IDS)
    got = np.asarray(specjax.logits(model, IDS))
    print(f"{case} (split kv_b {split_kv_b}): rel |specjax - transformers| = {rel_err(got, want):.2e}")
    assert rel_err(got, want) < 1e-4


_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=0.7,
             mscale_all_dim=0.7)


def test_deepseek2_gguf_with_yarn(tmp_path):
    """Yarn as llama.cpp's deepseek2 graph runs it (the converter keeps only 0.1 * mscale_all_dim,
    and llama.cpp's rotation is unscaled: transformers' with mscale = mscale_all_dim)."""
    directory, hf_model = _make(tmp_path, "q_lora", rope_parameters=_YARN)
    write_deepseek2_gguf(tmp_path / "y.gguf", directory)
    model = specjax.load(str(tmp_path / "y.gguf"), dtype="float32")
    assert model.module.config.rope_scaling.mscale_all_dim == pytest.approx(0.7)
    assert rel_err(specjax.logits(model, IDS), torch_logits(hf_model, IDS)) < 1e-4


def test_deepseek2_gguf_greedy_decoding_matches_transformers(tmp_path):
    directory, hf_model = _make(tmp_path, "q_lora")
    write_deepseek2_gguf(tmp_path / "d.gguf", directory)
    model = specjax.load(str(tmp_path / "d.gguf"), dtype="float32")
    prompt, new = IDS[:1, :5], 8
    with torch.no_grad():
        want = hf_model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=new, do_sample=False,
                                 pad_token_id=0)[:, 5:].numpy()
    got = specjax.generate(model, prompt, max_new_tokens=new, temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(got.tokens), want)


def _rope_rows_in_halves(name, w):
    """Each head's rotary rows of q (and the shared k_pe rows of kv_a) in halves order, not pairs."""
    from specjax._src.models import gguf as gguf_lib

    if name.endswith(("attn_q_b.weight", "attn_q.weight")):
        per_head = w.reshape(4, 24, -1)
        per_head = np.concatenate([per_head[:, :16], gguf_lib.unpermute_rotary(
            per_head[:, 16:].reshape(4 * 8, -1), 4).reshape(4, 8, -1)], axis=1)
        return per_head.reshape(w.shape)
    if name.endswith("attn_kv_a_mqa.weight"):
        return np.concatenate([w[:16], gguf_lib.unpermute_rotary(w[16:], 1)])
    return w


@pytest.mark.parametrize("wrong", ["rope_rows", "kv_b_heads"])
def test_deepseek2_gguf_negative_controls(wrong, tmp_path):
    """The parity check sees the rotary row order and the per-head split of kv_b."""
    directory, hf_model = _make(tmp_path, "q_lora")
    transform = _rope_rows_in_halves if wrong == "rope_rows" else (
        lambda name, w: w[::-1] if name.endswith(("attn_k_b.weight", "attn_v_b.weight")) else w)
    write_deepseek2_gguf(tmp_path / "w.gguf", directory, transform=transform)
    got = specjax.logits(specjax.load(str(tmp_path / "w.gguf"), dtype="float32"), IDS)
    assert rel_err(got, torch_logits(hf_model, IDS)) > 1e-3


@pytest.mark.parametrize("change, match", [
    (dict(skip_keys=("attention.kv_lora_rank",)), r"lacks the metadata key deepseek2.attention.kv_lora_rank"),
    (dict(skip_keys=("expert_gating_func",)), r"softmax.*deepseek2.expert_gating_func"),
    (dict(drop=("blk.1.attn_v_b.weight",)), r"lacks the tensor blk.1.attn_v_b.weight"),
    (dict(drop=("blk.1.exp_probs_b.bias",)), r"lacks the tensor blk.1.exp_probs_b.bias"),
    (dict(drop=("blk.1.ffn_up_shexp.weight",)), r"ffn_up_shexp|shared_experts.up_proj"),
])
def test_deepseek2_gguf_missing_keys_and_tensors_are_named(change, match, tmp_path):
    directory, _ = _make(tmp_path, "q_lora")
    write_deepseek2_gguf(tmp_path / "m.gguf", directory, **change)
    with pytest.raises(ValueError, match=match):
        specjax.load(str(tmp_path / "m.gguf"))


def test_quantized_deepseek2_gguf_loads(tmp_path):
    """A Q8_0 file (the matrices whose rows hold whole 32-value blocks): floats close to the
    model, and ``quantize="gguf"`` keeping the blocks close to those floats (the latent and the experts
    32 wide, so that every matrix takes 32-input groups)."""
    directory, hf_model = _make(tmp_path, "q_lora", kv_lora_rank=32, moe_intermediate_size=32)
    write_deepseek2_gguf(tmp_path / "q8.gguf", directory, qtype=gguf.GGMLQuantizationType.Q8_0)
    floats = specjax.load(str(tmp_path / "q8.gguf"), dtype="float32")
    want = np.asarray(specjax.logits(floats, IDS))
    assert rel_err(want, torch_logits(hf_model, IDS)) < 0.1
    q = specjax.load(str(tmp_path / "q8.gguf"), quantize="gguf")
    # kv_b requantized from the k_b / v_b floats, near-tied routing: close, not equal (2.0e-2 here)
    assert rel_err(specjax.logits(q, IDS), want) < 0.05


@pytest.mark.parametrize("split_kv_b, yarn", [(True, False), (False, False), (True, True)])
def test_deepseek2_gguf_against_llama_cpp(split_kv_b, yarn, tmp_path):
    """llama.cpp reads the same file: its logits (float32 weights and KV cache) equal specjax's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    directory, hf_model = _make(tmp_path, "q_lora", **({"rope_parameters": _YARN} if yarn else {}))
    path = str(tmp_path / "l.gguf")
    write_deepseek2_gguf(path, directory, split_kv_b=split_kv_b, tokenizer=True)
    try:
        llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, verbose=False, type_k=0, type_v=0,
                              n_threads=1)
    except Exception as e:  # llama.cpp refuses the file (tiny dims, an older llama.cpp)
        pytest.skip(f"llama.cpp does not load this tiny deepseek2 file: {e}")
    ids = [int(t) for t in IDS[0]]
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)], np.float32)
    ours = np.asarray(specjax.logits(specjax.load(path, dtype="float32"), IDS[:1]))[0]
    print(f"llama.cpp vs specjax (split kv_b {split_kv_b}, yarn {yarn}): rel {rel_err(theirs, ours):.2e}")
    assert rel_err(theirs, ours) < 1e-3
    assert rel_err(ours, torch_logits(hf_model, IDS[:1])[0]) < 1e-4


def test_deepseek_v3_pre_tokenizer_splits_as_llama_cpp(tmp_path):
    """``tokenizer.ggml.pre`` "deepseek-v3" (DeepSeek-V3's three splits: digits in threes, CJK runs,
    then words with one leading punctuation mark): on a byte-level vocabulary whose merges would
    cross those splits, specjax's token ids equal llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from tokenizers.pre_tokenizers import ByteLevel

    from specjax._src.models import gguf as gguf_lib

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: ch.encode("utf-8"))  # any order: ids are the list's
    merges = ["3 4", "1 2", "12 3", "4 5", ". a", "a b", "Ġ a", "x Ċ", "Ċ Ċ"]
    tokens = byte_chars + [m.replace(" ", "") for m in merges]
    directory, _ = _make(tmp_path, "q_lora", vocab_size=len(tokens))
    path = str(tmp_path / "t.gguf")
    write_deepseek2_gguf(path, directory, tokenizer=(tokens, merges, "deepseek-v3"))
    ours = gguf_lib.read_gguf(path).tokenizer
    try:
        llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    except Exception as e:
        pytest.skip(f"llama.cpp does not load this vocabulary: {e}")
    for text in ["12345", ".ab a.ab", "ab 77 \u65e5\u672c\u8a9ex", "x\n\n  y!!.a", "12 345 6789012"]:
        theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert ours.encode(text).ids == theirs, text
    # Negative control: GPT-2's split ("default") keeps "12345" one piece, where 3 and 4 merge first.
    write_deepseek2_gguf(tmp_path / "gpt2.gguf", directory, tokenizer=(tokens, merges, "default"))
    assert gguf_lib.read_gguf(str(tmp_path / "gpt2.gguf")).tokenizer.encode("12345").ids != ours.encode("12345").ids
