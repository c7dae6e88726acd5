"""Qwen2-MoE from GGUF (llama.cpp's ``qwen2moe``): a tiny transformers Qwen2-MoE written as
``convert_hf_to_gguf.py`` writes it (experts stacked into ``ffn_{gate,up,down}_exps``, the shared
expert as ``ffn_{gate,up,down}_shexp`` and its gate as the vector ``ffn_gate_inp_shexp``), loaded
by specjax and compared with the transformers model it came from."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from tests._hf_models import rel_err, torch_logits  # noqa: E402

_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def _qwen2_moe(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        norm_topk_prob=False,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.3) * torch.randn_like(p))
    model = model.to(torch.float32).eval()
    model.config._attn_implementation = "eager"
    directory = str(tmp_path / "hf")
    model.save_pretrained(directory)
    return directory, model


def _write_gguf(path, directory: str) -> None:
    from safetensors.numpy import load_file

    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(16)
    writer.add_expert_shared_feed_forward_length(24)
    writer.add_vocab_size(96)
    out, stacks = {}, {}
    for name, w in load_file(os.path.join(directory, "model.safetensors")).items():
        w = w.astype(np.float32)
        top = {
            "model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight",
        }
        if name in top:
            out[top[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        inner, suffix = rest.rsplit(".", 1)
        if ".experts." in inner:
            expert, proj = inner.split(".experts.")[1].split(".")
            stacks.setdefault((layer, proj[:-5]), {})[int(expert)] = w
            continue
        if inner == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # llama.cpp keeps the gate as a vector of n_embd
        out[f"blk.{layer}.{_NAMES[inner]}.{suffix}"] = w
    for (layer, proj), experts in stacks.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([experts[j] for j in sorted(experts)])
    for name, w in out.items():
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen2_moe_gguf_gives_the_transformers_logits(tmp_path):
    directory, hf_model = _qwen2_moe(tmp_path)
    _write_gguf(tmp_path / "m.gguf", directory)
    model = specjax.load(str(tmp_path / "m.gguf"), dtype="float32")
    cfg = model.module.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == ("qwen2_moe", 4, 2, False)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.shared_expert_gate) == (16, 24, True)
    ids = np.random.default_rng(0).integers(3, 96, (2, 12)).astype(np.int32)
    want = torch_logits(hf_model, ids)
    got = np.asarray(specjax.logits(model, ids))
    assert rel_err(got, want) < 1e-4
    # Negative control: without the shared expert's gate (a gate of 1) the logits part from transformers'.
    params = {
        k: (
            {
                **v,
                "mlp": {
                    **v["mlp"],
                    "shared_expert_gate": {"kernel": 0 * v["mlp"]["shared_expert_gate"]["kernel"] + 1e4},
                },
            }
            if k.startswith("layer_")
            else v
        )
        for k, v in model.params.items()
    }
    assert rel_err(specjax.logits(model.replace(params=params), ids), want) > 1e-3
