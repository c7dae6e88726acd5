"""Rules with the same fields never share a compiled program.

JAX compares the treedefs of two ``flax.struct.dataclass`` classes with equal fields as equal, so
``jax.jit`` alone occasionally runs one rule's program for another (a silent wrong result); specjax
passes the rule's classes in a static argument (:mod:`specjax._src.foundation.jit_keys`).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

import specjax
from specjax import theory
from specjax.engine import Engine
from specjax.rules import block_verification, speculative_sampling
from specjax.testing import bigram_model, random_table
from specjax._src.engine import loop
from specjax._src.foundation.jit_keys import pytree_classes
from specjax._src.rules.base import SpeculativeSampling


def top_ranks_rule(n: int):
    """A field-less rule class of its own whose greedy set is the ``n`` most likely tokens."""

    @struct.dataclass
    class TopRanks(SpeculativeSampling):
        name = f"top_{n}_ranks"

        def accepted_set(self, logits, probs):
            del probs
            return logits > -n  # the certificate functions pass -rank as the logits

    return TopRanks()


def test_many_rules_with_the_same_fields_each_run_their_own_program():
    """64 field-less rule classes through one jitted certificate function: each gets its own
    count (through jit's cache alone, several of them ran another class's program)."""
    probs = np.full((128,), 1 / 128, np.float32)
    got = [int(theory.num_accepted(top_ranks_rule(n), probs)) for n in range(1, 65)]
    assert got == list(range(1, 65))


def test_decode_and_engine_programs_are_keyed_by_the_rule_class(monkeypatch):
    """Two rules without fields (their treedefs compare equal) reach decode's and the engine's
    programs with statics that differ."""
    a, b = speculative_sampling(), block_verification()
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)  # what jit alone would see
    assert pytree_classes(a) != pytree_classes(b)
    target, draft = bigram_model(random_table(0, 8)), bigram_model(random_table(1, 8))
    pair = specjax.pair(target, draft)
    seen, run = [], loop._decode_jit
    monkeypatch.setattr(loop, "_decode_jit", lambda *args, cfg, **kw: seen.append(cfg) or run(*args, cfg=cfg, **kw))
    for rule in (a, b):
        specjax.decode(pair, [[1, 2]], rule=rule, num_draft=2, max_new_tokens=2, temperature=0.0)
    assert seen[0] != seen[1] and seen[0]._replace(classes=()) == seen[1]._replace(classes=())
    engines = [Engine(pair, num_slots=1, capacity=8, num_draft=2, rule=rule) for rule in (a, b)]
    assert engines[0].cfg != engines[1].cfg
