"""A mixture of experts at the cost of its active parameters, and speculative decoding on it.

    python benchmarks/moe.py                                   # float32 and int8, 4 layers
    python benchmarks/moe.py --formats float32 --layers 2 --rounds 3 --markdown out.md

Models (random weights, batch 1, greedy): ``moe``, Qwen3-30B-A3B's expert layout
(128 experts, 8 routed, renormalised; expert width 0.375 x hidden, q/k norms,
8:1 grouped-query heads) at ``--hidden`` 512 with ``--layers`` blocks and a
``--vocab``-token head; ``dense``, a Qwen3 with the same attention, embeddings
and head and one MLP as wide as the 8 routed experts together (the same active
parameters). Random routers route uniformly, so tokens of one block share few
experts: a worst case for the verification's cost next to trained routers.

1. **Step cost**: one cached forward of width 1 (a decode step) and of widths
   2..K+1 (verification blocks), each model, the contenders alternating over
   ``--rounds``; median ms, min-max spread, and the MoE/dense ratio (median of
   per-round ratios).
2. **Speculative decoding** on the MoE target: ``specjax.generate`` (target
   only) against ``specjax.decode`` with K = 1..``--max-k`` and a draft that
   proposes the target's own greedy token with probability ``--agree`` (a
   table lookup, so drafting costs next to nothing: the figures isolate the
   target's verification cost). Tokens are checked equal to target-only's.

With ``--mesh M`` everything runs on a ``(1, M)`` mesh whose ``'model'`` axis
splits the experts (on the CPU, ``M`` host devices sharing its cores), and the
step table gains ``moe-all``: every device computing every token on each of its
experts, what a mesh ran before routed compute worked across it.

Figures on the shared 2-core CPU VM are noisy; the spreads say how much.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def configs(hidden: int, layers: int, vocab: int, kv_heads: int = 1):
    """``(moe, dense)`` ModelConfigs with Qwen3-30B-A3B's expert layout scaled to ``hidden``
    (``kv_heads``: 1, or one per device of a mesh's 'model' axis)."""
    from specjax import ModelConfig

    heads, head_dim = 8, hidden // 8
    expert = hidden * 3 // 8  # 768 / 2048 in Qwen3-30B-A3B
    base = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        qk_norm=True,
        rope_theta=1e6,
        norm_eps=1e-6,
    )
    moe = ModelConfig(
        model_type="qwen3_moe",
        intermediate_size=6 * hidden,
        moe_intermediate_size=expert,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        **base,
    )
    dense = ModelConfig(model_type="qwen3", intermediate_size=8 * expert, **base)
    return moe, dense


@dataclasses.dataclass(frozen=True)
class AgreeingDraft:
    """A drafter (the LM protocol) whose next token at position ``p`` is ``params["next"][p]``:
    the target's greedy token there, replaced by another with probability ``1 - agree``."""

    vocab_size: int

    @property
    def hidden_size(self) -> int:
        return 1

    @property
    def num_layers(self) -> int:
        return 1

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None):
        from specjax import KVCache

        del max_length, dtype
        return KVCache.empty(batch_size)

    def apply(
        self, params, tokens, cache=None, *, hidden_layers: Sequence[int] = (), tree_parents=None, tree_offset: int = 0
    ):
        import jax
        import jax.numpy as jnp

        from specjax import LMOutput

        b, t = tokens.shape
        start = jnp.zeros((b,), jnp.int32) if cache is None else cache.lengths
        positions = jnp.clip(start[:, None] + jnp.arange(t), 0, params["next"].shape[0] - 1)
        logits = 10.0 * jax.nn.one_hot(params["next"][positions], self.vocab_size, dtype=jnp.float32)
        new_cache = None if cache is None else cache.replace(lengths=cache.lengths + t)
        return LMOutput(logits=logits, hidden=tuple(logits for _ in hidden_layers), cache=new_cache)


def agreeing_draft(greedy: np.ndarray, vocab: int, agree: float, seed: int = 0):
    """The :class:`AgreeingDraft` for one sequence whose greedy tokens (prompt and
    continuation) are ``greedy``."""
    import jax.numpy as jnp

    from specjax import Model

    rng = np.random.default_rng(seed)
    nxt = np.concatenate([greedy[1:], greedy[-1:]]).astype(np.int32)
    wrong = rng.random(nxt.shape) >= agree
    nxt = np.where(wrong, (nxt + 1 + rng.integers(0, vocab - 1, nxt.shape)) % vocab, nxt).astype(np.int32)
    return Model({"next": jnp.asarray(np.concatenate([nxt, np.zeros(4096, np.int32)]))}, AgreeingDraft(vocab))


def step_fns(model, widths: Sequence[int], prefix: int):
    """``{w: fn}``: ``fn()`` runs one cached forward of ``w`` tokens after a ``prefix``-token prompt."""
    import jax
    import jax.numpy as jnp

    cache = model.module.init_cache(1, prefix + max(widths) + 8)
    # Jitted, so that on a mesh the cache comes back in the layout the step's program takes.
    prefill = jax.jit(lambda p, toks, c: model.module.apply(p, toks, c).cache)
    cache = prefill(model.params, jnp.arange(3, 3 + prefix, dtype=jnp.int32)[None], cache)
    fwd = jax.jit(lambda p, toks, c: model.module.apply(p, toks, c).logits)
    fns = {}
    for w in widths:
        toks = jnp.arange(7, 7 + w, dtype=jnp.int32)[None] % model.vocab_size
        fns[w] = lambda toks=toks: jax.block_until_ready(fwd(model.params, toks, cache))
    return fns


def timed_steps(fns: dict, rounds: int, repeats: int) -> dict[str, list[float]]:
    """ms per call of each ``fns[name]`` (mean of ``repeats`` calls), alternating ``rounds`` times."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            times[name].append((time.perf_counter() - t0) / repeats * 1e3)
    return times


def spread(ts: Sequence[float]) -> str:
    return f"{statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})"


def ratio(a: Sequence[float], b: Sequence[float]) -> float:
    return statistics.median([x / y for x, y in zip(a, b)])


def on_mesh(model, mesh, experts: Any = None):
    """``model`` with its params split over ``mesh`` and XLA's products (as ``decode`` on a mesh
    runs it); ``experts`` overrides how its experts compute (default: routed, each device its own)."""
    from specjax import sharding

    placed = sharding.shard_params(model, mesh)
    fields = {"matmul": "xla"}
    if model.module.config.num_experts:
        fields["experts"] = sharding.ExpertMesh(mesh) if experts is None else experts
    return placed.replace(module=dataclasses.replace(model.module, **fields))


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=["float32", "int8"], help="float32 and/or a quantize= format")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--agree", type=float, default=0.8, help="probability the draft proposes the target's token")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10, help="forwards per timed step measurement")
    ap.add_argument("--mesh", type=int, default=0, help="split the experts over this many devices (host devices on a CPU)")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    if args.mesh > 1 and "jax" not in sys.modules:  # host devices must be asked for before jax starts
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.mesh}"
        ).strip()
    import jax

    import specjax
    from specjax import Decoder, Model, sharding

    mesh = sharding.make_mesh(1, args.mesh) if args.mesh > 1 else None

    moe_cfg, dense_cfg = configs(args.hidden, args.layers, args.vocab, max(1, args.mesh))
    lines = [
        common.header(
            "benchmarks/moe.py: a mixture of experts against the dense model of its active "
            "parameters, and speculative decoding on it"
        ),
        "",
    ]

    def emit(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    base = {}
    for name, cfg in (("moe", moe_cfg), ("dense", dense_cfg)):
        base[name] = Model(Decoder(cfg).init(jax.random.key(0)), Decoder(cfg))
    emit(
        f"moe: {moe_cfg.num_layers} layers, hidden {moe_cfg.hidden_size}, {moe_cfg.num_experts} experts of width "
        f"{moe_cfg.moe_intermediate_size}, {moe_cfg.num_experts_per_tok} routed; dense: MLP width "
        f"{dense_cfg.intermediate_size}; {moe_cfg.num_kv_heads} kv heads; vocabulary {moe_cfg.vocab_size}; batch 1, greedy"
    )
    widths = list(range(1, args.max_k + 2))
    prompt = [list(range(3, 19))]
    if mesh is not None:
        emit(f"on a (1, {args.mesh}) mesh: the experts split over 'model' ({jax.device_count()} {jax.devices()[0].platform} devices)")
    for fmt in args.formats:
        models = base if fmt == "float32" else {n: specjax.quantize(m, fmt) for n, m in base.items()}
        if mesh is not None:
            models = {**{n: on_mesh(m, mesh) for n, m in models.items()}, "moe-all": on_mesh(models["moe"], mesh, "all")}
        emit()
        emit(f"## {fmt}")
        emit()
        fns = {}
        for name, model in models.items():
            for w, fn in step_fns(model, widths, prefix=32).items():
                fns[(name, w)] = fn
        times = timed_steps(fns, args.rounds, args.repeats)
        every = "moe-all" in models
        emit(
            "| width | moe ms | dense ms | moe / dense | moe / its 1-token step | dense / its 1-token step |"
            + (" moe-all ms | moe-all / moe |" if every else "")
        )
        emit("|---|---|---|---|---|---|" + ("---|---|" if every else ""))
        for w in widths:
            m, d = times[("moe", w)], times[("dense", w)]
            emit(
                f"| {w} | {spread(m)} | {spread(d)} | {ratio(m, d):.2f}x | {ratio(m, times[('moe', 1)]):.2f}x | "
                f"{ratio(d, times[('dense', 1)]):.2f}x |"
                + (f" {spread(times[('moe-all', w)])} | {ratio(times[('moe-all', w)], m):.2f}x |" if every else "")
            )
        emit()

        target = models["moe"]
        kw = dict(max_new_tokens=args.new_tokens, temperature=0.0, eos_token_id=())
        alone = np.asarray(specjax.generate(target, prompt, **kw).tokens)[0]
        greedy = np.concatenate([np.asarray(prompt[0]), alone])
        draft = agreeing_draft(greedy, target.vocab_size, args.agree)
        pair = specjax.pair(target, draft)
        placement = {} if mesh is None else {"mesh": mesh}
        runs = {"target-only": lambda: specjax.generate(target, prompt, **kw, **placement)}
        for k in range(1, args.max_k + 1):
            runs[f"K={k}"] = lambda k=k: specjax.decode(pair, prompt, num_draft=k, **kw, **placement)
        outs = {name: fn() for name, fn in runs.items()}  # compile, and check the tokens
        for name, out in outs.items():
            if not np.array_equal(np.asarray(out.tokens)[0], alone):
                raise SystemExit(f"{fmt} {name}: tokens differ from target-only's greedy output")
        walls = common.alternate(
            {n: (lambda fn=fn: jax.block_until_ready(fn().tokens)) for n, fn in runs.items()},
            rounds=args.rounds,
            warmup=0,
        )
        emit(
            f"speculative decoding on the moe target, {args.new_tokens} new tokens, draft agreeing at "
            f"{args.agree:.0%} (tokens equal to target-only's in every run)"
        )
        emit()
        emit("| contender | ms / token | tau (tokens per cycle) | speedup over target-only |")
        emit("|---|---|---|---|")
        for name, ts in walls.items():
            per = [t / args.new_tokens * 1e3 for t in ts]
            stats = outs[name].stats if name != "target-only" else None
            tau = f"{stats.tau:.2f}" if stats is not None else "1"
            emit(f"| {name} | {spread(per)} | {tau} | {ratio(walls['target-only'], ts):.2f}x |")
    emit()
    emit(common.load_average() + " (at end)")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
