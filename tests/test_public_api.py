"""The public surface: every ``__all__`` name exists, the library under ``_src``
has no command-line or printing code, and the console script resolves."""

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "specjax" / "_src"
PUBLIC_MODULES = (
    "specjax",
    "specjax.drafting",
    "specjax.engine",
    "specjax.rules",
    "specjax.sharding",
    "specjax.theory",
    "specjax.evaluation",
    "specjax.testing",
    "specjax.trees",
    "specjax.heads",
    "specjax.models",
    "specjax.cli",
)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_name_in_all_exists(name):
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported, f"{name}.__all__ is empty"
    assert len(set(exported)) == len(exported), f"{name}.__all__ lists a name twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def test_star_import_gives_the_curated_api():
    namespace: dict = {}
    exec("from specjax import *", namespace)
    for name in ("load", "decode", "generate", "pair", "Model", "DecodeStats", "drafting"):
        assert name in namespace
    import specjax

    assert isinstance(specjax.__version__, str)


def _library_files() -> list[Path]:
    files = sorted(SRC.rglob("*.py"))
    assert files, f"no sources under {SRC}"
    return files


def _offences(path: Path, root: Path = ROOT) -> list[str]:
    """``argparse`` imports and ``print(...)`` calls in one file, as ``file:line what``.

    Read from the syntax tree, so a docstring that shows ``print(out.stats)`` to
    a user is not an offence.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            found.append(f"{path.relative_to(root)}:{node.lineno} import argparse")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            found.append(f"{path.relative_to(root)}:{node.lineno} from argparse import")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"{path.relative_to(root)}:{node.lineno} print(...)")
    return found


def test_library_has_no_argparse_and_no_printing():
    # App code (commands, report tables, printing) lives in specjax/cli/; the
    # library reports through return values and callbacks (e.g. run_certify's
    # progress=) so that a server or notebook decides where output goes.
    offences = [o for path in _library_files() for o in _offences(path)]
    assert not offences, "app code under specjax/_src:\n" + "\n".join(offences)


def test_the_offence_check_sees_print_and_argparse(tmp_path):
    path = tmp_path / "x.py"
    path.write_text('"""print(docs) is fine."""\nimport argparse\n\ndef f():\n    print("no")\n')
    assert _offences(path, root=tmp_path) == ["x.py:2 import argparse", "x.py:5 print(...)"]


def test_console_script_and_python_m_run_the_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["specjax"].partition(":")
    entry = getattr(importlib.import_module(module), attr)
    import specjax.__main__
    import specjax.cli

    assert entry is specjax.cli.main and specjax.__main__.main is specjax.cli.main


def test_the_old_head_loader_names_warn_and_load_what_the_new_ones_do(tmp_path):
    """``load_head`` named two loaders (a pivot head in specjax.rules, a feature
    head in specjax.heads); each old name still loads, for one release, and its
    DeprecationWarning names the function to call instead."""
    import jax
    import numpy as np

    from specjax import heads, rules
    from specjax.testing import llama_config, peaked_target_and_draft

    config = rules.PivotHeadConfig(hidden_size=8, layer=-1, target_num_layers=2, arch="linear")
    rules.PivotHead.init(config, jax.random.key(0)).save(tmp_path / "pivot")
    with pytest.warns(DeprecationWarning, match=r"specjax\.rules\.load_pivot_head"):
        old = rules.load_head(tmp_path / "pivot")
    assert old.config == rules.load_pivot_head(tmp_path / "pivot").config

    target = peaked_target_and_draft(llama_config())[0]
    heads.save_head(heads.init_from_target(target, jax.random.key(0), np.arange(80)), str(tmp_path / "feature"))
    with pytest.warns(DeprecationWarning, match=r"specjax\.heads\.load_feature_head"):
        old = heads.load_head(str(tmp_path / "feature"))
    new = heads.load_feature_head(str(tmp_path / "feature"))
    assert heads.is_feature_head(old.module) and old.module == new.module


# The engine tier: what a new drafter or a new driver of the draft-verify loop is written with
# (docs/engine.md#the-tiers); tests/test_public_tier.py drives decoding with these names alone.
ENGINE_TIER = ("LoopConfig", "DecodeState", "Logprobs", "init_state", "Cycle", "CycleInputs", "run_cycles",
               "CHAIN", "TREE", "TARGET_ONLY", "cycle_for")


def test_the_engine_tier_is_exported_and_documented():
    import specjax.engine

    missing = [n for n in ENGINE_TIER if n not in specjax.engine.__all__]
    assert not missing, f"specjax.engine.__all__ lacks the engine tier's {missing}"
    values = ("CHAIN", "TREE", "TARGET_ONLY")
    undocumented = [n for n in ENGINE_TIER if n not in values and not (getattr(specjax.engine, n).__doc__ or "").strip()]
    assert not undocumented, f"engine tier names without a docstring: {undocumented}"
    assert all(isinstance(getattr(specjax.engine, n), specjax.engine.Cycle) for n in values)
