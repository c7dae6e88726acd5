"""The per-row warps and logits processors are skipped only where skipping changes nothing.

The engine's cycle runs the vocabulary-wide top-k / top-p sorts and the
processors' counts only when a live row needs them (a traced predicate);
these tests check the predicates at their edges and that the warp of a batch
equals the rows' own warps whether or not the filters run.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax._src.logits import processors as P
from specjax._src.logits import sampling
from specjax._src.engine.cycle import live_settings as _live_settings
from specjax._src.engine.ops import warp
from specjax.engine import LoopConfig

V = 50
CFG = LoopConfig(diagnostics=None, num_draft=2, max_new_tokens=8, cache_length=16, greedy=False, top_k=None,
                 use_top_p=True)


def _controls(**fields):
    rows = P.controls_rows([P.GenerationControls(**f) for f in fields.get("rows", [{}])], 4)
    return P.Controls(**{k: jnp.asarray(v) for k, v in rows.items()})


@pytest.mark.parametrize("row, generated, expected", [
    ({}, 0, False),
    ({"repetition_penalty": 1.2}, 0, True),
    ({"presence_penalty": 0.5}, 0, True),
    ({"frequency_penalty": -0.5}, 0, True),
    ({"logit_bias": {3: 1.0}}, 0, True),
    ({"min_new_tokens": 5}, 4, True),  # one more token is still early
    ({"min_new_tokens": 5}, 5, False),  # reached: the EOS mask is off from here on
])
def test_changes_logits_at_the_edges(row, generated, expected):
    controls = _controls(rows=[{}, row])
    live = jnp.array([True, True])
    got = P.changes_logits(P.BUILTIN_PROCESSORS, controls, jnp.array([0, generated]), live)
    assert bool(got) is expected
    # A finished row's controls never count.
    assert not bool(P.changes_logits(P.BUILTIN_PROCESSORS, controls, jnp.array([0, generated]),
                                     jnp.array([True, False])))


def test_other_processors_always_run():
    custom = lambda logits, ctx: logits.at[0].set(-jnp.inf)  # noqa: E731 - changes logits at default controls
    assert P.changes_logits((custom,), _controls(), jnp.array([0]), jnp.array([True])) is None


def test_skipped_processing_is_the_identity_and_active_processing_is_not():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, V)), jnp.float32)
    tokens = jnp.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 1, 2, 3]])
    controls = _controls(rows=[{}, {"repetition_penalty": 1.5}])
    block = jnp.array([[1, 2], [3, 4]])
    for active in (jnp.array(False), jnp.array(True)):
        hist = P.history(tokens, jnp.array([2, 2]), jnp.array([6, 6]), jnp.array([0]), V, active=active)
        out = P.process(P.BUILTIN_PROCESSORS, controls, hist, logits, block, 0)
        full = P.process(P.BUILTIN_PROCESSORS, controls, hist._replace(active=None), logits, block, 0)
        if bool(active):
            np.testing.assert_array_equal(out, full)
            assert not np.array_equal(out[1], logits[1])  # the penalty applied
        else:
            np.testing.assert_array_equal(out, logits)


def _rows(greedy, top_k):
    return P.RowSettings(greedy=jnp.asarray(greedy), top_k=jnp.asarray(top_k, jnp.int32))


def _alone(raw, t, p, k, greedy):
    """One row's warp, as a loop with that row's settings alone would do it."""
    if greedy:
        return raw
    return sampling.warp_logits(raw, t, k or None, p if p < 1.0 else None)


@pytest.mark.parametrize("greedy, top_k, top_p", [
    ([True, True], [0, 0], [1.0, 1.0]),  # nothing to filter: both sorts skipped
    ([True, True], [5, 0], [0.5, 1.0]),  # greedy rows' filters never run
    ([False, True], [0, 5], [1.0, 0.5]),  # a sampled row with no filter
    ([False, False], [5, 0], [1.0, 0.8]),  # each filter wanted by one row
    ([False, False], [3, 7], [0.6, 0.9]),
])
def test_warp_of_a_batch_is_each_rows_warp(greedy, top_k, top_p):
    raw = jnp.asarray(np.random.default_rng(1).normal(size=(2, V)) * 3, jnp.float32)
    t = jnp.array([0.7, 1.3])
    got = warp(CFG, raw, t, jnp.asarray(top_p, jnp.float32), _rows(greedy, top_k))
    for b in range(2):
        want = _alone(raw[b], float(t[b]), top_p[b], top_k[b], greedy[b])
        np.testing.assert_allclose(got[b], want, rtol=1e-6)


def test_finished_rows_filters_are_off():
    rows, top_p = _live_settings(_rows([False, False], [5, 5]), jnp.array([0.5, 0.5]), jnp.array([True, False]))
    np.testing.assert_array_equal(rows.top_k, [5, 0])
    np.testing.assert_array_equal(top_p, [0.5, 1.0])
