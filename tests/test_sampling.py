"""The vocabulary-wide primitives of the decode loop: argmax, inverse-CDF
sampling, the non-finite check and the rotary table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax._src.logits import sampling
from specjax import ModelConfig
from specjax._src.models import decoder


def _awkward_rows(vocab: int, rng) -> np.ndarray:
    x = rng.normal(size=(12, vocab)).astype(np.float32)
    x[0, :] = -np.inf  # no finite entry
    x[1, :] = 1.0  # ties everywhere: the first index wins
    x[2, vocab // 2] = np.nan
    x[3, vocab - 1] = np.inf
    x[4, :] = -np.inf
    x[4, vocab - 1] = 0.0  # the maximum in the padded last block
    x[5, 0] = x[5].max() + 1.0
    return x


@pytest.mark.parametrize("vocab", [1, 5, 64, 65, 200, 2048, 2049])
def test_argmax_and_nonfinite_rows_match_the_plain_versions(vocab):
    x = _awkward_rows(vocab, np.random.default_rng(vocab))
    got = np.asarray(jax.jit(sampling.argmax)(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    assert got.dtype == np.int32
    bad = np.isnan(x).any(-1) | np.isposinf(x).any(-1) | np.isneginf(x).all(-1)
    np.testing.assert_array_equal(np.asarray(jax.jit(sampling.nonfinite_rows)(x)), bad)


@pytest.mark.parametrize("vocab", [3, 64, 130, 2049])
def test_sample_categorical_follows_the_weights_and_never_draws_a_zero(vocab):
    rng = np.random.default_rng(vocab)
    weights = rng.random(vocab).astype(np.float32) * (rng.random(vocab) < 0.4)
    weights[vocab // 2], weights[-1] = 0.3, 0.2
    weights[0] = 0.0
    n = 100_000
    u = jax.random.uniform(jax.random.key(vocab), (n,))
    draw = jax.jit(jax.vmap(sampling.sample_categorical, in_axes=(None, 0)))
    counts = np.bincount(np.asarray(draw(jnp.asarray(weights), u)), minlength=vocab)
    assert counts[weights == 0].sum() == 0
    live = weights > 0
    expected = weights[live].astype(np.float64) / weights.sum(dtype=np.float64) * n  # unnormalized is fine
    assert stats.chisquare(counts[live], expected).pvalue > 1e-4


def test_sample_categorical_is_the_inverse_cdf_and_stops_at_the_last_positive_weight():
    weights = jnp.array([0.0, 0.25, 0.0, 0.25, 0.5, 0.0, 0.0], jnp.float32)
    draw = jax.jit(jax.vmap(sampling.sample_categorical, in_axes=(None, 0)))
    u = jnp.array([0.0, 0.2, 0.25, 0.49, 0.5, 0.99, 1.0 - 2**-24], jnp.float32)
    np.testing.assert_array_equal(np.asarray(draw(weights, u)), [1, 1, 3, 3, 4, 4, 4])
    # A distribution that is wrong on purpose is detected: the chi-square above can fail.
    counts = np.bincount(np.asarray(draw(weights, jax.random.uniform(jax.random.key(0), (20_000,)))), minlength=7)
    assert stats.chisquare(counts[[1, 3, 4]], [5_000, 10_000, 5_000]).pvalue < 1e-6


def test_rope_table_equals_the_on_device_angles():
    config = ModelConfig(model_type="llama", vocab_size=11, hidden_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=2, head_dim=32, intermediate_size=8, max_position_embeddings=512)
    inv_freq = decoder.rope_inv_freq(config)
    positions = jnp.array([[0, 1, 2], [250, 300, 511]], jnp.int32)
    table = decoder.rope_cos_sin(positions, inv_freq, 512)
    direct = decoder.rope_cos_sin(positions, inv_freq, None)
    for a, b in zip(table, direct):
        assert a.shape == (2, 3, 1, 16)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)


def test_top_indices_matches_lax_top_k():
    from specjax._src.logits.sampling import top_indices

    x = jax.random.normal(jax.random.key(0), (4, 6, 200))
    for k in (1, 3, 8, 12):
        np.testing.assert_array_equal(np.asarray(top_indices(x, k)), np.asarray(jax.lax.top_k(x, k)[1]))
    masked = jnp.array([[-jnp.inf, 3.0, -jnp.inf, 0.0, -jnp.inf]])  # fewer finite entries than k: distinct indices
    np.testing.assert_array_equal(np.asarray(top_indices(masked, 4)), np.asarray(jax.lax.top_k(masked, 4)[1]))
