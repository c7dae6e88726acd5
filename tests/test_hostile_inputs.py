"""What a hostile but fair user tries: each gets a clear error naming the cause
and what to do, before any slow work, or works as documented.

Trees too large to build or too deep to compile, a cached kernel library
without its symbols, a pair given in the wrong order, a hand-built lookup
with bad values, training output inside the installed package, damaged
checkpoints and an interrupted trainer, empty or malformed CLI values, and
the permissions of the files specjax writes.
"""

from __future__ import annotations

import ctypes.util
import os
import pathlib
import runpy
import shutil
import stat
import uuid
import warnings

import jax
import numpy as np
import pytest

import specjax
from specjax._src.proposals import trees as trees_lib
from specjax._src.kernels import cpu_matmul
from specjax._src.models import feature_head as fh
from specjax._src.models import feature_head_build as fhb
from specjax.cli import app
from specjax.drafting import NgramLookup, ngram_lookup
from specjax.testing import llama_config, peaked_target_and_draft
from specjax.trees import dynamic_tree, parse_tree, static_tree
from training import common, draft, eagle, pivot

PACKAGE = pathlib.Path(specjax.__file__).resolve().parent


@pytest.fixture(scope="module")
def target():
    return peaked_target_and_draft(llama_config())[0]


@pytest.fixture(scope="module")
def head(target):
    return fhb.init_from_target(target, jax.random.key(1), np.arange(80))


# --------------------------------------------------------------------------- 1. tree sizes


@pytest.mark.parametrize("make", [
    lambda: static_tree((3000, 3000, 3000)),  # 2.7e10 nodes: must not be built
    lambda: static_tree((100, 100)),  # 10,101 nodes
    lambda: parse_tree("3000,3000,3000"),
    lambda: dynamic_tree(depth=8, top_k=64, num_nodes=60),  # 28,736 candidates, ranked O(C^2)
])
def test_a_tree_too_large_is_refused_before_it_is_built(make):
    with pytest.raises(ValueError, match=f"(?s){trees_lib.MAX_TREE_NODES:,}.*smaller"):
        make()


def test_a_tree_too_deep_is_refused_and_a_deep_one_warns():
    with pytest.raises(ValueError, match=f"depth 100.*{trees_lib.MAX_TREE_DEPTH}.*num_draft"):
        static_tree((1,) * 100)
    with pytest.raises(ValueError, match="depth 100"):
        dynamic_tree(100, 2, 4)
    deep = trees_lib.WARN_TREE_DEPTH + 1
    with pytest.warns(RuntimeWarning, match=f"depth {deep}.*compil"):
        assert static_tree((1,) * deep).max_depth == deep
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert static_tree((1,) * trees_lib.WARN_TREE_DEPTH).max_depth == trees_lib.WARN_TREE_DEPTH
        assert static_tree((4, 2, 2, 1)).num_nodes == 45  # the docstring's example still builds


def test_the_cli_names_the_flag_of_a_tree_too_large():
    with pytest.raises(SystemExit, match="--tree.*4,096"):
        app.main(["generate", "--tree", "3000,3000,3000", "--prompt", "x"])
    # --help states the limits (written out there: the CLI's options load without jax).
    generate = app.build_parser()._subparsers._group_actions[0].choices["generate"]
    text = " ".join(generate.format_help().split())
    assert f"At most {trees_lib.MAX_TREE_NODES:,} nodes" in text and f"depth {trees_lib.MAX_TREE_DEPTH};" in text
    assert f"past depth {trees_lib.WARN_TREE_DEPTH}" in text


# --------------------------------------------------------------------------- 2. the kernel library


def test_a_cached_library_without_the_kernels_is_unavailable_and_named(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    path = cpu_matmul._library_path(cpu_matmul._compiler())
    path.parent.mkdir(parents=True)
    shutil.copy(_shared_library("m"), path)  # a valid .so, other symbols
    monkeypatch.setattr(cpu_matmul, "_registered", [])  # as in a new process (nothing registered yet)
    cpu_matmul._reset_for_tests()
    try:
        assert not cpu_matmul.is_available()
        with pytest.raises(cpu_matmul.KernelUnavailableError, match=f"(?s){path.name}.*SpecjaxMatmul.*delete it"):
            cpu_matmul.ensure_loaded()
    finally:
        cpu_matmul._reset_for_tests()


def _shared_library(name: str) -> str:
    """The file of a system shared library (e.g. libm), for a .so without specjax's symbols."""
    lib = ctypes.CDLL(ctypes.util.find_library(name))
    maps = pathlib.Path("/proc/self/maps").read_text().split("\n")
    found = [line.split()[-1] for line in maps if f"/lib{name}" in line and ".so" in line]
    if not found:
        pytest.skip(f"no lib{name} file found ({lib})")
    return found[0]


# --------------------------------------------------------------------------- 3. pair order


def test_a_pair_given_in_the_wrong_order_says_so(target, head):
    specjax.pair(target, head)  # the right order
    with pytest.raises(ValueError, match=r"(?s)target.*feature head.*pair\(target, head\)"):
        specjax.pair(head, target)


# --------------------------------------------------------------------------- 4. lookup values


@pytest.mark.parametrize("values,error", [
    ((0, 0), ValueError), ((-3, 2), ValueError), (("a", 8), ValueError), ((2, 1), ValueError),
    ((2.0, 8), ValueError), ((True, 8), ValueError),
])
def test_a_hand_built_lookup_is_checked_as_the_factorys(values, error):
    with pytest.raises(error, match="min_match|max_match"):
        NgramLookup(*values)
    with pytest.raises(error):
        ngram_lookup(*values)


def test_a_lookup_changed_by_replace_is_checked_and_good_ones_stay_equal():
    assert NgramLookup() == ngram_lookup() == NgramLookup(2, 8)
    assert hash(NgramLookup(3, 5)) == hash(ngram_lookup(3, 5))  # a jit static
    assert NgramLookup(np.int32(3), 5).min_match == 3 and type(NgramLookup(np.int32(3), 5).min_match) is int
    with pytest.raises(ValueError, match="min_match"):
        NgramLookup()._replace(min_match=0)


# --------------------------------------------------------------------------- 5. training output


def _inside_package() -> pathlib.Path:
    return PACKAGE / "assets" / f"hostile-test-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("trainer,flag", [(eagle, "--out"), (draft, "--out"), (pivot, "--out"), (pivot, "--ckpt-dir")])
def test_trainers_refuse_to_write_inside_the_installed_package(trainer, flag, capsys):
    inside = _inside_package()
    argv = [flag, str(inside), "--target", "embedded-target"]
    try:
        with pytest.raises(SystemExit) as err:
            trainer.main(argv)
        msg = str(err.value.code) + capsys.readouterr().err
        assert flag in msg and "installed package" in msg and str(PACKAGE) in msg, msg
        assert not inside.exists()
    finally:
        shutil.rmtree(inside, ignore_errors=True)


def test_the_documented_export_into_the_package_is_not_refused(tmp_path):
    # --export (not --out) may name the shipped directories: that is how they are made.
    common.check_outside_package(tmp_path / "run", "--out")
    with pytest.raises(SystemExit, match="--out"):
        common.check_outside_package(PACKAGE / "assets" / "models" / "smollm2-eagle", "--out")


# --------------------------------------------------------------------------- 6. damage, --fresh and SIGINT


def _state(step: int) -> dict:
    import jax.numpy as jnp

    return {"step": jnp.int32(step), "params": {"w": jnp.full((3,), float(step))},
            "opt_state": {"m": jnp.zeros((3,))}}


def _damage_every_step(directory: pathlib.Path) -> None:
    ckpt = common.Checkpointer(directory, every_steps=1, log=lambda _: None)
    ckpt.save(1, _state(1), {})
    ckpt.save(2, _state(2), {})
    ckpt.close()
    for step in (1, 2):
        (directory / str(step) / "meta" / "metadata").write_text("not json")


def test_a_rerun_after_every_step_was_damaged_does_not_restart_silently(tmp_path):
    _damage_every_step(tmp_path / "ck")
    for attempt in range(2):  # the run that found the damage, then a rerun of the same command
        ckpt = common.Checkpointer(tmp_path / "ck", log=lambda _: None)
        with pytest.raises(ValueError, match="(?s)no intact checkpoint.*damaged.*pass --fresh") as err:
            ckpt.restore(_state(0), start_over="pass --fresh")
        ckpt.close()
        assert str(tmp_path / "ck.damaged") in str(err.value), (attempt, err.value)
    assert sorted(os.listdir(tmp_path / "ck.damaged")) == ["1", "2"]  # kept, not deleted


@pytest.mark.parametrize("trainer", [eagle, draft])
def test_trainers_name_fresh_which_starts_over(trainer, tmp_path):
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)  # as a run that found every step damaged leaves it
    (out / "ckpt.damaged" / "2").mkdir(parents=True)
    # Refused at the argument checks, before the target is loaded.
    with pytest.raises(SystemExit, match="(?s)ckpt.damaged.*--fresh") as err:
        trainer.main(["--out", str(out), "--target", "no-such-model-is-loaded"])
    assert "Traceback" not in str(err.value.code)
    assert "--fresh" in trainer.build_parser().format_help()
    # --fresh discards them: training starts at step 0.
    common.check_resumable(out / "ckpt", fresh=True)
    assert not (out / "ckpt").exists() and not (out / "ckpt.damaged").exists()


@pytest.mark.parametrize("trainer", ["eagle", "draft"])
def test_an_interrupted_trainer_says_how_to_resume(trainer, monkeypatch, tmp_path, capsys):
    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(specjax, "load", interrupted)  # Ctrl-C while the target loads
    monkeypatch.setattr("sys.argv", ["x", "--out", str(tmp_path / "run"), "--target", "embedded-target"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
        runpy.run_module(f"training.{trainer}", run_name="__main__")  # as `python -m training.{trainer}`
    err = capsys.readouterr().err
    assert exit_.value.code == 130
    assert "interrupted" in err and "same command" in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- 8. empty and malformed CLI values


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--tree", "", "--prompt", "x"], "--tree"),
    (["generate", "--lookup", "", "--prompt", "x"], "--lookup"),
    (["generate", "--drafting", "", "--prompt", "x"], "--drafting"),
    (["generate", "--tree", "3,1", "--lookup", "", "--prompt", "x"], "--lookup"),
    (["certify", "--trees", "abc"], "--trees"),
    (["certify", "--trees", "2,0"], "--trees"),
    (["certify", "--rules", ""], "--rules"),
])
def test_empty_or_malformed_cli_values_are_refused_naming_the_flag(argv, flag, monkeypatch):
    def no_loading(*_):
        raise AssertionError("the models were loaded before the flags were checked")

    from specjax.cli import common as cli_common

    monkeypatch.setattr(cli_common, "load_pair", no_loading)
    with pytest.raises(SystemExit) as err:
        app.main(argv)
    assert flag in str(err.value.code), err.value.code


@pytest.mark.parametrize("layers", [2.5, "3", True, 0])
def test_with_num_layers_names_a_bad_count(head, layers):
    with pytest.raises(ValueError, match="num_layers"):
        fhb.with_num_layers(head, layers)
    assert fhb.with_num_layers(head, np.int64(2)).module.config.num_layers == 2


# --------------------------------------------------------------------------- 9. permissions


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_an_exported_head_follows_the_umask(head, tmp_path, umask_022):
    fh.save_head(head, str(tmp_path / "head"))
    for name in ("config.json", fh.WEIGHTS_FILE):
        assert stat.S_IMODE(os.stat(tmp_path / "head" / name).st_mode) == 0o644, name
    loaded = fh.load_feature_head(str(tmp_path / "head"))  # what it wrote reads back
    got, want = fh._flat(loaded.params), fh._flat(head.params)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# The cached kernel library's mode: tests/test_cpu_matmul.py::test_the_library_is_built_into_the_cache_dir.
