"""switch_in_place / cond_in_place: lax.switch's results, without XLA's copies.

A conditional whose branch writes a buffer in place makes XLA copy that
buffer (the KV cache, on every cycle); the while-loop form must not.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from specjax._src.engine.ops import cond_in_place, switch_in_place

ROWS, COLS = 64, 512


def _writer(width: int, offset):
    def run(carry):
        total, buf = carry
        update = jax.lax.dynamic_slice(buf, (0, 0), (1, COLS)) + jnp.arange(width, dtype=buf.dtype)[:, None] + 1.0
        return total + width, jax.lax.dynamic_update_slice(buf, update, (offset, 0))
    return run


def _loop(switch):
    def body(i, carry):
        return switch(i % 3, [_writer(w, i % 32) for w in (1, 2, 4)], carry)
    return jax.jit(lambda buf: jax.lax.fori_loop(0, 9, body, (jnp.int32(0), buf)))


def _buffer_copies(fn, buf) -> int:
    text = fn.lower(buf).compile().as_text()
    return len(re.findall(rf"f32\[{ROWS},{COLS}\]\{{1,0\}} copy\(", text))


def test_switch_in_place_gives_lax_switch_results_without_copies():
    buf = jnp.asarray(np.random.default_rng(0).normal(size=(ROWS, COLS)), jnp.float32)
    reference, in_place = _loop(jax.lax.switch), _loop(switch_in_place)
    want, got = reference(buf), in_place(buf)
    assert int(got[0]) == int(want[0]) == 3 * (1 + 2 + 4)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    # lax.switch copies the buffer inside its branches; the while-loop form
    # at most once, outside the loop (the argument is not donated).
    assert _buffer_copies(reference, buf) > 1
    assert _buffer_copies(in_place, buf) <= 1


def test_cond_in_place_takes_the_branch_its_predicate_names():
    carry = (jnp.int32(0), jnp.zeros((ROWS, COLS), jnp.float32))
    for pred, width in ((True, 1), (False, 4)):
        total, buf = jax.jit(lambda p, c: cond_in_place(p, _writer(1, 3), _writer(4, 3), c))(jnp.asarray(pred), carry)
        assert int(total) == width
        assert np.asarray(buf)[3 : 3 + width].min() > 0 and np.asarray(buf)[3 + width :].max() == 0
