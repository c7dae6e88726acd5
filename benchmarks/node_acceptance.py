"""How much of a tree node's target mass its children take, sampled or chosen (no timing).

    python benchmarks/node_acceptance.py                         # 12 prompts, T=1, up to 4 children
    python benchmarks/node_acceptance.py --temperatures 0.7 1 --prompts 24

When sampling, a tree node's children are either drawn from the draft's ``q``
without replacement and verified by recursive rejection sampling (a static
tree, ``dynamic_tree(..., sampled=True)``), or they are the draft's top-n,
verified as point-mass drafts (``sampled=False``, EAGLE-2's children). Both
are exact; which accepts more depends on how the two models spread their
mass. This script measures it on the real pair at the positions a user's
decode meets: the target answers ``--prompts`` held-out chat prompts at each
temperature, then target and draft model are run teacher-forced over prompt
and answer, and at every answer position it computes, for ``n = 1 ..
--children``,

* chosen: ``sum_{i <= n} p(c_i)`` over the draft's top-n tokens ``c_i``
  (exact: each try takes ``p`` without the earlier children, so the node
  accepts one of them with the target mass they hold);
* sampled: the probability that recursive rejection sampling accepts one of
  ``n`` children drawn without replacement (Monte Carlo, ``--draws`` per
  position; "Recursive Speculative Decoding", Jeon et al., arXiv:2402.14160),

and ``sum min(p, q)``, one sampled child's exact acceptance, as a check of
the Monte Carlo column. ``p`` and ``q`` are the two models' softmax at the
temperature, no top-k / top-p.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from real_pair import CHAT, DRAFTERS, TARGET  # noqa: E402


def chosen_acceptance(p: np.ndarray, q: np.ndarray, n: int) -> np.ndarray:
    """``[n]``: the target mass on the draft's top-1 .. top-n tokens."""
    top = np.argsort(-q, kind="stable")[:n]
    return np.cumsum(p[top])


def sampled_acceptance(p: np.ndarray, q: np.ndarray, n: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """``[n]``: how often recursive rejection sampling accepts one of the first
    1 .. n children drawn from ``q`` without replacement (Gumbel top-n)."""
    logq = np.log(np.where(q > 0, q, 1.0))
    hits = np.zeros(n)
    for _ in range(draws):
        scores = np.where(q > 0, logq + rng.gumbel(size=q.shape), -np.inf)
        top = np.argpartition(-scores, n)[:n]
        children = top[np.argsort(-scores[top])]
        pp, qq = p, q
        for i, x in enumerate(children):
            if qq[x] <= 0:
                break
            if rng.random() * qq[x] <= pp[x]:
                hits[i:] += 1
                break
            residual = np.maximum(pp - qq, 0.0)
            pp = residual / residual.sum() if residual.sum() > 1e-12 else pp
            qq = qq.copy()
            qq[x] = 0.0
            qq = qq / max(qq.sum(), 1e-300)
    return hits / draws


def main(argv=None):
    import jax
    import jax.numpy as jnp

    import specjax

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0])
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--draws", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    if any(t <= 0 for t in args.temperatures):
        ap.error("--temperatures: positive values (greedy trees take the draft's top-k whatever this says)")

    report = common.Report("tree node acceptance, sampled vs chosen children: SmolLM2-135M-Instruct + draft model")
    target = specjax.load(TARGET, dtype="float32")
    draft = specjax.load(DRAFTERS["draft"], dtype="float32")
    vocab = min(target.module.config.vocab_size, draft.module.config.vocab_size)
    texts = [r["prompt"] for r in common.read_jsonl(CHAT)][: args.prompts]
    forward = {name: jax.jit(lambda toks, m=m: m.module.apply(m.params, toks).logits[0, :, :vocab])
               for name, m in (("target", target), ("draft", draft))}
    report.text(f"{len(texts)} held-out chat prompts, target answers of up to {args.max_new_tokens} tokens "
                f"(EOS honoured), {args.draws} Monte Carlo draws per position for the sampled column")
    rng = np.random.default_rng(args.seed)
    n = args.children
    for temperature in args.temperatures:
        p_rows, q_rows = [], []
        for i, text in enumerate(texts):
            ids = specjax.encode_chat(target, text)
            out = specjax.generate(target, [ids], max_new_tokens=args.max_new_tokens, temperature=temperature,
                                   eos_token_id=tuple(target.module.config.eos_token_ids),
                                   key=jax.random.key(args.seed + i))
            answer = np.asarray(out.tokens[0, : int(out.lengths[0])]).tolist()
            seq = jnp.asarray([ids + answer], jnp.int32)
            rows = slice(len(ids) - 1, len(ids) - 1 + len(answer))  # the positions that predicted the answer
            for name, dest in (("target", p_rows), ("draft", q_rows)):
                logits = np.asarray(forward[name](seq), np.float64)[rows] / temperature
                logits -= logits.max(-1, keepdims=True)
                probs = np.exp(logits)
                dest.append(probs / probs.sum(-1, keepdims=True))
        P, Q = np.concatenate(p_rows), np.concatenate(q_rows)
        chosen = np.mean([chosen_acceptance(p, q, n) for p, q in zip(P, Q)], axis=0)
        sampled = np.mean([sampled_acceptance(p, q, n, args.draws, rng) for p, q in zip(P, Q)], axis=0)
        overlap = float(np.minimum(P, Q).sum(-1).mean())
        rows = [[f"{i + 1}", f"{chosen[i]:.3f}", f"{sampled[i]:.3f}", f"{sampled[i] - chosen[i]:+.3f}"]
                for i in range(n)]
        report.table(f"T={temperature:g}: {len(P)} positions; sum min(p, q) = {overlap:.3f} (one sampled child, exact)",
                     ["children", "chosen (top-n, point masses)", "sampled (w/o replacement, RRS)", "difference"],
                     rows)
    report.write(args.markdown)


if __name__ == "__main__":
    main()
