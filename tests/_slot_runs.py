"""Stepping a slots engine until one request finishes (shared by the prefix-cache tests)."""

import jax
import numpy as np


def run_until_done(engine, state, slot: int):
    """Steps until ``slot`` is done: the state, its tokens and their log-probabilities."""
    tokens, logprobs = [], []
    for _ in range(100):
        state, out = engine.step(state, 2)
        out = jax.device_get(out)
        count = int(out.counts[slot])
        tokens += out.tokens[slot, :count].tolist()
        logprobs += out.logprobs[slot, :count].tolist()
        if out.done[slot]:
            return state, tokens, np.array(logprobs)
    raise AssertionError("the request did not finish")
