"""The sections of ``benchmarks/accelerator.py``: the shapes it times, the plumbing (time budget,
persistent compilation cache, program counts, launch counts), random models on the device, the
correctness checks, and the speed measurements, a shape's (:class:`ShapeRun`) and the real pair's
(:func:`real_pair`). Imported by ``accelerator.py``, which runs them in order and writes the
report; its docstring says what each section measures.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from common import timed
from specjax import Decoder, ModelConfig, testing

ROOT = Path(__file__).resolve().parent.parent


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

    @staticmethod
    def _counts(built: int, loaded: int, seconds: float) -> dict:
        return {"built": built, "loaded": loaded, "compiled": built - loaded, "seconds": seconds}

    def totals(self) -> dict:
        """What was built since this object was made."""
        return self._counts(self.built, self.loaded, self.seconds)

    def take(self) -> dict:
        built, loaded, seconds = self.built - self._last[0], self.loaded - self._last[1], self.seconds - self._last[2]
        self._last = (self.built, self.loaded, self.seconds)
        return self._counts(built, loaded, seconds)

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


def greedy(new: int) -> dict:
    """The timed calls' settings: greedy, exactly ``new`` tokens (no end-of-sequence id), no prompt buckets."""
    return dict(temperature=0.0, max_new_tokens=new, eos_token_id=(), buckets=None)


def target_only(model, batch: int, width: int, new: int, repeats: int, bandwidth: float) -> dict:
    rows = prompts(batch, width, model.module.config.vocab_size)
    kw = greedy(new)
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
    weight_bytes = param_bytes(model)
    step_bytes = weight_bytes + batch * kv_bytes_per_token(model.module.config) * prefix
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
        "param_bytes": weight_bytes,
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
    kw = greedy(new)
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
        self.cfg, self.args, self.bandwidth, self.budget = cfg, args, bandwidth, budget
        self.save, self.programs = save, programs
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


