"""Shipped model directories with xz-compressed files (``specjax/_src/models/packed.py``).

A packed directory must load as the plain one did, bit for bit; a damaged
packed file must be named, never loaded; a second load reads the cached copy;
bf16 weights pack smaller than ``xz -9e``, weights whose columns share a scale
pack column by column, and streams packed with other settings still load.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil

import jax
import numpy as np
import pytest

import specjax
from specjax._src.models import packed
from specjax.testing import llama_config, peaked_target_and_draft


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A small Hugging Face directory (safetensors + config)."""
    path = tmp_path_factory.mktemp("plain") / "model"
    specjax.export_hf(peaked_target_and_draft(llama_config())[1], str(path))
    return path


def _packed_copy(plain_dir, where) -> str:
    path = where / "packed-model"
    shutil.copytree(plain_dir, path)
    packed.pack(str(path), ["model.safetensors"])
    return str(path)


def _sha(file) -> str:
    return hashlib.sha256(open(file, "rb").read()).hexdigest()


def test_a_packed_directory_loads_bit_for_bit_and_once(plain_dir, tmp_path, cache, monkeypatch):
    path = _packed_copy(plain_dir, tmp_path)
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    assert os.path.getsize(os.path.join(path, "model.safetensors.xz")) < os.path.getsize(plain_dir / "model.safetensors")

    model, reference = specjax.load(path), specjax.load(str(plain_dir))
    for a, b in zip(*(map(np.asarray, jax.tree.leaves(m.params)) for m in (model, reference))):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    (copy,) = list((cache / "models").iterdir())
    assert _sha(copy / "model.safetensors") == _sha(plain_dir / "model.safetensors")

    monkeypatch.setattr(packed, "_decompress", lambda *a: pytest.fail("unpacked a second time"))
    specjax.load(path)


def test_the_unpacked_copy_follows_the_umask(plain_dir, tmp_path, cache):
    path = _packed_copy(plain_dir, tmp_path)
    old = os.umask(0o022)
    try:
        copy = packed.unpacked(path)
    finally:
        os.umask(old)
    assert os.stat(copy).st_mode & 0o777 == 0o755  # readable by the next user of a shared cache
    assert os.stat(os.path.join(copy, "model.safetensors")).st_mode & 0o777 == 0o644


def test_a_damaged_packed_file_is_named(plain_dir, tmp_path, cache):
    path = _packed_copy(plain_dir, tmp_path)
    xz = os.path.join(path, "model.safetensors.xz")
    data = bytearray(open(xz, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(xz, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors.xz.*(damaged|cannot be decompressed)"):
        specjax.load(path)
    assert not any((cache / "models").iterdir())  # nothing half-written is left to be loaded later


def test_a_file_that_decompresses_to_other_bytes_is_refused(plain_dir, tmp_path, cache):
    path = _packed_copy(plain_dir, tmp_path)
    with lzma.open(os.path.join(path, "model.safetensors.xz"), "wb") as f:
        f.write(b"not the weights")
    with pytest.raises(ValueError, match="not the .* recorded in specjax_packed.json"):
        specjax.load(path)


def test_bf16_weights_pack_smaller_than_xz_9e_and_unpack_exactly(tmp_path, cache):
    """bf16 weights compress at least 5% better than ``xz -9e`` (the two-byte LZMA2 setting: 7% on
    this data; the text setting alone gives 3%), and the stream is still plain xz."""
    import ml_dtypes

    data = np.random.default_rng(0).normal(0, 0.02, 1 << 17).astype(ml_dtypes.bfloat16).tobytes()
    path = tmp_path / "weights"
    path.mkdir()
    (path / "weights.bin").write_bytes(data)
    packed.pack(str(path), ["weights.bin"])
    xz_9e = len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    assert os.path.getsize(path / "weights.bin.xz") < 0.95 * xz_9e
    assert lzma.decompress((path / "weights.bin.xz").read_bytes()) == data  # what ``xz -dk`` gives back
    assert open(os.path.join(packed.unpacked(str(path)), "weights.bin"), "rb").read() == data


def test_a_directory_packed_with_default_xz_settings_loads(plain_dir, tmp_path, cache):
    """Streams written with xz's default settings (as ``xz -9`` writes them) unpack as before: the
    reader takes any xz stream, whatever settings packed it."""
    path = tmp_path / "default-xz"
    shutil.copytree(plain_dir, path)
    src = path / "model.safetensors"
    with open(src, "rb") as fin, lzma.open(str(src) + ".xz", "wb", preset=9) as fout:
        fout.write(fin.read())
    meta = {"format": packed.PACKED_FORMAT,
            "files": {"model.safetensors": {"size": os.path.getsize(src), "sha256": _sha(src)}}}
    (path / packed.PACKED).write_text(json.dumps(meta))
    os.unlink(src)
    model, reference = specjax.load(str(path)), specjax.load(str(plain_dir))
    for a, b in zip(*(map(np.asarray, jax.tree.leaves(m.params)) for m in (model, reference))):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def _write_columns_packed(plain_dir, path, stream: bytes, layout: str = "columns") -> None:
    """``path``: ``plain_dir`` with model.safetensors replaced by ``stream`` (xz) recorded in ``layout``."""
    shutil.copytree(plain_dir, path)
    src = path / "model.safetensors"
    meta = {"format": packed.PACKED_FORMAT,
            "files": {"model.safetensors": {"size": os.path.getsize(src), "sha256": _sha(src), "layout": layout}}}
    (path / packed.PACKED).write_text(json.dumps(meta))
    (path / "model.safetensors.xz").write_bytes(lzma.compress(stream))
    os.unlink(src)


def test_weights_whose_columns_share_a_scale_pack_by_columns_and_unpack_exactly(tmp_path, cache):
    """A 2-D tensor whose columns have scales 2**-12 .. 2**2 (as an embedding's dimensions do)
    packs smaller stored column by column than any row-order stream pack() tries; the
    record says so, and the unpacked file is the exact original."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    scales = 2.0 ** rng.uniform(-12, 2, 64)
    tensors = {"embed": (rng.normal(size=(2048, 64)) * scales).astype(ml_dtypes.bfloat16),
               "norm": rng.normal(size=(64,)).astype(np.float32)}
    path = tmp_path / "weights"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    data = (path / "model.safetensors").read_bytes()
    packed.pack(str(path), ["model.safetensors"])

    rows = min(len(lzma.compress(data, format=lzma.FORMAT_XZ, filters=[{"id": lzma.FILTER_LZMA2, **f}]))
               for f in packed._FILTER_CANDIDATES)
    assert os.path.getsize(path / "model.safetensors.xz") < 0.95 * rows
    assert json.loads((path / packed.PACKED).read_text())["files"]["model.safetensors"]["layout"] == "columns"
    stream = lzma.decompress((path / "model.safetensors.xz").read_bytes())
    assert stream != data and len(stream) == len(data)  # the same bytes, in another order
    assert open(os.path.join(packed.unpacked(str(path)), "model.safetensors"), "rb").read() == data


def test_a_model_packed_by_columns_loads_bit_for_bit(plain_dir, tmp_path, cache):
    data = (plain_dir / "model.safetensors").read_bytes()
    path = tmp_path / "by-columns"
    _write_columns_packed(plain_dir, path, packed._by_columns(data, to_columns=True))
    model, reference = specjax.load(str(path)), specjax.load(str(plain_dir))
    for a, b in zip(*(map(np.asarray, jax.tree.leaves(m.params)) for m in (model, reference))):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("stream", [b"not the weights", b"\x02" + bytes(7) + b"{}", b"\x0c" + bytes(7) + b'{"a": 1, "b": 2}'])
def test_a_columns_stream_that_is_not_the_recorded_file_is_refused(plain_dir, tmp_path, cache, stream):
    path = tmp_path / "not-weights"
    _write_columns_packed(plain_dir, path, stream)
    with pytest.raises(ValueError, match="model.safetensors.xz decompresses to .* not the .* recorded in specjax_packed.json"):
        specjax.load(str(path))
    assert not any((cache / "models").iterdir())


def test_an_unknown_layout_is_named(plain_dir, tmp_path, cache):
    path = tmp_path / "unknown-layout"
    _write_columns_packed(plain_dir, path, (plain_dir / "model.safetensors").read_bytes(), layout="diagonal")
    with pytest.raises(ValueError, match="'diagonal', which this specjax does not know.*upgrade specjax"):
        specjax.load(str(path))


def test_the_shipped_drafters_are_packed_and_load():
    from specjax._src.models import registry

    for name in ("smollm2-135m-instruct-draft", "smollm2-135m-instruct-eagle"):
        assert packed.is_packed(registry.resolve(name)), name
    draft = specjax.load("smollm2-135m-instruct-draft")
    assert draft.module.config.hidden_size == 256 and draft.tokenizer is not None
    assert draft.tokenizer.encode("Hello").ids
    head = specjax.load("smollm2-135m-instruct-eagle")
    assert type(head.module).__name__ == "FeatureHead"


def test_the_embedded_pair_is_packed_and_loads():
    """The embedded target and draft ship xz-compressed too; each directory holds its own
    tokenizer, so a copy of either one alone still loads with it."""
    from specjax._src.models import registry

    for name in ("embedded-target", "embedded-draft"):
        path = registry.resolve(name)
        assert packed.is_packed(path), name
        assert not os.path.exists(os.path.join(path, "model.safetensors")), name
        model = specjax.load(name)
        assert model.tokenizer.encode("assert 37 + 48 ==").ids, name
