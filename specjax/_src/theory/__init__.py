"""Acceptance theory: what a rule is guaranteed to accept, and how often it does in a run.

* :mod:`.certificates`: exact acceptance certificates of level-set rules (how far, in
  ``KL(p || q)``, a greedy drafter may be from the target before its draft can be rejected),
  and their margin bounds; pure functions of distributions (public as ``specjax.theory``);
* :mod:`.certify`: the same certificates measured on real ``decode`` runs (a diagnostics hook
  and its report); it sits above the engine, which it runs.
"""
