"""specjax vs Hugging Face assisted generation on the same checkpoints (CPU, batch 1).

    python benchmarks/hf_assisted.py                     # embedded pair, fp32, K=4
    python benchmarks/hf_assisted.py --markdown out.md   # also write the tables as markdown

Peer: ``transformers`` ``model.generate(..., assistant_model=draft)`` in PyTorch
on the embedded pair's HF directories (``specjax/assets/models/{target,draft}``),
the same weights specjax loads; both frameworks in ``--dtype`` (fp32 default).
Settings made equal:

* K: ``assistant_model.generation_config.num_assistant_tokens = K``,
  ``num_assistant_tokens_schedule = "constant"`` (the default "heuristic" one
  rewrites K and persists it across calls), ``assistant_confidence_threshold
  = 0`` (default 0.4 stops drafting early); reset before every call.
* lengths: no EOS on either side (``generation_config.eos_token_id = None`` for
  HF, ``eos_token_id=()`` for specjax), so both emit exactly
  ``--max-new-tokens`` per prompt; we check the counts.
* sampling: greedy, and T=1 with no top-k / top-p on both (HF's ``top_k=50``
  default is switched off). HF's assisted T>0 path is standard speculative
  sampling, as is specjax's lossless ``speculative_sampling`` rule.
* batch 1 (HF assisted generation supports nothing else): specjax runs the
  prompts one by one too, padded to one width so one program serves all.
* ``torch.set_num_threads`` = every core, and also 1 thread (``--torch-threads``):
  on a loaded 2-core machine one thread is often faster; the goal is judged
  against the faster peer.

Timing: everything warms up first (compile for JAX, first-call setup for
torch), then the contenders alternate ``--rounds`` times over the whole prompt
set, each timed run preceded by an untimed one-prompt call of the same
contender (the other framework's run leaves thread pools cold); medians,
spread, and the per-round ratio specjax/HF.

Correctness (printed): greedy outputs of specjax decode, specjax generate,
HF assisted and HF target-only are compared token for token; at a mismatch,
the target's top-2 logit gap at that position (fp32, specjax) says whether it
is a near tie (rounding) or a real bug.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(common.MODELS / "target"))
    ap.add_argument("--draft", default=str(common.MODELS / "draft"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-task", type=int, default=4, help="held-out arithmetic prompts")
    ap.add_argument("--num-code", type=int, default=2, help="held-out code prompts (cut to --max-prompt)")
    ap.add_argument("--max-prompt", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-draft", "-K", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-threads", default=f"{os.cpu_count()},1", help="comma list; each is one HF contender")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", help="write the report as markdown here")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import jax
    import specjax
    from specjax.models import unpacked_dir
    from specjax.rules import parse_rule

    rep = common.Report("hf_assisted: specjax lossless vs Hugging Face assisted generation (batch 1)")
    K, N = args.num_draft, args.max_new_tokens
    threads = [int(t) for t in args.torch_threads.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]

    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    # The shipped pair keeps its weights xz-compressed; transformers reads the unpacked copy.
    hf_t = AutoModelForCausalLM.from_pretrained(unpacked_dir(args.target), dtype=tdtype).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(unpacked_dir(args.draft), dtype=tdtype).eval()
    for m in (hf_t, hf_d):
        m.generation_config.eos_token_id = None  # no EOS: exactly N tokens
        m.generation_config.pad_token_id = 0
    calls = {"target": 0}
    hf_t.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))

    target = specjax.load(args.target, dtype=args.dtype)
    draft = specjax.load(args.draft, dtype=args.dtype)
    params = specjax.pair(target, draft)
    rule = parse_rule("speculative_sampling")

    prompts = common.eval_prompts(args.num_task, args.num_code, args.max_prompt)
    width = max(len(p) for p in prompts)
    arr, lens = common.pad(prompts, width)
    rep.text(f"pair: {args.target} / {args.draft}, dtype {args.dtype} in both frameworks; K={K}; "
             f"{len(prompts)} prompts ({args.num_task} arithmetic + {args.num_code} code, "
             f"{min(lens)}-{max(lens)} tokens), {N} new tokens each, no EOS; torch threads {threads}; "
             f"transformers {transformers.__version__}, torch {torch.__version__}, jax {jax.__version__}")

    def hf_call(i, temperature, assistant=True, nthreads=None):
        if nthreads:
            torch.set_num_threads(nthreads)
        gc = hf_d.generation_config
        gc.num_assistant_tokens = K
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0
        kw = dict(max_new_tokens=N, min_new_tokens=N, pad_token_id=0)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        if assistant:
            kw["assistant_model"] = hf_d
        with torch.no_grad():
            out = hf_t.generate(torch.tensor([prompts[i]]), **kw)
        return out[0, len(prompts[i]):].tolist()

    def sj_call(i, temperature, lossless=True):
        common_kw = dict(max_new_tokens=N, temperature=temperature, eos_token_id=(),
                         key=jax.random.key(args.seed + i), prompt_lengths=lens[i:i + 1])
        if lossless:
            out = specjax.decode(params, arr[i:i + 1], rule=rule, num_draft=K, **common_kw)
        else:
            out = specjax.generate(params, arr[i:i + 1], **common_kw)
        out.tokens.block_until_ready()
        return out

    # ---------------- correctness: greedy outputs token for token ----------------
    torch.set_num_threads(threads[0])
    rows, n_same = [], {"decode": 0, "hf_assisted": 0, "hf_target": 0}
    mismatches = []
    t0 = time.perf_counter()
    sj_call(0, 0.0, True)
    sj_call(0, 0.0, False)
    rep.text(f"T=0: specjax compile + first call (decode + generate, batch 1) {time.perf_counter() - t0:.1f} s, "
             "excluded from every timing")
    for i in range(len(prompts)):
        ref = sj_call(i, 0.0, lossless=False).to_lists()[0]  # specjax target-only
        got = {"decode": sj_call(i, 0.0).to_lists()[0], "hf_assisted": hf_call(i, 0.0),
               "hf_target": hf_call(i, 0.0, assistant=False)}
        cells = [str(i), str(len(prompts[i]))]
        for name, toks in got.items():
            if len(toks) != N:
                cells.append(f"LENGTH {len(toks)}")
                continue
            diff = [j for j in range(N) if toks[j] != ref[j]]
            if not diff:
                n_same[name] += 1
                cells.append("identical")
            else:
                j = diff[0]
                lg = np.asarray(specjax.logits(target, np.asarray([prompts[i] + ref[:j]], np.int32)))[0, -1]
                top = np.sort(lg[: params.vocab_size])[::-1]
                cells.append(f"differs at {j} (top-2 gap {top[0] - top[1]:.2e})")
                mismatches.append((i, name, j, float(top[0] - top[1])))
        rows.append(cells)
    rep.table("Greedy outputs vs specjax target-only (token for token, each prompt)",
              ["prompt", "len", "specjax lossless", "HF assisted", "HF target-only"], rows)
    rep.text(f"identical: specjax lossless {n_same['decode']}/{len(prompts)}, HF assisted "
             f"{n_same['hf_assisted']}/{len(prompts)}, HF target-only {n_same['hf_target']}/{len(prompts)}"
             + ("" if not mismatches else "; mismatches listed with the target's top-2 logit gap at the first "
                "differing position (a gap ~1e-6 or below is a rounding tie between frameworks)"))

    # ---------------- speed: alternating rounds ----------------
    speed_rows, ratio_rows = [], []
    for temperature in temps:
        fns, extra = {}, {}

        def sj_all(lossless, temperature=temperature):
            outs = [sj_call(i, temperature, lossless) for i in range(len(prompts))]
            extra["tokens_sj" if lossless else "tokens_ar"] = sum(int(o.lengths[0]) for o in outs)
            if lossless:
                extra["tau_sj"] = sum(o.stats.summary()["tokens"] for o in outs) / sum(
                    o.stats.summary()["cycles"] for o in outs)
            return outs

        def hf_all(nthreads, temperature=temperature):
            calls["target"] = 0
            outs = [hf_call(i, temperature, True, nthreads) for i in range(len(prompts))]
            extra[f"tokens_hf{nthreads}"] = sum(len(o) for o in outs)
            extra[f"tau_hf{nthreads}"] = extra[f"tokens_hf{nthreads}"] / calls["target"]
            return outs

        names = []
        for nt in threads:
            name = f"HF assisted, {nt} thread{'s' if nt > 1 else ''}"
            fns[name] = lambda nt=nt: hf_all(nt)
            names.append((name, f"tokens_hf{nt}", f"tau_hf{nt}"))
            fns["specjax lossless" + " " * len(names)] = lambda: sj_all(True)
        fns["specjax target-only"] = lambda: sj_all(False)
        # warm-up: one prompt each (JAX compiles once for the padded width)
        t0 = time.perf_counter()
        sj_call(0, temperature, True)
        sj_call(0, temperature, False)
        compile_s = time.perf_counter() - t0
        for nt in threads:
            hf_call(0, temperature, True, nt)
        # Untimed one-prompt call right before each timed run: the previous
        # contender leaves the other framework's thread pools cold (or spinning).
        prewarm = {n: (lambda: sj_call(0, temperature, True)) for n in fns if n.startswith("specjax lossless")}
        prewarm["specjax target-only"] = lambda: sj_call(0, temperature, False)
        for nt in threads:
            prewarm[f"HF assisted, {nt} thread{'s' if nt > 1 else ''}"] = lambda nt=nt: hf_call(0, temperature, True, nt)
        times = common.alternate(fns, args.rounds, warmup=0, prewarm=prewarm)
        sj_names = [n for n in fns if n.startswith("specjax lossless")]
        sj_times = [t for n in sj_names for t in times[n]]
        tok_sj = extra["tokens_sj"]
        for name, tkey, taukey in names:
            t = times[name]
            speed_rows.append([f"T={temperature:g}", name, extra[tkey], f"{extra[tkey] / common.median(t):.1f}",
                               common.spread([extra[tkey] / x for x in t]), f"{extra[taukey]:.2f}"])
        speed_rows.append([f"T={temperature:g}", "specjax lossless", tok_sj, f"{tok_sj / common.median(sj_times):.1f}",
                           common.spread([tok_sj / x for x in sj_times]), f"{extra['tau_sj']:.2f}"])
        t_ar = times["specjax target-only"]
        speed_rows.append([f"T={temperature:g}", "specjax target-only", extra["tokens_ar"],
                           f"{extra['tokens_ar'] / common.median(t_ar):.1f}",
                           common.spread([extra['tokens_ar'] / x for x in t_ar]), "1.00"])
        for (name, _, _), sj_name in zip(names, sj_names):
            # specjax ran right after this HF contender in every round: per-round ratio of tok/s
            r = common.pair_ratios(times[name], times[sj_name])
            ratio_rows.append([f"T={temperature:g}", f"specjax lossless / {name}", common.ratio_cell(r)])
        r = common.pair_ratios(t_ar, times[sj_names[-1]])
        ratio_rows.append([f"T={temperature:g}", "specjax lossless / specjax target-only", common.ratio_cell(r)])
        if temperature > 0:  # the greedy programs were compiled before the correctness check
            rep.text(f"T={temperature:g}: specjax compile + first call (decode + generate, batch 1) "
                     f"{compile_s:.1f} s, excluded")

    rep.table(f"Speed, batch 1, medians of {args.rounds} alternating rounds over all prompts "
              "(tau for HF = tokens / target forwards)",
              ["T", "method", "tokens", "tok/s", "tok/s range", "tau"], speed_rows)
    rep.table("Ratios of tok/s, median per-round ratio [min-max]", ["T", "ratio", "value"], ratio_rows)
    rep.write(args.markdown)


if __name__ == "__main__":
    main()
