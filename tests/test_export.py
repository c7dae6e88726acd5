"""Every decode configuration lowers for CUDA and TPU (``jax.export``), with no CPU-only code.

specjax is written for accelerators and tested on a CPU. What keeps the two
apart is lowering: the CPU's few-row matmul kernels
(:mod:`specjax._src.kernels.cpu_matmul`) are XLA FFI custom calls registered
for the CPU only and sit behind ``lax.platform_dependent``, and nothing else
may leave the device. So each configuration ``decode`` / ``generate`` offers
is exported here for ``("cuda", "tpu")`` from the CPU, and the StableHLO must
hold no custom call to the CPU kernels (nor any other non-standard target) and
no host transfer. ``jax.export`` lowers the program without compiling it, so
each configuration costs about a second.

The programs are the engine's own jitted functions with the arguments
``decode`` prepares: the call is run up to the jitted function, whose
arguments are captured (:func:`_captured`), then exported.

The sharded program (a mesh spanning two processes) is exported the same way
in ``tests/test_multihost.py``, where a mesh exists.

Streaming (``on_tokens=``) is the one configuration with a host callback by
design. A Python callback is registered with the backend that lowers it, so
a CPU machine cannot lower it for another platform; its test checks instead
that the traced program holds exactly that one ordered callback and nothing
else crosses to the host.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.extend
import numpy as np
import pytest

import specjax
from specjax.models import exporting_for
from specjax._src.engine import loop as decode_lib
from specjax._src.kernels import cpu_matmul
from specjax._src.models import feature_head_build as fhb
from specjax._src.models.pivot_head import PivotHead, PivotHeadConfig, init_head_params
from specjax.drafting import adasd_entropy, combine, confidence, heuristic, ngram_lookup
from specjax.rules import (
    adasd, additive, any_of, block_verification, ears, mars, multiplicative, pad, speculative_sampling, top_m,
    typical,
)
from specjax.testing import bigram_model, llama_config, peaked_target_and_draft, random_table
from specjax.trees import dynamic_tree, static_tree

from _kernels import require_kernels

PLATFORMS = ("cuda", "tpu")
CPU_KERNEL_TARGETS = frozenset(target for target, _ in cpu_matmul._TARGETS.values())
PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60]]
KW = dict(num_draft=3, max_new_tokens=8)
SAMPLE = dict(temperature=1.0, key=jax.random.key(0))
GREEDY = dict(temperature=0.0)


class _Captured(Exception):
    """Raised in place of running the engine: its jitted program and the call's arguments."""

    def __init__(self, program, args, kwargs):
        super().__init__("captured")
        self.program, self.args, self.kwargs = program, args, kwargs


@contextlib.contextmanager
def _capturing():
    """Replaces the engine's jitted functions by ones that raise :class:`_Captured`."""
    saved = decode_lib._decode_jit, decode_lib._generate_jit

    def recorder(program):
        def record(*args, **kwargs):
            raise _Captured(program, args, kwargs)
        return record

    decode_lib._decode_jit, decode_lib._generate_jit = map(recorder, saved)
    try:
        yield
    finally:
        decode_lib._decode_jit, decode_lib._generate_jit = saved


def _captured(call) -> _Captured:
    """The jitted program ``call()`` (a ``decode`` / ``generate`` call) would run, with its arguments."""
    with _capturing():
        try:
            call()
        except _Captured as c:
            return c
    raise AssertionError("the call never reached the engine's jitted function")


def stablehlo_for(call, platforms=PLATFORMS) -> str:
    """The StableHLO text of ``call``'s program exported for ``platforms``."""
    c = _captured(call)
    # jax.export refuses custom calls without a stability guarantee; let the
    # CPU kernels through so that the assertions below name what leaked.
    allow = [jax.export.DisabledSafetyCheck.custom_call(t) for t in CPU_KERNEL_TARGETS]
    with exporting_for(*platforms):
        exported = jax.export.export(c.program, platforms=platforms, disabled_checks=allow)(*c.args, **c.kwargs)
    return exported.mlir_module()


def custom_call_targets(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w.$-]+)", text)) | set(
        re.findall(r'call_target_name = "([^"]+)"', text)
    )


def host_transfers(text: str) -> list[str]:
    """Ops that move data between device and host (how callbacks lower on TPU and GPU)."""
    return re.findall(r"stablehlo\.(?:send|recv|outfeed|infeed)\b", text) + [
        t for t in custom_call_targets(text) if "callback" in t.lower()
    ]


def assert_portable(text: str) -> None:
    targets = custom_call_targets(text)
    assert not targets & CPU_KERNEL_TARGETS, f"CPU-only kernels in a {PLATFORMS} lowering: {targets}"
    # Standard ops only: any custom call would need the target platform to provide it.
    assert targets == set(), targets
    assert host_transfers(text) == [], host_transfers(text)


# ---------------------------------------------------------------------------
# models: the tests' tiny Llama pair (float32, so the CPU kernels apply to
# every verification forward), a feature head, a bigram pair


@pytest.fixture(scope="module")
def llama():
    target, draft = peaked_target_and_draft(llama_config())
    return target, draft


@pytest.fixture(scope="module")
def llama_pair(llama):
    return specjax.pair(*llama)


def _constant_pivot_head() -> PivotHead:
    cfg = PivotHeadConfig(hidden_size=32, layer=-2, target_num_layers=2, arch="linear")
    return PivotHead(cfg, init_head_params(cfg, jax.random.key(0)))


def test_the_tiny_pair_uses_the_cpu_kernels_on_the_cpu(llama_pair):
    """The premise of every test below: lowered for the CPU, the same program
    does call the kernels (else their absence elsewhere would prove nothing)."""
    require_kernels()
    text = stablehlo_for(lambda: specjax.decode(llama_pair, PROMPTS, **KW, **SAMPLE), platforms=("cpu",))
    assert custom_call_targets(text) & CPU_KERNEL_TARGETS


CHAIN_CONFIGS = {
    "greedy": dict(GREEDY),
    "speculative_sampling_top_k_top_p": dict(rule=speculative_sampling(), top_k=8, top_p=0.9, **SAMPLE),
    "block_verification": dict(rule=block_verification(), **SAMPLE),
    "ears": dict(rule=ears(beta=0.2), **SAMPLE),
    "mars": dict(rule=mars(theta=0.9), **SAMPLE),
    "adasd": dict(rule=adasd(), drafting=adasd_entropy(), **SAMPLE),
    "criteria": dict(rule=any_of(typical(), additive(0.1), multiplicative(0.5), top_m(2)), **SAMPLE),
    "pad": dict(rule=pad(_constant_pivot_head(), sigma=0.5), **SAMPLE),
    "drafting_policies": dict(drafting=combine(heuristic(), confidence(0.4)), **SAMPLE),
    "lookup": dict(lookup=ngram_lookup(2), **SAMPLE),
}


@pytest.mark.parametrize("name", sorted(CHAIN_CONFIGS))
def test_chain_decoding_lowers_for_accelerators(llama_pair, name):
    kw = {**KW, **CHAIN_CONFIGS[name]}
    assert_portable(stablehlo_for(lambda: specjax.decode(llama_pair, PROMPTS, **kw)))


TREE_CONFIGS = {
    "static_greedy": dict(tree=static_tree((2, 2)), **GREEDY),
    "static_sampling_mars": dict(tree=static_tree((2, 1)), rule=mars(theta=0.9), **SAMPLE),
    "dynamic_greedy": dict(tree=dynamic_tree(3, 2, 6), **GREEDY),
    "dynamic_sampling": dict(tree=dynamic_tree(2, 2, 4), **SAMPLE),
}


@pytest.mark.parametrize("name", sorted(TREE_CONFIGS))
def test_tree_decoding_lowers_for_accelerators(llama_pair, name):
    kw = dict(max_new_tokens=8, **TREE_CONFIGS[name])
    assert_portable(stablehlo_for(lambda: specjax.decode(llama_pair, PROMPTS, **kw)))


def test_a_feature_head_lowers_for_accelerators(llama):
    target = llama[0]
    head = fhb.init_from_target(target, jax.random.key(1), np.arange(80)[::-1])
    pair = specjax.pair(target, head)
    assert_portable(stablehlo_for(lambda: specjax.decode(pair, PROMPTS, **KW, **SAMPLE)))


# int8 is slow-only (about 7 s): the default case lowers the int8 product too (the draft, the
# head and the embedding are int8 there) beside the target's q4.
@pytest.mark.parametrize("spec", [pytest.param("int8", marks=pytest.mark.slow), "q4,embedding=int8/32"])
def test_quantized_weights_lower_for_accelerators(llama, spec):
    """Quantized target, draft and feature head: the same programs, with the
    quantized CPU kernels behind ``lax.platform_dependent`` like the float ones."""
    require_kernels("quantizing on the CPU needs the kernels")
    target, draft = specjax.quantize(llama[0], spec), specjax.quantize(llama[1], "int8")
    head = specjax.quantize(fhb.init_from_target(llama[0], jax.random.key(1), np.arange(64)), "int8")
    head = fhb.attach_embedding(head, target)
    for pair in (specjax.pair(target, draft), specjax.pair(target, head)):
        call = lambda: specjax.decode(pair, PROMPTS, **KW, **SAMPLE)  # noqa: E731
        assert custom_call_targets(stablehlo_for(call, platforms=("cpu",))) & {"specjax_qmatmul_q4",
                                                                             "specjax_qmatmul_int8"}
        assert_portable(stablehlo_for(call))
    assert_portable(stablehlo_for(lambda: specjax.generate(target, PROMPTS, max_new_tokens=8, **SAMPLE)))


def test_target_only_generation_lowers_for_accelerators(llama):
    assert_portable(stablehlo_for(lambda: specjax.generate(llama[0], PROMPTS, max_new_tokens=8, **SAMPLE)))


def test_a_model_of_the_lm_protocol_lowers_for_accelerators():
    """A bigram table: any model following the LM protocol, no Decoder involved."""
    pair = specjax.pair(bigram_model(random_table(0, 16)), bigram_model(random_table(1, 16)))
    assert_portable(stablehlo_for(lambda: specjax.decode(pair, [[1, 2, 3]], **KW, **SAMPLE)))


def _callback_primitives(jaxpr) -> list[str]:
    """The callback primitives of ``jaxpr`` and of every jaxpr nested in it (loops, conds)."""
    found = []
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            found.append(eqn.primitive.name + (":ordered" if eqn.params.get("ordered") else ""))
        for sub in _subjaxprs(eqn):
            found += _callback_primitives(sub)
    return found


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _jaxpr_of(call):
    c = _captured(call)
    return c.program.trace(*c.args, **c.kwargs).jaxpr.jaxpr


def test_streaming_holds_exactly_its_ordered_callbacks_and_nothing_else_does(llama_pair):
    """Two ordered callbacks: the first tokens, drawn from the prefill, and each cycle's tokens in the loop."""
    streaming = _jaxpr_of(lambda: specjax.decode(llama_pair, PROMPTS, **KW, **SAMPLE, on_tokens=lambda t, c: None))
    plain = _jaxpr_of(lambda: specjax.decode(llama_pair, PROMPTS, **KW, **SAMPLE))
    assert _callback_primitives(streaming) == ["io_callback:ordered"] * 2
    assert _callback_primitives(plain) == []


def test_an_unguarded_cpu_kernel_is_caught(llama_pair, monkeypatch):
    """The check works: without ``lax.platform_dependent`` around the CPU
    kernels, lowering for an accelerator fails or keeps their custom calls."""
    require_kernels()
    monkeypatch.setattr(cpu_matmul, "_rows_matmul", lambda kind, x, w: cpu_matmul._ffi(kind, x, w))
    jax.clear_caches()  # programs traced with the guard must not be reused, nor this one kept
    try:
        text = stablehlo_for(lambda: specjax.decode(llama_pair, PROMPTS, **KW, **SAMPLE))
    except Exception as e:  # noqa: BLE001 - the lowering itself may refuse the CPU-only target
        assert any(t in str(e) for t in CPU_KERNEL_TARGETS), e
        return
    finally:
        jax.clear_caches()
    with pytest.raises(AssertionError, match="CPU-only kernels"):
        assert_portable(text)
