"""Mixtures of experts (Mixtral, Qwen3-MoE) against transformers on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from tests._hf_models import rel_err, torch_logits  # noqa: E402
from tests.test_decode import NO_BUCKETS  # noqa: E402

_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, num_experts_per_tok=2,
               bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
CONFIGS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True)),
    # A shared expert behind a sigmoid gate, and a dense layer (mlp_only_layers) before the expert one.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       norm_topk_prob=False, mlp_only_layers=[0])),
    # DeepSeek-V3's routing (sigmoid scores, a choice bias, the best 1 of 2 groups, scaled weights), a
    # shared expert and a dense first layer, with Qwen3's attention.
    "dots1": ("Dots1Config", "Dots1ForCausalLM",
              dict(n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=2, n_group=2, topk_group=1,
                   first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, head_dim=8)),
    "qwen3_moe_unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(num_experts=4, moe_intermediate_size=16, head_dim=8, norm_topk_prob=False)),
}


def _make(case: str, tmp_path):
    config_name, model_name, fields = CONFIGS[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**_COMMON, **fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.3) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's choice bias: zero at init
                b.copy_(0.3 * torch.randn_like(b))
    model = model.to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    directory = str(tmp_path / case)
    model.save_pretrained(directory)
    return directory, model


# Slow-only (about 18 s): qwen3_moe_unnormalised differs from qwen3_moe by norm_topk_prob=False
# alone, which qwen2_moe runs by default; qwen3_moe's parts run by default in mixtral (softmax
# routing, normalised) and dots1 (Qwen3's attention, the same checkpoint names), and its checkpoint
# loads and decodes by default in test_moe_gguf.py (test_quantize_a_mixture_of_experts[q4], and its
# logits against transformers' GGUF loader).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c in ("qwen3_moe", "qwen3_moe_unnormalised") else c for c in CONFIGS])
def test_moe_logits_decoding_and_export_match_transformers(case, tmp_path):
    directory, hf_model = _make(case, tmp_path)
    model = specjax.load(directory, dtype="float32")
    cfg = model.module.config
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (case not in ("qwen3_moe_unnormalised", "qwen2_moe"))
    if case == "qwen2_moe":
        assert cfg.shared_expert_intermediate_size == 24 and cfg.dense_mlp_layers == (0,)
    if case == "dots1":
        assert (cfg.shared_expert_intermediate_size, cfg.dense_mlp_layers, cfg.router_scores, cfg.router_groups,
                cfg.routed_scaling_factor) == (32, (0,), "sigmoid", 2, 2.5)
    ids = np.random.default_rng(0).integers(3, 96, (2, 12)).astype(np.int32)
    want = torch_logits(hf_model, ids)
    assert rel_err(specjax.logits(model, ids), want) < 1e-4
    # Negative control: routing to the top 1 instead of the top 2 parts the logits from transformers'.
    top1 = specjax.Model(model.params, specjax.Decoder(cfg.replace(num_experts_per_tok=1)))
    assert rel_err(specjax.logits(top1, ids), want) > 1e-3
    # Lossless speculative decoding reproduces the model's greedy output (the model as its own draft's
    # first layer: a draft that is sometimes wrong).
    draft = specjax.Model({k: v for k, v in model.params.items() if k != "layer_1"},
                          specjax.Decoder(cfg.replace(num_layers=1)))
    kw = dict(max_new_tokens=10, temperature=0.0, eos_token_id=())
    alone = specjax.generate(model, ids[:, :5], **kw)
    spec = specjax.decode(specjax.pair(model, draft), ids[:, :5], num_draft=3, **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(alone.tokens))
    with torch.no_grad():
        hf_greedy = hf_model.generate(torch.as_tensor(ids[:1, :5], dtype=torch.long), max_new_tokens=10,
                                      do_sample=False, pad_token_id=0)[:, 5:].numpy()
    np.testing.assert_array_equal(np.asarray(alone.tokens)[:1], hf_greedy)
    # Export: transformers reads the experts back, one tensor per expert.
    specjax.export_hf(model, str(tmp_path / "out"))
    exported = getattr(transformers, CONFIGS[case][1]).from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    exported.config._attn_implementation = "eager"
    assert rel_err(torch_logits(exported.eval(), ids), want) < 1e-5


def test_experts_shard_over_the_model_axis():
    from jax.sharding import PartitionSpec as P

    from specjax import sharding

    cfg = specjax.ModelConfig(model_type="mixtral", vocab_size=96, hidden_size=32, num_layers=1, num_heads=4,
                              num_kv_heads=2, head_dim=8, intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    specs = sharding.param_specs(cfg, model_axis_size=2)
    assert specs["layer_0"]["mlp"]["experts_gate"] == P("model", None, None)
    shared = sharding.param_specs(cfg.replace(model_type="qwen2_moe", shared_expert_intermediate_size=64,
                                              shared_expert_gate=True), model_axis_size=2)["layer_0"]["mlp"]
    assert shared["shared_expert"]["gate"]["kernel"] == P(None, "model")  # the shared expert: a column-split MLP
    assert shared["shared_expert_gate"]["kernel"] == P()
    # An expert count the axis does not divide is refused by name: tests/test_sharding.py, on 8 devices.


def test_moe_layouts_specjax_does_not_run_are_named(tmp_path):
    import json

    directory, _ = _make("qwen3_moe", tmp_path)
    path = tmp_path / "qwen3_moe" / "config.json"
    config = json.loads(path.read_text())
    for change, message in [({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
                            ({"shared_expert_intermediate_size": 8}, "shared expert is not supported")]:
        path.write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            specjax.load(directory)


# Slow-only (about 19 s): a mixture of experts computes logits as any target does (no token is
# dropped by batch); it decodes speculatively by default in
# test_moe_logits_decoding_and_export_match_transformers, and the sampling law is checked by
# default in test_decode.py and test_block_verification.py.
@pytest.mark.slow
def test_lossless_sampling_with_a_moe_target_and_a_dense_draft_follows_the_targets_law():
    """A Mixtral-layout target (random, 4 experts, top 2) drafted for by a dense Llama
    of the same vocabulary: the first two sampled tokens follow the target's law."""
    import jax

    from specjax.testing import llama_config, peaked_target_and_draft
    from test_quant import _chi_square, _two_token_law

    moe_cfg = llama_config(vocab_size=16).replace(model_type="mixtral", num_experts=4, num_experts_per_tok=2)
    target, _ = peaked_target_and_draft(moe_cfg)
    target = target.replace(params={**target.params, "lm_head": target.params["lm_head"] / 5.0})
    draft, _ = peaked_target_and_draft(llama_config(vocab_size=16))
    draft = draft.replace(params={**draft.params, "lm_head": draft.params["lm_head"] / 5.0})
    prompt, n = [3, 1, 4], 20_000
    out = specjax.decode(specjax.pair(target, draft), [prompt] * n, num_draft=3, max_new_tokens=2,
                         temperature=1.0, eos_token_id=(), key=jax.random.key(11), buckets=NO_BUCKETS)
    toks = np.asarray(out.tokens)[:, :2]
    counts = np.zeros((16, 16))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    assert out.stats.acceptance_rate > 0.05  # drafts are accepted: the rule's correction is exercised
    assert _chi_square(counts, _two_token_law(target, prompt)) > 1e-4
    # Negative control: the dense draft's own law is rejected at this sample size.
    assert _chi_square(counts, _two_token_law(draft, prompt)) < 1e-4
