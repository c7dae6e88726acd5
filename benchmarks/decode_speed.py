"""Speculative decoding speed vs the target alone, and vs the ideal speedup.

    python benchmarks/decode_speed.py                       # random tiny decoders
    python benchmarks/decode_speed.py --target ckpt/big --draft ckpt/small --num-draft 5

Prints, measured in one run (compile excluded: everything is warmed up first;
medians of ``--repeats`` runs):

* target-only tok/s (``specjax.generate``), speculative tok/s
  (``specjax.decode``) and their ratio (the realized speedup);
* tau (mean tokens committed per cycle) and the acceptance rate alpha (accepted / judged);
* forward costs: ``c_AR`` (target, 1 token), ``c_draft`` (draft, 1 token),
  ``c_verify`` (target, K+1 tokens), each timed as an on-device loop of
  forwards against a cache of typical length;
* the ideal speedup ``tau * c_AR / (K * c_draft + c_verify)`` and
  realized / ideal.

Default models (no ``--target``): a random 6-layer Llama-layout target and a
draft that shares its embedding, its first layer and its head (perturbed), so
the two agree often enough to give a realistic tau; the head is scaled up so
distributions are peaked.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import Decoder, Model, ModelConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import timed  # noqa: E402


def random_pair(vocab: int, hidden: int, layers: int, draft_layers: int, seed: int = 0,
                embed_scale: float = 30.0, draft_noise: float = 0.1):
    cfg = ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=max(1, hidden // 64), num_kv_heads=max(1, hidden // 128), head_dim=64,
        intermediate_size=4 * hidden, max_position_embeddings=4096,
    )
    module = Decoder(cfg)
    params = module.init(jax.random.key(seed))
    params["lm_head"] = params["lm_head"] * 30.0
    # A larger embedding dominates the residual stream, so a draft made of the
    # target's first layers agrees with it often (tau ~ 2.5-3 at K=4).
    params["embed"]["embedding"] = params["embed"]["embedding"] * embed_scale
    draft_params = {k: v for k, v in params.items() if not k.startswith("layer_") or int(k.split("_")[1]) < draft_layers}
    head = draft_params["lm_head"]
    draft_params["lm_head"] = head + draft_noise * jnp.std(head) * jax.random.normal(jax.random.key(seed + 1), head.shape)
    target = Model(params, module)
    draft = Model(draft_params, Decoder(cfg.replace(num_layers=draft_layers)))
    return target, draft


def forward_cost(model: Model, batch: int, t: int, context: int, cache_length: int, vocab: int,
                 repeats: int, steps: int = 16) -> float:
    """Seconds per ``t``-token forward with ``context`` cached tokens in a cache
    of ``cache_length`` (the size decode allocates), on device."""
    module = model.module
    cache = module.init_cache(batch, cache_length)
    cache = cache.rollback(jnp.full((batch,), context, jnp.int32))
    tokens = jnp.ones((batch, t), jnp.int32)

    @jax.jit
    def loop(params, cache, tokens):
        def body(i, carry):
            c, acc = carry
            out = module.apply(params, tokens, c)
            # Consume the logits (as decode does) and roll back: same cost every step.
            return out.cache.rollback(c.lengths), acc + out.logits[..., :vocab].max()
        return jax.lax.fori_loop(0, steps, body, (cache, jnp.float32(0)))[1]

    return timed(lambda: loop(model.params, cache, tokens).block_until_ready(), repeats) / steps


def _rule_list(text: str) -> list[str]:
    if text in ("all", "compare"):
        from specjax.evaluation import DEFAULT_RULES

        return list(DEFAULT_RULES)
    return [r for r in text.split(";") if r]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="checkpoint dir for specjax.load (default: random tiny decoders)")
    ap.add_argument("--draft", help="checkpoint dir for specjax.load")
    ap.add_argument("--embedded", action="store_true", help="the embedded pair (specjax/assets/models) on its eval prompts")
    ap.add_argument("--dtype", default=None, help="load dtype (float32 / bfloat16); default: the checkpoint's")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--embed-scale", type=float, default=30.0, help="random models: agreement knob")
    ap.add_argument("--draft-noise", type=float, default=0.1, help="random models: head perturbation")
    ap.add_argument("--batch", type=int, default=1, help="sequences per call (eval prompts: chunks of this size)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--num-task", type=int, default=4, help="--embedded: arithmetic prompts")
    ap.add_argument("--num-code", type=int, default=2, help="--embedded: code prompts (cut to --prompt-len)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--temperatures", help="comma list; overrides --temperature")
    ap.add_argument("--rule", default="speculative_sampling",
                    help="parse_rule strings separated by ';', or 'all' (the compare job's rule list)")
    ap.add_argument("--drafting", default="fixed", choices=["fixed", "heuristic", "confidence", "adasd_entropy"])
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds (and forward-cost repeats)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", help="also write the report as markdown")
    args = ap.parse_args(argv)

    from specjax.rules import parse_rule

    rep = common.Report("decode_speed: target-only vs speculative, realized vs ideal speedup")
    if args.embedded:
        args.target = args.target or str(common.MODELS / "target")
        args.draft = args.draft or str(common.MODELS / "draft")
    if args.target:
        target = specjax.load(args.target, dtype=args.dtype)
        draft = specjax.load(args.draft or args.target, dtype=args.dtype)
    else:
        target, draft = random_pair(
            args.vocab, args.hidden, args.layers, args.draft_layers, args.seed, args.embed_scale, args.draft_noise
        )
    params = specjax.pair(target, draft)
    vocab = params.vocab_size
    policy = getattr(specjax.drafting, args.drafting)()
    k, n, b = args.num_draft, args.max_new_tokens, args.batch
    if args.embedded:
        plist = common.eval_prompts(args.num_task, args.num_code, args.prompt_len)
        what = f"{args.num_task} arithmetic + {args.num_code} code eval prompts"
    else:
        rng = np.random.default_rng(args.seed)
        plist = [list(r) for r in rng.integers(0, vocab, size=(b, args.prompt_len))]
        what = "random prompts"
    width = max(len(p) for p in plist)
    chunks = [common.pad(plist[i:i + b], width) for i in range(0, len(plist), b)]
    temps = [float(t) for t in args.temperatures.split(",")] if args.temperatures else [args.temperature]
    rules = _rule_list(args.rule)
    eos = ()  # no EOS: every call generates exactly max_new_tokens per sequence
    key = jax.random.key(args.seed)

    def run_all(fn):
        outs = [fn(arr, lens) for arr, lens in chunks]
        for o in outs:
            o.tokens.block_until_ready()
        return outs

    def gen(temperature):
        return lambda: run_all(lambda a, l: specjax.generate(
            params, a, prompt_lengths=l, max_new_tokens=n, temperature=temperature, key=key, eos_token_id=eos))

    def dec(rule, temperature):
        return lambda: run_all(lambda a, l: specjax.decode(
            params, a, prompt_lengths=l, rule=rule, drafting=policy, num_draft=k, max_new_tokens=n,
            temperature=temperature, key=key, eos_token_id=eos))

    context, cache_length = width + n // 2, width + n + k
    c_ar = forward_cost(target, b, 1, context, cache_length, vocab, args.repeats)
    c_draft = forward_cost(draft, b, 1, context, cache_length, vocab, args.repeats)
    c_verify = forward_cost(target, b, k + 1, context, cache_length, vocab, args.repeats)
    dev = jax.devices()[0]
    rep.text(f"device: {dev.platform} ({dev.device_kind}), batch {b}, {len(plist)} prompts ({what}) "
             f"(width {width}), max_new_tokens {n} (no EOS), K={k}, drafting {policy.spec}; "
             f"{args.repeats} alternating rounds, compile excluded (measured separately)")
    rep.text(f"forward costs (median of {args.repeats}, on-device loop, cache {context}/{cache_length}): "
             f"c_AR {c_ar * 1e6:.1f} us, c_draft {c_draft * 1e6:.1f} us, c_verify(K+1={k + 1}) "
             f"{c_verify * 1e6:.1f} us; c_draft/c_AR {c_draft / c_ar:.3f}, c_verify/c_AR {c_verify / c_ar:.2f}")
    rows = []
    for temperature in temps:
        fns = {"target-only": gen(temperature)}
        for r in rules:
            fns[r] = dec(parse_rule(r), temperature)
        compile_s = {}
        for name, fn in fns.items():  # compile + first call, timed apart
            _, compile_s[name] = common.timed_once(fn)
        times = common.alternate(fns, args.repeats, warmup=0)
        base_out = fns["target-only"]()
        base_tok = sum(int(np.sum(o.lengths)) for o in base_out)
        base_tps = [base_tok / t for t in times["target-only"]]
        rows.append([f"{temperature:g}", "target-only", f"{common.median(base_tps):.1f}", common.spread(base_tps),
                     "1.00x", "1.00", "-", "-", "-", f"{compile_s['target-only']:.1f}"])
        for r in rules:
            outs = fns[r]()
            tok = sum(int(np.sum(o.lengths)) for o in outs)
            tokens = sum(float(np.sum(o.stats.tokens)) for o in outs)
            cycles = sum(float(np.sum(o.stats.cycles)) for o in outs)
            acc = specjax.concatenate_stats([o.stats for o in outs]).acceptance_rate  # alpha = accepted / judged
            dpc = sum(float(o.stats.draft_forwards) for o in outs) / max(
                sum(float(o.stats.target_forwards) for o in outs), 1.0)
            tau = tokens / cycles
            ideal = tau * c_ar / (dpc * c_draft + c_verify)
            tps = [tok / t for t in times[r]]
            ratios = common.pair_ratios(times["target-only"], times[r])
            realized = common.median(ratios)
            rows.append([f"{temperature:g}", r, f"{common.median(tps):.1f}", common.spread(tps),
                         common.ratio_cell(ratios), f"{tau:.2f}", f"{acc:.3f}", f"{ideal:.2f}x",
                         f"{realized / ideal:.2f}", f"{compile_s[r]:.1f}"])
    rep.table("tok/s (median, range over rounds), speedup = per-round tok/s ratio vs target-only [min-max], "
              "ideal = tau*c_AR/(drafts per cycle*c_draft + c_verify)",
              ["T", "method", "tok/s", "range", "speedup", "tau", "alpha", "ideal", "realized/ideal", "compile s"],
              rows)
    rep.write(args.markdown)


if __name__ == "__main__":
    main()
