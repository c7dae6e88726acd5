"""Evaluation: what speculative decoding buys on a pair, measured (public as ``specjax.evaluation``).

* :mod:`.tasks`: evaluation sets (prompts with answers, open prompts) and answer checking;
* :mod:`.rules`: the rules a comparison runs by default, and which are lossless;
* :mod:`.scoring`: Wilson intervals, percentiles, the target's NLL of a text, token agreement;
* :mod:`.comparison`: the timed comparison (contenders, rows, :func:`run_comparison`).

It sits above the engine, which it runs. ``specjax compare`` (``specjax/cli/compare.py``) adds
the presets, the printed table, the verdicts and the plot; ``training/`` and ``benchmarks/``
use the same pieces through ``specjax.evaluation``.
"""
