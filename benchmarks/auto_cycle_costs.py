"""What one cycle of drafting.auto()'s program costs, forced to each draft length.

    python benchmarks/auto_cycle_costs.py 8        # batch 8

The real pair (SmolLM2-135M-Instruct float32 and its EAGLE-3-style head), the
first ``batch`` held-out chat prompts, greedy, 32 new tokens, no EOS. Contenders:
``generate`` (target-only), ``decode`` with fixed K=1 and K=3, and ``decode``
with ``auto()`` capped at K=3 whose costs force every cycle to draft k (k = 0:
plain target steps), then ``auto()`` itself. Each compiles once, then 3 rounds
alternate. Printed per contender: process CPU time and wall time per loop cycle
(median over rounds) and the ratio of whole-call time to target-only's. A plain
cycle of auto's program against a ``generate`` step shows what the program adds.
"""

import sys
import time

import jax
import numpy as np

import common
import specjax
from specjax import drafting
import jax.numpy as jnp

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
n, K = 32, 3
rows = common.read_prompt_file(common.ROOT / "benchmarks/prompts/heldout_chat_64.jsonl", None)[:batch]
target = specjax.load("smollm2-135m-instruct", dtype="float32")
params = specjax.pair(target, specjax.load("smollm2-135m-instruct-eagle", dtype="float32"))
prompts = [specjax.encode_chat(target, r["prompt"]) for r in rows]
buckets = specjax.Buckets(prompt=max(map(len, prompts)), new_tokens=n)
kw = dict(max_new_tokens=n, temperature=0.0, eos_token_id=(), buckets=buckets, key=jax.random.key(0))
print(common.header(f"auto()'s cycle forced to each draft length, batch {batch}"))
base = specjax.engine.measure_costs(params, batch=batch, num_draft=K, verify_widths=(1, 2, 4), cache_length=512)
print(base.describe())
cont = {
    "target-only": lambda: specjax.generate(params.target, prompts, **kw),
    "fixed K=1": lambda: specjax.decode(params, prompts, drafting=drafting.fixed(), num_draft=1, **kw),
    "fixed K=3": lambda: specjax.decode(params, prompts, drafting=drafting.fixed(), num_draft=3, **kw),
}


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


for k in range(K + 1):
    pol = drafting.auto(costs=forcing(base, k))
    cont[f"auto k={k}"] = lambda pol=pol: specjax.decode(params, prompts, drafting=pol, num_draft=K, **kw)
cont["auto"] = lambda: specjax.decode(params, prompts, drafting=drafting.auto(), num_draft=K, **kw)
outs = {}
for name, f in cont.items():
    outs[name] = f()
    jax.block_until_ready(outs[name].tokens)
times = {name: [] for name in cont}
walls = {name: [] for name in cont}
for r in range(3):
    for name, f in cont.items():
        t, w = time.process_time(), time.perf_counter()
        o = f()
        jax.block_until_ready(o.tokens)
        times[name].append(time.process_time() - t)
        walls[name].append(time.perf_counter() - w)
for name in cont:
    st = getattr(outs[name], "stats", None)
    cyc = int(np.sum(np.asarray(st.target_forwards))) if st is not None and hasattr(st, "target_forwards") else n
    med = np.median(times[name])
    print(
        f"{name:12s} {med * 1000:8.1f} ms  cycles {cyc}  ms/cycle {med * 1000 / max(cyc, 1):6.1f}  "
        f"vs target-only {np.median(times['target-only']) / med:.2f}x  wall ms/cycle "
        f"{np.median(walls[name]) * 1000 / max(cyc, 1):6.1f} wall vs target-only "
        f"{np.median(walls['target-only']) / np.median(walls[name]):.2f}x"
    )
