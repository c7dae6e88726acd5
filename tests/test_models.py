"""The decoder family: parity with PyTorch, the KV cache contract, hidden states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _hf_models import make_hf_model, random_tokens, rel_err, torch_logits
from specjax import Decoder, KVCache, LanguageModel, ModelConfig, load, logits
from specjax._src.models.config import RopeScaling

FP32_BOUND = 1e-4
# bf16 keeps 8 mantissa bits (relative rounding 2**-9 ~ 2e-3 per op); through
# two blocks of these tiny random models the logits drift by 1-3% of their
# largest magnitude. The bound is checked against the float32 PyTorch model.
BF16_BOUND = 5e-2

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0}

# name -> (model_type, config overrides). Together they cover GQA, tied and
# untied heads, Qwen3's head_dim != hidden/heads, Llama 3 rope scaling and a
# Mistral sequence longer than its sliding window.
PARITY_CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama3-rope-tied": ("llama", dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True,
                                       rope_theta=500000.0, max_position_embeddings=128)),
    "llama-linear-rope": ("llama", dict(rope_scaling=LINEAR_ROPE)),
    "mistral-window4": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-headdim16-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "gpt2": ("gpt2", {}),
}
SEQ_LEN = 24  # > Mistral's window of 4; < GPT-2's 64 positions


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Each parity case built once: (dir, torch model)."""
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_model(mt, root, name=name, **ov) for name, (mt, ov) in PARITY_CASES.items()}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_fp32_logits_match_pytorch(hf_models, case):
    directory, torch_model = hf_models[case]
    model = load(directory)
    cfg = model.module.config
    tokens = random_tokens(cfg.vocab_size, batch=3, length=SEQ_LEN, seed=1)
    got = logits(model, tokens)
    assert got.dtype == jnp.float32 and got.shape == (3, SEQ_LEN, cfg.vocab_size)
    assert rel_err(got, torch_logits(torch_model, tokens)) <= FP32_BOUND
    # The case really exercises what its name says.
    if "gqa" in case or case.startswith(("mistral", "qwen")):
        assert cfg.num_kv_heads < cfg.num_heads
    if case.endswith("-tied"):
        assert cfg.tie_word_embeddings and "lm_head" not in model.params
    if case.endswith("-untied"):
        assert not cfg.tie_word_embeddings and "lm_head" in model.params
    if case.startswith("qwen3"):
        assert cfg.head_dim * cfg.num_heads != cfg.hidden_size
    if case.startswith("llama3"):
        assert cfg.rope_scaling is not None
    if case == "llama-linear-rope":
        assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 4.0
    if case.startswith("mistral"):
        assert cfg.sliding_window < SEQ_LEN


@pytest.mark.parametrize("case,feature", [
    ("llama3-rope-tied", dict(rope_scaling=None)),
    ("llama-linear-rope", dict(rope_scaling=None)),
    ("mistral-window4", dict(sliding_window=None)),
    ("qwen3-headdim16-tied", dict(qk_norm=False)),
])
def test_parity_test_detects_a_missing_feature(hf_models, case, feature):
    # Guards the parity test itself: dropping the feature must break parity.
    directory, torch_model = hf_models[case]
    model = load(directory)
    broken = Decoder(model.module.config.replace(**feature))
    params = model.params
    if feature.get("qk_norm") is False:
        params = jax.tree.map(lambda x: x, params)
        for layer in range(broken.num_layers):
            params[f"layer_{layer}"]["attn"] = {
                k: v for k, v in params[f"layer_{layer}"]["attn"].items() if not k.endswith("_norm")}
    tokens = random_tokens(broken.vocab_size, 2, SEQ_LEN, seed=2)
    got = jax.jit(broken.apply)(params, jnp.asarray(tokens)).logits
    assert rel_err(got, torch_logits(torch_model, tokens)) > 100 * FP32_BOUND


@pytest.mark.parametrize("case", ["llama-gqa-untied", "mistral-window4", "qwen2-bias",
                                  "qwen3-headdim16-tied", "gpt2"])
def test_bf16_logits_within_documented_bound(hf_models, case):
    directory, torch_model = hf_models[case]
    model = load(directory, dtype="bfloat16")
    leaves = jax.tree.leaves(model.params)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    tokens = random_tokens(model.vocab_size, 2, 16, seed=3)
    got = logits(model, tokens)
    assert got.dtype == jnp.float32
    err = rel_err(got, torch_logits(torch_model, tokens))
    assert FP32_BOUND < err <= BF16_BOUND  # really computed in bf16, and within bound


# --------------------------------------------------------------------------- #
# The cache contract, on random specjax models (no torch needed)
# --------------------------------------------------------------------------- #


def tiny_config(model_type: str, **overrides) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, intermediate_size=64, max_position_embeddings=64)
    layout = {
        "llama": dict(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16)),
        "mistral": dict(sliding_window=3),
        "qwen2": dict(attention_bias=True),
        "qwen3": dict(qk_norm=True, head_dim=16, tie_word_embeddings=True),
        "gpt2": dict(num_kv_heads=4, activation="gelu_new", norm_eps=1e-5,
                     tie_word_embeddings=True),
    }[model_type]
    return ModelConfig(model_type=model_type, **{**base, **layout, **overrides})


MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gpt2"]
_MODELS: dict = {}


def _model(model_type, **overrides):
    """(module, params, jitted apply), built once per config: each compile costs
    about a second on the shared 2-core CPU, so the tests reuse shapes too."""
    key = (model_type, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        module = Decoder(tiny_config(model_type, **overrides))
        apply = jax.jit(module.apply, static_argnames="hidden_layers")
        _MODELS[key] = (module, module.init(jax.random.key(0)), apply)
    return _MODELS[key]


# The cache tests share three compiled shapes per model (batch 3, cache 16):
# appends of 4 and of 1 token, and a full forward of 12 tokens.
B, S, FULL = 3, 16, 12


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_incremental_decoding_equals_full_forward(model_type):
    module, params, apply = _model(model_type)
    seq = jnp.asarray(random_tokens(module.vocab_size, B, FULL, seed=4))
    full = apply(params, seq).logits  # causal: its prefixes are the references

    out = apply(params, seq[:, :4], module.init_cache(B, S))  # prefill
    chunks = [out.logits]
    for t in (4, 5):                                           # 1-token appends
        out = apply(params, seq[:, t:t + 1], out.cache)
        chunks.append(out.logits)
    out = apply(params, seq[:, 6:10], out.cache)               # multi-token append
    chunks.append(out.logits)
    np.testing.assert_array_equal(out.cache.lengths, [10] * B)
    np.testing.assert_allclose(jnp.concatenate(chunks, 1), full[:, :10], rtol=1e-5, atol=1e-5)

    # Reject the last 3 tokens, then append 4 different ones over them.
    cache = out.cache.rollback(jnp.full((B,), 7))
    assert all(a is b for a, b in zip(cache.keys, out.cache.keys))  # no buffer copied
    new = jnp.asarray(random_tokens(module.vocab_size, B, 5, seed=5))
    out = apply(params, new[:, :4], cache)
    redo = jnp.concatenate([seq[:, :7], new], axis=1)
    np.testing.assert_allclose(out.logits, apply(params, redo).logits[:, 7:11], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.cache.lengths, [11] * B)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_ragged_batch_equals_each_sequence_alone(model_type):
    module, params, apply = _model(model_type)
    lengths = [2, 4, 3]
    prompts = [random_tokens(module.vocab_size, 1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    padded = np.zeros((B, 4), np.int32)
    for i, p in enumerate(prompts):
        padded[i, :len(p)] = p
    steps = random_tokens(module.vocab_size, B, 5, seed=20)

    # The batch: right-padded prefill, lengths reset to the true ones, then a
    # 4-token and a 1-token append (each sequence at its own offset).
    out = apply(params, jnp.asarray(padded), module.init_cache(B, S))
    batch = [np.stack([out.logits[i, n - 1] for i, n in enumerate(lengths)])]
    out = apply(params, jnp.asarray(steps[:, :4]), out.cache.rollback(jnp.asarray(lengths)))
    batch += [out.logits[:, t] for t in range(4)]
    out = apply(params, jnp.asarray(steps[:, 4:]), out.cache)
    batch += [out.logits[:, 0]]
    np.testing.assert_array_equal(out.cache.lengths, np.asarray(lengths) + 5)

    # Each sequence alone, fed one token at a time (one more compiled shape).
    for i, p in enumerate(prompts):
        cache, alone = module.init_cache(1, S), []
        for tok in [*p, *steps[i]]:
            o = apply(params, jnp.asarray([[tok]], jnp.int32), cache)
            cache = o.cache
            alone.append(o.logits[0, 0])
        for got, want in zip(batch, alone[len(p) - 1:]):
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_sliding_window_through_cache_past_the_window():
    # 1-token steps far past the window see exactly the last `window` positions.
    module, params, apply = _model("mistral")
    window = module.config.sliding_window
    seq = jnp.asarray(random_tokens(module.vocab_size, B, FULL, seed=6))
    out = apply(params, seq[:, :1], module.init_cache(B, S))
    got = [out.logits]
    for t in range(1, FULL):
        out = apply(params, seq[:, t:t + 1], out.cache)
        got.append(out.logits)
    full = apply(params, seq).logits
    np.testing.assert_allclose(jnp.concatenate(got, 1), full, rtol=1e-5, atol=1e-5)
    plain = jax.jit(Decoder(module.config.replace(sliding_window=None)).apply)(params, seq).logits
    np.testing.assert_allclose(full[:, :window], plain[:, :window], rtol=1e-5, atol=1e-5)
    assert not np.allclose(full[:, window:], plain[:, window:], atol=1e-3)


def test_hidden_layers_index_like_a_list():
    module, params, apply = _model("qwen3")
    tokens = jnp.asarray(random_tokens(module.vocab_size, B, FULL))
    out = apply(params, tokens, hidden_layers=(-1, 0, 1))
    assert len(out.hidden) == 3
    assert all(h.shape == (B, FULL, module.hidden_size) and h.dtype == jnp.float32 for h in out.hidden)
    np.testing.assert_array_equal(out.hidden[0], out.hidden[2])
    assert not np.allclose(out.hidden[0], out.hidden[1])
    # Through the cache, the same hidden states come back.
    cached = apply(params, tokens[:, :4], module.init_cache(B, S), hidden_layers=(0,))
    np.testing.assert_allclose(cached.hidden[0], out.hidden[1][:, :4], rtol=1e-5, atol=1e-5)
    with pytest.raises(IndexError, match=r"hidden_layers index 2 out of range.*2 layers"):
        module.apply(params, tokens, hidden_layers=(2,))
    with pytest.raises(IndexError, match="out of range"):
        module.apply(params, tokens, hidden_layers=(-3,))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # untied and tied heads
def test_logits_at_returns_that_row_of_the_full_logits(model_type):
    module, params, _ = _model(model_type)
    assert module.supports_logits_at
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (3, 4)), jnp.int32)
    cache = module.init_cache(3, 16).rollback(jnp.array([0, 5, 9], jnp.int32))
    full = module.apply(params, tokens, cache)
    rows = jnp.array([0, 3, 1], jnp.int32)
    one = module.apply(params, tokens, cache, logits_at=rows, hidden_layers=(-1,))
    assert one.logits.shape == (3, 1, 97)
    np.testing.assert_allclose(np.asarray(one.logits[:, 0]), np.asarray(full.logits)[np.arange(3), rows],
                               rtol=1e-5, atol=1e-6)
    assert one.hidden[0].shape == (3, 4, 32)  # hidden states stay full length
    with pytest.raises(ValueError, match=r"one position per sequence, shape \(3,\)"):
        module.apply(params, tokens, cache, logits_at=jnp.zeros((3, 1), jnp.int32))
    for a, b in zip(jax.tree.leaves(one.cache), jax.tree.leaves(full.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decoder_is_a_hashable_language_model_with_bf16_compute():
    module, params, apply = _model("llama", dtype="bfloat16")
    assert isinstance(module, LanguageModel)
    assert hash(module) == hash(Decoder(tiny_config("llama", dtype="bfloat16")))
    assert (module.vocab_size, module.hidden_size, module.num_layers) == (97, 32, 2)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    cache = module.init_cache(2, 8)
    assert isinstance(cache, KVCache) and cache.keys[0].dtype == jnp.bfloat16
    assert cache.keys[0].shape == (2, 2, 8, 8) and len(cache.keys) == 2
    out = apply(params, jnp.zeros((2, 1), jnp.int32), cache)
    assert out.logits.dtype == jnp.float32 and out.cache.keys[0].dtype == jnp.bfloat16
    # Same key, same params: `init` is deterministic.
    again = module.init(jax.random.key(0))
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)))


def test_second_call_with_new_inputs_compiles_nothing():
    module, params, step = _model("llama")
    out = step(params, jnp.ones((B, 1), jnp.int32), module.init_cache(B, S))
    size = step._cache_size()
    step(params, jnp.full((B, 1), 5, jnp.int32), out.cache)
    assert step._cache_size() == size


def test_prompt_longer_than_cache_is_refused():
    module, params, _ = _model("llama")
    with pytest.raises(ValueError, match=r"12 tokens is longer than the cache \(max_length=8\)"):
        module.apply(params, jnp.zeros((1, 12), jnp.int32), module.init_cache(1, 8))


def test_gpt2_positions_beyond_its_table_are_refused():
    module, params, _ = _model("gpt2")
    with pytest.raises(ValueError, match="exceeds this GPT-2 model's 64 learned positions"):
        module.init_cache(1, 65)
    with pytest.raises(ValueError, match="65 tokens exceeds this GPT-2 model's 64"):
        module.apply(params, jnp.zeros((1, 65), jnp.int32))


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"Unsupported model_type 'bert'.*llama, mistral, qwen2, qwen3, gpt2"):
        ModelConfig("bert", 97, 32, 2, 4, 4, 8, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config("llama", num_kv_heads=3)
    with pytest.raises(ValueError, match="Unsupported dtype 'int8'"):
        tiny_config("llama", dtype="int8")


def _attention_traces(config: ModelConfig) -> int:
    """How many times tracing one cached forward of ``config`` runs an attention's body."""
    from specjax._src.models import decoder

    model = Decoder(config)
    params = model.init(jax.random.key(0))
    cache = model.init_cache(1, 16)
    calls = []
    original = decoder.Attention.__call__

    def counting(self, *args, **kwargs):
        calls.append(self.layer)
        return original(self, *args, **kwargs)

    decoder.Attention.__call__ = counting
    try:
        jax.jit(lambda p, c, t: model.apply(p, t, c).logits).trace(params, cache, jnp.ones((1, 3), jnp.int32))
    finally:
        decoder.Attention.__call__ = original
    return len(calls)


def test_a_forward_traces_one_block_per_kind_of_layer():
    llama = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, num_layers=5, num_heads=4,
                        num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    assert [llama.representative_layer(i) for i in range(5)] == [0] * 5
    assert _attention_traces(llama) == 1
    # Negative control: layers of two attention kinds (Gemma 3's sliding and full) trace two blocks.
    gemma = llama.replace(model_type="gemma3_text", sliding_window=8, rope_local_theta=10_000.0,
                          layer_types=("sliding_attention",) * 2 + ("full_attention",) + ("sliding_attention",) * 2,
                          query_pre_attn_scalar=8)
    assert [gemma.representative_layer(i) for i in range(5)] == [0, 0, 2, 0, 0]
    assert _attention_traces(gemma) == 2
