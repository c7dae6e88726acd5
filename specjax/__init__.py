"""specjax: speculative decoding in JAX with composable acceptance rules.

    import jax, specjax
    from specjax.rules import mars

    target, draft = specjax.load("ckpt/target"), specjax.load("ckpt/draft")
    out = specjax.decode(specjax.pair(target, draft), prompts, rule=mars(theta=0.9),
                         key=jax.random.key(0))
"""

from specjax._src.lm import KVCache, LanguageModel, LMOutput, Model
from specjax._src.models.config import ModelConfig

__version__ = "0.1.0"

# Public entry points are appended below as their modules land.
from specjax._src.models.decoder import Decoder
from specjax._src.models.loading import export_hf, load, logits, save_orbax
from specjax._src.models.manifest import checkpoint_manifest, verify_manifest
from specjax._src.models.registry import describe as known_models
from specjax._src.chat import encode_chat, render_chat
from specjax._src.decode import BUCKETS, MIN_TEMPERATURE, Buckets, DecodeOutput, ModelPair, decode, generate, pair
from specjax._src.stats import DecodeStats
from specjax import drafting
from specjax import sharding
