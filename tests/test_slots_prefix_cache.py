"""The slots engine's prefix cache: a prompt that begins with cached blocks decodes exactly what it
decodes from a cold cache, and nothing is reused that was computed for other tokens or another model."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from _slot_runs import run_until_done
import specjax
from specjax._src.engine.prefix_cache import BLOCK, PrefixCache, usable_blocks
from specjax._src.models import feature_head_build as fhb
from specjax._src.serve import scheduler as sched
from specjax.engine import Engine, SlotSettings
from specjax.testing import llama_config, peaked_target_and_draft

K, CAPACITY, LOGPROBS = 3, 248, 2
GREEDY = SlotSettings(temperature=0.0, max_new_tokens=16, logprobs=LOGPROBS)
SAMPLED = SlotSettings(temperature=0.8, seed=5, max_new_tokens=16, logprobs=LOGPROBS)
BIG = 1 << 30


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 96, n).tolist()


A = prompt(200)
B = A[:150] + prompt(80, seed=1)  # shares blocks 0 and 1 (tokens 0 .. 128) with A, not block 2


@pytest.fixture(scope="module")
def draft_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config(max_position_embeddings=320)))


@pytest.fixture(scope="module")
def engines(draft_pair):
    """A draft model with the n-gram lookup, and a feature head (its cache reads the target's features)."""
    target = draft_pair.target
    head = specjax.pair(target, fhb.init_from_target(target, jax.random.key(1), np.arange(80)[::-1]))
    lookup = specjax.drafting.ngram_lookup()
    return {
        "draft+lookup": Engine(
            draft_pair, num_slots=2, capacity=CAPACITY, num_draft=K, logprobs=LOGPROBS, lookup=lookup
        ),
        "head": Engine(head, num_slots=2, capacity=CAPACITY, num_draft=K, logprobs=LOGPROBS),
    }


def run(engine, state, slot: int):
    """Steps until ``slot`` is done (:func:`_slot_runs.run_until_done`)."""
    return run_until_done(engine, state, slot)[1:]


def cold(engine, ids, settings):
    return run(engine, engine.insert(engine.init(), 0, ids, settings), 0)


def from_cache(engine, cache, ids, settings, chunk=64):
    job, hit = cache.begin_insert(engine, engine.init(), 1, ids, settings, chunk=chunk)
    state = engine.init()
    while not job.finished:
        state, job = engine.continue_insert(state, job)
    cache.release(hit)
    return hit, run(engine, state, 1)


def decodes_otherwise(engine, ids, prefix) -> bool:
    """Whether ``ids`` inserted over ``prefix`` (``(caches, tokens)`` holding another prompt's entries)
    decodes other greedy tokens or log-probabilities than it does cold: a negative control."""
    job = engine.begin_insert(engine.init(), 1, ids, GREEDY, chunk=64, prefix=prefix)
    state = engine.init()
    while not job.finished:
        state, job = engine.continue_insert(state, job)
    got, got_logprobs = run(engine, state, 1)
    ref, ref_logprobs = cold(engine, ids, GREEDY)
    return got != ref or np.abs(got_logprobs - ref_logprobs).max() > 1e-3


# The draft model with the lookup reads whole blocks by default in test_prefix_cache_release.py
# (a finished request's blocks under the next turn) and partial ones below; here with -m slow.
@pytest.mark.parametrize("kind", [pytest.param("draft+lookup", marks=pytest.mark.slow), "head"])
def test_a_cached_prefix_decodes_what_a_cold_cache_does(engines, kind):
    """Greedy and sampled, a prompt whose first two blocks come from the cache gets the tokens and
    log-probabilities it gets cold; the negative control (another prompt's blocks under it) does not."""
    engine = engines[kind]
    cache = PrefixCache(BIG)
    state = engine.insert(engine.init(), 0, A, GREEDY)
    # Three whole blocks; the partial fourth (positions 192 .. 197) would not fit the 251-position buffers.
    assert cache.store(engine, state, 0, A) == usable_blocks(len(A)) == 3
    assert cache.num_blocks == 3 and cache.bytes == sum(b.nbytes for b in cache._blocks.values())
    for settings in (GREEDY, SAMPLED):
        hit, (tokens, logprobs) = from_cache(engine, cache, B, settings)
        assert hit.tokens == 2 * BLOCK
        ref_tokens, ref_logprobs = cold(engine, B, settings)
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)
    # A's own third block is reused by a prompt with A's first 193 tokens; so all three serve A itself.
    hit, (tokens, _) = from_cache(engine, cache, A, GREEDY)
    assert hit.tokens == 3 * BLOCK and tokens == cold(engine, A, GREEDY)[0]
    # Negative control: C shares no block with A; restored from A's blocks anyway, it decodes otherwise.
    c = prompt(200, seed=2)
    wrong = cache.match(engine, A)
    assert decodes_otherwise(engine, c, (cache.restore(engine, wrong), 2 * BLOCK))
    cache.release(wrong)


@pytest.mark.parametrize("kind", ["draft+lookup", "head"])
def test_a_prefix_cached_inside_a_block_resumes_there(engines, kind):
    """A prompt that agrees with a cached prompt into its last, partial block reads that block too:
    the prefill resumes inside it, its blocks ending at the prompt's last token, and decodes the
    tokens it decodes cold (log-probabilities within float rounding: other block boundaries). The
    negative control (another prompt's partial block under it) does not; a partial match that saves
    no block is not taken; a whole block that extends a partial one replaces it."""
    engine = engines[kind]
    cache = PrefixCache(BIG)
    first = A[:150]
    assert cache.store(engine, engine.insert(engine.init(), 0, first, GREEDY), 0, first) == 3  # 2 whole, positions 128 .. 147
    other = A[:130] + prompt(20, seed=6)  # agrees with `first` into block 2 for one position only
    assert cache.store(engine, engine.insert(engine.init(), 0, other, GREEDY), 0, other) == 1
    nxt = A[:149] + prompt(51, seed=5)  # 200 tokens: block 2 agrees through position 147
    for settings in (GREEDY, SAMPLED):
        hit, (tokens, logprobs) = from_cache(engine, cache, nxt, settings)
        assert hit.tokens == len(nxt) - BLOCK == 136 and len(hit.keys) == 3  # one block to prefill, not two
        ref_tokens, ref_logprobs = cold(engine, nxt, settings)
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4)
    # Negative control: `other`'s partial block restored under `nxt` (wrong from position 130 on).
    wrong = cache.match(engine, other + prompt(50, seed=7))
    right = cache.match(engine, nxt)
    assert wrong.tokens == 136 and wrong.keys[2] not in right.keys
    assert decodes_otherwise(engine, nxt, (cache.restore(engine, wrong), 136))
    # 190 tokens: from position 128 or from 148, one block either way; the whole blocks' hit stays exact.
    short = cache.match(engine, nxt[:190])
    assert short.tokens == 2 * BLOCK and len(short.keys) == 2
    # `nxt` stored whole through block 2: `first`'s partial block 2 is dropped (its tokens begin `nxt`'s).
    for h in (wrong, right, short):
        cache.release(h)
    before = cache.num_blocks
    assert cache.store(engine, engine.insert(engine.init(), 0, nxt, GREEDY), 0, nxt) == 1
    assert cache.num_blocks == before and cache.bytes == sum(b.nbytes for b in cache._blocks.values())
    assert cache.match(engine, nxt).tokens == 3 * BLOCK
    # Two blocks after the resumption (block 1 agrees through position 117; 229 - 2 x 64 = 101), in
    # one chunk of 256 (its last two blocks not run) and in two of 64: the same tokens as cold.
    longer = A[:119] + prompt(110, seed=8)
    for chunk in (256, 64):
        hit, (tokens, logprobs) = from_cache(engine, cache, longer, GREEDY, chunk=chunk)
        ref_tokens, ref_logprobs = cold(engine, longer, GREEDY)
        assert hit.tokens == 101 and tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4)
    # The engine takes a start off the block grid only where its blocks end at the prompt's last token.
    with pytest.raises(ValueError, match="multiple of 64 or the prompt's length"):
        engine.begin_insert(engine.init(), 1, nxt, GREEDY, chunk=64, prefix=(engine.empty_prefill_caches(), 130))


def test_blocks_are_keyed_by_their_tokens_and_the_model(engines, draft_pair):
    engine = engines["draft+lookup"]
    cache = PrefixCache(BIG)
    cache.store(engine, engine.insert(engine.init(), 0, A, GREEDY), 0, A)
    assert cache.match(engine, A).tokens == 3 * BLOCK
    # One token changed in block 1: block 0 is reused whole, block 1 through position 98 (the token
    # after it differs), and the prefill resumes at 200 - 2 x 64 = 72: two blocks, where three
    # would run from position 64.
    changed = list(A)
    changed[100] = (changed[100] + 1) % 96
    assert cache.match(engine, changed).tokens == len(A) - 2 * BLOCK
    # The token after a block (a feature head's draft entry reads it) is part of the block's key:
    # block 0 is not reused whole, its first 63 positions are (the prefill resumes at 8: 3 blocks).
    after = list(A)
    after[BLOCK] = (after[BLOCK] + 1) % 96
    hit = cache.match(engine, after)
    assert hit.tokens == len(A) - 3 * BLOCK and len(hit.keys) == 1
    # A prompt too short to keep a block's last position in both caches takes it in part.
    assert cache.match(engine, A[: BLOCK + 1]).tokens == 1 and cache.match(engine, A[: BLOCK + 2]).tokens == BLOCK
    # A block whose stored tokens disagree with its key (a hash collision) is never reused.
    first = next(b for b in cache._blocks.values() if b.parent == cache.identity(engine))
    first.tokens = first.tokens.copy()
    first.tokens[3] += 1
    assert cache.match(engine, A).tokens == 0
    # Another model, even of the same shapes (one weight changed), never reads these blocks.
    params = draft_pair.target.params
    leaves, treedef = jax.tree_util.tree_flatten(params)
    leaves[0] = leaves[0] * 1.001
    other = specjax.pair(
        draft_pair.target.replace(params=jax.tree_util.tree_unflatten(treedef, leaves)), draft_pair.draft
    )
    twin = Engine(
        other, num_slots=2, capacity=CAPACITY, num_draft=K, logprobs=LOGPROBS, lookup=specjax.drafting.ngram_lookup()
    )
    fresh = PrefixCache(BIG)
    fresh.store(engine, engine.insert(engine.init(), 0, A, GREEDY), 0, A)
    assert fresh.match(engine, A).tokens == 3 * BLOCK and fresh.match(twin, A).tokens == 0
    assert PrefixCache(BIG, namespace="template 2").identity(engine) != fresh.identity(engine)


def test_eviction_is_least_recently_used_and_spares_pinned_blocks(engines):
    engine = engines["draft+lookup"]
    state = engine.insert(engine.init(), 0, A, GREEDY)
    block_bytes = PrefixCache(BIG)
    block_bytes.store(engine, state, 0, A[: BLOCK + 2])
    size = block_bytes.bytes
    cache = PrefixCache(2 * size)
    assert cache.store(engine, state, 0, A) == 2 and cache.bytes == 2 * size  # the third does not fit
    hit = cache.match(engine, A)  # pins both
    other = prompt(200, seed=3)
    state_other = engine.insert(engine.init(), 0, other, GREEDY)
    assert cache.store(engine, state_other, 0, other) == 0  # every block is pinned: nothing is evicted
    assert cache.match(engine, A).tokens == 2 * BLOCK and cache.evictions == 0
    cache.release(hit)
    cache.release(hit)
    assert cache.store(engine, state_other, 0, other) == 2 and cache.evictions == 2
    assert cache.match(engine, A).tokens == 0 and cache.bytes <= cache.budget_bytes
    # Least recently used first: of A's chain and another block, the one not matched since goes.
    cache = PrefixCache(3 * size)
    cache.store(engine, state, 0, A[: 2 * BLOCK + 2])  # A's blocks 0 and 1
    cache.store(engine, state_other, 0, other[: BLOCK + 2])  # other's block 0
    cache.release(cache.match(engine, A))  # A's blocks are now the most recently used
    third = prompt(66, seed=4)  # one whole block, no partial one
    assert cache.store(engine, engine.insert(engine.init(), 0, third, GREEDY), 0, third) == 1
    assert cache.match(engine, other).tokens == 0 and cache.match(engine, A).tokens == 2 * BLOCK


def test_the_scheduler_reports_cached_tokens_and_serves_them_exactly(engines):
    """A request sharing a prefilled prompt's blocks is served from them (``Done.cached_tokens``),
    with the tokens it gets from a cold scheduler; the hit rate and bytes are in the metrics."""
    engine = engines["head"]
    results = {}
    for label, cache in (("cold", None), ("cached", PrefixCache(BIG))):
        scheduler = sched.Scheduler(
            engine,
            _NoText(),
            num_cycles=2,
            warmup_widths=(16,),
            prefill_chunk=64,
            prefill_groups=[1],
            prefix_cache=cache,
        ).start()
        assert scheduler.ready.wait(300)
        done = []
        for ids in (A, B):
            events = []
            request = sched.Request(prompt=ids, settings=GREEDY._replace(logprobs=None), emit=events.append)
            scheduler.submit(request)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not any(isinstance(e, (sched.Done, sched.Failed)) for e in events):
                time.sleep(0.05)
            done.append(
                (
                    "".join(e.text for e in events if isinstance(e, sched.Delta)),
                    next(e for e in events if isinstance(e, sched.Done)),
                )
            )
        metrics = scheduler.metrics()
        scheduler.close(drain_seconds=5)
        results[label] = (done, metrics)
    (cold_done, cold_metrics), (cached_done, cached_metrics) = results["cold"], results["cached"]
    assert [text for text, _ in cached_done] == [text for text, _ in cold_done] and cold_done[1][0]
    assert [d.cached_tokens for _, d in cached_done] == [0, 2 * BLOCK]
    assert [d.cached_tokens for _, d in cold_done] == [0, 0] and cold_metrics["prefix_cache"] is None
    stats = cached_metrics["prefix_cache"]
    assert stats["hit_tokens"] == 2 * BLOCK and stats["queried_tokens"] == len(A) + len(B)
    assert stats["blocks"] == 3 + 1 and 0 < stats["bytes"] <= stats["budget_bytes"]


class _NoText:
    """A tokenizer stand-in that decodes every id to one character (the scheduler's text streams)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)
