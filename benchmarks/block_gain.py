"""Block vs token verification on the real pair, paired: expected accepted drafts per cycle.

    python benchmarks/block_gain.py --prompts 64 --batch 8            # the shipped head, T=1, K=3
    python benchmarks/block_gain.py --drafter draft --num-draft 5

Timed runs and sampled acceptance compare the two rules along different sampled
texts, so their difference (a few percent) drowns in the texts' own spread.
This script decodes once with token verification and, at every cycle, computes
from the same drafts and distributions what each rule accepts *in expectation*
over its uniforms: ``sum_k prod_{j <= k} min(1, p_j / q_j)`` for token
verification and ``sum_t t P(tau = t)`` for block verification
(:func:`specjax.rules.stopping_probabilities`). The two figures
share every draft, so their ratio is exact up to which cycles occur.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import common
import specjax
from specjax.rules import speculative_sampling, stopping_probabilities, token_prob

DRAFTERS = {"eagle": "smollm2-135m-instruct-eagle", "draft": "smollm2-135m-instruct-draft"}


def expected_accepted(inputs, verdict, num_accepted):
    """Per sequence and cycle: E[accepted drafts] under each rule, same block."""
    del verdict, num_accepted
    p = token_prob(inputs.target_probs, inputs.draft_tokens)
    q = token_prob(inputs.draft_probs, inputs.draft_tokens)
    ratio = jnp.where(inputs.valid, jnp.minimum(1.0, p / jnp.maximum(q, 1e-30)), 0.0)
    token = jnp.cumprod(ratio).sum()
    h, _ = stopping_probabilities(inputs)
    later = jnp.cumprod((1.0 - h)[::-1])[::-1]  # prod_{i >= t} (1 - h_i)
    after = jnp.concatenate([later[1:], jnp.ones((1,))])  # prod_{i > t} (1 - h_i)
    block = jnp.sum(jnp.arange(1, h.shape[0] + 1) * h * after)
    return {"token": token, "block": block, "cycles": jnp.float32(1.0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="eagle", choices=sorted(DRAFTERS))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.temperature <= 0:
        ap.error("block verification equals token verification at temperature 0; give --temperature > 0")
    print(common.header("block_gain: block vs token verification, expected accepted drafts on the same blocks"))
    target = specjax.load("smollm2-135m-instruct")
    pair = specjax.pair(target, specjax.load(DRAFTERS[args.drafter], dtype="float32"))
    texts = [r["prompt"] for r in common.read_jsonl(common.ROOT / "specjax/assets/chat/heldout_prompts.jsonl")]
    prompts = [specjax.encode_chat(target, t) for t in texts[: args.prompts]]
    per_prompt = []
    for i in range(0, len(prompts), args.batch):
        out = specjax.decode(pair, prompts[i:i + args.batch], rule=speculative_sampling(),
                             num_draft=args.num_draft, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, eos_token_id=tuple(target.module.config.eos_token_ids),
                             key=jax.random.key(i), diagnostics=expected_accepted)
        extra = jax.device_get(out.stats.extra)
        per_prompt += list(zip(extra["token"], extra["block"], extra["cycles"]))
    token, block, cycles = (np.asarray(x, np.float64) for x in zip(*per_prompt))
    gain = block / cycles - token / cycles  # per prompt, per cycle
    print(f"{args.drafter}, K={args.num_draft}, T={args.temperature:g}, {len(per_prompt)} prompts, "
          f"{int(cycles.sum())} cycles")
    print(f"E[accepted drafts per cycle]: token {token.sum() / cycles.sum():.4f}, block {block.sum() / cycles.sum():.4f} "
          f"(x{block.sum() / token.sum():.4f}); tau (+1 emitted) token {1 + token.sum() / cycles.sum():.4f}, "
          f"block {1 + block.sum() / cycles.sum():.4f} (x{(cycles.sum() + block.sum()) / (cycles.sum() + token.sum()):.4f})")
    print(f"per prompt, block - token per cycle: {gain.mean():+.4f} +- {gain.std(ddof=1) / np.sqrt(len(gain)):.4f} "
          f"(s.e.); prompts where block is higher / lower: {(gain > 1e-9).sum()} / {(gain < -1e-9).sum()}")
    print(f"load average at end: {common.load_average()}")


if __name__ == "__main__":
    main()
