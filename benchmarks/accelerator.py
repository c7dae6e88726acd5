"""specjax on an accelerator: correctness on the device, then speed of the shapes users run.

    python benchmarks/accelerator.py                 # a GPU or TPU: about 5 minutes on an H100
    python benchmarks/accelerator.py --smoke         # one tiny shape on the CPU (the suite runs it)
    python benchmarks/accelerator.py --shapes llama-3.2-1b --batches 1 8

Writes ``OUT/accelerator.json`` (every number) and ``OUT/accelerator.md`` (the
tables; paste into BENCHMARKS.md), ``OUT`` = ``--out`` (default
``benchmarks/results/accelerator-<date>``). Sections:

1. **Device and versions**: platform, device kind, jax / jaxlib / flax, the
   measured copy bandwidth (a jitted ``x + 1`` over ``--copy-mib``, bytes read
   plus bytes written over the median time).
2. **Correctness on the device** (float32, full-precision products): greedy speculative decoding equals
   the target's own greedy output on the embedded pair, on a random-weight
   Llama pair (``specjax.testing``) and on that pair quantized (q4 target,
   int8 draft); lossless sampling follows the target's law
   on a bigram pair (the first two tokens of 16384 sequences against the exact
   joint distribution: chi-square p-value and total variation).
3. **Speed** in bfloat16 of random-weight models built from the configs of
   SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B (no download; the final norm is
   scaled x30 so that greedy choices are not near-ties):

   * target-only ``generate`` tok/s at batch 1, 8 and 32 (prompt 32, 128 new
     tokens) against the memory-bandwidth roofline: batch x copy bandwidth /
     bytes one step must read (every weight once, plus each sequence's valid
     KV cache at the mean context);
   * the cost of a (K+1)-token verification forward relative to a 1-token one
     (batch 1, after a 128-token prefix);
   * a 1-token forward at batch 8 after 128 cached tokens in a tight cache
     (192 slots) and in a ``LONG_CACHE``-slot one, read as the platform reads
     it by default (``Decoder(attention_reads="auto")``: the needed prefix on
     TPU, the whole buffer on a GPU) and with ``attention_reads="prefix"``
     (a ``lax.switch`` per layer over the prefix widths, on every platform),
     with the bytes of K and V each reads: what reading only the needed part
     of a long cache gives on this device;
   * the same target-only figures with **quantized weights** (``--quantize``,
     default int8 and q4; random quantized arrays drawn on the device): XLA
     dequantizes in the dot, so the bytes a step reads fall to 1 (int8) or
     0.625 (q4) per weight; the roofline uses those bytes, and
     ``c_verify / c_1`` is measured for each format;
   * speculative decoding at batch 1, K = ``--num-draft``, greedy, with an
     *oracle* draft (the target itself: every draft accepted) and a *small*
     draft (the target's first ``L/8`` blocks with its embedding and head).
     ``ideal`` = tau x c_1 / (K c_d + c_v), the speedup the measured forward
     costs allow at the measured tau (c_1 one target token, c_d one draft
     token, c_v the verification); ``realized`` = target-only time / SD time
     for the same tokens; ``overhead`` = the engine's time per cycle beyond
     K c_d + c_v, as a fraction of the cycle.

Timings are medians of ``--repeats`` calls after one untimed (compiling) call.
Sections stop being started once ``--budget-s`` seconds have passed (each
recorded as skipped), so the run fits a lent machine's time.

On a bare GPU machine with no package index: the machine needs jax with its
CUDA plugin, flax, optax, orbax-checkpoint, safetensors, tokenizers, numpy,
jinja2 and tqdm (scipy for the p-value, else only the total variation is
reported); run from the repository root without installing::

    PYTHONPATH=$PWD python3 benchmarks/accelerator.py --out $OUT

Nothing here reads a GGUF file, so the ``gguf`` wheel is needed only to load
the real SmolLM2 target (``specjax.load("smollm2-135m-instruct")``); carry it
as a wheel (``pip download --no-deps gguf``) with anything else the machine
lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import specjax  # noqa: E402
from common import timed  # noqa: E402
from specjax import Decoder, ModelConfig, testing  # noqa: E402

# The shapes users run (Hugging Face configs; random weights), in the order they run:
# the time budget cuts from the end.
SHAPES = {
    "llama-3.2-1b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, max_position_embeddings=4096, rope_theta=500000.0,
        tie_word_embeddings=True, norm_eps=1e-5,
    ),
    "llama-3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, max_position_embeddings=4096, rope_theta=500000.0,
        tie_word_embeddings=False, norm_eps=1e-5,
    ),
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, max_position_embeddings=2048, rope_theta=100000.0,
        tie_word_embeddings=True, norm_eps=1e-5,
    ),
}
SMOKE_SHAPES = {
    "tiny": ModelConfig(
        model_type="llama", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True,
    ),
}
PEAK = 30.0  # final-norm scale: peaked logits, no greedy near-ties


# --------------------------------------------------------------------------- #
# plumbing


class Budget:
    """Seconds since start; sections are skipped once ``limit`` has passed."""

    def __init__(self, limit: float):
        self.start, self.limit = time.perf_counter(), limit

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> bool:
        return self.elapsed < self.limit


def blocking(fn):
    return lambda: jax.block_until_ready(jax.tree.leaves(fn()))


def versions() -> dict:
    import flax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count(),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "flax": flax.__version__, "python": platform.python_version(), "command": " ".join(sys.argv),
    }


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes read + written per second by a jitted elementwise pass over ``mib`` MiB."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    step = jax.jit(lambda v: v + 1.0)
    seconds = timed(lambda: step(x).block_until_ready(), repeats)
    return 2 * x.nbytes / seconds


# --------------------------------------------------------------------------- #
# models


def random_model(cfg: ModelConfig, seed: int = 0) -> specjax.Model:
    """Random params drawn leaf by leaf on the device (no float32 copy of the whole
    model): ``cfg.dtype`` weights of std 0.02, unit norms with the final one scaled by
    :data:`PEAK`; with ``cfg.quantization``, random quantized arrays of about that std."""
    module = Decoder(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(module.param_shapes())
    four_bit = cfg.quantization is not None and cfg.quant.weights.kind == "q4"
    key, leaves = jax.random.key(seed), []
    for i, (path, shape) in enumerate(flat):
        name = str(getattr(path[-1], "key", path[-1]))
        top = str(getattr(path[0], "key", path[0]))
        k = jax.random.fold_in(key, i)
        if name == "qweight" and shape.dtype == jnp.int8:
            leaves.append(jax.random.randint(k, shape.shape, -127, 128, jnp.int32).astype(jnp.int8))
        elif name == "qweight":  # two 4-bit values a byte
            leaves.append(jax.random.randint(k, shape.shape, 0, 256, jnp.int32).astype(jnp.uint8))
        elif name in ("qscale", "qmin"):  # q * d (+ m) of std about 0.02
            step = 0.02 / (4.6 if four_bit else 73.0)
            leaves.append(jnp.full(shape.shape, step if name == "qscale" else -7.5 * step, shape.dtype))
        elif name == "scale":
            leaves.append(jnp.full(shape.shape, PEAK if top == "final_norm" else 1.0, shape.dtype))
        elif name == "bias":
            leaves.append(jnp.zeros(shape.shape, shape.dtype))
        elif name == "head_vocab_ids":
            leaves.append(jnp.arange(shape.shape[0], dtype=shape.dtype))
        else:
            leaves.append(0.02 * jax.random.normal(k, shape.shape, shape.dtype))
    return specjax.Model(jax.tree_util.tree_unflatten(treedef, leaves), module)


def first_blocks(target: specjax.Model, num_layers: int) -> specjax.Model:
    """The target's first ``num_layers`` blocks with its embedding, final norm and head."""
    params = {k: v for k, v in target.params.items() if not k.startswith("layer_") or int(k[6:]) < num_layers}
    return specjax.Model(params, Decoder(target.module.config.replace(num_layers=num_layers)))


def param_bytes(model: specjax.Model) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(model.params)))


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def prompts(batch: int, width: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, size=(batch, width)).astype(np.int32)


# --------------------------------------------------------------------------- #
# correctness


def greedy_equal(pair: specjax.ModelPair, rows: np.ndarray, new: int, num_draft: int) -> dict:
    sd = specjax.decode(pair, rows, temperature=0.0, num_draft=num_draft, max_new_tokens=new, eos_token_id=())
    ar = specjax.generate(pair.target, rows, temperature=0.0, max_new_tokens=new, eos_token_id=())
    return {"equal": sd.to_lists() == ar.to_lists(), "sequences": len(rows), "new_tokens": new,
            "tau": float(np.mean(np.asarray(sd.stats.tau)))}


def lossless_law(vocab: int = 8, samples: int = 16384, num_draft: int = 3) -> dict:
    """First two tokens after prompt ``[3]`` from the lossless rule at T=1, against the exact law."""
    target_table, draft_table = testing.random_table(0, vocab), testing.random_table(1, vocab)
    pair = specjax.pair(testing.bigram_model(target_table), testing.bigram_model(draft_table))
    out = specjax.decode(pair, [[3]] * samples, temperature=1.0, num_draft=num_draft, max_new_tokens=2,
                         eos_token_id=(), key=jax.random.key(0))
    tokens = np.asarray(out.tokens)[:, :2]
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    logits = target_table.astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    exact = p[3][:, None] * p
    result = {"samples": samples, "tv": float(0.5 * np.abs(counts / samples - exact).sum())}
    try:
        from scipy import stats as scipy_stats

        expected, observed = exact.ravel() * samples, counts.ravel()
        big = expected >= 5  # cells expected fewer than 5 times are pooled into one
        f_exp = np.append(expected[big], expected[~big].sum())
        f_obs = np.append(observed[big], observed[~big].sum())
        result["chi2_p"] = float(scipy_stats.chisquare(f_obs, f_exp * f_obs.sum() / f_exp.sum()).pvalue)
    except ImportError:
        result["chi2_p"] = None
    # Without scipy, a loose bound on the total variation (about 3x its sampling noise at 16384).
    result["ok"] = result["chi2_p"] > 1e-3 if result["chi2_p"] is not None else result["tv"] < 0.05
    return result


def correctness(smoke: bool) -> dict:
    """The three checks; ``smoke`` leaves out the embedded pair (the same code on another pair)
    and draws fewer samples."""
    out = {}
    new = 8 if smoke else 64
    if not smoke:
        target = specjax.load("embedded-target", dtype="float32")
        draft = specjax.load("embedded-draft", dtype="float32")
        rows = prompts(4, 8, target.module.config.vocab_size, seed=1)
        out["embedded_pair_greedy"] = greedy_equal(specjax.pair(target, draft), rows, new, 4)
    target, draft = testing.peaked_target_and_draft(testing.llama_config())
    out["random_llama_greedy"] = greedy_equal(specjax.pair(target, draft), prompts(4, 8, 96, seed=2), new, 4)
    quantized = specjax.pair(specjax.quantize(target, "q4"), specjax.quantize(draft, "int8"))
    out["quantized_llama_greedy"] = greedy_equal(quantized, prompts(4, 8, 96, seed=2), new, 4)
    out["bigram_lossless_law"] = lossless_law(samples=2048 if smoke else 16384)
    return out


# --------------------------------------------------------------------------- #
# speed


def target_only(model, batch: int, width: int, new: int, repeats: int, bandwidth: float) -> dict:
    rows = prompts(batch, width, model.module.config.vocab_size)
    kw = dict(temperature=0.0, max_new_tokens=new, eos_token_id=(), buckets=None)
    seconds = timed(blocking(lambda: specjax.generate(model, rows, **kw).tokens), repeats)
    step_bytes = param_bytes(model) + batch * kv_bytes_per_token(model.module.config) * (width + new / 2)
    roofline = batch * bandwidth / step_bytes  # tok/s if each step only read what it must
    tok_s = batch * new / seconds
    return {"batch": batch, "tok_s": tok_s, "roofline_tok_s": roofline, "of_roofline": tok_s / roofline,
            "ms_per_step": 1e3 * seconds / new, "bytes_per_step": step_bytes}


def forward_ms(model, batch: int, width: int, prefix: int, repeats: int, capacity: int | None = None) -> float:
    """Median ms of one cached forward of ``width`` tokens after ``prefix`` cached ones
    (a cache of ``capacity`` slots, default ``prefix + 64``)."""
    module, params = model.module, model.params
    # The cost does not depend on what the cached entries hold: a zeroed cache that
    # counts ``prefix`` entries stands in for a prefill (one program fewer to compile).
    # It is donated and carried, as the decode loop carries it: without donation each
    # forward would copy the whole buffer to write its block.
    lengths = np.full((batch,), prefix, np.int32)  # host ints: a fresh buffer each call (the cache is donated)
    fwd = jax.jit(lambda p, c, t: (lambda out: (out.logits, out.cache))(module.apply(p, t, c)), donate_argnums=1)
    tokens = jnp.ones((batch, width), jnp.int32)
    state = {"cache": module.init_cache(batch, prefix + 64 if capacity is None else capacity)}

    def call():
        logits, state["cache"] = fwd(params, state["cache"].replace(lengths=lengths), tokens)
        logits.block_until_ready()
    return 1e3 * timed(call, repeats)


# A serving-sized cache (the slots engine and the server allocate hundreds to thousands of slots).
LONG_CACHE = 2048


def kv_slots_read(module, capacity: int, needed: int, prefix: bool) -> int:
    """Cache slots a forward's attention reads: the narrowest of the model's widths holding
    ``needed`` positions where it reads a prefix, else the whole buffer."""
    return next(w for w in module.attention_widths(capacity) if w >= needed) if prefix else capacity


def long_cache(model, batch: int, prefix: int, repeats: int, smoke: bool) -> dict:
    """A 1-token forward after ``prefix`` cached tokens, in a tight cache and in a long one."""
    module = model.module
    capacity = 512 if smoke else LONG_CACHE
    # "auto" reads a prefix on TPU and CPU; jax names the CUDA and ROCm backends "gpu".
    auto_prefix = jax.default_backend() in ("cpu", "tpu")
    per_slot = batch * kv_bytes_per_token(module.config)
    prefixed = model.replace(module=dataclasses.replace(module, attention_reads="prefix"))
    rows = {"tight": (model, prefix + 64, True), "long": (model, capacity, auto_prefix),
            "long, prefix reads": (prefixed, capacity, True)}
    out = {"batch": batch, "cached": prefix, "capacity": capacity}
    for name, (m, cap, reads_prefix) in rows.items():
        out[name] = {"ms": forward_ms(m, batch, 1, prefix, repeats, capacity=cap),
                     "kv_bytes_read": per_slot * kv_slots_read(m.module, cap, prefix + 1, reads_prefix)}
    return out


def speculative(target, draft, name: str, num_draft: int, width: int, new: int, repeats: int,
                c: dict) -> dict:
    """Batch 1, greedy: realized against ideal speedup and the engine's overhead per cycle."""
    rows = prompts(1, width, target.module.config.vocab_size, seed=3)
    kw = dict(temperature=0.0, max_new_tokens=new, eos_token_id=(), buckets=None)
    pair = specjax.pair(target, draft)
    out = specjax.decode(pair, rows, num_draft=num_draft, **kw)
    sd_s = timed(blocking(lambda: specjax.decode(pair, rows, num_draft=num_draft, **kw).tokens), repeats)
    ar_s = timed(blocking(lambda: specjax.generate(target, rows, **kw).tokens), repeats)
    cycles = float(np.mean(np.asarray(out.stats.cycles)))
    tau = float(np.mean(np.asarray(out.stats.tau)))
    c_d = c["c_1"] if draft is target else c["c_draft"]
    model_cycle_ms = num_draft * c_d + c["c_verify"]
    cycle_ms = 1e3 * sd_s / cycles
    ideal = tau * c["c_1"] / model_cycle_ms
    realized = ar_s / sd_s
    return {"draft": name, "num_draft": num_draft, "tau": tau, "acceptance": float(np.mean(np.asarray(out.stats.acceptance_rate))),
            "cycles": cycles, "sd_tok_s": new / sd_s, "target_tok_s": new / ar_s,
            "realized": realized, "ideal": ideal, "realized_over_ideal": realized / ideal,
            "cycle_ms": cycle_ms, "modelled_cycle_ms": model_cycle_ms, "overhead_ms": cycle_ms - model_cycle_ms,
            "overhead_of_cycle": max(0.0, cycle_ms - model_cycle_ms) / cycle_ms}  # < 0: timing noise


def speed(shape: str, cfg: ModelConfig, args, bandwidth: float, budget: Budget, save) -> dict:
    """One shape's figures, the batch-1 ones first (each later section only while the budget
    lasts); ``save(out)`` after each section, so that a run stopped from outside keeps them."""
    target = random_model(cfg.replace(dtype="bfloat16"))
    draft = first_blocks(target, max(1, cfg.num_layers // 8))
    k = args.num_draft
    out = {"shape": shape, "params": int(sum(x.size for x in jax.tree.leaves(target.params))),
           "param_bytes": param_bytes(target), "draft_layers": draft.module.config.num_layers,
           "target_only": [], "speculative": [], "skipped": []}

    def section(name, run):
        if budget.left():
            run()
        else:
            out["skipped"].append(name)
        save(out)

    def costs():
        c = {"c_1": forward_ms(target, 1, 1, 128, args.repeats),
             "c_verify": forward_ms(target, 1, k + 1, 128, args.repeats),
             "c_draft": forward_ms(draft, 1, 1, 128, args.repeats)}
        out["forward_ms"], out["verify_over_one"] = c, c["c_verify"] / c["c_1"]

    def target_only_at(batch):
        out["target_only"].append(target_only(target, batch, args.prompt, args.new_tokens, args.repeats, bandwidth))

    def speculative_with(name, d):
        if "forward_ms" in out:
            out["speculative"].append(
                speculative(target, d, name, k, args.prompt, args.new_tokens, args.repeats, out["forward_ms"]))

    def quantized(fmt):
        model = random_model(cfg.replace(dtype="bfloat16", quantization=fmt))
        row = {"format": fmt, "param_bytes": param_bytes(model),
               "target_only": [target_only(model, b, args.prompt, args.new_tokens, args.repeats, bandwidth)
                               for b in (1, 8) if b in args.batches],
               "c_1": forward_ms(model, 1, 1, 128, args.repeats),
               "c_verify": forward_ms(model, 1, k + 1, 128, args.repeats)}
        row["verify_over_one"] = row["c_verify"] / row["c_1"]
        out.setdefault("quantized", []).append(row)

    batches = list(args.batches)
    if 1 in batches:
        section("target-only batch 1", lambda: target_only_at(1))
        batches.remove(1)
    section("verification cost", costs)
    for fmt in args.quantize:
        section(f"quantized {fmt}", lambda f=fmt: quantized(f))
    section("long cache", lambda: out.update(long_cache=long_cache(target, 8, 128, args.repeats, args.smoke)))
    section("speculative oracle", lambda: speculative_with("oracle", target))
    section("speculative small", lambda: speculative_with("small", draft))
    for batch in batches:
        section(f"target-only batch {batch}", lambda b=batch: target_only_at(b))
    out["target_only"].sort(key=lambda r: r["batch"])
    return out


# --------------------------------------------------------------------------- #
# report


def markdown(report: dict) -> str:
    v = report["versions"]
    lines = [
        f"Measured {v['date']} on {v['device_count']} x {v['device_kind']} ({v['platform']}); jax {v['jax']}, "
        f"flax {v['flax']}; copy bandwidth {report['copy_bandwidth_gb_s']:.3g} GB/s; "
        f"`{v['command']}` ({report['seconds']:.0f} s).", "",
        "| correctness (float32, on the device) | result |", "|---|---|",
    ]
    for name, r in report["correctness"].items():
        if "equal" in r:
            lines.append(f"| {name.replace('_', ' ')} | {'equal' if r['equal'] else 'DIFFERENT'} "
                         f"({r['sequences']} sequences x {r['new_tokens']} tokens, tau {r['tau']:.2f}) |")
        else:
            p = "n/a" if r["chi2_p"] is None else f"{r['chi2_p']:.3f}"
            lines.append(f"| {name.replace('_', ' ')} | {'ok' if r['ok'] else 'FAILED'} "
                         f"(TV {r['tv']:.4f}, chi-square p {p}, {r['samples']} samples) |")
    lines += ["", "| shape (bf16) | batch | tok/s | roofline tok/s | of roofline | ms/step |", "|---|---|---|---|---|---|"]
    for s in report["speed"]:
        for r in s["target_only"]:
            lines.append(f"| {s['shape']} | {r['batch']} | {r['tok_s']:.0f} | {r['roofline_tok_s']:.0f} | "
                         f"{r['of_roofline']:.2f} | {r['ms_per_step']:.2f} |")
    lines += ["", "| shape (bf16), batch 1 | c_1 ms | c_verify(K+1) / c_1 | draft | tau | realized | ideal | "
              "realized / ideal | cycle ms | overhead of cycle |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["speed"]:
        for r in s["speculative"]:
            lines.append(
                f"| {s['shape']} | {s['forward_ms']['c_1']:.2f} | {s['verify_over_one']:.2f} | {r['draft']} "
                f"(K={r['num_draft']}{', ' + str(s['draft_layers']) + ' blocks' if r['draft'] == 'small' else ''}) | "
                f"{r['tau']:.2f} | {r['realized']:.2f} | {r['ideal']:.2f} | {r['realized_over_ideal']:.2f} | "
                f"{r['cycle_ms']:.2f} | {r['overhead_of_cycle']:.0%} |")
    quantized = [s for s in report["speed"] if s.get("quantized")]
    if quantized:
        lines += ["", "| shape, weights | MB | batch | tok/s | roofline tok/s | of roofline | vs bf16 tok/s | "
                  "c_1 ms | c_verify(K+1) / c_1 |", "|---|---|---|---|---|---|---|---|---|"]
        for s in quantized:
            base = {r["batch"]: r["tok_s"] for r in s["target_only"]}
            for q in [{"format": "bf16", "param_bytes": s["param_bytes"], "target_only": s["target_only"],
                       "c_1": s.get("forward_ms", {}).get("c_1", float("nan")),
                       "verify_over_one": s.get("verify_over_one", float("nan"))}] + s["quantized"]:
                for r in q["target_only"]:
                    if r["batch"] not in (1, 8):
                        continue
                    vs = r["tok_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
                    lines.append(f"| {s['shape']}, {q['format']} | {q['param_bytes'] / 1e6:.0f} | {r['batch']} | "
                                 f"{r['tok_s']:.0f} | {r['roofline_tok_s']:.0f} | {r['of_roofline']:.2f} | "
                                 f"{vs:.2f}x | {q['c_1']:.2f} | {q['verify_over_one']:.2f} |")
    longs = [s for s in report["speed"] if "long_cache" in s]
    if longs:
        lines += ["", "| shape (bf16), 1 token at batch 8 after 128 cached | cache | ms | K/V MB read |",
                  "|---|---|---|---|"]
        for s in longs:
            lc = s["long_cache"]
            for name, cap in (("tight", lc["cached"] + 64), ("long", lc["capacity"]),
                              ("long, prefix reads", lc["capacity"])):
                label = f"{cap} slots" + (", attention_reads='prefix'" if "prefix" in name else "")
                lines.append(f"| {s['shape']} | {label} | {lc[name]['ms']:.2f} | {lc[name]['kv_bytes_read'] / 1e6:.1f} |")
    skipped = [f"{s['shape']}: {x}" for s in report["speed"] for x in s["skipped"]]
    skipped += [f"{x} (budget)" for x in report.get("skipped_shapes", [])]
    if skipped:
        lines += ["", "Skipped (time budget): " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats: checks the script on a CPU")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="target-only batches (default 1 8 32)")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per figure (default 5)")
    ap.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth pass (default 2048)")
    ap.add_argument("--quantize", nargs="*", default=None,
                    help="weight formats timed beside bf16 (default: int8 q4; none: leave out)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no section after this many seconds")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        unknown = [s for s in args.shapes if s not in shapes]
        if unknown:
            ap.error(f"unknown shape(s) {unknown}; choose from {list(shapes)}")
        shapes = {s: shapes[s] for s in args.shapes}
    args.batches = args.batches or ([1] if args.smoke else [1, 8, 32])
    args.quantize = ["int8", "q4"] if args.quantize is None else args.quantize
    args.new_tokens = args.new_tokens or (8 if args.smoke else 128)
    args.repeats = args.repeats or (1 if args.smoke else 5)
    args.copy_mib = args.copy_mib or (16 if args.smoke else 2048)
    args.out = args.out or ROOT / "benchmarks" / "results" / f"accelerator-{time.strftime('%Y-%m-%d')}"

    budget = Budget(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"versions": versions(), "smoke": args.smoke, "correctness": {}, "speed": [], "skipped_shapes": []}

    def save(shape_report=None):
        if shape_report is not None and shape_report not in report["speed"]:
            report["speed"].append(shape_report)
        report["seconds"] = budget.elapsed
        (args.out / "accelerator.json").write_text(json.dumps(report, indent=1))
        (args.out / "accelerator.md").write_text(markdown(report))

    report["copy_bandwidth_gb_s"] = copy_bandwidth(args.copy_mib, max(args.repeats, 3)) / 1e9
    # Float32 products at full precision (GPUs would otherwise use TF32): greedy equality
    # between a (K+1)-token verification and 1-token forwards needs the same rounding.
    with jax.default_matmul_precision("highest"):
        report["correctness"] = correctness(args.smoke)
    save()
    for shape, cfg in shapes.items():
        if not budget.left():
            report["skipped_shapes"].append(shape)
            continue
        speed(shape, cfg, args, report["copy_bandwidth_gb_s"] * 1e9, budget, save)
        jax.clear_caches()  # free one shape's programs (and device memory) before the next
    save()
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
