"""The few-row CPU matmul kernels (specjax/_src/kernels/cpu_matmul.cc) and the
decoder's use of them."""

import dataclasses
import os
import stat
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax._src.models import sharding as sharding_lib
from specjax._src.kernels import cpu_matmul
from specjax._src.models.config import ModelConfig
from specjax._src.models.decoder import Decoder

# Skips without the kernels; fails instead under CI=true or SPECJAX_REQUIRE_KERNELS=1 (tests/_kernels.py).
pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture
def fresh_kernel_state():
    """Lets a test break the load state; the kernels load again afterwards."""
    yield
    cpu_matmul._reset_for_tests()
    cpu_matmul.ensure_loaded()


def _ref(x, w, transpose_w):
    w64 = np.asarray(w, np.float64)
    return np.asarray(x, np.float64) @ (w64.T if transpose_w else w64)


@pytest.mark.parametrize("transpose_w", [False, True])
# (7, 1536, 576) and (8, 130, 1000) split the contraction among the threads
# (a block's rows not a multiple of the kernel's band, columns past the last
# vector); (7, 64, 8) and (16, 40, 264) are too short to split.
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (4, 576, 1536), (3, 577, 1500), (7, 1536, 576), (8, 130, 1000),
                                   (7, 64, 8), (16, 40, 264), (2, 13, 7), (5, 9, 3), (4, 0, 16)])
def test_matches_a_float64_product(m, k, n, transpose_w):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((n, k) if transpose_w else (k, n), np.float32)
    got = jax.jit(lambda a, b: cpu_matmul.matmul(a, b, transpose_w=transpose_w))(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    # float32 rounding of a k-term sum: a few ulps of the sum of |terms|.
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64).T if transpose_w else w)
    np.testing.assert_array_less(np.abs(np.asarray(got) - _ref(x, w, transpose_w)), 1e-6 * scale + 1e-30)


@pytest.mark.parametrize("transpose_w", [False, True])
def test_a_rows_result_does_not_depend_on_the_other_rows(transpose_w):
    # What makes a verification forward's logits equal the one-token ones.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 200), np.float32)
    w = rng.standard_normal((328, 200) if transpose_w else (200, 328), np.float32)
    f = jax.jit(lambda a, b: cpu_matmul.matmul(a, b, transpose_w=transpose_w))
    whole = np.asarray(f(x, w))
    for lo, hi in [(0, 1), (3, 4), (2, 7), (8, 9)]:
        np.testing.assert_array_equal(np.asarray(f(x[lo:hi], w)), whole[lo:hi])


def test_leading_dimensions_are_rows():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 24), np.float32)
    w = rng.standard_normal((24, 40), np.float32)
    got = cpu_matmul.matmul(x, w)
    assert got.shape == (2, 3, 40)
    np.testing.assert_allclose(np.asarray(got), _ref(x.reshape(6, 24), w, False).reshape(2, 3, 40), rtol=1e-5,
                               atol=1e-5)


def test_gradient_and_vmap_match_xla():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 32), np.float32))
    w = jnp.asarray(rng.standard_normal((32, 48), np.float32))
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))  # noqa: E731
    got = jax.grad(loss(cpu_matmul.matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(jnp.dot), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(np.asarray(jax.vmap(lambda a: cpu_matmul.matmul(a, w))(xs)),
                               np.asarray(xs @ w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_an_expert_of_a_stack_is_multiplied_where_it_lies(rows):
    """``expert_dot`` reads expert ``e`` inside the ``[E, K, N]`` stack (the kernel is
    in the program, no dynamic slice copies it out), equals ``x @ stack[e]`` for each
    ``e``, clamps the index as XLA does, and differentiates like the indexed product."""
    rng = np.random.default_rng(rows)
    stack = jnp.asarray(rng.standard_normal((6, 40, 24), np.float32))
    x = jnp.asarray(rng.standard_normal((rows, 40), np.float32))
    f = jax.jit(lambda a, s, e: cpu_matmul.expert_dot(a, s, e))
    text = f.lower(x, stack, 0).as_text()
    assert "specjax_matmul_expert" in text and "dynamic_slice" not in text
    got = [np.asarray(f(x, stack, e)) for e in range(6)]
    for e in range(6):
        np.testing.assert_allclose(got[e], np.asarray(x, np.float64) @ np.asarray(stack[e]), rtol=1e-5, atol=1e-5)
    assert np.abs(got[1] - got[2]).max() > 1e-2  # each index reads its own expert
    np.testing.assert_array_equal(np.asarray(f(x, stack, 9)), got[5])
    np.testing.assert_array_equal(np.asarray(f(x, stack, -3)), got[0])
    loss = lambda g: lambda a, s: jnp.sum(jnp.sin(g(a, s)))  # noqa: E731
    want = jax.grad(loss(lambda a, s: a @ s[3]), argnums=(0, 1))(x, stack)
    have = jax.grad(loss(lambda a, s: cpu_matmul.expert_dot(a, s, jnp.int32(3))), argnums=(0, 1))(x, stack)
    for h, w in zip(have, want):
        np.testing.assert_allclose(np.asarray(h), np.asarray(w), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"stack \[E, K, N\]; got x"):
        cpu_matmul.expert_dot(x[:, :24], stack, 0)


def test_bad_operands_are_refused():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    with pytest.raises(TypeError, match="float32"):
        cpu_matmul.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="cannot multiply"):
        cpu_matmul.matmul(x, jnp.ones((7, 3)))
    with pytest.raises(ValueError, match="1 to 16 rows"):
        cpu_matmul.matmul(jnp.ones((17, 8)), w)


def _tiny_decoder(matmul="auto", **changes):
    fields = dict(model_type="llama", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=64, tie_word_embeddings=True)
    cfg = ModelConfig(**{**fields, **changes})
    return Decoder(cfg, matmul=matmul)


def _lowered_text(module, params, tokens, cache):
    return jax.jit(lambda p, t, c: module.apply(p, t, c).logits).lower(params, tokens, cache).as_text()


@pytest.mark.parametrize("tied", [True, False])
def test_decoder_verification_block_uses_the_kernels_and_agrees_with_xla(tied):
    auto = _tiny_decoder(tie_word_embeddings=tied)
    xla = dataclasses.replace(auto, matmul="xla")
    params = auto.init(jax.random.key(0))
    prompt = jnp.asarray([[5, 9, 11, 3, 7, 2]], jnp.int32)
    cache = xla.apply(params, prompt, xla.init_cache(1, 32)).cache
    block = jnp.asarray([[4, 8, 15, 16]], jnp.int32)
    head_target = "specjax_matmul_nt" if tied else "specjax_matmul\""
    assert "specjax_matmul" in _lowered_text(auto, params, block, cache)
    assert head_target in _lowered_text(auto, params, block, cache) or not tied
    assert "specjax_matmul" not in _lowered_text(xla, params, block, cache)
    # One token stays with XLA's matrix-vector loop (MIN_ROWS).
    assert "specjax_matmul" not in _lowered_text(auto, params, block[:, :1], cache)
    got = np.asarray(auto.apply(params, block, cache).logits)
    want = np.asarray(xla.apply(params, block, cache).logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_and_long_blocks_stay_with_xla():
    bf16 = _tiny_decoder(dtype="bfloat16")
    params = bf16.init(jax.random.key(0))
    cache = bf16.init_cache(1, 64)
    assert "specjax_matmul" not in _lowered_text(bf16, params, jnp.ones((1, 4), jnp.int32), cache)
    f32 = _tiny_decoder()
    params = f32.init(jax.random.key(0))
    assert "specjax_matmul" not in _lowered_text(f32, params, jnp.ones((1, 17), jnp.int32), f32.init_cache(1, 64))


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="matmul must be one of"):
        _tiny_decoder(matmul="fast")


def test_greedy_speculative_decoding_with_the_kernels_equals_target_greedy():
    target = _tiny_decoder()
    draft = Decoder(target.config.replace(num_layers=1))
    tp, dp = target.init(jax.random.key(0)), draft.init(jax.random.key(1))
    pair = specjax.pair(specjax.Model(tp, target), specjax.Model(dp, draft))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    sd = specjax.decode(pair, prompts, num_draft=4, max_new_tokens=20, temperature=0.0)
    ref = specjax.generate(specjax.Model(tp, dataclasses.replace(target, matmul="xla")), prompts,
                           max_new_tokens=20, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(sd.tokens), np.asarray(ref.tokens))


def test_a_failed_build_falls_back_to_xla_with_one_warning(fresh_kernel_state):
    cpu_matmul._reset_for_tests(error="no C++ compiler found (simulated)")
    module = _tiny_decoder()
    params = module.init(jax.random.key(0))
    cache = module.init_cache(1, 16)
    with pytest.warns(RuntimeWarning, match="(?s)simulated.*falls back to XLA"):
        text = _lowered_text(module, params, jnp.ones((1, 4), jnp.int32), cache)
    assert "specjax_matmul" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process
        _lowered_text(module, params, jnp.ones((1, 3), jnp.int32), cache)
    with pytest.raises(cpu_matmul.KernelUnavailableError, match="simulated"):
        _lowered_text(dataclasses.replace(module, matmul="kernel"), params, jnp.ones((1, 4), jnp.int32), cache)


def test_a_missing_compiler_is_named(fresh_kernel_state, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    cpu_matmul._reset_for_tests()
    with pytest.raises(cpu_matmul.KernelUnavailableError, match="no-such-c"):
        cpu_matmul.ensure_loaded()
    assert not list(tmp_path.rglob("*.so"))


def test_the_wheel_ships_every_file_the_kernels_build_reads():
    """Every local file the kernels' sources include is among the files the build hashes and
    reads, and pyproject.toml's package-data ships them all: a wheel without the headers once
    gave a specjax whose kernels could not be built (.ci/wheel_check.sh checks a built wheel)."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    package = Path(cpu_matmul.__file__).resolve().parents[2]
    pyproject = package.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not run from a source checkout")
    read = {f.name for f in (*cpu_matmul._SOURCES, *cpu_matmul._HEADERS)}
    for f in (*cpu_matmul._SOURCES, *cpu_matmul._HEADERS):
        local = set(re.findall(r'^#include "([^"/]+)"', f.read_text(), flags=re.M))
        assert local <= read, f"{f.name} includes {sorted(local - read)}, which the build does not list"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["specjax"]
    for f in (*cpu_matmul._SOURCES, *cpu_matmul._HEADERS):
        rel = f.relative_to(package)
        assert any(rel.match(g) for g in globs), f"package-data {globs} does not ship {rel}"


def test_the_library_is_built_into_the_cache_dir(fresh_kernel_state, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    cpu_matmul._reset_for_tests()
    old_umask = os.umask(0o022)
    try:
        cpu_matmul.ensure_loaded()
    finally:
        os.umask(old_umask)
    built = list((tmp_path / "kernels").glob("cpu_matmul-*.so"))
    assert len(built) == 1 and os.listdir(tmp_path / "kernels") == [built[0].name]  # nothing half-written
    # With the user's umask, not mkstemp's 0600: a cache shared between users stays readable.
    assert stat.S_IMODE(os.stat(built[0]).st_mode) == 0o755


def test_a_mesh_runs_xla_dots():
    module = _tiny_decoder()
    params = module.init(jax.random.key(0))
    mesh = sharding_lib.make_mesh(data=1, model=1)
    placed, layout = sharding_lib.prepare({"target": specjax.Model(params, module)}, 1, mesh)
    assert layout is not None and placed["target"].module.matmul == "xla"
    # Refused with the other checks, before any param is placed.
    kernel = specjax.Model(params, _tiny_decoder(matmul="kernel"))
    with pytest.raises(ValueError, match="one device"):
        sharding_lib.prepare({"target": kernel}, 1, mesh)
