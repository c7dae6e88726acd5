"""Conversions never overwrite silently, and a checkpoint can be checked against a manifest.

* ``python -m checkpoints_conversion to-hf / to-orbax`` refuse a non-empty
  output directory unless ``--force``; with ``--force`` the new checkpoint is
  written into a temporary sibling and swapped in, so stale shards are gone.
* ``export_hf`` / ``save_orbax`` refuse the same unless ``overwrite=True``,
  and an export that fails midway leaves the old directory as it was.
* ``checkpoint_manifest`` / ``verify_manifest`` (and the ``manifest`` /
  ``verify`` subcommands) record and check a SHA-256 per file.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints_conversion.__main__ import main as convert
from specjax import Decoder, Model, ModelConfig, export_hf, load, save_orbax
from specjax._src.models import hf as hf_lib
from specjax._src.models.manifest import MANIFEST, checkpoint_manifest, verify_manifest

CFG = ModelConfig("llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8, intermediate_size=24, tie_word_embeddings=True)


def _model(seed: int) -> Model:
    module = Decoder(CFG)
    return Model(params=module.init(jax.random.key(seed)), module=module)


def _same(a: Model, b: Model) -> None:
    la, lb = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _stale_sharded_checkpoint(directory) -> list[str]:
    """An old sharded HF checkpoint: an index and two shards, plus config.json."""
    os.makedirs(directory)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, name in enumerate(names):
        save_file({f"old.{i}": np.zeros(3, np.float32)}, os.path.join(directory, name))
    index = {"metadata": {}, "weight_map": {f"old.{i}": n for i, n in enumerate(names)}}
    json.dump(index, open(os.path.join(directory, "model.safetensors.index.json"), "w"))
    json.dump({"model_type": "llama"}, open(os.path.join(directory, "config.json"), "w"))
    return sorted(os.listdir(directory))


def _siblings(path) -> list[str]:
    return sorted(os.listdir(os.path.dirname(os.path.abspath(path))))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("src") / "hf")
    export_hf(_model(0), d)
    return d


# --------------------------------------------------------------------------- #
# The CLI
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("command", ["to-hf", "to-orbax"])
def test_cli_refuses_a_non_empty_output_directory(tmp_path, src, command, capsys):
    out = tmp_path / "out"
    before = _stale_sharded_checkpoint(out)
    assert convert([command, src, str(out)]) == 2
    err = capsys.readouterr().err
    assert "non-empty directory" in err and "--force" in err and str(out) in err
    assert err.count("\n") == 1  # one line, no traceback
    assert sorted(os.listdir(out)) == before


@pytest.mark.parametrize("command", ["to-hf", "to-orbax"])
def test_cli_force_replaces_the_directory_and_its_stale_shards(tmp_path, src, command):
    out = tmp_path / "out"
    _stale_sharded_checkpoint(out)
    assert convert([command, src, str(out), "--force"]) == 0
    files = os.listdir(out)
    assert "model.safetensors.index.json" not in files
    assert not [f for f in files if f.startswith("model-0000")]
    _same(load(str(out)), load(src))
    assert _siblings(out) == ["out"]  # no temporary or backup directory left behind


def test_cli_writes_into_a_new_or_empty_directory(tmp_path, src):
    assert convert(["to-hf", src, str(tmp_path / "new" / "nested")]) == 0
    (tmp_path / "empty").mkdir()
    assert convert(["to-orbax", src, str(tmp_path / "empty")]) == 0
    _same(load(str(tmp_path / "empty")), load(src))


def test_cli_refuses_an_output_that_is_a_file(tmp_path, src, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert convert(["to-hf", src, str(out), "--force"]) == 2
    assert "is a file" in capsys.readouterr().err
    assert out.read_text() == "x"


@pytest.mark.parametrize("command", ["to-hf", "to-orbax"])
@pytest.mark.parametrize("where", ["the source", "its parent"])
def test_cli_force_never_replaces_the_source(tmp_path, command, where, capsys):
    src = tmp_path / "ckpts" / "model"
    export_hf(_model(0), str(src))
    before = sorted(os.listdir(src))
    out = src if where == "the source" else src.parent
    assert convert([command, str(src), str(out), "--force"]) == 2
    assert "would delete the source" in capsys.readouterr().err
    assert sorted(os.listdir(src)) == before
    _same(load(str(src)), _model(0))


def test_cli_help_says_gguf_sources_and_force(capsys):
    with pytest.raises(SystemExit):
        convert(["--help"])
    text = capsys.readouterr().out
    assert ".gguf" in text and "--force" in text and "manifest" in text


# --------------------------------------------------------------------------- #
# The library
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("save", [export_hf, save_orbax], ids=["export_hf", "save_orbax"])
def test_library_refuses_to_overwrite_unless_asked(tmp_path, save):
    out = str(tmp_path / "out")
    before = _stale_sharded_checkpoint(out)
    with pytest.raises(ValueError, match=r"non-empty directory.*overwrite=True"):
        save(_model(1), out)
    assert sorted(os.listdir(out)) == before
    save(_model(1), out, overwrite=True)
    assert "model.safetensors.index.json" not in os.listdir(out)
    _same(load(out), _model(1))
    assert _siblings(out) == ["out"]


def test_an_overwrite_killed_between_its_renames_is_put_back(tmp_path):
    """A hard kill after the old directory was renamed aside and before the new one
    took its place: the next write puts the old one back instead of deleting it."""
    out = tmp_path / "out"
    export_hf(_model(2), str(out))
    os.rename(out, tmp_path / ".out.specjax-old")  # the state such a kill leaves
    with pytest.raises(ValueError, match="non-empty directory"):
        export_hf(_model(3), str(out))  # not asked to overwrite: the old checkpoint is back, kept
    _same(load(str(out)), _model(2))
    assert _siblings(out) == ["out"]


def test_a_failed_overwrite_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    export_hf(_model(2), out)
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}

    def broken(path, tensors):
        yield from []
        raise OSError("disk full")

    monkeypatch.setattr(hf_lib, "write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        export_hf(_model(3), out, overwrite=True)
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before
    assert _siblings(out) == ["out"]


# --------------------------------------------------------------------------- #
# Manifests (safetensors carry no checksum)
# --------------------------------------------------------------------------- #


def test_manifest_records_and_catches_a_flipped_bit(tmp_path, src):
    import shutil

    d = str(tmp_path / "m")
    shutil.copytree(src, d)
    manifest = checkpoint_manifest(d)
    assert set(manifest["files"]) == set(os.listdir(d))
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    verify_manifest(d, manifest)
    # A flipped bit loads fine (the format has no checksum) ...
    file = os.path.join(d, "model.safetensors")
    blob = bytearray(open(file, "rb").read())
    blob[-5] ^= 0x01
    open(file, "wb").write(bytes(blob))
    load(d)
    # ... but the manifest names the file.
    with pytest.raises(ValueError, match=r"model\.safetensors.*SHA-256"):
        verify_manifest(d, manifest)


def test_manifest_catches_missing_and_extra_files(tmp_path, src):
    import shutil

    d = str(tmp_path / "m")
    shutil.copytree(src, d)
    manifest = checkpoint_manifest(d)
    save_file({"x": np.zeros(2, np.float32)}, os.path.join(d, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"not in the manifest: model-00002-of-00002\.safetensors"):
        verify_manifest(d, manifest)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ValueError, match=r"missing: config\.json"):
        verify_manifest(d, manifest)


def test_cli_manifest_then_verify(tmp_path, src, capsys):
    import shutil

    d = str(tmp_path / "m")
    shutil.copytree(src, d)
    assert convert(["verify", d]) == 2
    assert f"no {MANIFEST}" in capsys.readouterr().err
    assert convert(["manifest", d]) == 0
    assert os.path.exists(os.path.join(d, MANIFEST))
    assert convert(["manifest", d]) == 2  # never overwritten silently
    assert "--force" in capsys.readouterr().err
    assert convert(["verify", d]) == 0
    assert "ok" in capsys.readouterr().out
    with open(os.path.join(d, "config.json"), "a") as f:
        f.write(" ")
    assert convert(["verify", d]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and err.count("\n") == 1
    assert convert(["manifest", d, "--force"]) == 0
    assert convert(["verify", d]) == 0
