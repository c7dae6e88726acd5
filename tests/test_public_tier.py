"""The engine tier on public names alone: a driver of the draft-verify loop
built from ``specjax`` and ``specjax.engine`` (nothing from ``specjax._src``)
decodes what ``specjax.decode`` and ``specjax.generate`` do, and a cycle of
its own plugs into the same loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafting import fixed
from specjax.engine import (
    CHAIN,
    TARGET_ONLY,
    Cycle,
    CycleInputs,
    DecodeState,
    LoopConfig,
    cycle_for,
    init_state,
    run_cycles,
)
from specjax.rules import speculative_sampling
from specjax.testing import llama_config, peaked_target_and_draft

PROMPTS = [[5, 17, 3, 9], [40, 2], [7], [11, 12, 13, 14, 15, 16, 17]]
K, N = 3, 12


@pytest.fixture(scope="module")
def pair():
    return specjax.pair(*peaked_target_and_draft(llama_config()))


def _config(num_draft: int) -> LoopConfig:
    width = max(map(len, PROMPTS))
    return LoopConfig(diagnostics=None, num_draft=num_draft, max_new_tokens=N, cache_length=width + N + num_draft,
                      greedy=True, top_k=None, use_top_p=False)


def _batch():
    """``(prompts [B, P], lengths [B], max_new [B], inputs)``: the padded prompts, greedy, no EOS."""
    prompts = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)
    for i, p in enumerate(PROMPTS):
        prompts[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    max_new = jnp.full((len(PROMPTS),), N, jnp.int32)
    keys = jax.random.split(jax.random.key(0), len(PROMPTS))  # unused when greedy
    inputs = CycleInputs(prompt_lengths=lengths, max_new=max_new, eos_ids=jnp.asarray([-1], jnp.int32), keys=keys,
                         temperature=1.0, top_p=1.0)
    return jnp.asarray(prompts), lengths, max_new, inputs


def _until_done(state: DecodeState, cycles_run):
    return ~state.done.all() & (cycles_run < N)


def _drive(cycle: Cycle, pair_params, rule, policy, cfg: LoopConfig, after_cycle=None, extra=None,
           first_token: bool = False) -> DecodeState:
    prompts, lengths, max_new, inputs = _batch()

    @jax.jit
    def run(pair_params, prompts):
        state = init_state(cfg, pair_params, rule, policy, prompts, lengths, max_new,
                           inputs if first_token else None)
        if extra is not None:
            state = state.replace(stats=state.stats.replace(extra=extra(state)))
        return run_cycles(cycle.bind(cfg, pair_params, rule, policy, inputs), state, _until_done, after_cycle)

    return run(pair_params, prompts)


def _generated(state: DecodeState) -> list[list[int]]:
    tokens, committed = np.asarray(state.tokens), np.asarray(state.num_committed)
    return [tokens[b, len(p): committed[b]].tolist() for b, p in enumerate(PROMPTS)]


def test_the_chain_cycle_driven_by_hand_decodes_what_decode_does(pair):
    cfg = _config(K)
    assert cycle_for(cfg) is CHAIN
    state = _drive(CHAIN, pair, speculative_sampling(), fixed(), cfg)
    ref = specjax.decode(pair, PROMPTS, num_draft=K, max_new_tokens=N, temperature=0.0, eos_token_id=())
    assert _generated(state) == ref.to_lists()
    assert all(len(t) == N for t in _generated(state)) and bool(state.done.all())
    assert int(np.sum(state.stats.accepted)) > 0  # the drafts were judged, not bypassed


def test_the_target_only_cycle_driven_by_hand_generates_what_generate_does(pair):
    target_only = specjax.ModelPair(target=pair.target, draft=None, vocab_size=pair.vocab_size)
    state = _drive(TARGET_ONLY, target_only, None, None, _config(0))
    ref = specjax.generate(pair.target, PROMPTS, max_new_tokens=N, temperature=0.0, eos_token_id=())
    assert _generated(state) == ref.to_lists()
    assert state.draft_cache is None and int(state.stats.target_forwards) == N


@pytest.mark.parametrize("first_token", [False, True])
def test_init_state_draws_the_first_token_from_the_prefill_given_the_inputs(pair, first_token):
    """With the cycles' inputs, ``init_state`` commits each sequence's first token from the
    prefill's logits: the same tokens, one target forward fewer (control: without them, N)."""
    target_only = specjax.ModelPair(target=pair.target, draft=None, vocab_size=pair.vocab_size)
    state = _drive(TARGET_ONLY, target_only, None, None, _config(0), first_token=first_token)
    ref = specjax.generate(pair.target, PROMPTS, max_new_tokens=N, temperature=0.0, eos_token_id=())
    assert _generated(state) == ref.to_lists()
    assert int(state.stats.target_forwards) == N - int(first_token)
    chain = _drive(CHAIN, pair, speculative_sampling(), fixed(), _config(K), first_token=first_token)
    assert _generated(chain) == ref.to_lists()


def counting(inner: Cycle) -> Cycle:
    """A cycle of one's own: ``inner`` with the live rows of each cycle as its diagnostics."""

    def run(cfg, pair_params, rule, policy, inputs, state):
        new, _ = inner.run(cfg, pair_params, rule, policy, inputs, state)
        return new, {"cycles": (~state.done).astype(jnp.int32)}

    return Cycle(f"counting-{inner.name}", run)


def test_a_cycle_of_ones_own_plugs_into_the_loop(pair):
    def add_diagnostics(before, after, diag):
        extra = jax.tree_util.tree_map(jnp.add, after.stats.extra, diag)
        return after.replace(stats=after.stats.replace(extra=extra))

    def zeros(state):
        return {"cycles": jnp.zeros_like(state.num_committed)}

    cfg = _config(K)
    plain = _drive(CHAIN, pair, speculative_sampling(), fixed(), cfg)
    counted = _drive(counting(CHAIN), pair, speculative_sampling(), fixed(), cfg, add_diagnostics, zeros)
    assert _generated(counted) == _generated(plain)
    counts = np.asarray(counted.stats.extra["cycles"])
    np.testing.assert_array_equal(counts, np.asarray(plain.stats.cycles))  # the chain's own count of live cycles
    assert (counts >= 1).all() and (counts <= N).all()
