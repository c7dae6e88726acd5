"""Tiny random Hugging Face models for tests (PyTorch reference, no downloads).

Stable helpers other test files import:

* ``make_hf_model(model_type, tmp_path, **overrides) -> (dir, torch_model)``
* ``torch_logits(torch_model, tokens) -> np.ndarray [B, T, V] float32``
* ``rel_err(a, b) = max|a - b| / max|b|``
"""

from __future__ import annotations

import os

import numpy as np

# Small enough to build, save and load in well under a second each.
TINY = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=256),
    "mistral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    max_position_embeddings=256, sliding_window=4, head_dim=8),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=256),
    "qwen3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=128, max_position_embeddings=256),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                 bos_token_id=0, eos_token_id=0),
}


def make_hf_model(model_type: str, tmp_path, *, seed: int = 0, std: float = 0.2,
                  dtype: str = "float32", save: bool = True, **overrides):
    """Builds a random ``transformers`` causal LM and saves it with ``save_pretrained``.

    Weights are redrawn with a larger ``std`` than HF's 0.02 (and norms around 1
    rather than exactly 1) so that logits are far from uniform and a wrong
    layout shows up as a large error.

    Args:
      model_type: "llama", "mistral", "qwen2", "qwen3" or "gpt2".
      tmp_path: parent directory; the model goes to ``tmp_path / f"{model_type}-hf"``
        (add ``name=...`` to choose another sub-directory).
      seed: torch seed.
      std: std of the redrawn weights.
      dtype: "float32" or "bfloat16" for the saved weights.
      **overrides: config fields (``tie_word_embeddings=True``, ``rope_scaling=...``).

    Returns:
      ``(directory as str, torch model in eval mode)``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    name = overrides.pop("name", f"{model_type}-hf")
    kwargs = {**TINY[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname or ".ln_" in pname:
                base = 1.0 if (pname.endswith("weight")) else 0.0
                p.copy_(base + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    model = model.to(getattr(torch, dtype)).eval()
    directory = os.path.join(str(tmp_path), name)
    if save:
        model.save_pretrained(directory)
    return directory, model


def torch_logits(model, tokens) -> np.ndarray:
    """Reference float32 logits of a ``transformers`` model for ``tokens[B, T]``."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|``: the parity metric of the model tests."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def random_tokens(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length), dtype=np.int32)


def write_tokenizer(directory, vocab_size: int) -> None:
    """A tiny word-level ``tokenizer.json`` (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["[UNK]"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(str(directory), "tokenizer.json"))
