"""Shipped model directories with xz-compressed files (``specjax/_src/models/packed.py``).

A packed directory must load as the plain one did, bit for bit; a damaged
packed file must be named, never loaded; a second load reads the cached copy.
"""

from __future__ import annotations

import hashlib
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


def test_the_shipped_drafters_are_packed_and_load():
    from specjax._src.models import registry

    for name in ("smollm2-135m-instruct-draft", "smollm2-135m-instruct-eagle"):
        assert packed.is_packed(registry.resolve(name)), name
    draft = specjax.load("smollm2-135m-instruct-draft")
    assert draft.module.config.hidden_size == 256 and draft.tokenizer is not None
    assert draft.tokenizer.encode("Hello").ids
    head = specjax.load("smollm2-135m-instruct-eagle")
    assert type(head.module).__name__ == "FeatureHead"
