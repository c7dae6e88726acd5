"""What one cycle of drafting.auto()'s program costs, forced to each draft length, against the
fixed-K program of the same length.

    python benchmarks/auto_cycle_costs.py --batch 4                      # float32, batch 4
    python benchmarks/auto_cycle_costs.py --quantize gguf --batch 1      # the GGUF's 4-bit target
    python benchmarks/auto_cycle_costs.py --batch 2 --temperature 1      # sampled, lossless

The real pair (SmolLM2-135M-Instruct and its EAGLE-3-style head), the first ``--batch`` held-out
chat prompts, greedy (or ``--temperature``, lossless speculative sampling), ``--max-new-tokens``
new tokens, no EOS. Contenders: ``generate``
(target-only); ``decode`` with ``drafting.fixed()`` at K = 1 .. ``--cap``; ``decode`` with
``auto()`` capped at ``--cap`` whose costs force every cycle to draft k (k = 0: plain target
steps inside the drafting program), for k = 0 .. cap; then ``auto()`` itself. Each compiles once,
then ``--rounds`` rounds alternate. Printed per contender: wall time and process CPU time per
loop cycle (median over rounds), tokens per cycle, and tok/s against target-only. The table
beside it sets auto's cycle forced to k against the fixed-K=k program's cycle (the same drafts,
the same verification): what auto's program adds per cycle at each length, the cap's wider
buffers and its conditionals included.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import common
import specjax
from specjax import drafting


def forcing(costs, k):
    """Costs under which auto() always drafts k (every other length costs a million cycles)."""
    lengths = jnp.arange(costs.verify.shape[-1])
    zero = jnp.zeros_like
    return costs.replace(
        verify=jnp.where(lengths == k, 1.0, 1e6).astype(jnp.float32),
        draft_first=zero(costs.draft_first),
        draft_step=zero(costs.draft_step),
        cycle=zero(costs.cycle),
        measured=zero(costs.measured),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cap", type=int, default=3, help="auto's K cap; fixed K runs 1 .. cap")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantize", choices=["gguf"], help="the target's weights: the GGUF's own 4-bit blocks")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0, lossless sampling")
    args = ap.parse_args()
    batch, n, cap = args.batch, args.max_new_tokens, args.cap
    rows = common.read_prompt_file(common.ROOT / "benchmarks/prompts/heldout_chat_64.jsonl", ap)[:batch]
    target = specjax.load("smollm2-135m-instruct", dtype="float32", quantize=args.quantize)
    params = specjax.pair(target, specjax.load("smollm2-135m-instruct-eagle", dtype="float32"))
    prompts = [specjax.encode_chat(target, r["prompt"]) for r in rows]
    buckets = specjax.Buckets(prompt=max(map(len, prompts)), new_tokens=n)
    kw = dict(max_new_tokens=n, temperature=args.temperature, eos_token_id=(), buckets=buckets, key=jax.random.key(0))
    weights = "the GGUF's 4-bit weights" if args.quantize else "float32"
    print(common.header(f"auto()'s cycle forced to each draft length against fixed K, batch {batch}, {weights}, "
                        f"T={args.temperature:g}"))
    base = specjax.engine.measure_costs(params, batch=batch, num_draft=cap)
    print(base.describe())
    cont = {"target-only": lambda: specjax.generate(params.target, prompts, **kw)}
    for k in range(1, cap + 1):
        cont[f"fixed K={k}"] = lambda k=k: specjax.decode(params, prompts, drafting=drafting.fixed(), num_draft=k, **kw)
    for k in range(cap + 1):
        pol = drafting.auto(costs=forcing(base, k), timed=False)
        cont[f"auto k={k}"] = lambda pol=pol: specjax.decode(params, prompts, drafting=pol, num_draft=cap, **kw)
    cont["auto"] = lambda: specjax.decode(params, prompts, drafting=drafting.auto(), num_draft=cap, **kw)
    outs = {}
    t0 = time.perf_counter()
    for name, f in cont.items():
        outs[name] = f()
        jax.block_until_ready(outs[name].tokens)
    print(f"compiled and warmed up {len(cont)} contenders in {time.perf_counter() - t0:.0f} s")
    cpu = {name: [] for name in cont}
    wall = {name: [] for name in cont}
    names = list(cont)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t, w = time.process_time(), time.perf_counter()
            jax.block_until_ready(cont[name]().tokens)
            cpu[name].append(time.process_time() - t)
            wall[name].append(time.perf_counter() - w)
    tokens = batch * n
    per_cycle = {}
    print(f"\n{'contender':12s} {'cycles':>6s} {'tok/cycle':>9s} {'wall ms/cycle':>13s} {'cpu ms/cycle':>12s} "
          f"{'vs target-only':>14s}  (wall: median [min-max] over {args.rounds} rounds)")
    base_wall = np.median(wall["target-only"])
    for name in cont:
        st = getattr(outs[name], "stats", None)
        cycles = int(np.asarray(st.target_forwards)) if name != "target-only" else n
        med = np.median(wall[name])
        per_cycle[name] = med / cycles
        ratios = [b / w for b, w in zip(wall["target-only"], wall[name])]
        print(f"{name:12s} {cycles:6d} {tokens / batch / cycles:9.2f} {med * 1000 / cycles:13.2f} "
              f"{np.median(cpu[name]) * 1000 / cycles:12.2f} {base_wall / med:13.2f}x  "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    print("\nauto's program forced to draft k, per cycle, against the fixed-K=k program's cycle (wall)")
    print(f"{'k':>2s} {'fixed ms':>9s} {'auto ms':>9s} {'auto / fixed':>12s} {'in target-only steps':>21s}")
    for k in range(cap + 1):
        fixed = per_cycle["target-only"] if k == 0 else per_cycle[f"fixed K={k}"]
        forced = per_cycle[f"auto k={k}"]
        print(f"{k:2d} {fixed * 1000:9.2f} {forced * 1000:9.2f} {forced / fixed:12.3f} "
              f"{forced / per_cycle['target-only']:21.3f}")
    st = outs["auto"].stats
    print(f"\nauto: drafted at slots {np.asarray(st.drafted_at).sum(0).tolist()} of "
          f"{int(np.asarray(st.cycles).sum())} sequence-cycles")


if __name__ == "__main__":
    main()
