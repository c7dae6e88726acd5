"""Chunked prefill: a prompt prefilled over several calls, interleaved with steps, decodes
exactly what a whole insert decodes (``Engine.begin_insert`` / ``continue_insert``)."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

import specjax
from specjax.engine import Engine, PrefillJob, SlotSettings
from specjax.testing import llama_config, peaked_target_and_draft
from specjax._src.models import feature_head_build as fhb
from specjax._src.serve import scheduler as sched
from test_decode import count_compilations

# A capacity that is no multiple of the 64-token prefill block: a prompt cut to it ends in a
# tail block (positions 192 .. 247), which a chunk must run as a whole insert does.
K, CAPACITY = 3, 248
GREEDY = SlotSettings(temperature=0.0, max_new_tokens=20)
SAMPLED = SlotSettings(temperature=0.8, seed=7, max_new_tokens=20)
SHORT = ([5, 9, 3, 7], SlotSettings(temperature=0.7, top_p=0.9, seed=3, max_new_tokens=40))


def long_prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 96, n).tolist()


@pytest.fixture(scope="module")
def draft_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config(max_position_embeddings=320)))


@pytest.fixture(scope="module")
def head_pair(draft_pair):
    target = draft_pair.target
    return specjax.pair(target, fhb.init_from_target(target, jax.random.key(1), np.arange(80)[::-1]))


def collect(engine, state, tokens, cycles=2, steps=None):
    """Steps (``steps`` times, or until every slot is done), appending each slot's tokens to
    ``tokens``; returns the state and the step outputs."""
    outs = []
    for _ in range(500 if steps is None else steps):
        state, out = engine.step(state, cycles)
        out = jax.device_get(out)
        outs.append(out)
        for s in range(engine.num_slots):
            tokens.setdefault(s, []).extend(out.tokens[s, : out.counts[s]].tolist())
        if steps is None and out.done.all():
            break
    return state, outs


def whole(engine, prompt, settings):
    """The long request inserted whole into slot 1 beside the short one in slot 0, both to the end."""
    tokens = {}
    state = engine.insert(engine.init(), 0, *SHORT)
    state, _ = collect(engine, state, tokens, steps=1)
    state = engine.insert(state, 1, prompt, settings)
    collect(engine, state, tokens)
    return tokens


def chunked(engine, prompt, settings, chunk):
    """The same, the long prompt prefilled ``chunk`` positions a call with a step of slot 0 between
    calls. Checks that the pending slot stays free and reports nothing meanwhile."""
    tokens = {}
    state = engine.insert(engine.init(), 0, *SHORT)
    state, _ = collect(engine, state, tokens, steps=1)
    job = engine.begin_insert(state, 1, prompt, settings, chunk=chunk)
    assert job.chunks == -(-(len(prompt) - 1) // chunk) and job.chunks_left == job.chunks
    calls = 0
    while not job.finished:
        state, job = engine.continue_insert(state, job)
        calls += 1
        if not job.finished:
            assert not bool(np.asarray(state.occupied)[1])
            before = len(tokens.get(0, []))
            state, (out,) = collect(engine, state, tokens, steps=1)
            assert out.counts[1] == 0 and len(tokens[0]) > before  # the neighbour streams on
    assert calls == job.chunks and job.chunks_left == 0
    collect(engine, state, tokens)
    return tokens, calls


CASES = [(200, GREEDY, 64), (200, SAMPLED, 128), (130, SAMPLED, 64), (140, GREEDY, 128)]


# With a draft model slow-only: the scheduler test below prefills a draft model's pair in chunks
# by default, and tests/test_slots_prefix_cache.py a draft model's from a cached prefix.
@pytest.mark.parametrize("which", [pytest.param("draft", marks=pytest.mark.slow), "head"])
def test_a_chunked_insert_decodes_what_a_whole_insert_decodes(which, draft_pair, head_pair):
    """Greedy and seeded sampling, a draft model and a feature head, prompts with and without the
    tail block, chunks of 64 and 128: the long request's tokens equal a whole insert's, and the
    short one streaming beside it (a step between every two chunks) gets the tokens it gets when
    the long prompt is inserted whole."""
    pair = draft_pair if which == "draft" else head_pair
    engine = Engine(pair, num_slots=2, capacity=CAPACITY, num_draft=K, controls=False)
    for n, settings, chunk in CASES:
        ref = whole(engine, long_prompt(n), settings)
        got, calls = chunked(engine, long_prompt(n), settings, chunk)
        assert calls > 1
        assert len(ref[1]) == settings.max_new_tokens
        assert got[1] == ref[1], (n, settings, chunk)
        assert got[0] == ref[0], (n, settings, chunk)


def test_the_state_a_chunked_insert_leaves_is_a_whole_inserts(draft_pair, head_pair):
    """Every leaf of the slot's row (both caches, a head's pending features, the token buffer the
    n-gram lookup reads, counters, settings) equals a whole insert's, bit for bit."""
    for pair in (draft_pair, head_pair):
        engine = Engine(pair, num_slots=2, capacity=CAPACITY, num_draft=K, controls=False)
        for n, settings, chunk in CASES[:2]:
            prompt, settings = long_prompt(n, seed=1), settings._replace(seed=11)
            ref = jax.device_get(engine.insert(engine.init(), 1, prompt, settings))
            state = engine.init()
            job = engine.begin_insert(state, 1, prompt, settings, chunk=chunk)
            while not job.finished:
                state, job = engine.continue_insert(state, job)
            got = jax.device_get(state)
            paths = jax.tree_util.tree_flatten_with_path(ref)[0]
            for (path, a), b in zip(paths, jax.tree_util.tree_leaves(got)):
                if np.ndim(a) and np.shape(a)[0] == 2:
                    np.testing.assert_array_equal(a[1], b[1], err_msg=jax.tree_util.keystr(path))



def test_a_prompt_shorter_than_a_block_inserted_in_chunks_is_a_whole_insert(draft_pair, head_pair):
    """A prompt of at most 48 tokens is prefilled at its own width (16, 32 or 48), narrower than
    the chunks' 64-token blocks: its one call must still fill both caches as a whole insert does
    (before, it filled neither, and the request decoded from empty caches)."""
    for pair in (draft_pair, head_pair):
        engine = Engine(pair, num_slots=2, capacity=CAPACITY, num_draft=K, controls=False)
        for n in (5, 20, 48):
            prompt, settings = long_prompt(n, seed=2), GREEDY._replace(seed=11)
            ref = jax.device_get(engine.insert(engine.init(), 1, prompt, settings))
            job = engine.begin_insert(engine.init(), 1, prompt, settings, chunk=64)
            state, job = engine.continue_insert(engine.init(), job)
            assert job.finished
            got = jax.device_get(state)
            assert int(np.count_nonzero(got.loop.target_cache.keys[0][1])) > 0, n
            paths = jax.tree_util.tree_flatten_with_path(ref)[0]
            for (path, a), b in zip(paths, jax.tree_util.tree_leaves(got)):
                if np.ndim(a) and np.shape(a)[0] == 2:
                    np.testing.assert_array_equal(a[1], b[1], err_msg=f"{n}: {jax.tree_util.keystr(path)}")

def test_chunked_insert_checks_and_a_donating_engine(draft_pair):
    """Bad chunks, busy slots and a slot taken meanwhile are refused before anything runs; with
    ``donate_state=True`` the chunks reuse the job's buffers and the tokens are the same."""
    engine = Engine(draft_pair, num_slots=2, capacity=CAPACITY, num_draft=K, controls=False, donate_state=True)
    prompt = long_prompt(200)
    state = engine.init()
    for bad in (0, 32, 100, "64"):
        with pytest.raises(ValueError, match="multiple of 64"):
            engine.begin_insert(state, 1, prompt, GREEDY, chunk=bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.begin_insert(state, 1, prompt, GREEDY._replace(max_new_tokens=60), chunk=64)
    job = engine.begin_insert(state, 1, prompt, GREEDY, chunk=64)
    assert isinstance(job, PrefillJob)
    while job.chunks_left > 1:
        state, job = engine.continue_insert(state, job)
    taken = engine.insert(state, 1, [1, 2], GREEDY)
    with pytest.raises(ValueError, match="was taken"):
        engine.continue_insert(taken, job)
    state = engine.release(taken, 1)
    state, job = engine.continue_insert(state, job)
    with pytest.raises(ValueError, match="finished"):
        engine.continue_insert(state, job)
    with pytest.raises(ValueError, match="busy"):
        engine.begin_insert(state, 1, prompt, GREEDY, chunk=64)
    tokens = {}
    collect(engine, state, tokens)
    plain = Engine(draft_pair, num_slots=2, capacity=CAPACITY, num_draft=K, controls=False)
    ref = {}
    collect(plain, plain.insert(plain.init(), 1, prompt, GREEDY), ref)
    assert tokens[1] == ref[1]


def test_one_program_per_chunk_width_then_none(draft_pair):
    """A second chunked insert of another length compiles nothing: the chunk programs are one per
    chunk width, whatever the prompt's length or width bucket."""
    engine = Engine(draft_pair, num_slots=2, capacity=CAPACITY, num_draft=K, controls=False, max_eos=5)

    def insert(n):
        state = engine.init()
        job = engine.begin_insert(state, 0, long_prompt(n), GREEDY, chunk=64)
        while not job.finished:
            state, job = engine.continue_insert(state, job)
        return jax.block_until_ready(state)

    insert(200)
    with count_compilations() as compiled:
        for n in (70, 130, 190, 220):
            insert(n)
    assert compiled["n"] == 0


# ---------------------------------------------------------------------------
# The scheduler: a long prompt admitted chunk by chunk while another request streams
# ---------------------------------------------------------------------------


class Collector:
    """A request's consumer: its text, and the scheduler's counters at each of its deltas."""

    def __init__(self, scheduler):
        self.scheduler, self.text, self.seen, self.events = scheduler, "", [], []
        self.done = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        c = self.scheduler.counters
        if isinstance(event, sched.Delta):
            self.text += event.text
            self.seen.append((c.steps, c.prefill_chunks))
        else:
            self.done.set()


def test_the_scheduler_streams_on_while_a_long_prompt_is_prefilled():
    """The embedded pair as `specjax serve` builds its engine, chunks of 64: a 230-token prompt
    admitted while a sampled request streams. The stream's text is what it gets alone, the long
    request's is what ``specjax.decode`` gives it alone, the stream's tokens keep coming between
    the long prompt's chunks (steps run between them, and it gets deltas meanwhile), and serving
    compiles nothing the warm-up did not."""
    target = specjax.load("embedded-target", dtype="float32")
    pair = specjax.pair(target, specjax.load("embedded-draft", dtype="float32"))
    k, capacity = 4, 252
    engine = Engine(pair, num_slots=2, capacity=capacity, num_draft=k, prompt_bucket=capacity, row_buckets="powers",
                    donate_state=True, specialized_steps=True)
    # One width of grouped inserts: each prompt here is inserted alone (its own width, always
    # compiled) or in chunks, so the others would only add compilation.
    scheduler = sched.Scheduler(engine, target.tokenizer, num_cycles=2, prefill_chunk=64, warmup_widths=(16,),
                                prefill_groups=[1], eos_ids=[target.module.config.eos_token_id]).start()
    tok = target.tokenizer
    short_ids = tok.encode("def fib(n):").ids
    short = SlotSettings(temperature=0.8, seed=3, max_new_tokens=120, eos_token_id=())
    long_ids = (tok.encode("x = [1, 2, 3]\nfor i in range(10):\n    print(i * x[i % 3])\n" * 12).ids)[:230]
    long = SlotSettings(temperature=0.0, max_new_tokens=16)

    def submit(ids, settings):
        consumer = Collector(scheduler)
        scheduler.submit(sched.Request(prompt=ids, settings=settings, emit=consumer))
        return consumer

    try:
        assert scheduler.ready.wait(300) and scheduler.error is None
        with count_compilations() as compiled:
            alone = submit(short_ids, short)
            assert alone.done.wait(120)
            chunks_before = scheduler.counters.prefill_chunks
            streaming = submit(short_ids, short)
            while not streaming.seen:
                time.sleep(0.01)
            late = submit(long_ids, long)
            assert late.done.wait(120) and streaming.done.wait(120)
        assert compiled["n"] == 0
    finally:
        scheduler.close(drain_seconds=5)
    assert scheduler.error is None
    assert streaming.text == alone.text and isinstance(streaming.events[-1], sched.Done)
    ref = specjax.decode(pair, [long_ids], num_draft=k, max_new_tokens=16, temperature=0.0,
                         max_length=capacity + k).to_lists()[0]
    assert late.text == tok.decode(ref)
    chunks = -(-(len(long_ids) - 1) // 64)
    assert scheduler.counters.prefill_chunks - chunks_before == chunks
    first_chunk = chunks_before + 1
    # Steps between the long prompt's first chunk and its first token, and the stream's deltas then.
    during = [steps for steps, done in streaming.seen if first_chunk <= done < chunks_before + chunks]
    assert len(during) > 1, streaming.seen
    assert late.seen[0][0] - during[0] > 1


@pytest.mark.parametrize("capacity, chunk", [(400, 64), (1100, 128), (CAPACITY, 64)])
def test_the_warm_up_s_chunked_prefills_read_every_key_width(capacity, chunk):
    """A chunk's attention reads the narrowest key width holding the positions up to its end (a
    branch of its program, which XLA's CPU runtime prepares the first time it runs it): the
    server's warm-up prefills prompts whose last chunks read every width a chunked prompt's last
    chunk can read, and whose middle chunks read every width a middle chunk can, so that no
    request pays for a first run. (Three chunks' worth alone, as before, read two widths.)"""
    pair = specjax.pair(*peaked_target_and_draft(llama_config(max_position_embeddings=1200)))
    engine = Engine(pair, num_slots=1, capacity=capacity, num_draft=K, controls=False)
    lengths = sched.Scheduler(engine, None, prefill_chunk=chunk)._chunked_warmup_lengths()
    widths = engine.attention_widths()

    def read(end):  # the width index a chunk ending at position ``end`` reads
        return next(i for i, w in enumerate(widths) if w >= end)

    longest = capacity - 2  # the warm-up's requests generate two tokens
    assert all(chunk < n <= longest for n in lengths)
    assert {read(n) for n in lengths} == {read(n) for n in range(chunk + 1, longest + 1)}
    middle = {read(end) for n in lengths for end in range(chunk, n, chunk)}
    assert middle == {read(end) for end in range(chunk, longest, chunk)}
    assert (len(widths) > 1) == (len(lengths) > 1)


@pytest.mark.parametrize("capacity", [400, 1100, CAPACITY])
def test_the_warm_up_runs_every_draft_length_at_every_key_width(capacity):
    """The server's warm-up steps, for each key width, a request whose step reads that width at
    every draft length (the draft length and the width each pick a branch of the step, which XLA's
    CPU runtime prepares the first time it runs it): every width but one too narrow to hold any
    prompt and a verification, as the model picks it."""
    from specjax._src.engine.live_costs import widths_read
    from specjax._src.serve.warm_branches import branch_warmup_prompts

    pair = specjax.pair(*peaked_target_and_draft(llama_config(max_position_embeddings=1200)))
    engine = Engine(pair, num_slots=1, capacity=capacity, num_draft=K, controls=False)
    widths = engine.attention_widths()
    prompts = branch_warmup_prompts(widths, engine.num_draft, engine.capacity)
    assert [j for j, _ in prompts] == list(range(len(widths)))
    for j, length in prompts:
        assert length <= capacity - 2
        assert all(widths_read(widths, length, length + 1, k) == (j,) for k in range(K + 1)), (j, length)
