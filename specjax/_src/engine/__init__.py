"""The engine: the decode loop and the slots engine built from the same cycle.

* :mod:`.config`: the loop's static config and its state (``LoopConfig``,
  ``DecodeState``, ``Logprobs``);
* :mod:`.prepare`: argument checks, shape buckets, what a call returns;
* :mod:`.state`: the prefills and the state before the first cycle (``init_state``);
* :mod:`.chain` and :mod:`.tree`: one draft-verify cycle over a chain or a
  token tree, as the same five steps (draft, verify, accept, commit, record);
  :mod:`.tree_drafting`: the tree cycle's draft step (static trees, EAGLE-2's dynamic ones);
* :mod:`.plain`: a plain step inside a drafting program (``auto``'s choice of no
  drafts, on a chain or a tree) and the draft's catch-up after it;
* :mod:`.target_only`: ``generate``'s cycle, one target token and no draft;
* :mod:`.cycle`: the cycle interface (``Cycle``, ``run_cycles``) and what the
  cycles are built from; :mod:`.cycles`: the cycles as values;
* :mod:`.ops`: device helpers every loop shares;
* :mod:`.loop`: ``decode`` and ``generate``, each one jitted ``while_loop``
  of cycles;
* :mod:`.streaming`: ``on_tokens=`` reports from inside the loop;
* :mod:`.stats`: per-sequence decode statistics (``DecodeStats``) that every cycle records;
* :mod:`.slots`: many requests in one state, advanced by a jitted step;
* :mod:`.costs`: what a cycle's parts cost on this machine, for ``auto``;
  :mod:`.live_costs`: the same refreshed from the slots engine's own steps;
* :mod:`.text`: stop strings on the detokenized text.

``specjax.engine`` exports the engine tier (``LoopConfig``, ``DecodeState``,
``init_state``, ``Cycle``, ``run_cycles``, the cycles); the rest is private to
its module's callers here.
"""
