"""Proposals: where a cycle's draft tokens come from, besides the draft model itself.

* :mod:`.lookup`: drafts copied from the sequence's own earlier text (prompt lookup, n-grams);
* :mod:`.trees`: token trees (static shapes, EAGLE-2's dynamic trees) and the walk that verifies
  a drafted tree against the target.

The drafting policies (how many tokens to draft each cycle, ``specjax._src.drafting``) belong
here too and join this room later. Like the rules, these modules sit below the engine: they
are pure functions of arrays that the chain and tree cycles call.
"""
