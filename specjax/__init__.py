"""specjax: speculative decoding in JAX with composable acceptance rules.

Example::

    import jax, specjax
    from specjax.rules import mars

    target, draft = specjax.load("ckpt/target"), specjax.load("ckpt/draft")
    out = specjax.decode(specjax.pair(target, draft), prompts, rule=mars(theta=0.9),
                         key=jax.random.key(0))
"""

__version__ = "0.1.0"

from specjax._src.models.lm import KVCache, LanguageModel, LMOutput, Model
from specjax._src.models.config import ModelConfig
from specjax._src.models.decoder import Decoder
from specjax._src.models.loading import dequantize, export_hf, load, logits, quantize, save_orbax
from specjax._src.models.manifest import checkpoint_manifest, verify_manifest
from specjax._src.models.registry import describe as known_models
from specjax._src.models.chat import encode_chat, render_chat
from specjax._src.engine.loop import BUCKETS, MIN_TEMPERATURE, Buckets, DecodeOutput, ModelPair, decode, generate, pair
from specjax._src.engine.stats import DecodeStats, concatenate as concatenate_stats, expected_tau
from specjax._src.logits.processors import GenerationControls
from specjax import drafting
from specjax import engine
from specjax import heads
from specjax import sharding
from specjax import trees

# The curated public API. Rules, drafting policies, sharding and certificates
# live in their own modules (specjax.rules, .drafting, .sharding, .theory), tiny
# models for tests in specjax.testing, the command line in specjax.cli.
__all__ = [
    # models and the LM protocol
    "LanguageModel",
    "Model",
    "ModelConfig",
    "Decoder",
    "KVCache",
    "LMOutput",
    # checkpoints
    "load",
    "save_orbax",
    "export_hf",
    "logits",
    "quantize",
    "dequantize",
    "checkpoint_manifest",
    "verify_manifest",
    "known_models",
    # chat prompts
    "encode_chat",
    "render_chat",
    # decoding
    "pair",
    "decode",
    "generate",
    "ModelPair",
    "DecodeOutput",
    "DecodeStats",
    "concatenate_stats",
    "expected_tau",
    "Buckets",
    "BUCKETS",
    "MIN_TEMPERATURE",
    "GenerationControls",
    # submodules
    "drafting",
    "engine",
    "heads",
    "sharding",
    "trees",
]
