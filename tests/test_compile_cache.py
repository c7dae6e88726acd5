"""The persistent compilation cache of the ``specjax`` commands, and the count of programs a job builds.

No timing: what is checked is where JAX is told to keep programs, that a
program is written there and loaded back by a fresh jit cache, and that the
cache can be turned off (then nothing is written).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from specjax._src.kernels import compile_cache
from specjax.cli.app import build_parser, main

_SETTINGS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture(autouse=True)
def restore_jax_cache_settings(monkeypatch):
    """Each test changes process-wide JAX settings: put the suite's back afterwards."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def _fresh_program(seed: float):
    """A jitted function no other test compiles (its constant is part of the program)."""
    return jax.jit(lambda x: jnp.sin(x) * seed + jnp.cumsum(x))


def test_the_directory_follows_the_flag_then_the_environment_then_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve() == str(tmp_path / "xdg" / "specjax" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-env"))
    assert compile_cache.resolve() == str(tmp_path / "jax-env")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "ours"))
    assert compile_cache.resolve() == str(tmp_path / "ours")
    assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")
    for off in ("none", "off", "0", "None"):
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.resolve() is None
    assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")  # the flag wins
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.resolve(str(tmp_path / "flag"), enabled=False) is None  # --no-compile-cache wins
    assert compile_cache.resolve("none") is None


def test_enable_keeps_every_program_and_a_fresh_jit_cache_loads_it_back(tmp_path):
    directory = tmp_path / "cache"
    assert compile_cache.enable(str(directory)) == str(directory) and directory.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(directory) and jax.config.jax_enable_compilation_cache
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    f, x = _fresh_program(1.25), jnp.arange(7.0)
    with compile_cache.count_programs() as first:
        expected = np.asarray(f(x))
    assert (first.built, first.compiled, first.loaded) == (1, 1, 0) and first.seconds > 0
    ((name, programs, seconds),) = first.slowest()
    assert "lambda" in name and programs == 1 and seconds == first.seconds
    assert any(directory.iterdir()), "the compiled program was not written to the cache"
    with compile_cache.count_programs() as again:
        f(x)
    assert again.built == 0  # in this process's jit cache: not built again
    jax.clear_caches()  # as a new process would start: the program comes from the disk
    with compile_cache.count_programs() as restarted:
        np.testing.assert_array_equal(np.asarray(_fresh_program(1.25)(x)), expected)
    assert (restarted.built, restarted.loaded, restarted.compiled) == (1, 1, 0), restarted


def test_turned_off_nothing_is_written_and_everything_compiles(tmp_path):
    directory = tmp_path / "cache"
    compile_cache.enable(str(directory))
    assert compile_cache.enable(None) is None and not jax.config.jax_enable_compilation_cache
    x = jnp.arange(5.0)
    with compile_cache.count_programs() as count:
        _fresh_program(2.5)(x)
    assert (count.built, count.loaded) == (1, 0)
    assert not any(directory.iterdir())


def test_a_directory_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match="give a writable directory.*--no-compile-cache"):
        compile_cache.enable(str(tmp_path / "file" / "cache"))


def _stub_generate(monkeypatch, seen: dict):
    """``specjax generate`` replaced by a job that records JAX's cache settings and compiles one program."""
    module = importlib.import_module("specjax.cli.generate")

    def run(args):
        del args
        seen.update(enabled=jax.config.jax_enable_compilation_cache, dir=jax.config.jax_compilation_cache_dir)
        _fresh_program(3.75)(np.arange(3.0)).block_until_ready()
        return 0

    monkeypatch.setattr(module, "run", run)


def test_the_commands_turn_the_cache_on_by_default_and_print_the_programs_built(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    seen: dict = {}
    _stub_generate(monkeypatch, seen)
    assert main(["generate", "--prompt", "x"]) == 0
    expected = tmp_path / "xdg" / "specjax" / "jax"
    assert seen == {"enabled": True, "dir": str(expected)}
    assert any(expected.iterdir())
    assert "programs: 1 programs built" in capsys.readouterr().out
    for command in ("compare", "generate", "certify", "serve"):  # every compiling command takes the flag
        assert build_parser().parse_args([command, "--no-compile-cache"]).no_compile_cache


def test_no_compile_cache_turns_it_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    seen: dict = {}
    _stub_generate(monkeypatch, seen)
    assert main(["generate", "--prompt", "x", "--no-compile-cache"]) == 0
    assert seen["enabled"] is False and not (tmp_path / "xdg").exists()
    assert "1 compiled, 0 loaded" in capsys.readouterr().out
    seen.clear()
    monkeypatch.setenv(compile_cache.ENV, "none")
    assert main(["generate", "--prompt", "x"]) == 0
    assert seen["enabled"] is False
