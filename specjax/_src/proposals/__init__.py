"""Proposals: where a cycle's draft tokens come from, besides the draft model itself.

* :mod:`.lookup`: drafts copied from the sequence's own earlier text (prompt lookup, n-grams);
* :mod:`.trees`: token trees (static shapes, EAGLE-2's dynamic trees) and the walk that verifies
  a drafted tree against the target;
* :mod:`.drafting`: the drafting policies (how many tokens to draft each cycle, and
  :func:`~specjax.drafting.auto`'s cost model and acceptance estimates).

Like the rules, these modules sit below the engine: they are pure functions of arrays that the chain and tree cycles call.
"""
