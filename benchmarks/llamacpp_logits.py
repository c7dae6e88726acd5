"""Where specjax and llama.cpp part on the same GGUF: logits on the same tokens.

``benchmarks/llamacpp.py`` compares free-running greedy texts, and one early
different token changes everything after it, so their agreement says little
about how close the two engines' numbers are. This script teacher-forces both
on the same sequences (a held-out chat prompt and specjax's own float32 greedy
answer to it) and compares, at every answer position:

* top-1 agreement of llama.cpp with specjax float32 (the GGUF dequantized) and
  with specjax on the file's own quantized blocks (``quantize="gguf"``);
* the same for llama.cpp fed one token at a time (how it decodes) against
  llama.cpp fed the whole sequence in one batch (how it reads a prompt): the
  spread of llama.cpp against itself;
* the log-probability gap, in specjax float32, between specjax's top-1 and the
  token llama.cpp ranks first, where they differ: how close the call was;
* KL(first || second) per position, and the largest log-probability
  difference among the second's top 10 tokens.

Run (no timing; a few minutes on a 2-core CPU)::

    python benchmarks/llamacpp_logits.py --target gemma-3-270m --prompts 8
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from llamacpp import HELDOUT_64, INSTALL, N_CTX, TARGET, gguf_path  # noqa: E402


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def llamacpp_scores(llm, ids: list[int], one_at_a_time: bool) -> np.ndarray:
    """Logits ``[len(ids), V]`` from llama.cpp, the whole sequence in one batch or a token per call."""
    llm.reset()
    if one_at_a_time:
        for t in ids:
            llm.eval([t])
    else:
        llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def compare(ref_lp: np.ndarray, other: np.ndarray) -> dict:
    """Top-1 agreement of ``other`` logits with ``ref_lp`` log-probs ``[N, V]``, and how close the calls were."""
    other_lp = log_softmax(other)
    a, b = ref_lp.argmax(-1), other_lp.argmax(-1)
    differ = a != b
    top10 = np.argsort(-ref_lp, -1)[:, :10]
    rows = np.arange(len(a))
    gap = (ref_lp[rows, a] - ref_lp[rows, b])[differ]  # >= 0: how far the other's choice lies below ours
    return {"positions": int(len(a)), "agree": float(1 - differ.mean()), "differ": int(differ.sum()),
            "gaps": gap.tolist(), "kl": (np.exp(other_lp) * (other_lp - ref_lp)).sum(-1).tolist(),
            "top10_dlogp": np.abs(np.take_along_axis(ref_lp - other_lp, top10, -1)).max(-1).tolist()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--prompt-file", type=common.Path, default=HELDOUT_64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the report here (markdown)")
    args = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(INSTALL) from None
    import specjax

    texts = [row["prompt"] for row in common.read_prompt_file(args.prompt_file, ap)][:args.prompts]
    report = common.Report(f"specjax and llama.cpp on the same tokens: {args.target}, teacher-forced logits")
    f32 = specjax.load(args.target, dtype="float32")
    q4 = specjax.load(args.target, dtype="float32", quantize="gguf")
    prompts = [specjax.encode_chat(f32, t) for t in texts]
    if max(map(len, prompts)) + args.max_new_tokens > N_CTX:
        ap.error(f"a prompt plus --max-new-tokens exceeds llama.cpp's n_ctx {N_CTX}")
    llm = llama_cpp.Llama(model_path=gguf_path(args.target), n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=N_CTX, logits_all=True, verbose=False)
    report.text(f"GGUF {gguf_path(args.target)}; llama-cpp-python {llama_cpp.__version__}; {len(prompts)} prompts of "
                f"{args.prompt_file.name} in the chat template, each followed by specjax float32's greedy answer "
                f"({args.max_new_tokens} tokens, EOS ignored); compared at the answer positions")

    names = ("llama.cpp batch vs specjax f32", "llama.cpp batch vs specjax q4",
             "llama.cpp one-by-one vs specjax f32", "llama.cpp one-by-one vs llama.cpp batch",
             "specjax q4 vs specjax f32")
    per_prompt = {n: [] for n in names}
    for i, ids in enumerate(prompts):
        out = specjax.generate(f32, [ids], max_new_tokens=args.max_new_tokens, temperature=0.0, eos_token_id=())
        seq = ids + np.asarray(out.tokens)[0, :int(np.asarray(out.lengths)[0])].tolist()
        # The logits at position p predict token p + 1: the answer's tokens are predicted from len(ids) - 1 on.
        span = slice(len(ids) - 1, len(seq) - 1)
        lp_f32 = log_softmax(np.asarray(specjax.logits(f32, [seq]))[0, span])
        lg_q4 = np.asarray(specjax.logits(q4, [seq]))[0, span]
        batch = llamacpp_scores(llm, seq, one_at_a_time=False)[span]
        single = llamacpp_scores(llm, seq, one_at_a_time=True)[span]
        per_prompt[names[0]].append(compare(lp_f32, batch))
        per_prompt[names[1]].append(compare(log_softmax(lg_q4), batch))
        per_prompt[names[2]].append(compare(lp_f32, single))
        per_prompt[names[3]].append(compare(log_softmax(batch), single))
        per_prompt[names[4]].append(compare(lp_f32, lg_q4))
        print(f"prompt {i}: " + "; ".join(f"{n}: {per_prompt[n][-1]['agree']:.3f}" for n in names), flush=True)

    rows = []
    for n in names:
        rs = per_prompt[n]
        agree = [r["agree"] for r in rs]
        gaps = np.concatenate([np.asarray(r["gaps"]) for r in rs]) if any(r["gaps"] for r in rs) else np.zeros(0)
        total = sum(r["positions"] for r in rs)
        kl = np.concatenate([r["kl"] for r in rs])
        d10 = np.concatenate([r["top10_dlogp"] for r in rs])
        gap_cell = (f"{np.median(gaps):.3f} / {np.percentile(gaps, 90):.3f} / {gaps.max():.3f}" if gaps.size else "-")
        rows.append([n, f"{1 - gaps.size / total:.4f}", f"{min(agree):.3f}-{max(agree):.3f}", f"{gaps.size}/{total}",
                     gap_cell, f"{np.mean(kl):.2e} / {np.max(kl):.2e}", f"{np.median(d10):.4f} / {np.max(d10):.4f}"])
    report.table("top-1 at the answer positions", ["pair (first vs second)", "top-1 agreement", "per prompt [min-max]", "positions differing",
                  "gap where they differ: median / p90 / max (nats)", "KL(first || second): mean / max",
                  "max |dlogp| over the second's top 10: median / max"], rows)
    report.text("gap: log-probability, under the second model of the pair, of its own top-1 minus that of the "
                "first model's top-1; a gap near 0 is a near tie that any rounding can flip.")
    report.write(args.out)


if __name__ == "__main__":
    main()
