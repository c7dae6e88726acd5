"""Writing GGUF files as llama.cpp's converter does, for the GGUF tests: the metadata and a
byte-level vocabulary, then the tensors."""

from __future__ import annotations

import gguf
import numpy as np


def gguf_writer(path, arch: str, keys: dict, *, skip_keys=(), tokenizer=False, vocab_size: int = 0):
    """A ``GGUFWriter`` for ``arch`` holding ``keys`` under the ``arch.`` prefix (less ``skip_keys``).

    ``tokenizer``: False (none), True (``vocab_size - 1`` printable characters, then one token that
    merges the first two: a byte-level vocabulary, which llama.cpp wants), or ``(tokens, merges,
    pre)``."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        if key in skip_keys:
            continue
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    if tokenizer:
        tokens, merges, pre = (tokenizer if isinstance(tokenizer, tuple) else
                               ([chr(0x21 + i) for i in range(vocab_size - 1)] + ['!"'], ['! "'], "default"))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types([1] * len(tokens))
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_add_bos_token(False)
    return writer


def write_tensors(writer, tensors: dict, *, drop=(), transform=None, qtype_of=None) -> None:
    """Adds ``tensors`` (GGUF name -> array; less ``drop``, each through ``transform(name, array)``
    first), quantized to ``qtype_of(name, array)`` where that gives a GGML type, and closes the file."""
    for name, w in tensors.items():
        if name in drop:
            continue
        w = np.ascontiguousarray(transform(name, w) if transform else w)
        qtype = qtype_of(name, w) if qtype_of else None
        if qtype is not None:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_params(a, b) -> None:
    """Two params trees hold the same leaves, bit for bit."""
    import jax

    flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
    flat_b = dict(jax.tree_util.tree_flatten_with_path(b)[0])
    assert len(flat_a) == len(flat_b)
    for path, leaf in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_b[path]), np.asarray(leaf), err_msg=str(path))
