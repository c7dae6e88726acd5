"""Opt-in integrity check for checkpoint directories: a SHA-256 per file.

Hugging Face safetensors carry no checksum: a flipped bit in a weight loads
and generates without complaint. (Converted Orbax directories do carry CRC32s,
checked by ``specjax.load``.) Record a manifest once, where the checkpoint is
known to be good, and check it whenever the copy may have been damaged::

    specjax.checkpoint_manifest("ckpt/qwen3-8b", write=True)  # specjax_manifest.json
    specjax.verify_manifest("ckpt/qwen3-8b")                  # raises ValueError if damaged

or ``python -m checkpoints_conversion manifest DIR`` / ``verify DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

MANIFEST = "specjax_manifest.json"
MANIFEST_FORMAT = "specjax-manifest"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(path: str) -> list[str]:
    """Every regular file under ``path`` (relative, '/'-separated), but the manifest."""
    out = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return out


def checkpoint_manifest(path: str, *, write: bool = False, overwrite: bool = False) -> dict:
    """SHA-256 and size of every file under checkpoint directory ``path``.

    Args:
      path: a checkpoint directory (Hugging Face, Orbax, or any other).
      write: also write the manifest to ``path/specjax_manifest.json``.
      overwrite: with ``write``, replace an existing manifest (otherwise refused).

    Returns:
      ``{"format", "version", "algorithm": "sha256", "files": {relpath: {"sha256", "size"}}}``.

    Raises:
      ValueError: ``path`` is not a directory, or (``write``) a manifest exists.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory; a manifest covers a checkpoint directory.")
    target = os.path.join(path, MANIFEST)
    if write and os.path.exists(target) and not overwrite:
        raise ValueError(
            f"{target} already exists; verify against it, or pass overwrite=True "
            "(CLI: --force) to record the directory's current state instead."
        )
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "algorithm": "sha256",
        "files": {
            rel: {"sha256": _sha256(os.path.join(path, rel)),
                  "size": os.path.getsize(os.path.join(path, rel))}
            for rel in _files(path)
        },
    }
    if write:
        tmp = target + ".tmp"
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, target)
    return manifest


def read_manifest(path: str) -> dict:
    """The manifest recorded in ``path/specjax_manifest.json``.

    Raises:
      ValueError: there is none, or it is unreadable (names the file).
    """
    file = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.exists(file):
        raise ValueError(
            f"{path} has no {MANIFEST}: record one first, where the checkpoint is known to be "
            "good (specjax.checkpoint_manifest(path, write=True), or "
            "python -m checkpoints_conversion manifest DIR)."
        )
    try:
        with open(file) as f:
            manifest = json.load(f)
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"format is {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{file} is not a readable specjax manifest ({e}).") from e
    return manifest


def verify_manifest(path: str, manifest: Optional[dict] = None) -> int:
    """Checks every file of checkpoint directory ``path`` against ``manifest``.

    Args:
      path: the checkpoint directory.
      manifest: from :func:`checkpoint_manifest`; ``None`` reads
        ``path/specjax_manifest.json``.

    Returns:
      the number of files checked.

    Raises:
      ValueError: a file is missing, changed (size or SHA-256), or not in the
        manifest (a stale shard would be read too); names each.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory.")
    if manifest is None:
        manifest = read_manifest(path)
    if manifest.get("algorithm", "sha256") != "sha256":
        raise ValueError(f"unsupported manifest algorithm {manifest.get('algorithm')!r}.")
    want = manifest["files"]
    have = _files(path)
    problems = []
    missing = sorted(set(want) - set(have))
    if missing:
        problems.append("missing: " + ", ".join(missing))
    extra = sorted(set(have) - set(want))
    if extra:
        problems.append("not in the manifest: " + ", ".join(extra))
    changed = []
    for rel in sorted(set(want) & set(have)):
        file = os.path.join(path, rel)
        if os.path.getsize(file) != want[rel]["size"]:
            changed.append(f"{rel} (size {os.path.getsize(file)}, recorded {want[rel]['size']})")
        elif _sha256(file) != want[rel]["sha256"]:
            changed.append(f"{rel} (SHA-256 differs)")
    if changed:
        problems.append("changed: " + ", ".join(changed))
    if problems:
        raise ValueError(
            f"Checkpoint {path} does not match its manifest: " + "; ".join(problems)
            + ". Fetch or convert the checkpoint again."
        )
    return len(want)
