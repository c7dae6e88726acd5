"""The engine: the decode loop and the slots engine built from the same cycle.

* :mod:`.config`: the loop's static config and its state;
* :mod:`.prepare`: argument checks, shape buckets, what a call returns;
* :mod:`.chain` and :mod:`.tree`: one draft-verify cycle over a chain or a
  token tree, as the same five steps (draft, verify, accept, commit, record);
* :mod:`.cycle`: what both cycles are built from;
* :mod:`.ops`: device helpers every loop shares;
* :mod:`.loop`: ``decode`` and ``generate``, each one jitted ``while_loop``;
* :mod:`.streaming`: ``on_tokens=`` reports from inside the loop;
* :mod:`.slots`: many requests in one state, advanced by a jitted step;
* :mod:`.text`: stop strings on the detokenized text.
"""
