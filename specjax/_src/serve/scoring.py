"""The prompt's own log-probabilities (completions' ``echo`` with ``logprobs``).

Evaluation harnesses score a text by sending it as a prompt with ``echo: true``,
``logprobs: k`` and ``max_tokens`` 0 or 1, and reading each prompt token's
log-probability given the tokens before it (lm-evaluation-harness'
``local-completions`` loglikelihood requests). vLLM answers with the first
token's entry ``null`` (nothing comes before it) and the others from the target's
log-softmax; so does this module, with one forward of the target over the whole
prompt, padded at its end to a power of two (a causal forward's positions do not
see the padding after them, and one program serves every length up to its width).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MIN_WIDTH = 16


@functools.partial(jax.jit, static_argnums=(0, 3))
def _score(module, params, tokens, most: int):
    """``tokens [1, W]`` -> ``(chosen [W - 1], top_ids [W - 1, most], top_logprobs [W - 1, most])``:
    position ``i``'s log-softmax at token ``i + 1``, and its ``most`` likeliest tokens."""
    logits = module.apply(params, tokens).logits[0, :-1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, most)
    return chosen, top_ids, top_logprobs


def width_for(length: int) -> int:
    """The padded width a prompt of ``length`` tokens is scored at: a power of two, at least 16."""
    return max(MIN_WIDTH, 1 << (int(length) - 1).bit_length())


def prompt_logprobs(target, ids, k: int) -> tuple[list, list]:
    """``(logprobs, top)`` of a prompt's tokens under ``target`` (a :class:`specjax.Model`).

    ``logprobs [P]``: None for the first token, then each token's log-probability
    given the tokens before it (the target's raw logits' log-softmax: no
    temperature, penalties or filters, which shape sampling, not the text's
    likelihood). ``top [P]``: None for the first token, then its position's ``k``
    likeliest ``(id, logprob)`` pairs, most likely first (``[]`` for ``k`` 0). The
    chosen token's figure and the alternatives' come from one array, so a token
    the target would have chosen greedily reports exactly its best alternative's
    figure (what lm-evaluation-harness' ``is_greedy`` compares).
    """
    ids = [int(t) for t in ids]
    padded = np.zeros((1, width_for(len(ids))), np.int32)
    padded[0, : len(ids)] = ids
    chosen, top_ids, top_lps = jax.device_get(_score(target.module, target.params, jnp.asarray(padded), max(1, int(k))))
    n = len(ids) - 1
    logprobs = [None] + [float(x) for x in chosen[:n]]
    top = [None] + [[(int(t), float(x)) for t, x in zip(top_ids[i, :k], top_lps[i, :k])] for i in range(n)]
    return logprobs, top
