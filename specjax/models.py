"""The decoder's parts, for code that writes its own forward pass, loss or checkpoint.

Using a model needs only :func:`specjax.load`, :class:`specjax.Decoder` and
:mod:`specjax.heads`. Training one often needs a little more: the Flax module
behind :class:`specjax.Decoder` (to ask for the reduced head's logits without
scattering them to the vocabulary), the rotary-embedding and attention
functions it is made of (a training forward that reshapes differently must
compute exactly what the decoder does), the few-row CPU matmul kernels the
decoder runs, the Hugging Face layout (``config.json`` and tensor names, to
rebuild a model in transformers), a way to write a checkpoint directory
whole, and the plain directory behind a shipped one whose files are stored
xz-compressed (:func:`unpacked_dir`, for code that reads the files itself).
The trainers in ``training/``, the scripts in ``benchmarks/`` and
``checkpoints_conversion`` use these; e.g. a reduced head's logits ``[B, T, V']`` for a distillation loss::

    logits, _, _ = Transformer(config).apply({"params": params}, tokens, positions, None, None,
                                             None, True)
"""

import jax

from specjax._src.kernels import cpu_matmul as _cpu_matmul
from specjax._src.kernels.platforms import exporting_for
from specjax._src.models.decoder import (
    Block,
    RMSNorm,
    Transformer,
    attention_mask,
    grouped_attention,
    is_index_param,
    rope_cos_sin,
    rope_inv_freq,
    rotate,
)
from specjax._src.models.files import check_output_dir, write_directory
from specjax._src.models.hf import tensor_specs as hf_tensor_specs, to_hf_config
from specjax._src.models import manifest as _manifest
from specjax._src.models.loading import astype, is_orbax_dir, load_hf
from specjax._src.models.packed import unpacked as unpacked_dir
from specjax._src.models.registry import built_path as built_model_path, resolve as known_model_path

#: The file :func:`specjax.checkpoint_manifest` writes into a checkpoint directory.
MANIFEST_FILE = _manifest.MANIFEST

#: The most rows :func:`cpu_matmul` multiplies at once (more go to XLA's dot in the decoder).
CPU_MATMUL_MAX_ROWS = _cpu_matmul.MAX_ROWS


def build_cpu_kernels() -> None:
    """Builds and registers the few-row CPU matmul kernels (``Decoder(matmul="kernel")``) now,
    instead of at the first product that uses them.

    Raises:
      RuntimeError: (``KernelUnavailableError``) with the reason, where they cannot be built
        (no C++ compiler, no FFI headers).
    """
    _cpu_matmul.ensure_loaded()


def cpu_matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False) -> jax.Array:
    """``x[..., K] @ w[K, N]`` (or ``@ w[N, K].T``) by the few-row CPU kernels, as one product.

    Float32 only, at most :data:`CPU_MATMUL_MAX_ROWS` rows (``x``'s leading axes
    together); on other platforms the same product by XLA's dot. Differentiable.
    See the CPU kernels guide for what they buy.
    """
    return _cpu_matmul.matmul(x, w, transpose_w=transpose_w)

__all__ = (
    "Transformer",
    "Block",
    "RMSNorm",
    "rope_inv_freq",
    "rope_cos_sin",
    "rotate",
    "attention_mask",
    "grouped_attention",
    "is_index_param",
    "astype",
    "load_hf",
    "is_orbax_dir",
    "MANIFEST_FILE",
    "to_hf_config",
    "hf_tensor_specs",
    "known_model_path",
    "built_model_path",
    "cpu_matmul",
    "CPU_MATMUL_MAX_ROWS",
    "build_cpu_kernels",
    "exporting_for",
    "check_output_dir",
    "write_directory",
    "unpacked_dir",
)
