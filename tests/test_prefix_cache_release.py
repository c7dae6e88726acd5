"""A finished request's generated tokens go into the prefix cache too, and a prompt the cache mostly
covers is prefilled before a long cold one: a conversation's next turn, which resends the reply,
decodes from its whole cached history what it decodes from a cold cache."""

from __future__ import annotations

import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from _slot_runs import run_until_done
import specjax
from specjax._src.engine.prefix_cache import BLOCK, PrefixCache, blocks_in_common
from specjax._src.models import feature_head_build as fhb
from specjax._src.serve import scheduler as sched
from specjax.engine import Engine, SlotSettings
from specjax.testing import llama_config, peaked_target_and_draft

K, CAPACITY, LOGPROBS = 3, 248, 2
GREEDY = SlotSettings(temperature=0.0, max_new_tokens=32, logprobs=LOGPROBS, eos_token_id=())
SAMPLED = SlotSettings(temperature=0.8, seed=5, max_new_tokens=16, logprobs=LOGPROBS, eos_token_id=())
BIG = 1 << 30


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 96, n).tolist()


A = prompt(170)  # its insert stores 2 blocks ((170 - 2) // 64); with 32 generated tokens, a third is whole


@pytest.fixture(scope="module")
def engines():
    """A feature head (its cache reads the target's features) and a draft model with the n-gram lookup."""
    pair = specjax.pair(*peaked_target_and_draft(llama_config(max_position_embeddings=320)))
    head = specjax.pair(pair.target, fhb.init_from_target(pair.target, jax.random.key(1), np.arange(80)[::-1]))
    return {
        "head": Engine(head, num_slots=2, capacity=CAPACITY, num_draft=K, logprobs=LOGPROBS),
        "draft+lookup": Engine(pair, num_slots=2, capacity=CAPACITY, num_draft=K, logprobs=LOGPROBS,
                               lookup=specjax.drafting.ngram_lookup()),
    }


def run(engine, state, slot: int):
    """Steps until ``slot`` is done (:func:`_slot_runs.run_until_done`)."""
    return run_until_done(engine, state, slot)


def cached_lengths(state, slot: int) -> int:
    loop = state.loop
    return min(int(loop.target_cache.lengths[slot]), int(loop.draft_cache.lengths[slot]))


def from_cache(engine, cache, ids, settings):
    job, hit = cache.begin_insert(engine, engine.init(), 1, ids, settings, chunk=64)
    state = engine.init()
    while not job.finished:
        state, job = engine.continue_insert(state, job)
    cache.release(hit)
    return hit, run(engine, state, 1)[1:]


@pytest.mark.parametrize("kind", ["head", "draft+lookup"])
def test_a_finished_request_stores_its_reply_and_the_next_turn_decodes_exactly(engines, kind):
    """The blocks of a finished request's prompt and reply (up to the caches' lengths) serve the next
    turn's prompt, which decodes the tokens and log-probabilities it decodes cold; the negative
    control (blocks read from a slot that holds other tokens past the prompt) does not."""
    engine = engines[kind]
    state, reply, _ = run(engine, engine.insert(engine.init(), 0, A, GREEDY), 0)
    assert len(reply) == 32
    history = A + reply
    cached = cached_lengths(state, 0)
    assert len(A) + 16 < cached < len(history)  # the caches hold the reply's entries but its last
    cache = PrefixCache(BIG)
    assert cache.store(engine, state, 0, history, cached=cached) == 3  # blocks 0, 1 and 2 (positions 0 .. 191)
    nxt = history + prompt(20, seed=7)  # the next turn: the history resent, a question added
    for settings in (GREEDY._replace(max_new_tokens=16), SAMPLED):
        hit, (tokens, logprobs) = from_cache(engine, cache, nxt, settings)
        assert hit.tokens == 3 * BLOCK
        _, ref_tokens, ref_logprobs = run(engine, engine.insert(engine.init(), 0, nxt, settings), 0)
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)
    # Negative control: a slot that holds A then other tokens, its blocks stored as A's history.
    other = engine.insert(engine.init(), 0, A + prompt(40, seed=8), GREEDY)
    wrong = PrefixCache(BIG)
    assert wrong.store(engine, other, 0, history, cached=len(A) + 38) == 3
    hit, (tokens, logprobs) = from_cache(engine, wrong, nxt, GREEDY._replace(max_new_tokens=16))
    _, ref_tokens, ref_logprobs = run(engine, engine.insert(engine.init(), 0, nxt, GREEDY._replace(max_new_tokens=16)),
                                      0)
    assert hit.tokens == 3 * BLOCK
    assert tokens != ref_tokens or np.abs(logprobs - ref_logprobs).max() > 1e-3


def test_store_takes_the_positions_below_the_cached_ones(engines):
    """Whole blocks, then the rest as one partial block, which a whole block over it replaces."""
    engine = engines["head"]
    state = engine.insert(engine.init(), 0, A, GREEDY)
    cache = PrefixCache(BIG)
    assert cache.store(engine, state, 0, A, cached=BLOCK - 1) == 1  # block 0's first 63 positions
    assert cache.store(engine, state, 0, A, cached=BLOCK - 2) == 0  # held by that block already
    assert cache.store(engine, state, 0, A, cached=BLOCK) == 1 and cache.num_blocks == 1  # whole: it replaces it
    assert cache.store(engine, state, 0, A[: BLOCK + 1], cached=10 * BLOCK) == 0  # block 0 and the token after it
    assert cache.store(engine, state, 0, A) == 2  # the default: len - 2 positions: block 1, and 40 of block 2
    assert cache.num_blocks == 3 and [b.positions for b in cache._blocks.values()] == [BLOCK, BLOCK, 40]


class _NoText:
    """A tokenizer stand-in that decodes every id to one character (the scheduler's text streams)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def _request(ids, settings):
    events = []
    return sched.Request(prompt=ids, settings=settings, emit=events.append), events


def _wait(events, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [e for e in events if isinstance(e, (sched.Done, sched.Failed))]
        if done:
            assert isinstance(done[0], sched.Done), done[0]
            return [t for e in events if isinstance(e, sched.Delta) for t in e.tokens], done[0]
        time.sleep(0.02)
    raise AssertionError("the request did not finish")


# Whole blocks alone (the history ending past block 2) with -m slow: the default case reads two whole
# blocks and a partial one, and whole blocks alone are checked on the engine above.
@pytest.mark.parametrize("first", [pytest.param(A, marks=pytest.mark.slow), A[:150]],
                         ids=["whole-blocks", "inside-a-block"])
def test_the_scheduler_serves_a_conversation_from_its_whole_history(engines, first):
    """Turn 2 of a conversation reads turn 1's prompt and reply from the cache and decodes what a
    cold engine decodes: three whole blocks, where the prompt alone gives two; or, where the
    history ends inside block 2, that block's positions too, the prefill resuming one block before
    the prompt's end (one block to prefill, where whole blocks leave two)."""
    engine = engines["head"]
    settings = GREEDY._replace(logprobs=0)  # (the events then carry their tokens)
    scheduler = sched.Scheduler(engine, _NoText(), num_cycles=2, warmup_widths=(16,), prefill_chunk=64,
                                prefill_groups=[1], prefix_cache=PrefixCache(BIG)).start()
    try:
        assert scheduler.ready.wait(300)
        request, events = _request(first, settings)
        scheduler.submit(request)
        reply, done = _wait(events)
        assert done.cached_tokens == 0 and len(reply) == 32
        nxt = first + reply + prompt(20, seed=7)
        request, events = _request(nxt, settings._replace(max_new_tokens=16))
        scheduler.submit(request)
        tokens, done = _wait(events)
        assert done.cached_tokens == (3 * BLOCK if first is A else len(nxt) - BLOCK)
    finally:
        scheduler.close(drain_seconds=5)
    _, ref, _ = run(engine, engine.insert(engine.init(), 0, nxt, GREEDY._replace(max_new_tokens=16)), 0)
    assert tokens == ref


def test_a_mostly_cached_prompt_is_prefilled_before_a_long_cold_one(engines):
    """Of two chunked prefills, the one with fewer chunks left runs first though it began later; the
    one passed over gains a chunk of priority each time, so it is not starved."""
    engine = engines["head"]
    state, reply, _ = run(engine, engine.insert(engine.init(), 0, A, GREEDY), 0)
    cache = PrefixCache(BIG)
    cache.store(engine, state, 0, A + reply, cached=cached_lengths(state, 0))
    scheduler = sched.Scheduler(engine, _NoText(), prefill_chunk=64, prefill_groups=[1], prefix_cache=cache)
    settings = GREEDY._replace(logprobs=None, max_new_tokens=4)
    cold, _ = _request(prompt(200, seed=9), settings)
    warm, _ = _request(A + reply + prompt(20, seed=7), settings)
    state = engine.init()
    scheduler._begin(state, [0], cold)  # older: begun first
    scheduler._begin(state, [1], warm, cache.match(engine, warm.prompt))
    assert [p.job.chunks_left for p in scheduler._pending.values()] == [4, 1]
    state = scheduler._prefill_chunk(state)
    assert list(scheduler._live) == [1] and scheduler._pending[0].job.chunks_left == 4  # the cached one went live
    assert scheduler._pending[0].passed == 1
    while scheduler._pending:
        state = scheduler._prefill_chunk(state)
    assert sorted(scheduler._live) == [0, 1]


def test_requests_finishing_in_one_step_each_store_their_reply(engines):
    """Two requests that finish in the same cycle (one token a cycle, admitted together) each leave
    their prompt and reply in the cache; the next turn of either reads it."""
    engine = engines["head"]
    cache = PrefixCache(BIG)
    scheduler = sched.Scheduler(engine, _NoText(), num_cycles=2, warmup_widths=(16,), prefill_chunk=64,
                                prefill_groups=[1, 2], prefix_cache=cache).start()
    settings = GREEDY._replace(logprobs=0, num_draft=0)
    try:
        assert scheduler.ready.wait(300)
        first = [prompt(60, seed=11), prompt(60, seed=12)]  # under one block each: only their replies give one
        with scheduler.paused():
            pending = [_request(ids, settings) for ids in first]
            for request, _ in pending:
                scheduler.submit(request)
        replies = [_wait(events)[0] for _, events in pending]
        # Each: its whole block 0 and a partial block 1 (the insert's partial block 0 gave way).
        assert scheduler.error is None and cache.num_blocks == 4
        request, events = _request(first[1] + replies[1] + prompt(5, seed=13), settings._replace(max_new_tokens=4))
        scheduler.submit(request)
        assert _wait(events)[1].cached_tokens == BLOCK
    finally:
        scheduler.close(drain_seconds=5)


def test_requests_sent_at_once_with_one_long_prefix_prefill_it_once(engines):
    """Three requests admitted together whose prompts share a 3-block system prompt: the first
    prefills it cold, the other two wait for its blocks and read them from the cache (the old
    scheduler prefilled all three cold: cached tokens 0), and each decodes what it decodes alone."""
    engine = engines["head"]
    system = prompt(200, seed=21)
    prompts = [system + prompt(10, seed=30 + i) for i in range(3)]
    assert blocks_in_common(prompts[0], prompts[1]) == 3 and blocks_in_common(prompts[0], prompt(200)) == 0
    settings = GREEDY._replace(logprobs=0, max_new_tokens=6)
    scheduler = sched.Scheduler(engine, _NoText(), num_cycles=2, warmup_widths=(16,), prefill_chunk=64,
                                prefill_groups=[1], prefix_cache=PrefixCache(BIG)).start()
    try:
        assert scheduler.ready.wait(300)
        with scheduler.paused():
            pending = [_request(ids, settings) for ids in prompts]
            for request, _ in pending:
                scheduler.submit(request)
        results = [_wait(events) for _, events in pending]
    finally:
        scheduler.close(drain_seconds=5)
    assert scheduler.error is None
    assert [done.cached_tokens for _, done in results] == [0, 3 * BLOCK, 3 * BLOCK]
    for ids, (tokens, _) in zip(prompts, results):
        _, ref, _ = run(engine, engine.insert(engine.init(), 0, ids, settings), 0)
        assert tokens == ref


def test_a_request_waits_only_for_a_prefill_that_gives_it_enough(engines):
    """A request waits for an in-flight prefill when it would read at least half as many of its
    positions as that prefill has left; not for one block of a long prompt, not for blocks already
    cached, not for a prompt it shares nothing with."""
    scheduler = sched.Scheduler(engines["head"], _NoText(), prefill_chunk=64, prefix_cache=PrefixCache(BIG))
    system = prompt(600, seed=40)

    def pending(ids, chunks_left, cached=0):
        return SimpleNamespace(request=SimpleNamespace(prompt=ids), job=SimpleNamespace(chunks_left=chunks_left, chunk=64),
                               hit=SimpleNamespace(tokens=cached) if cached else None)

    request = SimpleNamespace(prompt=system[:500] + prompt(10, seed=41))  # 7 blocks in common
    short = SimpleNamespace(prompt=system[:70] + prompt(10, seed=42))  # 1 block in common
    scheduler._pending = {0: pending(system, chunks_left=9)}  # 576 positions left
    assert scheduler._waits_for_a_prefill(request)  # 448 to read: 2 x 448 >= 576
    assert not scheduler._waits_for_a_prefill(short)  # 64 to read
    scheduler._pending = {0: pending(system, chunks_left=9, cached=7 * BLOCK)}
    assert not scheduler._waits_for_a_prefill(request)
    scheduler._pending = {0: pending(prompt(600, seed=43), chunks_left=1)}
    assert not scheduler._waits_for_a_prefill(request)
