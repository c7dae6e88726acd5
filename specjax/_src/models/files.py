"""What every checkpoint directory shares: its tokenizer files, and writing it whole.

Each format (Hugging Face and Orbax directories in :mod:`specjax._src.models.loading`,
feature heads in :mod:`specjax._src.models.feature_head`) keeps ``tokenizer.json`` and
``tokenizer_config.json`` beside its weights the same way, and writes its directory
through :func:`write_directory`: into a temporary sibling, then swapped in by renames, so a
reader sees the old checkpoint or the complete new one, never a mix.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import jax
import numpy as np

from specjax._src.models.lm import Model

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


# --------------------------------------------------------------------------- #
# Tokenizer files
# --------------------------------------------------------------------------- #


def load_tokenizer(path: str):
    """The ``tokenizers.Tokenizer`` of ``path/tokenizer.json``; None when there is none.

    Raises:
      ValueError: the file exists but is not a tokenizer.
    """
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.exists(file):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception for a damaged file
        raise ValueError(f"{file} cannot be read as a tokenizer ({e}); restore or remove it.") from e


def save_tokenizer(model: Model, path: str) -> None:
    """``tokenizer.json``, and a ``tokenizer_config.json`` with the chat template
    and the special tokens' text: transformers takes BOS / EOS / PAD from there,
    not from ``config.json``, and would pad and render templates without them."""
    settings = {}
    if model.tokenizer is not None:
        model.tokenizer.save(os.path.join(path, TOKENIZER_FILE))
        config = getattr(model.module, "config", None)
        for name in ("bos", "eos", "pad"):
            token_id = getattr(config, f"{name}_token_id", None)
            text = None if token_id is None else model.tokenizer.id_to_token(int(token_id))
            if text is not None:
                settings[f"{name}_token"] = text
    if model.chat_template is not None:
        settings["chat_template"] = model.chat_template
    if settings:
        with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
            json.dump(settings, f, indent=1)


def load_chat_template(path: str) -> Optional[str]:
    """The chat template of ``tokenizer_config.json``, as transformers reads it."""
    file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); fix or remove it.") from e
    return template if isinstance(template, str) else None


# --------------------------------------------------------------------------- #
# Output directories: never overwritten silently, swapped in whole
# --------------------------------------------------------------------------- #


def check_output_dir(path: str, overwrite: bool = False, *, flag: str = "overwrite=True") -> None:
    """Raises ``ValueError`` unless a checkpoint may be written to ``path``:
    it does not exist, is an empty directory, or (``overwrite``) a directory
    to replace. ``flag`` names the way to ask for that in the message."""
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"Output {path} is a file, not a directory; choose another output path.")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ValueError(
            f"Refusing to write into non-empty directory {path}: pass {flag} to replace it and "
            "everything in it, or choose a new directory."
        )


def write_directory(path: str, overwrite: bool, write: Callable[[str], None]) -> None:
    """Runs ``write(tmp)`` into a temporary sibling of ``path``, then swaps it
    in by renames: ``path`` is either the old directory or the complete new
    one, never a mix (no stale shard survives an overwrite)."""
    path, tmp, old = _prepare_directory(path, overwrite)
    try:
        write(tmp)
        _swap_in(path, tmp, old)
    finally:
        _remove(tmp)


def write_directory_from_every_process(path: str, overwrite: bool, write: Callable[[str], None]) -> None:
    """:func:`write_directory` for a multi-host job: process 0 prepares and
    swaps, every process runs ``write(tmp)`` (a collective), barriers between.
    A failure on process 0 before writing is raised on every process."""
    from jax.experimental import multihost_utils

    primary = jax.process_index() == 0
    error = None
    if primary:
        try:
            _prepare_directory(path, overwrite)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others learn of it
            error = e
    if not int(multihost_utils.broadcast_one_to_all(np.int32(error is None))):
        raise error or ValueError(f"process 0 could not prepare {path} for writing; see its error.")
    path, tmp, old = _sibling_paths(path)
    try:
        write(tmp)
        multihost_utils.sync_global_devices(f"specjax: {path} written")
        if primary:
            _swap_in(path, tmp, old)
    finally:
        if primary:
            _remove(tmp)
    multihost_utils.sync_global_devices(f"specjax: {path} swapped in")


def _sibling_paths(path: str) -> tuple[str, str, str]:
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    # A fixed name (not a random one) so that every host of a multi-host job
    # writes the same directory; a leftover of a killed run is ours to remove.
    return path, os.path.join(parent, f".{name}.specjax-tmp"), os.path.join(parent, f".{name}.specjax-old")


def _prepare_directory(path: str, overwrite: bool) -> tuple[str, str, str]:
    """Checks ``path`` may be written and makes an empty temporary sibling: ``(path, tmp, old)``."""
    import shutil

    path, tmp, old = _sibling_paths(path)
    if not os.path.exists(path) and os.path.isdir(old):
        # A run killed between the two renames below: the old directory is the
        # user's checkpoint, not a leftover. Put it back before anything else.
        os.rename(old, path)
    check_output_dir(path, overwrite)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for leftover in (tmp, old):
        if os.path.isdir(leftover):
            shutil.rmtree(leftover)
    os.makedirs(tmp)
    return path, tmp, old


def _swap_in(path: str, tmp: str, old: str) -> None:
    import shutil

    if os.path.isdir(path):
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)


def _remove(tmp: str) -> None:
    import shutil

    if os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
