"""Speculative decoding speed vs the target alone, and vs the ideal speedup.

    python benchmarks/decode_speed.py                       # random tiny decoders
    python benchmarks/decode_speed.py --target ckpt/big --draft ckpt/small --num-draft 5

Prints, measured in one run (compile excluded: everything is warmed up first;
medians of ``--repeats`` runs):

* target-only tok/s (``specjax.generate``), speculative tok/s
  (``specjax.decode``) and their ratio (the realized speedup);
* tau (mean tokens committed per cycle) and the acceptance rate;
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
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import Decoder, Model, ModelConfig


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


def timed(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` (which must block), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="checkpoint dir for specjax.load (default: random tiny decoders)")
    ap.add_argument("--draft", help="checkpoint dir for specjax.load")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--embed-scale", type=float, default=30.0, help="random models: agreement knob")
    ap.add_argument("--draft-noise", type=float, default=0.1, help="random models: head perturbation")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rule", default="speculative_sampling", help="a specjax.rules.parse_rule string")
    ap.add_argument("--drafting", default="fixed", choices=["fixed", "heuristic", "confidence", "adasd_entropy"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.target:
        target, draft = specjax.load(args.target), specjax.load(args.draft or args.target)
    else:
        target, draft = random_pair(
            args.vocab, args.hidden, args.layers, args.draft_layers, args.seed, args.embed_scale, args.draft_noise
        )
    params = specjax.pair(target, draft)
    vocab = params.vocab_size
    from specjax.rules import parse_rule

    rule = parse_rule(args.rule)
    policy = getattr(specjax.drafting, args.drafting)()
    k, n, b = args.num_draft, args.max_new_tokens, args.batch
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, vocab, size=(b, args.prompt_len)).astype(np.int32)
    key = jax.random.key(args.seed)
    common = dict(max_new_tokens=n, temperature=args.temperature, key=key)

    def run_generate():
        out = specjax.generate(params, prompts, **common)
        out.tokens.block_until_ready()
        return out

    def run_decode():
        out = specjax.decode(params, prompts, rule=rule, drafting=policy, num_draft=k, **common)
        out.tokens.block_until_ready()
        return out

    t_gen = timed(run_generate, args.repeats)
    t_dec = timed(run_decode, args.repeats)
    gen_tokens = int(np.sum(run_generate().lengths))
    out = run_decode()
    dec_tokens = int(np.sum(out.lengths))
    stats = out.stats

    context, cache_length = args.prompt_len + n // 2, args.prompt_len + n + k
    c_ar = forward_cost(target, b, 1, context, cache_length, vocab, args.repeats)
    c_draft = forward_cost(draft, b, 1, context, cache_length, vocab, args.repeats)
    c_verify = forward_cost(target, b, k + 1, context, cache_length, vocab, args.repeats)
    tau = stats.tau
    ideal = tau * c_ar / (k * c_draft + c_verify)
    # With an adaptive policy, the draft runs fewer than K forwards per cycle.
    draft_per_cycle = float(stats.draft_forwards) / max(float(stats.target_forwards), 1.0)
    ideal_measured_k = tau * c_ar / (draft_per_cycle * c_draft + c_verify)
    realized = (dec_tokens / t_dec) / (gen_tokens / t_gen)

    dev = jax.devices()[0]
    print(f"device: {dev.platform} ({dev.device_kind}), batch {b}, prompt {args.prompt_len}, "
          f"max_new_tokens {n}, K={k}, temperature {args.temperature}, rule {rule.spec}, "
          f"drafting {policy.spec}")
    print(f"target-only : {gen_tokens / t_gen:10.1f} tok/s  ({t_gen * 1e3:.1f} ms for {gen_tokens} tokens)")
    print(f"speculative : {dec_tokens / t_dec:10.1f} tok/s  ({t_dec * 1e3:.1f} ms for {dec_tokens} tokens)")
    print(f"speedup     : {realized:.3f}x realized")
    print(f"tau         : {tau:.3f}   acceptance {stats.acceptance_rate:.3f}   "
          f"draft forwards/cycle {draft_per_cycle:.2f}")
    print(f"costs       : c_AR {c_ar * 1e6:.1f} us, c_draft {c_draft * 1e6:.1f} us, "
          f"c_verify(K+1={k + 1}) {c_verify * 1e6:.1f} us")
    print(f"ideal       : {ideal:.3f}x = tau*c_AR/(K*c_draft+c_verify)"
          f"   ({ideal_measured_k:.3f}x with the measured draft forwards per cycle)")
    print(f"realized / ideal: {realized / ideal:.3f}")


if __name__ == "__main__":
    main()
