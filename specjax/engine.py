"""Many requests, one state: the slots engine a server drives from a host loop.

::

    import specjax
    from specjax.engine import Engine, SlotSettings

    engine = Engine(specjax.pair(target, draft), num_slots=4, capacity=256, num_draft=4)
    state = engine.init()
    state = engine.insert(state, 0, prompt_ids, SlotSettings(temperature=0.7, top_p=0.9, seed=1))
    state, out = engine.step(state, num_cycles=8)   # out.tokens[s, :out.counts[s]]: slot s's new tokens
    state = engine.release(state, 0)

Below ``decode``, ``generate`` and the slots engine is the engine tier, public
too, for a new drafter or a new driver of the draft-verify loop:

* :class:`LoopConfig`: a loop's compile-time settings (``num_draft`` K,
  ``max_new_tokens`` N, ``cache_length``, greedy, top-k / top-p, a tree, ...);
* :class:`DecodeState`: the loop's carry (``tokens [B, P + N + K + 1]``,
  ``num_committed [B]``, ``done [B]``, both KV caches, the rule's and the
  policy's states, :class:`~specjax.DecodeStats`), and :class:`Logprobs`
  beside its tokens;
* :func:`init_state`: the prefills and the state before the first cycle (with
  ``inputs``, each sequence's first token drawn from the prefill's logits);
* :class:`Cycle`: one cycle as a value, ``run(cfg, pair_params, rule, policy,
  inputs, state) -> (state, diagnostics or None)`` over :class:`CycleInputs`:
  ``CHAIN``, ``TREE``, ``TARGET_ONLY`` (``generate``'s), :func:`cycle_for`;
* :func:`run_cycles`: cycles in one ``lax.while_loop``.

::

    cfg = LoopConfig(diagnostics=None, num_draft=3, max_new_tokens=16, cache_length=64,
                     greedy=True, top_k=None, use_top_p=False)
    inputs = CycleInputs(lengths, max_new, eos_ids, keys, 1.0, 1.0)
    state = init_state(cfg, pair, rule, policy, prompts, lengths, max_new, inputs)
    state = run_cycles(CHAIN.bind(cfg, pair, rule, policy, inputs), state,
                       lambda s, _: ~s.done.all())

See ``docs/engine.md``.
"""

from specjax._src.engine.config import DecodeState, LoopConfig, Logprobs
from specjax._src.engine.costs import (
    calibrate_costs,
    last_measured as last_measured_costs,
    measure_costs,
    parts_undecided,
)
from specjax._src.engine.cycle import Cycle, CycleInputs, run_cycles
from specjax._src.engine.cycles import CHAIN, TARGET_ONLY, TREE, cycle_for
from specjax._src.engine.live_costs import LiveCosts
from specjax._src.engine.prefix_cache import PrefixCache, PrefixHit
from specjax._src.engine.slots import Engine, FieldError, PrefillJob, SlotSettings, SlotState, StepOutput, StepPlan
from specjax._src.engine.state import init_state
from specjax._src.engine.text import TextStream, check_stop_strings, cut_at_stop
from specjax._src.logits.processors import (
    BUILTIN_PROCESSORS,
    GenerationControls,
    TokenContext,
    logit_bias,
    min_new_tokens,
    presence_frequency_penalty,
    repetition_penalty,
)

__all__ = [
    "Engine",
    "SlotSettings",
    "SlotState",
    "StepOutput",
    "StepPlan",
    "PrefillJob",
    "PrefixCache",
    "PrefixHit",
    "FieldError",
    "LoopConfig",
    "DecodeState",
    "Logprobs",
    "init_state",
    "Cycle",
    "CycleInputs",
    "CHAIN",
    "TREE",
    "TARGET_ONLY",
    "cycle_for",
    "run_cycles",
    "measure_costs",
    "calibrate_costs",
    "parts_undecided",
    "last_measured_costs",
    "LiveCosts",
    "GenerationControls",
    "TokenContext",
    "BUILTIN_PROCESSORS",
    "logit_bias",
    "repetition_penalty",
    "presence_frequency_penalty",
    "min_new_tokens",
    "TextStream",
    "cut_at_stop",
    "check_stop_strings",
]
