"""A feature head built from its target, and reshaped after training.

* :func:`init_from_target`: a head to train, started from its target's last blocks, final norm and LM
  head rows (:func:`head_config` is its block config);
* :func:`attach_embedding`: the head with the target's embedding table (and, for EAGLE-1/2 heads, its
  final norm and LM head), as :func:`specjax.pair` does;
* :func:`with_feature_layers`, :func:`with_num_layers`, :func:`with_head_vocab`: a trained head grown to
  read more target blocks, grown by blocks, or narrowed to fewer tokens, each computing what it did.

The head itself (its Flax module, :class:`~specjax._src.models.feature_head.FeatureHead`) and its files
are in :mod:`specjax._src.models.feature_head`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.kernels import quant
from specjax._src.foundation.checks import check_positive_int
from specjax._src.models.lm import Array, Model, Params
from specjax._src.models.config import ModelConfig
from specjax._src.models.feature_head import BORROWED_HEAD, EMBED_PATH, TARGET_NORM, FeatureHead, require_head


def head_config(target_config: ModelConfig, *, head_vocab_size: int, num_layers: int = 1) -> ModelConfig:
    """A head's block config in its target's width (same attention shape, MLP and RoPE)."""
    if target_config.is_gpt2:
        raise ValueError("A FeatureHead needs a rotary (Llama-family) target; GPT-2 layouts are not supported.")
    return target_config.replace(
        num_layers=num_layers,
        head_vocab_size=int(head_vocab_size),
        tie_word_embeddings=False,
        quantization=None,
        layer_types=_last_layer_kinds(target_config.layer_types, num_layers),
    )


def _last_layer_kinds(layer_types: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """The attention kinds of ``num_layers`` head blocks copied from the last of blocks of
    ``layer_types`` (window and rope base: Gemma 2/3 interleave them); blocks beyond those
    copy the top one, so they repeat its kind. ``()`` (every block alike) stays ``()``."""
    if not layer_types:
        return ()
    return layer_types[-num_layers:] + layer_types[-1:] * (num_layers - len(layer_types))


def attach_embedding(head: Model, target: Model) -> Model:
    """The head with its target's embedding table in its params (the same array).

    A head that shipped its own table (``borrows_embedding=False``) keeps it.
    An ``"eagle"`` head also borrows the target's final norm (its features
    are the target's normed last hidden state) and LM head; an ``"eagle3"``
    head without ``feature_layers`` gets EAGLE-3's default blocks for this
    target (:func:`eagle3_default_layers`). A module with its own
    ``borrow_from_target(head, target)`` (a Medusa head) is handed to it.

    Raises:
      ValueError: the target is not a Decoder with an ``embed`` table of the
        head's shape, or lacks what the head's variant borrows.
    """
    borrow = getattr(head.module, "borrow_from_target", None)
    if borrow is not None:
        return borrow(head, target)
    table = target.params.get(EMBED_PATH[0], {}).get(EMBED_PATH[1]) if isinstance(target.params, dict) else None
    want = (head.module.config.vocab_size, head.module.config.hidden_size)
    if table is None or quant.matrix_shape(table) != want:
        got = None if table is None else quant.matrix_shape(table)
        raise ValueError(
            f"The feature head needs its target's embedding table of shape {want}; the target has {got}. "
            "Pair a head with the target it was trained on."
        )
    params = dict(head.params)
    module = head.module
    if getattr(module, "borrows_embedding", True):
        params[EMBED_PATH[0]] = {EMBED_PATH[1]: table}
    variant = getattr(module, "variant", "specjax")
    if variant == "eagle":
        for name in BORROWED_HEAD:  # a head paired before: its last target's head goes
            params.pop(name, None)
        params.update(_borrowed_from_target(target))
    if variant.startswith("eagle3") and not module.feature_layers:
        module = dataclasses.replace(module, feature_layers=eagle3_default_layers(target.module.num_layers))
    return head.replace(params=params, module=module)


def eagle3_default_layers(num_layers: int) -> tuple[int, ...]:
    """The target blocks whose outputs EAGLE-3 reads by default, as specjax indexes them.

    The published code captures the hidden state *entering* layers
    ``(2, L // 2, L - 3)`` (SafeAILab/EAGLE modeling_llama_kv.py, vLLM's and
    SGLang's defaults), i.e. the outputs of blocks ``(1, L // 2 - 1, L - 4)``.

    Raises:
      ValueError: a target too shallow for three distinct blocks.
    """
    layers = (1, num_layers // 2 - 1, num_layers - 4)
    if num_layers < 7 or len(set(layers)) != 3:
        raise ValueError(
            f"EAGLE-3's default feature layers need a target of at least 7 blocks; this one has "
            f"{num_layers}. Give the head eagle_config.eagle_aux_hidden_state_layer_ids."
        )
    return layers


def _borrowed_from_target(target: Model) -> Params:
    """An EAGLE-1/2 head's borrowed params: the target's final norm and LM head."""
    tcfg = target.module.config
    if tcfg.is_gemma or tcfg.is_gpt2 or tcfg.has_reduced_head or tcfg.final_logit_softcapping is not None:
        raise ValueError(
            "An EAGLE-1/2 head reads a Llama-family target's final norm and full LM head; this "
            f"target ({tcfg.model_type}) has another kind."
        )
    tp = target.params
    out = {TARGET_NORM: {"scale": tp["final_norm"]["scale"]}}
    if tcfg.tie_word_embeddings:
        out["lm_head_table"] = tp[EMBED_PATH[0]][EMBED_PATH[1]]
    else:
        out["lm_head"] = tp["lm_head"]
    return out


def init_from_target(target: Model, key: Array, head_vocab_ids, *, num_layers: int = 1, feature_layers=(-1,)) -> Model:
    """A head to train, started from its target.

    The block copies the target's last block, the final norm the target's,
    the LM head the target's (tied) embedding rows of ``head_vocab_ids``, and
    ``fuse`` passes the normalised feature through (identity on that half,
    small noise on the token half): before training the head already reads
    ``f_i`` the way the target's top does. With several ``feature_layers``
    (which must include ``-1``), ``reduce`` starts by passing the last block
    through (:func:`with_feature_layers`).
    """
    ids = np.asarray(head_vocab_ids, np.int32)
    tcfg = target.module.config
    cfg = head_config(tcfg, head_vocab_size=len(ids), num_layers=num_layers)
    module = FeatureHead(cfg)
    params = jax.tree_util.tree_map(lambda x: x, module.init(key))
    tp = target.params
    dtype = jnp.dtype(cfg.dtype)
    for i in range(num_layers):
        params[f"layer_{i}"] = jax.tree_util.tree_map(jnp.asarray, tp[f"layer_{tcfg.num_layers - num_layers + i}"])
    params["final_norm"] = jax.tree_util.tree_map(jnp.asarray, tp["final_norm"])
    if tcfg.quantization is not None:  # the head starts from (and trains) float weights
        tp = quant.dequantize_params(tp, dtype)
    table = tp["embed"]["embedding"] if tcfg.tie_word_embeddings else tp["lm_head"].T
    params["lm_head"] = jnp.asarray(table)[ids].T.astype(dtype)
    params["head_vocab_ids"] = jnp.asarray(ids)
    h = cfg.hidden_size
    fuse = params["fuse"]["kernel"].at[h:].set(jnp.eye(h, dtype=dtype))
    params["fuse"] = {"kernel": fuse}
    head = attach_embedding(
        Model(params=params, module=module, tokenizer=target.tokenizer, chat_template=target.chat_template), target
    )
    return with_feature_layers(head, feature_layers)


def with_feature_layers(head: Model, feature_layers) -> Model:
    """The head reading the target blocks ``feature_layers``, computing what it computed before.

    A one-block head (``feature_layers == (L,)``) gets a ``reduce`` kernel that
    passes block ``L``'s normalised output through and gives the other blocks
    zero weight, which the head's ``feature_norm`` makes the same input as
    before: training starts from the head as it is, and learns how much the
    other blocks add. Used to grow a trained head into a multi-block one.

    Raises:
      ValueError: the head already mixes several blocks, or ``L`` is not among
        ``feature_layers``.
    """
    require_head(head, "with_feature_layers")
    layers = _block_indices(feature_layers, "with_feature_layers")
    module = head.module
    if layers == module.feature_layers:
        return head
    _check_own_variant(module, "with_feature_layers")
    if len(module.feature_layers) != 1 or module.feature_layers[0] not in layers:
        raise ValueError(
            f"with_feature_layers: a head reading blocks {module.feature_layers} cannot be grown into one "
            f"reading {layers}; it must read one block, and that block must be among the new ones."
        )
    cfg = module.config
    h = cfg.hidden_size
    kernel = np.zeros((len(layers) * h, h), np.float32)
    at = layers.index(module.feature_layers[0])
    kernel[at * h : (at + 1) * h] = np.eye(h, dtype=np.float32)
    params = {**head.params, "reduce": {"kernel": jnp.asarray(kernel, jnp.dtype(cfg.dtype))}}
    return head.replace(params=params, module=FeatureHead(cfg, feature_layers=layers))


def with_num_layers(head: Model, num_layers: int) -> Model:
    """The head with ``num_layers`` blocks, computing what it computed before.

    New blocks go on top, copies of the head's last block with their output
    projections (``attn/o``, ``mlp/down``) set to zero: each starts as the
    identity on the residual stream, so the grown head drafts exactly as the
    old one did, and training it only has to learn what a deeper head adds.
    The zero projections get gradients at once (their inputs are not zero),
    and the rest of each block follows after the first update.

    Raises:
      ValueError: ``num_layers`` is not an integer, or fewer than the head's blocks.
    """
    require_head(head, "with_num_layers")
    cfg = head.module.config
    num_layers = check_positive_int("with_num_layers: num_layers", num_layers)
    _check_own_variant(head.module, "with_num_layers")
    if num_layers < cfg.num_layers:
        raise ValueError(
            f"with_num_layers: the head has {cfg.num_layers} blocks; it can grow, not shrink to {num_layers}."
        )
    if num_layers == cfg.num_layers:
        return head
    if cfg.quantization is not None:  # zero projections in a quantized layout would train nothing
        raise ValueError(
            f"with_num_layers: this head's matrices are quantized ({cfg.quantization}); grow its float "
            "version: heads.with_num_layers(specjax.dequantize(head), num_layers)."
        )
    top = head.params[f"layer_{cfg.num_layers - 1}"]
    params = dict(head.params)
    for i in range(cfg.num_layers, num_layers):
        block = jax.tree_util.tree_map(jnp.copy, top)
        block["attn"]["o"] = {"kernel": jnp.zeros_like(top["attn"]["o"]["kernel"])}
        block["mlp"]["down"] = {"kernel": jnp.zeros_like(top["mlp"]["down"]["kernel"])}
        params[f"layer_{i}"] = block
    module = FeatureHead(
        cfg.replace(num_layers=num_layers, layer_types=_last_layer_kinds(cfg.layer_types, num_layers)),
        feature_layers=head.module.feature_layers,
    )
    return head.replace(params=params, module=module)


def with_head_vocab(head: Model, ids) -> Model:
    """The head drafting over ``ids`` only: a subset of its reduced vocabulary.

    Its LM head keeps the columns of ``ids`` (and ``head_vocab_ids`` becomes
    ``ids``, sorted), so each step costs less: the LM head is the larger part
    of a one-block head. Every id keeps the logit it had; the softmax runs
    over fewer of them, so a token outside ``ids`` is never drafted, which
    stays lossless (verification's residual covers it). Choose ``ids`` by
    frequency: on SmolLM2-135M's answers, the 4,096 most frequent of the
    draft vocabulary's 8,192 ids hold 94.6% of the target's greedy tokens
    (8,192: 97.0%), and the shipped head is narrowed so (its MODEL_CARD.md).

    Raises:
      ValueError: an id that is not in the head's vocabulary, a repeated id, or no id.
    """
    require_head(head, "with_head_vocab")
    if head.module.variant == "eagle":
        raise ValueError(
            "with_head_vocab: an EAGLE-1/2 head scores with its target's full LM head; it has no "
            "reduced vocabulary to narrow."
        )
    old = np.asarray(jax.device_get(head.params["head_vocab_ids"]))
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"with_head_vocab: ids must be a non-empty 1-D array of token ids; got shape {ids.shape}, "
            f"dtype {ids.dtype}."
        )
    ids = np.sort(ids)
    if np.any(ids[1:] == ids[:-1]):
        raise ValueError("with_head_vocab: ids repeat a token; pass each id once.")
    order = np.argsort(old)
    at = np.searchsorted(old, ids, sorter=order)
    cols = order[np.minimum(at, old.size - 1)]
    missing = ids[old[cols] != ids]
    if missing.size:
        raise ValueError(
            f"with_head_vocab: {missing.size} ids are not in the head's vocabulary (e.g. "
            f"{missing[:5].tolist()}); the head can only drop tokens it has."
        )
    lm_head = head.params["lm_head"]  # [H, V'] float, or quantized with the ids on the first axis
    lm_head = jax.tree.map(lambda a: a[cols], lm_head) if quant.is_quantized(lm_head) else lm_head[:, cols]
    params = {**head.params, "lm_head": lm_head, "head_vocab_ids": jnp.asarray(ids, jnp.int32)}
    cfg = head.module.config.replace(head_vocab_size=int(ids.size))
    return head.replace(params=params, module=dataclasses.replace(head.module, config=cfg))


def _block_indices(feature_layers, what: str) -> tuple[int, ...]:
    """``feature_layers`` as distinct int block indices, or a clear error."""
    try:
        layers = tuple(feature_layers)
    except TypeError:
        layers = None
    if (
        not layers
        or any(isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) for x in layers)
        or len(set(layers)) != len(layers)
    ):
        raise ValueError(
            f"{what}: feature_layers must be distinct int block indices such as (2, 15, -1); got {feature_layers!r}."
        )
    return tuple(int(x) for x in layers)


def _check_own_variant(module, what: str) -> None:
    if getattr(module, "variant", "specjax") != "specjax":
        raise ValueError(f"{what}: only specjax's own heads grow; this is a published {module.variant!r} head.")
