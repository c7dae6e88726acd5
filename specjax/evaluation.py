"""Measuring what speculative decoding buys on a pair: evaluation sets, timed comparisons, scores.

``specjax compare`` is built on these; a script or a notebook can run the same measurement and
keep the rows::

    from specjax import evaluation

    eval_set = evaluation.load_chat_eval_set(target, "specjax/assets/chat", num_task=16, num_open=6)
    rows = evaluation.run_comparison(target, draft, eval_set, rules=("speculative_sampling",),
                                     temperatures=(0.0,), max_new_tokens=64, batch_size=1, rounds=2)
    rows[1].speedup, rows[1].speedup_p10, rows[1].task_accuracy, rows[1].task_low

Each :class:`Row` holds a contender's speed (tok/s, speedup over target-only at the same
temperature, its spread over prompts and rounds) and quality (task answers right with their 95%
Wilson interval, agreement with target-only's greedy text, the target's NLL of sampled text).
"""

from specjax._src.evaluation.comparison import (
    MIN_RECOVERY,
    Contender,
    Row,
    grid,
    keeps_task,
    run_comparison,
)
from specjax._src.evaluation.rules import DEFAULT_RULES, FULL_RULES, LOSSLESS_RULES, QUICK_RULES, is_lossless
from specjax._src.evaluation.scoring import mean_target_nll, percentiles, wilson_interval
from specjax._src.evaluation.tasks import (
    EvalSet,
    answer_in_reply,
    load_chat_eval_set,
    load_eval_set,
    read_jsonl,
    task_correct,
)

__all__ = [
    "DEFAULT_RULES",
    "FULL_RULES",
    "LOSSLESS_RULES",
    "MIN_RECOVERY",
    "QUICK_RULES",
    "Contender",
    "EvalSet",
    "Row",
    "answer_in_reply",
    "grid",
    "is_lossless",
    "keeps_task",
    "load_chat_eval_set",
    "load_eval_set",
    "mean_target_nll",
    "percentiles",
    "read_jsonl",
    "run_comparison",
    "task_correct",
    "wilson_interval",
]
