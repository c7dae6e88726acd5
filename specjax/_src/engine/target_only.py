"""The target-only cycle: one target token per sequence per cycle, nothing drafted.

:data:`TARGET_ONLY` is ``generate``'s cycle, a
:class:`~specjax._src.engine.cycle.Cycle` over the same loop state as the
chain and tree cycles (:class:`~specjax._src.engine.config.DecodeState`, built
by :func:`~specjax._src.engine.state.init_state` from a pair whose ``draft`` is
None), run by the same :func:`~specjax._src.engine.cycle.run_cycles`. Each
cycle is one ``T = 1`` target forward over every sequence's last committed
token; the sampled token is committed, cut at EOS and ``max_new_tokens``.

It reads the call's sampling settings (``cfg.greedy``, ``cfg.top_k``, a
scalar ``temperature`` and ``top_p``) and per-sequence logits processors
(``inputs.rows.controls``); the slots engine's other per-row settings (greedy
rows, per-row top-k, draft caps, rule numbers, log-probabilities) are refused
when traced. Randomness: sequence ``b`` samples its token of cycle ``s`` with
one uniform from ``fold_in(inputs.keys[b], s)`` (inverse-CDF sampling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax._src.logits import processors as processors_lib
from specjax._src.logits import sampling
from specjax._src.engine.config import DecodeState, LoopConfig
from specjax._src.engine.cycle import Cycle, CycleInputs
from specjax._src.engine.ops import gather, is_eos, warp
from specjax._src.models.pairing import ModelPair

__all__ = ["TARGET_ONLY"]

_PER_ROW = ("greedy", "top_k", "draft_cap", "rules", "logprobs")


def _target_only_cycle(cfg: LoopConfig, pair_params: ModelPair, rule, policy, inputs: CycleInputs,
                       state: DecodeState):
    """One target token per live sequence (:data:`TARGET_ONLY`'s ``run``);
    ``rule`` and ``policy`` are unused (None). Returns ``(state, None)``."""
    del rule, policy
    prompt_lengths, max_new, eos_ids, seq_keys, temperature, top_p, rows = inputs
    unsupported = [] if rows is None else [name for name in _PER_ROW if getattr(rows, name) is not None]
    if unsupported or state.logprobs is not None:
        raise ValueError(f"the target-only cycle takes per-sequence controls only, not the per-row settings "
                         f"{unsupported or ['logprobs']}.")
    target, vocab = pair_params.target, pair_params.vocab_size
    batch = state.num_committed.shape[0]
    nc = state.num_committed
    last = gather(state.tokens, nc - 1)
    out = target.module.apply(target.params, last[:, None], state.target_cache)
    raw = out.logits[:, 0, :vocab]
    bad_now = ~state.done & sampling.nonfinite_rows(raw)
    if rows is not None and rows.controls is not None:
        hist = processors_lib.history(state.tokens, prompt_lengths, nc, eos_ids, vocab)
        raw = processors_lib.process(rows.processors, rows.controls, hist, raw[:, None],
                                     jnp.zeros((batch, 0), jnp.int32), 0)[:, 0]
    if cfg.greedy:
        tok = sampling.argmax(raw)
    else:
        probs = jax.nn.softmax(warp(cfg, raw, temperature, top_p), axis=-1)
        u = jax.vmap(lambda k: sampling.uniform_open(jax.random.fold_in(k, state.step), ()))(seq_keys)
        tok = sampling.sample_categorical(probs, u)
    live = ~state.done & ~bad_now
    tokens = jax.vmap(lambda row, t, off: jax.lax.dynamic_update_slice(row, t[None], (off,)))(state.tokens, tok, nc)
    num_new = live.astype(jnp.int32)
    new_nc = nc + num_new
    hit_eos = live & is_eos(eos_ids, tok)
    done = state.done | bad_now | hit_eos | (new_nc - prompt_lengths >= max_new)
    stats = state.stats
    stats = stats.replace(cycles=stats.cycles + num_new, tokens=stats.tokens + num_new,
                          verified=stats.verified + num_new, target_forwards=stats.target_forwards + 1)
    new_state = state.replace(
        step=state.step + 1,
        tokens=tokens,
        num_committed=new_nc,
        done=done,
        bad=jnp.where(bad_now, 1, state.bad),
        target_cache=out.cache.rollback(new_nc - 1),
        stats=stats,
    )
    return new_state, None


TARGET_ONLY = Cycle("target_only", _target_only_cycle)
