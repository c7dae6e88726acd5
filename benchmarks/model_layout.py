"""Per-token decode latency of the decoder's per-layer params layout on this machine.

    python benchmarks/model_layout.py [--tokens 64] [--compare-stacked]

Builds a random ~28M-param Llama-shaped model (batch 1), prefills 16 tokens,
then greedily decodes ``--tokens`` tokens inside one jitted ``fori_loop`` (no
host round trip per token, as ``specjax.decode`` runs) and prints ms/token.
``--compare-stacked`` also times the same weights stacked as ``[L, ...]``
arrays with a ``lax.scan`` over layers, the layout the decoder does not use.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from specjax import Decoder, ModelConfig
from specjax.models import Block, RMSNorm

CONFIG = ModelConfig(
    model_type="llama", vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8,
    num_kv_heads=8, head_dim=64, intermediate_size=1408, max_position_embeddings=2048,
)
PREFILL = 16


def _count(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def per_layer_decoder(model: Decoder, params, steps: int):
    """Greedy decoding with the library's own ``apply`` (per-layer buffers)."""

    @jax.jit
    def run(params, prompt):
        out = model.apply(params, prompt, model.init_cache(1, PREFILL + steps))

        def body(_, carry):
            tok, cache = carry
            out = model.apply(params, tok, cache)
            return jnp.argmax(out.logits[:, -1:], -1).astype(jnp.int32), out.cache

        first = jnp.argmax(out.logits[:, -1:], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, steps, body, (first, out.cache))

    return run


def stacked_decoder(model: Decoder, params, steps: int):
    """The same weights stacked ``[L, ...]`` with a scan over layers (for comparison)."""
    cfg = model.config
    layers = [params[f"layer_{i}"] for i in range(cfg.num_layers)]
    stacked = {
        "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers),
        **{k: v for k, v in params.items() if not k.startswith("layer_")},
    }
    block = Block(cfg)

    def forward(p, tokens, keys, values, lengths):
        positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None]
        x = jnp.take(p["embed"]["embedding"], tokens, axis=0)

        def layer(x, xs):
            lp, k, v = xs
            x, (k, v) = block.apply({"params": lp}, x, positions, (k, v), lengths)
            return x, (k, v)

        x, (keys, values) = jax.lax.scan(layer, x, (p["layers"], keys, values))
        x = RMSNorm(cfg.norm_eps, jnp.dtype(cfg.dtype)).apply({"params": p["final_norm"]}, x)
        logits = x @ p["lm_head"]
        return logits, keys, values, lengths + tokens.shape[1]

    @jax.jit
    def run(p, prompt):
        shape = (cfg.num_layers, 1, PREFILL + steps, cfg.num_kv_heads, cfg.head_dim)
        keys = values = jnp.zeros(shape, jnp.dtype(cfg.dtype))
        logits, keys, values, lengths = forward(p, prompt, keys, values, jnp.zeros((1,), jnp.int32))

        def body(_, carry):
            tok, keys, values, lengths = carry
            logits, keys, values, lengths = forward(p, tok, keys, values, lengths)
            return jnp.argmax(logits[:, -1:], -1).astype(jnp.int32), keys, values, lengths

        first = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, steps, body, (first, keys, values, lengths))

    return run, stacked


def time_per_token(run, params, steps: int, repeats: int = 3) -> tuple[float, float]:
    """Best-of-``repeats`` (wall ms, process CPU ms) per token; the one 16-token
    prefill forward is included (small next to ``steps`` decode steps).

    CPU time counts every thread of this process: on a machine shared with
    other jobs it is a steadier figure than wall time.
    """
    prompt = jnp.arange(PREFILL, dtype=jnp.int32)[None] % CONFIG.vocab_size
    jax.block_until_ready(run(params, prompt))  # compile
    wall = cpu = float("inf")
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(run(params, prompt))
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return 1000 * wall / steps, 1000 * cpu / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="decode steps to time")
    parser.add_argument("--compare-stacked", action="store_true", help="also time stacked [L, ...] weights")
    args = parser.parse_args()

    model = Decoder(CONFIG)
    params = model.init(jax.random.key(0))
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"params: {_count(params) / 1e6:.1f}M, batch 1, {args.tokens} tokens")
    wall, cpu = time_per_token(per_layer_decoder(model, params, args.tokens), params, args.tokens)
    print(f"per-layer buffers: {wall:.2f} ms/token wall ({1000 / wall:.0f} tok/s), {cpu:.2f} ms CPU")
    if args.compare_stacked:
        run, stacked = stacked_decoder(model, params, args.tokens)
        wall, cpu = time_per_token(run, stacked, args.tokens)
        print(f"stacked [L, ...] + scan: {wall:.2f} ms/token wall ({1000 / wall:.0f} tok/s), {cpu:.2f} ms CPU")


if __name__ == "__main__":
    main()
