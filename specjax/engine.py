"""Many requests, one state: the slots engine a server drives from a host loop.

::

    import specjax
    from specjax.engine import Engine, SlotSettings

    engine = Engine(specjax.pair(target, draft), num_slots=4, capacity=256, num_draft=4)
    state = engine.init()
    state = engine.insert(state, 0, prompt_ids, SlotSettings(temperature=0.7, top_p=0.9, seed=1))
    state, out = engine.step(state, num_cycles=8)   # out.tokens[s, :out.counts[s]]: slot s's new tokens
    state = engine.release(state, 0)

The cycle both ``decode`` and ``step`` run is a value of one signature
(:class:`Cycle`: ``CHAIN``, ``TREE``). See ``docs/engine.md``.
"""

from specjax._src.engine.costs import last_measured as last_measured_costs, measure_costs
from specjax._src.engine.cycle import Cycle, CycleInputs, run_cycles
from specjax._src.engine.cycles import CHAIN, TREE, cycle_for
from specjax._src.engine.slots import Engine, FieldError, PrefillJob, SlotSettings, SlotState, StepOutput, StepPlan
from specjax._src.engine.text import TextStream, check_stop_strings, cut_at_stop
from specjax._src.processors import (
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
    "FieldError",
    "Cycle",
    "CycleInputs",
    "CHAIN",
    "TREE",
    "cycle_for",
    "run_cycles",
    "measure_costs",
    "last_measured_costs",
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
