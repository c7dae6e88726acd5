"""Published draft heads from local directories: EAGLE-1/2, EAGLE-3 and Medusa.

``specjax.load(dir)`` comes here (:func:`detect`) when ``dir`` holds a head
in one of these layouts, as the authors' code writes them:

* **EAGLE-1/2** ("EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", arXiv:2401.15077; "EAGLE-2: Faster Inference of Language
  Models with Dynamic Draft Trees", arXiv:2406.16858; SafeAILab/EAGLE
  ``eagle/model/cnets1.py``): ``config.json`` (a LlamaConfig) and
  ``pytorch_model.bin`` or ``model.safetensors`` holding ``fc.weight [H, 2H]``
  (and ``fc.bias``) over ``cat(embedding, feature)``, ``layers.{i}.*`` (layer
  0 without ``input_layernorm``), maybe ``embed_tokens.weight``. It reads the
  target's last hidden state after its final norm and scores its prediction
  with the target's own LM head: a :class:`FeatureHead` of variant ``"eagle"``.
* **EAGLE-3** ("EAGLE-3: Scaling up Inference Acceleration of Large Language
  Models via Training-Time Test", arXiv:2503.01840; SafeAILab/EAGLE
  ``eagle/model/cnets.py``, SpecForge ``llama3_eagle.py``, vLLM
  ``llama_eagle3.py``): ``fc.weight [H, 3H]`` over three target blocks'
  outputs, ``midlayer.*`` (attention over ``[2H]``), ``norm.weight``,
  ``lm_head.weight [draft_vocab, H]``, ``d2t`` (draft id ``i`` is target id
  ``i + d2t[i]``) and ``t2d``: a :class:`FeatureHead` of variant ``"eagle3"``
  whose reduced LM head scatters to the target's ids, ``-inf`` elsewhere.
  The same tensors in the **speculators** format (vLLM's ``speculators``
  configs, ``Eagle3Speculator``): ``config.json`` holds the block's
  LlamaConfig under ``transformer_layer_config`` and the algorithm's fields
  on top (``draft_vocab_size``, ``norm_before_residual``, true by default
  there, and vLLM's ``eagle_aux_hidden_state_layer_ids``).
* **Medusa** ("Medusa: Simple LLM Inference Acceleration Framework with
  Multiple Decoding Heads", arXiv:2401.10774; FasterDecoding/Medusa
  ``medusa_model.py``): heads ``{i}.{j}.linear`` (ResBlocks ``x + SiLU(W x +
  b)``) then ``{i}.{n}.weight`` (an LM head), in ``medusa_lm_head.safetensors``
  / ``medusa_lm_head.pt`` or a whole model's weights under ``medusa_head.``:
  a :class:`MedusaHead`.

Pickled ``.bin`` / ``.pt`` weights are read with ``torch.load(...,
weights_only=True)``, PyTorch's restricted unpickler that builds tensors and
plain containers only and refuses any other object (so no code from the file
runs); torch is imported only then.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.models.lm import Array, KVCache, LMOutput, Model, Params
from specjax._src.models import hf
from specjax._src.models.config import ModelConfig
from specjax._src.models.feature_head import EMBED_PATH, FeatureHead, TARGET_NORM, rms_norm
from specjax._src.models.files import load_tokenizer

EAGLE = "eagle"
EAGLE3 = "eagle3"
MEDUSA = "medusa"
UNKNOWN = "unknown"
# ``architectures`` names the serving stacks give these heads (vLLM, SGLang, EAGLE's own configs).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_PICKLES = ("pytorch_model.bin", "model.bin", "pytorch_model.pt")
_IGNORED = ("rotary_emb.inv_freq",)
SPECULATORS_EAGLE3 = "eagle3"  # speculators_model_type of the EAGLE-3 layout (architecture Eagle3Speculator)
_KIND_NAMES = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3", "medusa": "Medusa", "unknown": "draft"}


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #


def _read_config(path: str) -> dict:
    """``config.json`` as a dict; a speculators-format config as the flat one vLLM builds from it."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} cannot be read as JSON ({e}).") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object.")
    if "speculators_model_type" in config:
        return _from_speculators(config)
    return config


# The fields a speculators EAGLE-3 config sets beside its transformer_layer_config, and their defaults
# (vLLM's vllm/transformers_utils/configs/speculators/algos.py, update_eagle3).
_SPECULATORS_EAGLE3_FIELDS = {"draft_vocab_size": None, "target_hidden_size": None, "norm_before_residual": True,
                              "eagle_aux_hidden_state_layer_ids": None}


def _from_speculators(config: dict) -> dict:
    """A speculators-format config as a flat LlamaConfig-like dict: its
    ``transformer_layer_config`` with the algorithm's own fields on top (for
    ``speculators_model_type: "eagle3"``), keeping the speculators'
    ``architectures`` and type so that :func:`detect` tells the layout."""
    layer = config.get("transformer_layer_config")
    # kept only when it is not an object, for _check_config to name
    flat = dict(layer) if isinstance(layer, dict) else {"transformer_layer_config": layer}
    flat["architectures"] = config.get("architectures")
    flat["speculators_model_type"] = config["speculators_model_type"]
    if config["speculators_model_type"] == SPECULATORS_EAGLE3:
        for key, default in _SPECULATORS_EAGLE3_FIELDS.items():
            value = config.get(key, default)
            if value is not None:
                flat[key] = value
    return flat


# Fields the loaders turn into shapes or switches: a string or a float here would be coerced (``int("96")``,
# ``int(96.5)``, ``bool("false")``) into a head that loads but is not the one the file describes.
_COUNT_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_hidden_layers", "vocab_size", "draft_vocab_size", "medusa_num_heads")
_POSITIVE_FIELDS = ("rms_norm_eps", "rope_theta")
_BOOL_FIELDS = ("bias", "qkv_bias", "attention_bias", "mlp_bias", "norm_before_residual")


def _config_problem(config: dict, required=()) -> Optional[str]:
    """What is wrong with the fields of ``config`` this module reads, or None."""
    for key in required:
        if config.get(key) is None:
            return f"lacks {key!r}"
    for key, value in config.items():
        if value is None:
            continue
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if key in _COUNT_FIELDS and not (is_int and value >= 1):
            return f"has {key} {value!r}; it must be a positive integer"
        if key == "medusa_num_layers" and not (is_int and value >= 0):
            return f"has medusa_num_layers {value!r}; it must be an integer >= 0"
        if key in _POSITIVE_FIELDS and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            return f"has {key} {value!r}; it must be a positive number"
        if key in _BOOL_FIELDS and not isinstance(value, bool):
            return f"has {key} {value!r}; it must be true or false"
    return None


def _check_config(config: dict, path: str, kind: str) -> None:
    required = ("vocab_size",) if kind in (EAGLE, EAGLE3) else ()
    problem = _config_problem(config, required)
    if "speculators_model_type" in config:  # the speculators format: the block's fields are nested
        if "transformer_layer_config" in config:
            layer = config["transformer_layer_config"]
            problem = ("needs transformer_layer_config, an object holding the head block's LlamaConfig fields "
                       f"(the speculators format); {'it has none' if layer is None else 'got a ' + type(layer).__name__}")
        elif problem is not None and problem.startswith("lacks"):
            problem += " in its transformer_layer_config"
    if problem is not None:
        raise ValueError(f"{os.path.join(path, 'config.json')} {problem}; fix config.json (the {_KIND_NAMES[kind]} "
                         "head's own, as its authors publish it) or fetch it again.")


def _weight_files(path: str, names=None) -> list[str]:
    """The head's weight files: ``names`` if given and present, else safetensors, else a pickle."""
    for name in names or ():
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    try:
        return hf.find_weight_files(path)
    except ValueError:
        pickles = [os.path.join(path, f) for f in _PICKLES if os.path.isfile(os.path.join(path, f))]
        index = os.path.join(path, "pytorch_model.bin.index.json")
        if not pickles and os.path.isfile(index):
            with open(index) as f:
                pickles = [os.path.join(path, x) for x in sorted(set(json.load(f)["weight_map"].values()))]
        if pickles:
            return pickles
        raise ValueError(f"{path} has no head weights: expected model.safetensors or pytorch_model.bin"
                         + (f" or one of {', '.join(names)}" if names else "") + ".") from None


def read_tensors(files: list[str]) -> dict[str, np.ndarray]:
    """Every tensor of ``files`` as NumPy (a pickle's bfloat16 as float32), by its name in the file.

    Raises:
      ValueError: a damaged file, or a pickle holding anything but tensors.
    """
    out = {}
    for file in files:
        if file.endswith(".safetensors"):
            with hf.open_safetensors(file, "flax") as f:
                for name in f.keys():
                    out[name] = np.asarray(hf.checked_reader(file, f.get_tensor)(name))
            continue
        for name, t in _load_pickle(file).items():
            t = t.detach()
            out[name] = (t.float() if t.is_floating_point() else t).numpy()
    return out


def _all_finite(x: np.ndarray, chunk: int = 1 << 24) -> bool:
    # in chunks: a shipped embedding table is ~0.5G entries, and a whole-array mask would double its memory
    flat = x.reshape(-1)
    return all(bool(np.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.size, chunk))


def _check_weights(tensors: dict[str, np.ndarray], what: str, indices=()) -> None:
    """Every tensor but ``indices`` must be floating point and finite.

    An integer matrix is a quantized release (its scales live elsewhere) and
    would load as garbage once cast; a NaN or inf would only surface as
    non-finite logits mid-decode.

    Raises:
      ValueError: naming the first offending tensor.
    """
    for name, x in tensors.items():
        if name in indices or name.endswith(_IGNORED):
            continue
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{what}: tensor {name!r} is {x.dtype}, not floating point; a quantized or converted "
                             "release is not loaded here: use the head's float16, bfloat16 or float32 weights.")
        if not _all_finite(x):
            raise ValueError(f"{what}: tensor {name!r} holds NaN or inf values; the checkpoint is damaged or was "
                             "saved after training diverged: download or export it again.")


def _load_pickle(file: str) -> dict:
    """A pickled state dict through torch's restricted unpickler (``weights_only=True``): tensors only."""
    import torch  # only for pickled weights

    if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 6):
        raise ValueError(f"{file}: reading pickled weights needs torch >= 2.6, whose weights_only unpickler "
                         f"has no known bypass (CVE-2025-32434); this is torch {torch.__version__}. Upgrade "
                         "torch or convert the head to safetensors.")
    try:
        try:  # zip-format files (torch.save's since 1.6) are mapped, not read whole
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for a non-tensor object, RuntimeError for a damaged zip
        raise ValueError(f"{file} cannot be read as a PyTorch state dict of tensors ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}).") from e
    if not isinstance(state, dict):
        raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors.")
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{file}: entry {name!r} is a {type(t).__name__}, not a tensor.")
    return state


def _tensor_names(files: list[str]) -> set[str]:
    names = set()
    for file in files:
        if file.endswith(".safetensors"):
            with hf.open_safetensors(file, "np") as f:
                names |= set(f.keys())
        else:
            names |= set(_load_pickle(file))
    return names


def detect(path: str) -> Optional[str]:
    """``"eagle"``, ``"eagle3"``, ``"medusa"``, or None for a directory that holds none of them.

    By ``config.json`` first (``architectures``, ``medusa_num_heads``,
    ``draft_vocab_size``), then, for a plain LlamaConfig, by the weights'
    names (``midlayer.*``: EAGLE-3; ``fc.weight`` without ``model.layers.*``: EAGLE-1/2).
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    if any(os.path.isfile(os.path.join(path, f)) for f in MEDUSA_FILES):
        return MEDUSA
    try:
        config = _read_config(path)
    except ValueError:
        return None
    if "medusa_num_heads" in config:
        return MEDUSA
    if "speculators_model_type" in config:  # the speculators format: its own type names the algorithm
        return EAGLE3 if config["speculators_model_type"] == SPECULATORS_EAGLE3 else UNKNOWN
    archs = config.get("architectures") or ()
    archs = [str(a) for a in archs] if isinstance(archs, (list, tuple)) else [str(archs)]
    if any(a in EAGLE3_ARCHITECTURES for a in archs):
        return EAGLE3
    if any(a in EAGLE_ARCHITECTURES for a in archs):
        return EAGLE
    if any(word in a.lower() for a in archs for word in ("eagle", "medusa", "speculator")):
        return UNKNOWN  # a draft head's name, but not a layout loaded here: refused by name
    if "draft_vocab_size" in config:  # EAGLE-3's own configs say LlamaForCausalLM
        return EAGLE3
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers > 2:  # a whole model (or a config the HF loader will name), not a head
        return None
    try:
        files = _weight_files(path)
        # a pickle is opened (by torch's restricted unpickler) only for what looks like an EAGLE head's
        # config (one layer, or EAGLE's own "bias" field); a plain model's pickles are left to the
        # Hugging Face loader, which refuses them unopened
        if not all(f.endswith(".safetensors") for f in files) and not (layers == 1 or "bias" in config):
            return None
        names = _tensor_names(files)
    except Exception:  # unreadable weights: not recognised here; the Hugging Face loader names the problem
        return None
    names = {_strip(n) for n in names}
    if any(n.startswith("midlayer.") for n in names):
        return EAGLE3
    if "fc.weight" in names and not any(n.startswith("model.layers.") for n in names):
        return EAGLE
    return None


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") and not name.startswith("model.layers.") else name


def load_published_head(path: str, dtype: Any = None, kind: Optional[str] = None) -> Model:
    """Loads the EAGLE-1/2, EAGLE-3 or Medusa head in ``path`` (``kind``: ``"eagle"``, ``"eagle3"``,
    ``"medusa"``; by default read from the directory).

    Pair it with its target (:func:`specjax.pair`), which lends it what the
    published code takes from the target (the embedding table, and for
    EAGLE-1/2 and Medusa the final norm and LM head).

    Raises:
      ValueError: not a published head, or a config or tensor that does not
        fit its layout (named).
    """
    if kind not in (None, EAGLE, EAGLE3, MEDUSA, UNKNOWN):
        raise ValueError(f"kind must be 'eagle', 'eagle3' or 'medusa' (or None: read from the directory); got {kind!r}.")
    found = detect(path)
    if kind is not None and found not in (None, UNKNOWN, kind):  # e.g. a Medusa directory given as an EAGLE head
        raise ValueError(f"{path} holds a head laid out as {_KIND_NAMES[found]}, not the {_KIND_NAMES[kind]} head "
                         f"kind={kind!r} asks for; pass kind={found!r} or None, or the directory of the head you meant.")
    kind = kind or found
    if kind is None:
        raise ValueError(f"{path} is not a published draft head layout specjax knows (EAGLE-1/2, EAGLE-3, Medusa).")
    return load_detected_head(path, dtype, kind)


def load_detected_head(path: str, dtype: Any, kind: str) -> Model:
    """:func:`load_published_head` for a ``kind`` that :func:`detect` has already read from ``path``."""
    config = _read_config(path)
    _check_config(config, path, kind)
    if kind == UNKNOWN:
        raise ValueError(
            f"{path}: config.json names architecture(s) {config.get('architectures')}"
            + (f" (speculators_model_type {config['speculators_model_type']!r})"
               if "speculators_model_type" in config else "")
            + f", a draft head layout specjax does not load; it loads EAGLE-1/2 ({', '.join(EAGLE_ARCHITECTURES)} or "
            f"a LlamaConfig with fc.weight), EAGLE-3 ({', '.join(EAGLE3_ARCHITECTURES)}, draft_vocab_size, or the "
            f"speculators format with speculators_model_type {SPECULATORS_EAGLE3!r}) and Medusa (medusa_num_heads).")
    load = {EAGLE: _load_eagle, EAGLE3: _load_eagle3, MEDUSA: _load_medusa}[kind]
    model = load(path, config, dtype)
    return model.replace(tokenizer=load_tokenizer(path))


# --------------------------------------------------------------------------- #
# EAGLE-1/2 and EAGLE-3
# --------------------------------------------------------------------------- #


def _head_config(config: dict, dtype, *, head_vocab_size: int, what: str) -> ModelConfig:
    """The head block's :class:`ModelConfig` from its LlamaConfig."""
    hfc = dict(config)
    # the head's block is a Llama block whatever family its config names (EAGLE's Qwen2 heads say
    # qkv_bias: biases on q, k, v, not o)
    if hfc.get("model_type") not in ("llama", "qwen2", "mistral") or "qkv_bias" in config:
        hfc["model_type"] = "llama"
    hf.check_required_fields(hfc, f"{what}: config.json")
    cfg = hf.from_hf_config(hfc, jnp.dtype(dtype).name if dtype is not None else None)
    if "qkv_bias" in config:
        cfg = cfg.replace(attention_bias=bool(config["qkv_bias"]), attention_out_bias=False)
    if config.get("target_hidden_size") not in (None, cfg.hidden_size):
        raise ValueError(f"{what}: config.json has target_hidden_size {config['target_hidden_size']} != hidden_size "
                         f"{cfg.hidden_size}; heads narrower than their target are not supported.")
    return cfg.replace(head_vocab_size=int(head_vocab_size), tie_word_embeddings=False, quantization=None,
                       dtype=cfg.dtype)


def _take(tensors: dict, name: str, shape, what: str, transpose: bool = False) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"{what}: the checkpoint lacks tensor {name!r}.")
    x = tensors.pop(name)
    x = x.T if transpose else x
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{what}: tensor {name!r} has shape {tuple(x.T.shape if transpose else x.shape)}, expected "
                         f"{tuple(reversed(shape)) if transpose else tuple(shape)}.")
    return x


def _block_params(tensors: dict, prefix: str, cfg: ModelConfig, what: str, *, in_width: int,
                  norms: dict[str, str]) -> Params:
    """A Llama block's params from HF names under ``prefix`` (``norms``: HF norm name -> specjax name)."""
    h, n, kv, d, inner = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size

    def dense(name, fan_in, fan_out, bias):
        out = {"kernel": _take(tensors, f"{prefix}{name}.weight", (fan_in, fan_out), what, transpose=True)}
        if bias:
            out["bias"] = _take(tensors, f"{prefix}{name}.bias", (fan_out,), what)
        return out

    attn = {"q": dense("self_attn.q_proj", in_width, n * d, cfg.attention_bias),
            "k": dense("self_attn.k_proj", in_width, kv * d, cfg.attention_bias),
            "v": dense("self_attn.v_proj", in_width, kv * d, cfg.attention_bias),
            "o": dense("self_attn.o_proj", n * d, h, cfg.attention_out_bias)}
    mlp = {"gate": dense("mlp.gate_proj", h, inner, cfg.mlp_bias), "up": dense("mlp.up_proj", h, inner, cfg.mlp_bias),
           "down": dense("mlp.down_proj", inner, h, cfg.mlp_bias)}
    block = {"attn": attn, "mlp": mlp}
    for hf_name, name in norms.items():
        block[name] = {"scale": _take(tensors, f"{prefix}{hf_name}.weight", (h,), what)}
    return block


def _check_consumed(tensors: dict, what: str) -> None:
    left = sorted(n for n in tensors if not n.endswith(_IGNORED))
    if left:
        raise ValueError(f"{what}: the checkpoint has tensors this layout does not use: {', '.join(left[:8])}"
                         + (" ..." if len(left) > 8 else "") + ".")


def _cast(params: Params, cfg: ModelConfig) -> Params:
    dtype = jnp.dtype(cfg.dtype)
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, jnp.int32) if np.issubdtype(np.asarray(x).dtype, np.integer) else
        jnp.asarray(x, dtype), params)


def _own_embedding(tensors: dict, cfg: ModelConfig, params: Params, what: str) -> bool:
    """Keeps a shipped ``embed_tokens.weight`` (the published code loads it over the target's)."""
    if "embed_tokens.weight" not in tensors:
        return False
    params[EMBED_PATH[0]] = {EMBED_PATH[1]: _take(tensors, "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size),
                                                  what)}
    return True


def _load_eagle(path: str, config: dict, dtype) -> Model:
    what = f"EAGLE-1/2 head {path}"
    tensors = {_strip(k): v for k, v in read_tensors(_weight_files(path)).items()}
    _check_weights(tensors, what)
    cfg = _head_config(config, dtype or _file_dtype(config), head_vocab_size=int(config["vocab_size"]), what=what)
    h = cfg.hidden_size
    params: Params = {"fuse": {"kernel": _take(tensors, "fc.weight", (2 * h, h), what, transpose=True)}}
    bias = tensors.pop("fc.bias", None)
    if bias is None and config.get("bias", True) is not False:
        raise ValueError(f"{what}: the checkpoint lacks tensor 'fc.bias' (its config does not say bias: false).")
    params["fuse"]["bias"] = np.zeros((h,), np.float32) if bias is None else _take({"fc.bias": bias}, "fc.bias",
                                                                                    (h,), what)
    for i in range(cfg.num_layers):
        norms = {"post_attention_layernorm": "mlp_norm"}
        if i > 0:
            norms["input_layernorm"] = "attn_norm"
        params[f"layer_{i}"] = _block_params(tensors, f"layers.{i}.", cfg, what, in_width=h, norms=norms)
    own = _own_embedding(tensors, cfg, params, what)
    _check_consumed(tensors, what)
    module = FeatureHead(cfg, feature_layers=(-1,), variant="eagle", borrows_embedding=not own)
    return Model(params=_cast(params, cfg), module=module, tokenizer=None, chat_template=None)


def eagle3_feature_layers(config: dict) -> tuple[int, ...]:
    """The target blocks an EAGLE-3 head's ``config.json`` names, or ``()`` for EAGLE-3's defaults.

    Two conventions name them. ``eagle_config.eagle_aux_hidden_state_layer_ids``
    (SpecForge's heads) names block *outputs*, 0-based: SGLang captures the
    state entering layer ``id + 1`` for them (``set_eagle3_layers_to_capture``),
    which is specjax's block ``id``. A top-level ``eagle_aux_hidden_state_layer_ids``
    (the speculators format, as vLLM reads it) names the states *entering*
    layers: vLLM captures ``hidden_states + residual`` before layer ``id``,
    specjax's block ``id - 1`` (``id`` 0, the embeddings, is not a block
    output and is refused). The defaults
    (:func:`~specjax._src.models.feature_head_build.eagle3_default_layers`) are fixed
    by pairing, from the target's depth.
    """
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ValueError("config.json: eagle_config must be an object.")
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError("config.json: an EAGLE-3 head without auxiliary hidden states (use_aux_hidden_state: "
                         "false) is not supported; specjax loads the three-block fusion.")
    entering = config.get("eagle_aux_hidden_state_layer_ids")
    if entering is not None:
        if eagle_config.get("eagle_aux_hidden_state_layer_ids") is not None:
            raise ValueError("config.json names eagle_aux_hidden_state_layer_ids twice, at the top level (states "
                             "entering layers, vLLM's) and in eagle_config (block outputs, SpecForge's); keep one.")
        if (not isinstance(entering, list) or len(entering) != 3
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in entering)
                or len(set(entering)) != 3):
            raise ValueError("config.json: a top-level eagle_aux_hidden_state_layer_ids names the states entering "
                             f"three distinct target layers, ids >= 1 (0 would be the embeddings); got {entering!r}.")
        return tuple(i - 1 for i in entering)
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return ()
    if (not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) and i >= 0 for i in ids)
            or len(set(ids)) != 3):
        raise ValueError(f"config.json: eagle_aux_hidden_state_layer_ids must be three distinct block indices >= 0; "
                         f"got {ids!r}.")
    return tuple(ids)


def _load_eagle3(path: str, config: dict, dtype) -> Model:
    what = f"EAGLE-3 head {path}"
    tensors = {_strip(k): v for k, v in read_tensors(_weight_files(path)).items()}
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    _check_weights(tensors, what, indices=("d2t", "t2d"))
    vocab = int(config["vocab_size"])
    lm_head = tensors.get("lm_head.weight")
    if lm_head is None or lm_head.ndim != 2:
        raise ValueError(f"{what}: the checkpoint lacks a 2-D tensor 'lm_head.weight' [draft_vocab, H].")
    draft_vocab = lm_head.shape[0]
    if config.get("draft_vocab_size") not in (None, draft_vocab):
        raise ValueError(f"{what}: lm_head.weight has {draft_vocab} rows but config.json says draft_vocab_size "
                         f"{config['draft_vocab_size']}.")
    if not 1 <= draft_vocab <= vocab:
        raise ValueError(f"{what}: lm_head.weight scores {draft_vocab} draft tokens but config.json's vocab_size (the "
                         f"target's vocabulary) is {vocab}; a draft vocabulary is a non-empty subset of its target's, "
                         "so the config and the weights belong to different heads.")
    cfg = _head_config(config, dtype or _file_dtype(config), head_vocab_size=draft_vocab, what=what)
    layers = eagle3_feature_layers(config)
    h = cfg.hidden_size
    params: Params = {"reduce": {"kernel": _take(tensors, "fc.weight", (3 * h, h), what, transpose=True)}}
    params["layer_0"] = _block_params(
        tensors, "midlayer.", cfg, what, in_width=2 * h,
        norms={"input_layernorm": "attn_norm", "hidden_norm": "hidden_norm", "post_attention_layernorm": "mlp_norm"})
    for i in range(1, cfg.num_layers):  # vLLM's later layers: standard blocks over the stream
        params[f"layer_{i}"] = _block_params(tensors, f"layers.{i}.", cfg, what, in_width=h,
                                             norms={"input_layernorm": "attn_norm",
                                                    "post_attention_layernorm": "mlp_norm"})
    params["final_norm"] = {"scale": _take(tensors, "norm.weight", (h,), what)}
    params["lm_head"] = _take(tensors, "lm_head.weight", (h, draft_vocab), what, transpose=True)
    params["head_vocab_ids"] = draft_to_target_ids(tensors.pop("d2t", None), tensors.pop("t2d", None), draft_vocab,
                                                   vocab, what)
    own = _own_embedding(tensors, cfg, params, what)
    _check_consumed(tensors, what)
    variant = "eagle3_norm_before_residual" if config.get("norm_before_residual") else "eagle3"
    module = FeatureHead(cfg, feature_layers=layers, variant=variant, borrows_embedding=not own)
    return Model(params=_cast(params, cfg), module=module, tokenizer=None, chat_template=None)


def draft_to_target_ids(d2t, t2d, draft_vocab: int, vocab: int, what: str = "EAGLE-3 head") -> np.ndarray:
    """``[draft_vocab]`` int32: the target id of each draft id, ``i + d2t[i]`` (cnets.py).

    Without ``d2t`` the draft vocabulary must be the target's. ``t2d`` (a
    mask over the target vocabulary), when given, must mark exactly these ids.

    Raises:
      ValueError: a ``d2t`` whose length is not the LM head's, ids outside the
        target vocabulary or repeated, or a ``t2d`` that disagrees.
    """
    if draft_vocab < 1:
        raise ValueError(f"{what}: the draft vocabulary is empty (lm_head.weight has no rows).")
    if d2t is None:
        if draft_vocab != vocab:
            raise ValueError(f"{what}: the draft vocabulary ({draft_vocab}) is not the target's ({vocab}) and "
                             "there is no d2t to map it.")
        ids = np.arange(vocab)
    else:
        d2t = np.asarray(d2t)
        if not np.issubdtype(d2t.dtype, np.integer) or d2t.ndim != 1:
            raise ValueError(f"{what}: d2t must be a 1-D integer tensor (target id i + d2t[i] for draft id i); "
                             f"got {d2t.dtype} of shape {d2t.shape}.")
        if d2t.shape[0] != draft_vocab:
            raise ValueError(f"{what}: d2t has {d2t.shape[0]} entries but lm_head.weight scores {draft_vocab} draft "
                             "tokens; they must agree.")
        ids = np.arange(draft_vocab) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{what}: d2t maps draft ids outside the target vocabulary [0, {vocab}).")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{what}: d2t maps two draft ids to one target id.")
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.ndim != 1 or t2d.shape[0] != vocab:
            raise ValueError(f"{what}: t2d has shape {t2d.shape} but must be a mask over the target vocabulary, "
                             f"[{vocab}]; it belongs to a head for another target.")
        t2d = t2d.astype(bool)
        if t2d.sum() != ids.size or not t2d[ids].all():
            raise ValueError(f"{what}: t2d (a mask over the target vocabulary) does not mark exactly the ids d2t "
                             f"maps to (it marks {int(t2d.sum())}, d2t maps {ids.size}).")
    return ids.astype(np.int32)


def _file_dtype(config: dict) -> str:
    """A head's compute dtype: its ``torch_dtype``, float32 where NumPy or the CPU would round it."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return {"float16": "float32", "bfloat16": "bfloat16"}.get(name, "float32")


# --------------------------------------------------------------------------- #
# Medusa
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class MedusaHead:
    """Medusa's heads as a feature-reading draft (the static half; hashable).

    Head ``k`` reads the target's last hidden state after its final norm at
    position ``i`` and predicts the token ``k + 2`` positions ahead: through
    ``num_res_layers`` ResBlocks ``x + SiLU(W x + b)`` and its own LM head
    (FasterDecoding/Medusa ``medusa_model.py``). It follows the feature-head
    protocol the engine drives (:class:`FeatureHead`): the feature it is
    handed carries, in one extra channel, how many draft steps led to it,
    so draft step ``k`` (a chain's ``k``-th token, a tree's depth ``k``) uses
    head ``k``; the feature itself is handed back unchanged, since every
    Medusa head reads the same target state. Steps past the last head reuse
    the last head (lossless all the same; such drafts are rarely accepted).

    Its params are ``res_kernel [N, L, H, H]`` (``x @ W``), ``res_bias [N, L, H]``,
    ``lm_head [N, H, V]``, and from pairing ``target_norm.scale [H]``.
    """

    hidden_size: int
    vocab_size: int
    num_heads: int
    num_res_layers: int = 1
    norm_eps: float = 1e-6
    dtype: str = "float32"

    feature_layers = (-1,)
    reads_target_features = True
    supports_logits_at = True
    supports_trees = True
    num_layers = 0

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> KVCache:
        """No attention, so no buffers: only the lengths the engine rolls back."""
        del max_length, dtype
        return KVCache(keys=(), values=(), lengths=jnp.zeros((batch_size,), jnp.int32))

    def target_features(self, params: Params, hidden: Array) -> Array:
        """``[B, T, H]`` target last-block outputs -> ``[B, T, H + 1]``: normed by the
        target's final norm, step channel 0."""
        if TARGET_NORM not in params:
            raise ValueError("This Medusa head reads its target's final norm: pair it, specjax.pair(target, head).")
        x = rms_norm(hidden, params[TARGET_NORM]["scale"], self.norm_eps)
        return jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)

    def apply(self, params: Params, tokens: Array, cache: Optional[KVCache] = None, *, features: Array,
              hidden_layers=(), logits_at: Optional[Array] = None, tree_parents=None, tree_offset: int = 0) -> LMOutput:
        """Logits of head ``step`` (the features' last channel; one step per call) on each position's feature.

        ``tokens`` only set the shape (Medusa's drafts do not read the
        tokens drafted before them). Returns ``hidden = (features with step + 1,)``.
        """
        del hidden_layers, tree_parents, tree_offset
        tokens, features = jnp.asarray(tokens), jnp.asarray(features, jnp.float32)
        h = self.hidden_size
        if tokens.ndim != 2 or features.shape != tokens.shape + (h + 1,):
            raise ValueError(f"MedusaHead.apply: tokens must be [B, T] and features [B, T, {h + 1}] (the target's "
                             f"normed feature and a step channel); got {tokens.shape} and {features.shape}.")
        x, step = features[..., :h], features[..., h]
        if logits_at is not None:
            x = jnp.take_along_axis(x, jnp.asarray(logits_at, jnp.int32)[:, None, None], axis=1)
        k = jnp.clip(jnp.max(step).astype(jnp.int32), 0, self.num_heads - 1)  # the engine's calls share one step
        logits = _medusa_one(params, x, k, self.num_res_layers)
        new_cache = None if cache is None else cache.replace(lengths=cache.lengths + tokens.shape[1])
        hidden = jnp.concatenate([features[..., :h], step[..., None] + 1.0], axis=-1)
        return LMOutput(logits=logits, hidden=(hidden,), cache=new_cache)

    def borrow_from_target(self, head: Model, target: Model) -> Model:
        """At pairing: the target's final norm (Medusa reads the normed state) and its eps."""
        tcfg = getattr(target.module, "config", None)
        if tcfg is None or tcfg.is_gemma or tcfg.is_gpt2:
            raise ValueError("A Medusa head reads a Llama-family target's final norm; this target has none.")
        if tcfg.vocab_size != self.vocab_size:
            raise ValueError(f"This Medusa head scores {self.vocab_size} tokens but the target's vocabulary has "
                             f"{tcfg.vocab_size}; pair a head with the target it was trained on.")
        params = {**head.params, TARGET_NORM: {"scale": target.params["final_norm"]["scale"]}}
        return head.replace(params=params, module=dataclasses.replace(self, norm_eps=tcfg.norm_eps))


def _medusa_one(params: Params, x: Array, k: Array, num_res_layers: int) -> Array:
    """Head ``k`` (traced) on ``x [..., H]`` -> float32 logits ``[..., V]``."""
    take = lambda a: jax.lax.dynamic_index_in_dim(a, k, axis=0, keepdims=False)  # noqa: E731
    kernel, bias, head = take(params["res_kernel"]), take(params["res_bias"]), take(params["lm_head"])
    x = x.astype(kernel.dtype)
    for j in range(num_res_layers):
        x = x + jax.nn.silu(x @ kernel[j] + bias[j])
    return jnp.einsum("...h,hv->...v", x, head, preferred_element_type=jnp.float32)


def medusa_logits(params: Params, feature: Array) -> Array:
    """Every Medusa head on the target's normed last hidden state: ``[..., H] -> [..., N, V]`` float32.

    Row ``k`` scores the token ``k + 2`` positions after the feature's own
    (the target's LM head scores the one after it).
    """
    n, layers = params["res_kernel"].shape[:2]
    feature, h = jnp.asarray(feature), params["lm_head"].shape[1]
    if feature.shape[-1:] != (h,):
        raise ValueError(f"medusa_logits: feature must be [..., {h}] (the target's normed last hidden state); got "
                         f"shape {feature.shape}.")
    return jnp.stack([_medusa_one(params, feature, jnp.int32(k), layers) for k in range(n)], axis=-2)


_MEDUSA_NAME = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


def _load_medusa(path: str, config: dict, dtype) -> Model:
    what = f"Medusa head {path}"
    files = _weight_files(path, MEDUSA_FILES)
    tensors = read_tensors(files)
    if not any(os.path.basename(f) in MEDUSA_FILES for f in files):  # a whole Medusa-2 model: its heads only
        tensors = {k: v for k, v in tensors.items() if k.startswith("medusa_head.")}
    _check_weights(tensors, what)
    entries: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    names: dict[tuple[int, int, str], str] = {}
    for name, value in tensors.items():
        m = _MEDUSA_NAME.match(name)
        if m is None:
            raise ValueError(f"{what}: tensor {name!r} is not a Medusa head tensor ({{i}}.{{j}}.linear.weight/bias "
                             "or {i}.{n}.weight).")
        key = (int(m.group(1)), int(m.group(2)), m.group(3))
        if key in names:  # "0.0.weight" and "0.0.linear.weight" would both fill one slot
            raise ValueError(f"{what}: tensors {names[key]!r} and {name!r} are one parameter twice.")
        names[key] = name
        entries.setdefault(key[:2], {})[key[2]] = value
    if not entries:
        raise ValueError(f"{what}: no Medusa head tensors ({{i}}.{{j}}.linear.weight/bias, {{i}}.{{n}}.weight) in "
                         f"{', '.join(os.path.basename(f) for f in files)}; if this is an EAGLE head, its config.json "
                         "should not name medusa_num_heads.")
    num_heads = max(i for i, _ in entries) + 1
    lm_index = max(j for _, j in entries)  # each head's last module is its LM head
    declared = config.get("medusa_num_heads")
    if declared is not None and declared != num_heads:
        raise ValueError(f"{what}: config.json says medusa_num_heads {declared} but the weights hold {num_heads} "
                         "heads; the checkpoint is incomplete or its config belongs to another.")
    num_res = lm_index if config.get("medusa_num_layers") is None else config["medusa_num_layers"]
    if num_res != lm_index:
        raise ValueError(f"{what}: config.json says medusa_num_layers {num_res} but the heads hold {lm_index} "
                         "ResBlocks before their LM head.")
    lm0 = entries.get((0, lm_index), {}).get("weight")
    if lm0 is None or lm0.ndim != 2:
        raise ValueError(f"{what}: head 0 has no LM head tensor '0.{lm_index}.weight'.")
    vocab, h = lm0.shape
    kernels, biases, heads = [], [], []
    for i in range(num_heads):
        ks, bs = [], []
        for j in range(num_res):
            e = entries.get((i, j), {})
            if "weight" not in e or "bias" not in e:
                raise ValueError(f"{what}: head {i} lacks '{i}.{j}.linear.weight' or its bias.")
            if e["weight"].shape != (h, h) or e["bias"].shape != (h,):
                raise ValueError(f"{what}: '{i}.{j}.linear' has weight {e['weight'].shape} and bias "
                                 f"{e['bias'].shape}, expected {(h, h)} and {(h,)}.")
            ks.append(e["weight"].T)
            bs.append(e["bias"])
        lm = entries.get((i, num_res), {}).get("weight")
        if lm is None or lm.shape != (vocab, h):
            raise ValueError(f"{what}: head {i}'s LM head '{i}.{num_res}.weight' is "
                             f"{None if lm is None else lm.shape}, expected {(vocab, h)}.")
        kernels.append(np.stack(ks) if ks else np.zeros((0, h, h), np.float32))
        biases.append(np.stack(bs) if bs else np.zeros((0, h), np.float32))
        heads.append(lm.T)
    used = {(i, j, f) for i in range(num_heads) for j in range(num_res) for f in ("weight", "bias")}
    used |= {(i, num_res, "weight") for i in range(num_heads)}
    # Medusa's LM heads are bias-free Linears: a left-over tensor is another layout's, not one to drop
    _check_consumed({names[k]: None for k in names if k not in used}, what)
    if config.get("hidden_size") not in (None, h) or config.get("vocab_size") not in (None, vocab):
        raise ValueError(f"{what}: config.json's hidden_size/vocab_size ({config.get('hidden_size')}, "
                         f"{config.get('vocab_size')}) disagree with the heads' ({h}, {vocab}).")
    dt = jnp.dtype(dtype or _file_dtype(config))
    params = {"res_kernel": jnp.asarray(np.stack(kernels), dt), "res_bias": jnp.asarray(np.stack(biases), dt),
              "lm_head": jnp.asarray(np.stack(heads), dt)}
    module = MedusaHead(hidden_size=h, vocab_size=vocab, num_heads=num_heads, num_res_layers=num_res, dtype=dt.name)
    return Model(params=params, module=module, tokenizer=None, chat_template=None)


def is_medusa_head(module) -> bool:
    return isinstance(module, MedusaHead)
