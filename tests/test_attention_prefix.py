"""Attention over a KV cache reads only the prefix the batch's longest row needs.

A step's queries see cache slots below ``max(lengths) + T`` only, so attention
reads the narrowest of :func:`attention_widths` that holds them, not the whole
capacity. Two kinds of check: slots past that width are filled with NaN, which
any read would spread into the output (a masked score still multiplies its
value by zero, and ``0 * NaN`` is NaN); and decoding in a long cache gives the
tokens it gives in a short one.
"""

from __future__ import annotations

import dataclasses
import re
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.models import exporting_for
from specjax._src.engine import loop as decode_lib
from specjax._src.models import feature_head_build as fhb
from specjax._src.models.decoder import Decoder, attention_widths
from specjax.testing import llama_config, peaked_target_and_draft
from specjax.trees import static_tree

LONG = 2048  # widths 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048
VOCAB = 96


def config(**overrides):
    return llama_config(max_position_embeddings=4096, **overrides)


def poisoned(cache, start: int):
    """``cache`` with NaN in every key and value slot from ``start`` on."""
    nan = lambda x: x.at[:, :, start:].set(jnp.nan)  # noqa: E731
    return cache.replace(keys=tuple(map(nan, cache.keys)), values=tuple(map(nan, cache.values)))


def prefilled(module, params, batch: int, length: int, **kw):
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (batch, length)), jnp.int32)
    if kw:  # a feature head reads features beside its tokens
        kw = {"features": jnp.ones((batch, length, module.hidden_size), jnp.float32)}
    return module.apply(params, prompt, module.init_cache(batch, LONG), **kw).cache


def test_widths_step_by_64_then_by_half_and_whole_powers_of_two_then_the_capacity():
    assert attention_widths(64) == (64,)
    assert attention_widths(341) == (341,)
    assert attention_widths(342) == (64, 128, 192, 256, 342)
    assert attention_widths(384) == (64, 128, 192, 256, 384)
    assert attention_widths(516) == (64, 128, 192, 256, 384, 516)  # the server's default slots
    assert attention_widths(2048) == (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    assert attention_widths(2052) == (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2052)
    for capacity in (342, 516, 1284, 2052, 5000):  # each width below the capacity saves a quarter of it
        widths = attention_widths(capacity)
        assert widths[-1] == capacity and all(4 * w <= 3 * capacity for w in widths[:-1])
        assert all(b <= 1.5 * a for a, b in zip(widths[3:-1], widths[4:-1]))  # past 256: at most 1.5x apart


@pytest.mark.parametrize("case", ["one token", "verify block", "tree", "sliding window", "rows of unequal length"])
def test_a_step_reads_no_slot_past_the_width_its_rows_need(case):
    """Rows of 20 cached tokens plus a block fit in 64 slots (with a row of 200, in 256): NaN
    from there on must not reach the logits, which equal the clean cache's."""
    cfg = config(sliding_window=8) if case == "sliding window" else config()
    model = Decoder(cfg)
    params = model.init(jax.random.key(0))
    cache = prefilled(model, params, 2, 20)
    if case == "rows of unequal length":
        cache = cache.replace(lengths=jnp.asarray([20, 200], jnp.int32))
    t = 1 if case == "one token" else 4
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, t)), jnp.int32)
    kw = {"tree_parents": np.asarray([-1, 0, 0, 1], np.int32)} if case == "tree" else {}
    step = jax.jit(lambda c: model.apply(params, tokens, c, **kw).logits)
    clean, dirty = step(cache), step(poisoned(cache, 256 if case == "rows of unequal length" else 64))
    assert np.isfinite(np.asarray(dirty)).all(), "attention read cache slots past the width its rows need"
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_a_feature_head_step_reads_no_slot_past_the_width():
    target = peaked_target_and_draft(config())[0]
    head = fhb.init_from_target(target, jax.random.key(1), np.arange(80))
    module, params = head.module, head.params
    cache = prefilled(module, params, 2, 20, features=True)
    tokens = jnp.ones((2, 3), jnp.int32)
    feats = jnp.ones((2, 3, module.hidden_size), jnp.float32)
    step = jax.jit(lambda c: module.apply(params, tokens, c, features=feats).logits)
    clean, dirty = step(cache), step(poisoned(cache, 256))
    assert not np.isnan(np.asarray(dirty)).any(), "the head's attention read cache slots past the width"
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def test_a_row_past_a_width_reads_the_next_one():
    """A row at 300 cached tokens needs 384 slots: NaN from 384 stays out, and
    the slots between 300 and 384 are read (NaN there shows up, masked or not)."""
    model = Decoder(config())
    params = model.init(jax.random.key(0))
    cache = prefilled(model, params, 1, 20).replace(lengths=jnp.asarray([300], jnp.int32))
    step = jax.jit(lambda c: model.apply(params, jnp.ones((1, 1), jnp.int32), c).logits)
    assert np.isfinite(np.asarray(step(poisoned(cache, 384)))).all()
    assert not np.isfinite(np.asarray(step(poisoned(cache, 350)))).all()


@pytest.mark.parametrize("reads,want", [
    ("auto", {"tpu": attention_widths(LONG), "cuda": (LONG,)}),
    ("prefix", {"tpu": attention_widths(LONG), "cuda": attention_widths(LONG)}),
    ("whole", {"tpu": (LONG,), "cuda": (LONG,)}),
])
def test_what_each_platform_reads(reads, want):
    """Exported, a one-token step attends over the widths 256 ... 2048 (a switch)
    where it reads a prefix, over all 2048 slots where it reads the whole
    buffer: by default TPU the prefix, CUDA (where a conditional waits on the
    host) the whole buffer."""
    model = Decoder(config(), attention_reads=reads)
    params = model.init(jax.random.key(0))
    cache = model.init_cache(1, LONG)
    step = jax.jit(lambda p, c: model.apply(p, jnp.ones((1, 1), jnp.int32), c).logits)
    got = {}
    for platform in ("tpu", "cuda"):
        with exporting_for(platform):
            text = jax.export.export(step, platforms=(platform,))(params, cache).mlir_module()
        # the scores' shapes [B, K, G, T, width] (2 kv heads of 2 queries each)
        got[platform] = tuple(sorted({int(w) for w in re.findall(r"tensor<1x2x2x1x(\d+)xf32>", text)}
                                     & set(attention_widths(LONG))))
    assert got == want


def test_reading_the_whole_buffer_reads_the_poison():
    """The NaN check above can fail: a model told to read the whole buffer spreads it."""
    model = Decoder(config(), attention_reads="whole")
    params = model.init(jax.random.key(0))
    cache = poisoned(prefilled(model, params, 1, 20), 256)
    logits = model.apply(params, jnp.ones((1, 1), jnp.int32), cache).logits
    assert np.isnan(np.asarray(logits)).all()


def test_a_bad_attention_reads_is_refused():
    with pytest.raises(ValueError, match="attention_reads must be one of"):
        Decoder(config(), attention_reads="some")


def test_the_cache_is_written_in_place_in_a_loop_of_steps():
    """The switch over widths only reads: a branch that wrote the cache would
    make XLA copy the whole buffer on every step."""
    model = Decoder(config())
    params = model.init(jax.random.key(0))

    def steps(params, cache):
        def body(i, carry):
            cache, tok = carry
            out = model.apply(params, tok, cache)
            return out.cache, out.logits.argmax(-1).astype(jnp.int32)
        return jax.lax.fori_loop(0, 4, body, (cache, jnp.ones((2, 1), jnp.int32)))

    hlo = jax.jit(steps, donate_argnums=1).lower(params, model.init_cache(2, LONG)).compile().as_text()
    copies = re.findall(rf"= f32\[2,2,{LONG},8\]\{{[0-9,]*\}} copy\(", hlo)
    assert " conditional(" in hlo and copies == [], f"{len(copies)} copies of a whole cache buffer per step"


def _generate_loop_cache_copies(target) -> int:
    """Copies of a whole cache buffer in the loop body of ``generate``'s compiled program
    (a 48-slot cache: one width)."""
    jitted = decode_lib._generate_jit
    captured = {}

    def spy(*args, **kwargs):
        captured.setdefault("hlo", jitted.lower(*args, **kwargs).compile().as_text())
        return jitted(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_lib, "_generate_jit", spy)
        specjax.generate(target, [list(range(1, 33))], max_new_tokens=16)
    hlo = captured["hlo"]
    computations = dict(re.findall(r"\n%(\S+) \([^\n]*\{\n(.*?)\n\}\n", hlo, re.S))
    body = computations[re.findall(r"while\([^\n]*?body=%([^,\s]+)", hlo)[-1]]
    return len(re.findall(r"= f32\[1,2,48,8\]\{3,2,1,0\} copy\(", body))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the conditional is CPU-only")
def test_one_width_reads_the_cache_where_it_lies_on_the_cpu():
    """With one key width, XLA:CPU fused the cache write into the attention's operand and
    copied the whole buffer four times per layer and step; read through a conditional (the
    default), the loop copies none. The control, the read straight after the write
    (``attention_reads="whole"``), shows the copies."""
    target = peaked_target_and_draft(config())[0]
    after_the_write = target.replace(module=dataclasses.replace(target.module, attention_reads="whole"))
    assert attention_widths(48) == (48,)
    assert _generate_loop_cache_copies(target) == 0
    assert _generate_loop_cache_copies(after_the_write) > 0


@pytest.fixture(scope="module")
def pair():
    return specjax.pair(*peaked_target_and_draft(config()))


def prompts(lengths):
    rng = np.random.default_rng(4)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("case", ["chain", "tree", "feature head", "generate"])
def test_a_long_cache_decodes_what_a_short_one_does(pair, case):
    """Greedy tokens in a 2048-slot cache equal those in the cache ``decode``
    sizes itself (one width, the whole buffer); a 250-token prompt grows past
    256 slots, so its row switches widths while it decodes."""
    kw = dict(max_new_tokens=24, temperature=0.0)
    if case == "feature head":
        target = pair.target
        pair = specjax.pair(target, fhb.init_from_target(target, jax.random.key(1), np.arange(80)))
    if case == "tree":
        kw["tree"] = static_tree((2, 2))
    elif case != "generate":
        kw["num_draft"] = 3
    run = specjax.generate if case == "generate" else specjax.decode
    batch = prompts([5, 250, 12])
    short = run(pair, batch, **kw)
    long = run(pair, batch, max_length=LONG, **kw)
    np.testing.assert_array_equal(np.asarray(long.tokens), np.asarray(short.tokens))


def widened(cache, rows: int):
    """``cache``'s buffers as the first rows of ``rows``-row buffers whose other rows are NaN
    (its lengths kept: the batch is still ``cache``'s)."""
    def wide(x):
        return jnp.full((rows,) + x.shape[1:], jnp.nan, x.dtype).at[: x.shape[0]].set(x)
    return cache.replace(keys=tuple(map(wide, cache.keys)), values=tuple(map(wide, cache.values)))


@pytest.mark.parametrize("batch,rows,t", [(1, 4, 1), (2, 4, 4), (9, 12, 2)])
def test_a_batch_steps_the_leading_rows_of_wider_buffers(batch, rows, t):
    """The slots engine steps its leading rows over its whole cache buffers: a batch of
    ``batch`` rows with buffers of ``rows`` rows reads and writes only the first ``batch``
    (NaN in the others stays out of the logits and stays where it was), and gives the
    logits and cache rows of its own buffers (9 rows: the looped writer, past 8)."""
    model = Decoder(config())
    params = model.init(jax.random.key(0))
    cache = prefilled(model, params, batch, 20)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (batch, t)), jnp.int32)
    step = jax.jit(lambda c: model.apply(params, tokens, c))
    own, wide = step(cache), step(widened(cache, rows))
    assert np.isfinite(np.asarray(wide.logits)).all(), "attention read rows past the batch"
    np.testing.assert_array_equal(np.asarray(wide.logits), np.asarray(own.logits))
    for got, want in zip(wide.cache.keys + wide.cache.values, own.cache.keys + own.cache.values):
        assert got.shape[0] == rows
        np.testing.assert_array_equal(np.asarray(got[:batch]), np.asarray(want))
        assert np.isnan(np.asarray(got[batch:])).all(), "a write reached rows past the batch"
