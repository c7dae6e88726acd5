"""Defaults a user expects: a fresh recorded seed for key=None, EOS from the
model's config, and clear errors for inputs that used to go silently wrong
(issue 13's defaults, issue 14's temperature / float prompt / pad id rows).

Cheap models only: the bigram table, and the tests' tiny Decoder for EOS.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax import Decoder, Model
from specjax.rules import mars
from bigram import bigram_model, random_table
from tiny_models import llama_config, peaked_target_and_draft

VOCAB = 8


@pytest.fixture(scope="module")
def bigram_pair():
    return specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB)))


PROMPTS = [[1, 2, 3], [4, 5], [6]]


# ---------------------------------------------------------------------------
# key=None: a fresh seed, recorded
# ---------------------------------------------------------------------------


def test_design_card_call_without_a_key_runs(bigram_pair):
    out = specjax.decode(bigram_pair, PROMPTS, rule=mars(theta=.9))
    assert out.tokens.shape == (3, 64)
    np.testing.assert_array_equal(np.asarray(out.lengths), 64)
    assert isinstance(out.seed, int) and out.key is not None


def test_key_none_draws_a_fresh_recorded_seed_that_reproduces(bigram_pair):
    kw = dict(num_draft=3, max_new_tokens=24)
    a = specjax.decode(bigram_pair, PROMPTS, **kw)
    b = specjax.decode(bigram_pair, PROMPTS, **kw)
    assert a.seed != b.seed
    assert (np.asarray(a.tokens) != np.asarray(b.tokens)).any()
    for out in (a, b):
        # Passing the recorded key back, or a key built from the recorded seed,
        # reproduces the run exactly.
        for key in (out.key, jax.random.key(out.seed)):
            again = specjax.decode(bigram_pair, PROMPTS, key=key, **kw)
            np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))
            np.testing.assert_array_equal(np.asarray(again.lengths), np.asarray(out.lengths))
            assert again.seed is None and again.key is key  # a given key is recorded as given


def test_generate_records_its_seed_too(bigram_pair):
    kw = dict(max_new_tokens=24)
    a = specjax.generate(bigram_pair.target, PROMPTS, **kw)
    b = specjax.generate(bigram_pair.target, PROMPTS, **kw)
    assert a.seed != b.seed and (np.asarray(a.tokens) != np.asarray(b.tokens)).any()
    again = specjax.generate(bigram_pair.target, PROMPTS, key=a.key, **kw)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(a.tokens))


def test_greedy_needs_no_key_and_records_none(bigram_pair):
    out = specjax.decode(bigram_pair, PROMPTS, temperature=0.0, max_new_tokens=8)
    assert out.key is None and out.seed is None
    ref = specjax.generate(bigram_pair.target, PROMPTS, temperature=0.0, max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


# ---------------------------------------------------------------------------
# EOS from the model's config
# ---------------------------------------------------------------------------


def with_eos(model: Model, eos: int) -> Model:
    """The same weights behind a config that declares ``eos`` (as a checkpoint would)."""
    config = model.module.config.replace(eos_token_id=eos, eos_token_ids=(eos,))
    return Model(model.params, Decoder(config))


def test_a_decoder_stops_at_its_config_eos_by_default():
    target, draft = peaked_target_and_draft(llama_config())
    prompts = [[5, 17, 3], [40, 2], [11, 12, 13, 14]]
    kw = dict(num_draft=3, max_new_tokens=12, temperature=0.0)
    free = specjax.decode(specjax.pair(target, draft), prompts, **kw)
    free_toks = np.asarray(free.tokens)
    np.testing.assert_array_equal(np.asarray(free.lengths), 12)
    eos = int(free_toks[0, 4])  # a token the target emits mid-sequence
    pair = specjax.pair(with_eos(target, eos), draft)

    out = specjax.decode(pair, prompts, **kw)  # no eos_token_id: the config's
    gen = specjax.generate(pair, prompts, max_new_tokens=12, temperature=0.0)
    for res in (out, gen):
        lens, toks = np.asarray(res.lengths), np.asarray(res.tokens)
        for b in range(len(prompts)):
            row = free_toks[b].tolist()
            expected = row.index(eos) + 1 if eos in row else 12
            assert lens[b] == expected
            assert toks[b, : lens[b]].tolist() == row[:expected]
        assert (lens < 12).any()  # some sequences did stop at the EOS
    # eos_token_id=() disables it; an explicit id overrides the config's.
    off = specjax.decode(pair, prompts, eos_token_id=(), **kw)
    np.testing.assert_array_equal(np.asarray(off.tokens), free_toks)
    other = int(free_toks[1, 2])
    explicit = specjax.generate(pair, prompts, max_new_tokens=12, temperature=0.0, eos_token_id=other)
    assert int(explicit.lengths[1]) == free_toks[1].tolist().index(other) + 1


def test_config_eos_outside_the_vocabulary_is_ignored(bigram_pair):
    class WithConfig:
        """A bigram module whose config names an EOS id the pair cannot emit."""

        def __init__(self, inner):
            self.inner = inner
            self.config = type("Config", (), {"eos_token_ids": (VOCAB + 3,), "eos_token_id": VOCAB + 3})()

        def __getattr__(self, name):
            return getattr(self.inner, name)

    target = bigram_pair.target
    model = Model(target.params, WithConfig(target.module))
    out = specjax.generate(model, PROMPTS, temperature=0.0, max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(out.lengths), 8)


# ---------------------------------------------------------------------------
# Issue 14: inputs that used to go silently wrong
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 5e-7])
def test_a_temperature_too_small_to_sample_with_is_refused(bigram_pair, temperature):
    # Before: logits / 1e-38 overflowed float32 and every token came out 0.
    with pytest.raises(ValueError, match=r"temperature=.* too small.*temperature=0 for greedy"):
        specjax.decode(bigram_pair, PROMPTS, temperature=temperature, key=jax.random.key(0))
    with pytest.raises(ValueError, match="too small"):
        specjax.generate(bigram_pair.target, PROMPTS, temperature=temperature, key=jax.random.key(0))


def test_the_smallest_accepted_temperature_samples_like_greedy(bigram_pair):
    out = specjax.decode(bigram_pair, PROMPTS, temperature=1e-6, key=jax.random.key(0), max_new_tokens=8)
    ref = specjax.generate(bigram_pair.target, PROMPTS, temperature=0.0, max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


@pytest.mark.parametrize("prompts", [[[1.7, 2.2]], [1.7, 2.2], [[1, 2], [3, 4.5]], [[1.0, 2.0]]])
def test_float_prompts_are_refused_not_truncated(bigram_pair, prompts):
    # Before: [[1.7, 2.2]] was silently decoded as [[1, 2]].
    with pytest.raises(TypeError, match="integer token ids"):
        specjax.decode(bigram_pair, prompts, key=jax.random.key(0))
    with pytest.raises(TypeError, match="integer token ids"):
        specjax.generate(bigram_pair.target, prompts, key=jax.random.key(0))


@pytest.mark.parametrize("pad", [2**40, -(2**31) - 1, 1.5, True, "0"])
def test_pad_token_id_out_of_int32_is_refused_by_name(bigram_pair, pad):
    # Before: 2**40 raised an OverflowError from inside jax.numpy naming nothing.
    with pytest.raises(ValueError, match="pad_token_id"):
        specjax.decode(bigram_pair, PROMPTS, pad_token_id=pad, key=jax.random.key(0))
    with pytest.raises(ValueError, match="pad_token_id"):
        specjax.generate(bigram_pair.target, PROMPTS, pad_token_id=pad, key=jax.random.key(0))


def test_any_int32_pad_token_id_fills_after_the_end(bigram_pair):
    out = specjax.generate(
        bigram_pair.target, PROMPTS, temperature=0.0, max_new_tokens=8, eos_token_id=list(range(VOCAB)),
        pad_token_id=-1,
    )
    toks = np.asarray(out.tokens)
    np.testing.assert_array_equal(np.asarray(out.lengths), 1)  # every token is an EOS here
    assert (toks[:, 1:] == -1).all()


def test_sizes_given_as_floats_are_refused():
    """One check (specjax._src.foundation.checks) for every size: a float is a slip, said in one line."""
    from specjax.testing import bigram_model, random_table

    pair = specjax.pair(bigram_model(random_table(0, 8)), bigram_model(random_table(1, 8)))
    with pytest.raises(ValueError, match=r"num_draft \(K\) must be a positive integer, got 4.0"):
        specjax.decode(pair, [[1, 2]], num_draft=4.0, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 8.0"):
        specjax.generate(pair, [[1, 2]], max_new_tokens=8.0, temperature=0.0)
    with pytest.raises(ValueError, match=r"Buckets.prompt must be a positive integer, got 16.0"):
        specjax.decode(pair, [[1, 2]], buckets=specjax.Buckets(prompt=16.0), temperature=0.0)
