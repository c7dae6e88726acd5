"""Logits: what turns a model's raw next-token logits into the distribution a token is drawn from.

* :mod:`.processors`: per-sequence generation controls (logit bias, repetition, presence and
  frequency penalties, a minimum length) as pure functions of one sequence's logits;
* :mod:`.sampling`: the temperature / top-k / top-p warp, shared by the target, the draft and
  the baseline so that speculative sampling stays lossless, and the draws from it.

Both sit at the bottom of the library: the rules, the drafters, the theory and the engine
import them, and they import nothing of specjax but the argument checks.
"""
