"""Quantized weights (``specjax.quantize``, ``load(..., quantize=)``): the formats,
the CPU kernels against a float reference, GGUF blocks copied bit for bit,
Orbax round trips, and speculative decoding that stays exact for the
quantized target."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import specjax
from specjax.models import exporting_for
from specjax._src.kernels import quant
from specjax._src.kernels import cpu_matmul, qmatmul
from specjax.testing import llama_config, peaked_target_and_draft

from test_decode import NO_BUCKETS
from test_gguf import write_gguf

FORMATS = ["int8", "int8/32", "q4", "q4/64"]
# Skips without the kernels; fails instead under CI=true or SPECJAX_REQUIRE_KERNELS=1 (tests/_kernels.py).
needs_kernels = pytest.mark.usefixtures("cpu_kernels")


def _matrix(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Rows of different scales and an outlier per row: per-group scales matter.
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 0.2, size=(n, 1)).astype(np.float32)
    w[np.arange(n), rng.integers(0, k, n)] *= 8.0
    return w


def _leaves(w: np.ndarray, fmt: str) -> quant.QArray:
    return jax.tree.map(jnp.asarray, quant.quantize_matrix(w, quant.parse_format(fmt)))


def _error_bound(x: np.ndarray, w_hat: np.ndarray) -> np.ndarray:
    """What the kernel may differ from ``x @ w_hat.T`` in float64: float32 rounding."""
    return 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w_hat.astype(np.float64)).T) + 1e-6


# --------------------------------------------------------------------------- #
# formats
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_rounds_each_weight_to_its_grid(fmt):
    w = _matrix(24, 128)
    leaves = quant.quantize_matrix(w, quant.parse_format(fmt))
    w_hat = np.asarray(quant.dequantize_matrix(leaves))
    group = quant.parse_format(fmt).group_of(128)
    d = np.repeat(leaves["qscale"].astype(np.float32), group, axis=1)
    # Round to nearest: within half a step (and the float16 scale's rounding of the range).
    assert np.all(np.abs(w_hat - w) <= 0.5 * d * (1 + 1e-3) + 1e-6)
    # Negative control: the same bound fails for a quarter step, so the check has teeth.
    assert not np.all(np.abs(w_hat - w) <= 0.25 * d)


def test_format_names_round_trip_and_bad_ones_are_named():
    for text in ["int8", "int8/32", "q4", "q4/64", "q4,embedding=int8/32"]:
        assert str(quant.parse_quantization(text)) == text
    assert str(quant.parse_quantization("q4/32")) == "q4"
    with pytest.raises(ValueError, match="Unknown weight format 'q5'"):
        quant.parse_quantization("q5")
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.parse_quantization("q4/48")
    with pytest.raises(ValueError, match="embedding=FORMAT"):
        quant.parse_quantization("q4,head=int8")


def test_a_group_that_does_not_divide_the_inputs_is_named():
    with pytest.raises(ValueError, match=r"mlp/down.*not a whole number of groups of 64"):
        quant.quantize_matrix(np.ones((8, 96), np.float32), quant.Format("q4", 64), "layer_0/mlp/down")
    with pytest.raises(ValueError, match="NaN"):
        quant.quantize_matrix(np.full((8, 32), np.nan, np.float32), quant.Format("int8"))


# --------------------------------------------------------------------------- #
# the products
# --------------------------------------------------------------------------- #


# Outputs not a multiple of any tile; 96 inputs: an odd number of 32-blocks (which q4/64 cannot take).
_SHAPES = [
    (fmt, n, k) for fmt in FORMATS for n, k in [(67, 128), (37, 96)] if k % quant.parse_format(fmt).group_of(k) == 0
]


@needs_kernels
@pytest.mark.parametrize("fmt,n,k", _SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 13, 17])
def test_the_cpu_kernel_matches_the_float_product_of_the_dequantized_weights(fmt, rows, n, k):
    w = _matrix(n, k, seed=rows)
    leaves = _leaves(w, fmt)
    w_hat = np.asarray(quant.dequantize_matrix(leaves))
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    got = np.asarray(jax.jit(quant.qdot)(jnp.asarray(x), leaves))
    want = x.astype(np.float64) @ w_hat.T.astype(np.float64)
    bound = _error_bound(x, w_hat)
    assert np.all(np.abs(got - want) <= bound)
    # Negative control: a product that reads each row's scales from the next row is outside the bound.
    wrong = quant.QArray(leaves.qweight, jnp.roll(leaves.qscale, 1, axis=0), leaves.qmin, fmt=leaves.fmt)
    off = x.astype(np.float64) @ np.asarray(quant.dequantize_matrix(wrong)).T.astype(np.float64)
    assert not np.all(np.abs(off - want) <= bound)
    # XLA's product on the quantized weights (GPU, TPU) computes the same product.
    xla = np.asarray(qmatmul.xla_qmatmul(jnp.asarray(x), leaves.qweight, leaves.qscale, leaves.qmin))
    assert np.all(np.abs(xla - want) <= bound)


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "q4"])
@pytest.mark.parametrize("rows", [16, 41])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(fmt, rows):
    """16 rows go through the register tiles, 41 through dequantized panels (a prefill chunk's
    path, with a last tile of 5 rows): either way a row's sums are bit for bit its own."""
    leaves = _leaves(_matrix(203, 256), fmt)
    x = np.random.default_rng(3).standard_normal((rows, 256)).astype(np.float32)
    product = jax.jit(quant.qdot)
    together = np.asarray(product(jnp.asarray(x), leaves))
    for i in (0, 5, 15, rows - 1):
        alone = np.asarray(product(jnp.asarray(x[i : i + 1]), leaves))
        np.testing.assert_array_equal(alone[0], together[i])
    w_hat = np.asarray(quant.dequantize_matrix(leaves))
    want = x.astype(np.float64) @ w_hat.T.astype(np.float64)
    assert np.all(np.abs(together - want) <= _error_bound(x, w_hat))


def test_quantized_products_lower_without_the_cpu_kernel_for_accelerators():
    leaves = _leaves(_matrix(64, 64), "q4")
    x = jnp.ones((4, 64), jnp.float32)
    with exporting_for("cuda", "tpu"):
        exported = jax.export.export(jax.jit(quant.qdot), platforms=("cuda", "tpu"))(x, leaves)
    text = exported.mlir_module()
    assert "specjax_qmatmul" not in text
    if cpu_matmul.is_available():  # the premise: for the CPU the same function calls the kernel
        cpu = jax.export.export(
            jax.jit(quant.qdot),
            platforms=("cpu",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("specjax_qmatmul_q4")],
        )(x, leaves).mlir_module()
        assert "specjax_qmatmul_q4" in cpu


@needs_kernels
def test_a_cpu_trace_holds_only_the_cpu_branch_and_an_export_context_holds_every_asked_one():
    leaves = _leaves(_matrix(64, 64), "q4")
    x = jnp.ones((4, 64), jnp.float32)
    # Traced for this CPU: the kernel alone, no switch on the platform and no XLA formulation.
    plain = str(jax.make_jaxpr(quant.qdot)(x, leaves))
    assert "platform_index" not in plain and "dot_general" not in plain and "specjax_qmatmul_q4" in plain
    # Negative control: traced for a CPU and a GPU, both branches are there.
    with exporting_for("cpu", "cuda"):
        both = str(jax.make_jaxpr(quant.qdot)(x, leaves))
    assert "platform_index" in both and "dot_general" in both and "specjax_qmatmul_q4" in both
    # Outside the context an export for a GPU would carry the CPU kernel: jax.export names it.
    with pytest.raises(ValueError, match="specjax_qmatmul_q4"):
        jax.export.export(jax.jit(quant.qdot), platforms=("cuda",))(x, leaves)
    with pytest.raises(ValueError, match="platform names"):
        with exporting_for("gpu"):
            pass


# --------------------------------------------------------------------------- #
# models
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def pair():
    return peaked_target_and_draft(llama_config())


@needs_kernels
@pytest.mark.parametrize("spec", ["int8", "q4", "q4,embedding=int8/32"])
def test_a_quantized_model_is_its_dequantized_model(pair, spec):
    target, _ = pair
    q = specjax.quantize(target, spec)
    assert q.module.config.quantization == spec
    assert quant.nbytes(q.params) < 0.4 * quant.nbytes(target.params)
    ids = np.arange(1, 20)[None]
    got = np.asarray(specjax.logits(q, ids))
    ref = np.asarray(specjax.logits(specjax.dequantize(q), ids))
    np.testing.assert_allclose(got, ref, atol=0.05 * np.abs(ref).max())
    # and close to the float model it came from
    full = np.asarray(specjax.logits(target, ids))
    assert np.linalg.norm(got - full) / np.linalg.norm(full) < (0.3 if spec.startswith("q4") else 0.05)


@needs_kernels
def test_greedy_speculative_decoding_is_the_quantized_targets_own_greedy_output(pair):
    target, draft = pair
    qt, qd = specjax.quantize(target, "q4"), specjax.quantize(draft, "int8")
    prompts = [[5, 17, 3], [40, 2, 9, 11, 60], [7]]
    kw = dict(max_new_tokens=24, temperature=0.0, eos_token_id=())
    alone = np.asarray(specjax.generate(qt, prompts, **kw).tokens)
    spec = specjax.decode(specjax.pair(qt, qd), prompts, num_draft=4, **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), alone)
    assert spec.stats.tau > 1.0  # the draft is accepted at times: the comparison exercises verification
    # Negative control: the float target's greedy text differs from the quantized one's.
    assert not np.array_equal(np.asarray(specjax.generate(target, prompts, **kw).tokens), alone)


def _two_token_law(model, prompt):
    """p(t0, t1 | prompt) of ``model`` at temperature 1, ``[V, V]``."""
    v = model.vocab_size
    first = jax.nn.softmax(np.asarray(specjax.logits(model, [prompt]))[0, -1].astype(np.float64))
    seqs = np.asarray([prompt + [t] for t in range(v)])
    second = jax.nn.softmax(np.asarray(specjax.logits(model, seqs))[:, -1].astype(np.float64), axis=-1)
    return np.asarray(first)[:, None] * np.asarray(second)


def _chi_square(counts, probs):
    n = counts.sum()
    exp, obs = probs.ravel() * n, counts.ravel()
    big = exp >= 5
    f_obs, f_exp = obs[big], exp[big]
    if (~big).any():  # cells expected fewer than 5 times, pooled
        f_obs, f_exp = np.append(f_obs, obs[~big].sum()), np.append(f_exp, exp[~big].sum())
    return scipy_stats.chisquare(f_obs, f_exp * f_obs.sum() / f_exp.sum()).pvalue


# Slow-only (about 12 s): decoding with a quantized target is checked by default in
# test_greedy_speculative_decoding_is_the_quantized_targets_own_greedy_output (token for token
# against the quantized target's own output), and the sampling law in test_decode.py.
@pytest.mark.slow
@needs_kernels
def test_sampled_speculative_decoding_follows_the_quantized_targets_law():
    cfg = llama_config(vocab_size=16, hidden_size=32, intermediate_size=64)
    target, draft = peaked_target_and_draft(cfg)
    # A head peaked enough that 4 bits move the law (total variation 0.04 from the float one).
    target = target.replace(params={**target.params, "lm_head": target.params["lm_head"] / 5.0})
    qt = specjax.quantize(target, "q4")
    prompt = [3, 1, 4]
    n = 20_000
    out = specjax.decode(
        specjax.pair(qt, specjax.quantize(draft, "int8")),
        [prompt] * n,
        num_draft=3,
        max_new_tokens=2,
        temperature=1.0,
        eos_token_id=(),
        key=jax.random.key(7),
        buckets=NO_BUCKETS,
    )
    toks = np.asarray(out.tokens)[:, :2]
    counts = np.zeros((16, 16))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    assert _chi_square(counts, _two_token_law(qt, prompt)) > 1e-4
    # Negative control: the float target's law is rejected at this sample size.
    assert _chi_square(counts, _two_token_law(target, prompt)) < 1e-4


@needs_kernels
def test_a_quantized_feature_head_drafts_for_a_quantized_target(pair):
    from specjax._src.models import feature_head_build as fhb

    target, _ = pair
    head = fhb.init_from_target(target, jax.random.key(3), np.arange(48), num_layers=1)
    qt = specjax.quantize(target, "q4")
    qh = specjax.quantize(fhb.attach_embedding(head, qt), "int8")
    assert qh.params["embed"]["embedding"] is qt.params["embed"]["embedding"]  # borrowed, not copied
    # the fusion layer stays float (per-channel int8 would round its small learned weights away)
    np.testing.assert_array_equal(np.asarray(qh.params["fuse"]["kernel"]), np.asarray(head.params["fuse"]["kernel"]))
    assert quant.is_quantized(qh.params["layer_0"]["mlp"]["up"]["kernel"])
    prompts = [[5, 17, 3], [40, 2, 9, 11, 60]]
    kw = dict(max_new_tokens=16, temperature=0.0, eos_token_id=())
    alone = np.asarray(specjax.generate(qt, prompts, **kw).tokens)
    out = specjax.decode(specjax.pair(qt, qh), prompts, num_draft=3, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), alone)


# --------------------------------------------------------------------------- #
# checkpoints
# --------------------------------------------------------------------------- #


@needs_kernels
def test_orbax_round_trip_keeps_the_quantized_arrays(pair, tmp_path):
    q = specjax.quantize(pair[0], "q4,embedding=int8/32")
    specjax.save_orbax(q, tmp_path / "q")
    back = specjax.load(tmp_path / "q")
    assert back.module.config.quantization == "q4,embedding=int8/32"
    a, b = jax.tree_util.tree_leaves_with_path(q.params), dict(jax.tree_util.tree_leaves_with_path(back.params))
    assert len(a) == len(b)
    for path, leaf in a:
        assert b[path].dtype == leaf.dtype
        np.testing.assert_array_equal(np.asarray(b[path]), np.asarray(leaf), err_msg=str(path))
    with pytest.raises(ValueError, match="stored quantized as q4,embedding=int8/32"):
        specjax.load(tmp_path / "q", quantize="int8")
    # A Hugging Face export holds the dequantized float weights.
    specjax.export_hf(q, tmp_path / "hf")
    hf = specjax.load(tmp_path / "hf")
    assert hf.module.config.quantization is None
    ids = np.arange(1, 10)[None]
    np.testing.assert_allclose(
        np.asarray(specjax.logits(hf, ids)),
        np.asarray(specjax.logits(specjax.dequantize(q), ids)),
        rtol=1e-5,
        atol=1e-5,
    )


def _gguf_model(vocab: int = 96):
    cfg = llama_config(
        vocab_size=vocab,
        hidden_size=64,
        head_dim=16,
        intermediate_size=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    return cfg, specjax.Decoder(cfg).init(jax.random.key(2))


@needs_kernels
@pytest.mark.parametrize("qtype,spec", [("Q4_1", "q4"), ("Q4_0", "q4"), ("Q8_0", "int8/32")])
def test_gguf_blocks_load_bit_for_bit(tmp_path, qtype, spec):
    cfg, params = _gguf_model()
    path = tmp_path / "q.gguf"
    write_gguf(path, cfg, params, qtype=gguf.GGMLQuantizationType[qtype])
    model = specjax.load(path, quantize="gguf")
    assert model.module.config.quantization == spec
    # Each matrix dequantizes to exactly what gguf's reference dequantizer gives.
    floats = specjax.load(path)
    np.testing.assert_array_equal(
        np.asarray(quant.dequantize_matrix(model.params["layer_0"]["mlp"]["down"]["kernel"])),
        np.asarray(floats.params["layer_0"]["mlp"]["down"]["kernel"]).T,
    )
    np.testing.assert_array_equal(
        np.asarray(quant.dequantize_matrix(model.params["layer_1"]["attn"]["q"]["kernel"])),  # rows unpermuted
        np.asarray(floats.params["layer_1"]["attn"]["q"]["kernel"]).T,
    )
    np.testing.assert_array_equal(
        np.asarray(quant.dequantize_matrix(model.params["embed"]["embedding"])),
        np.asarray(floats.params["embed"]["embedding"]),
    )
    ids = np.arange(1, 17)[None]
    np.testing.assert_allclose(
        np.asarray(specjax.logits(model, ids)), np.asarray(specjax.logits(floats, ids)), atol=0.05
    )


@needs_kernels
def test_gguf_blocks_of_another_format_are_requantized(tmp_path):
    cfg, params = _gguf_model()
    path = tmp_path / "q.gguf"
    write_gguf(path, cfg, params, qtype=gguf.GGMLQuantizationType.Q8_0)
    model = specjax.load(path, quantize="q4")
    floats = specjax.load(path)
    want = quant.quantize_matrix(np.asarray(floats.params["layer_0"]["mlp"]["up"]["kernel"]).T, quant.Format("q4"))
    for name, value in want.parts().items():
        np.testing.assert_array_equal(np.asarray(model.params["layer_0"]["mlp"]["up"]["kernel"][name]), value)


def test_bad_requests_get_clear_errors(pair, monkeypatch, tmp_path):
    target, _ = pair
    with pytest.raises(ValueError, match="Unknown weight format"):
        specjax.quantize(target, "int4")
    odd = peaked_target_and_draft(llama_config(hidden_size=48, head_dim=12))[0]
    with pytest.raises(ValueError, match=r"\(96 x 48 inputs\) as q4.*groups of 32"):
        specjax.quantize(odd, "q4")
    with pytest.raises(ValueError, match="Quantized weights load onto one device"):
        specjax.load(tmp_path, quantize="int8", mesh=specjax.sharding.make_mesh(1))
    with pytest.raises(ValueError, match="keeps a GGUF file's own formats"):
        specjax.load(tmp_path, quantize="gguf")
    if cpu_matmul.is_available():
        with pytest.raises(ValueError, match=r"already quantized \(int8\).*specjax.dequantize"):
            specjax.quantize(specjax.quantize(target, "int8"), "q4")
        once = specjax.quantize(target, "int8")
        assert specjax.quantize(once, "int8") is once  # already in that format
    # On a CPU without the kernels: a clear error, not a slow float fallback.
    monkeypatch.setattr(
        cpu_matmul,
        "ensure_loaded",
        lambda: (_ for _ in ()).throw(cpu_matmul.KernelUnavailableError("no C++ compiler found")),
    )
    quant.check_kernels_for.cache_clear()
    with pytest.raises(ValueError, match="need specjax's kernels.*no C\\+\\+ compiler"):
        specjax.quantize(target, "int8")
    quant.check_kernels_for.cache_clear()


_ISA_CHECK = """
import sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, {tests!r})
from specjax._src.kernels import quant
from test_quant import _error_bound, _fingerprint, _leaves, _matrix
for fmt in ("int8", "int8/32", "q4", "q4/64"):
    for rows in (1, 4, 6, 27):
        w = _matrix(45, 128, seed=rows)
        leaves = _leaves(w, fmt)
        w_hat = np.asarray(quant.dequantize_matrix(leaves))
        x = np.random.default_rng(rows).standard_normal((rows, 128)).astype(np.float32)
        got = np.asarray(jax.jit(quant.qdot)(jnp.asarray(x), leaves))
        want = x.astype(np.float64) @ w_hat.T.astype(np.float64)
        assert np.all(np.abs(got - want) <= _error_bound(x, w_hat)), (fmt, rows)
print(_fingerprint())
"""


def _fingerprint() -> str:
    """The exact bits of one 4-bit product: different kernels sum in different orders."""
    import hashlib

    leaves = _leaves(_matrix(45, 128), "q4")
    x = np.random.default_rng(9).standard_normal((4, 128)).astype(np.float32)
    return hashlib.sha1(np.asarray(jax.jit(quant.qdot)(jnp.asarray(x), leaves)).tobytes()).hexdigest()


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_narrower_instruction_sets_compute_the_same_products(isa, tmp_path):
    """The AVX2 and portable kernels, chosen by $SPECJAX_CPU_ISA on this machine."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SPECJAX_CPU_ISA=isa, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", _ISA_CHECK.format(tests=os.path.dirname(__file__))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # The variable did pick another kernel: its sums are not bit for bit this process's.
    assert done.stdout.strip().splitlines()[-1] != _fingerprint()


@needs_kernels
def test_a_bfloat16_load_keeps_its_norms_in_bfloat16_and_its_scales_as_stored(tmp_path, pair):
    cfg, params = _gguf_model()
    write_gguf(tmp_path / "q.gguf", cfg, params, qtype=gguf.GGMLQuantizationType.Q4_1)
    model = specjax.load(tmp_path / "q.gguf", dtype="bfloat16", quantize="gguf")
    assert model.params["final_norm"]["scale"].dtype == jnp.bfloat16  # the float path: the model's dtype
    assert model.params["layer_0"]["mlp"]["down"]["kernel"]["qscale"].dtype == jnp.float16
    # An Orbax checkpoint loaded in another dtype casts the floats, never a quantized matrix's arrays.
    specjax.save_orbax(specjax.quantize(pair[0], "q4"), tmp_path / "o")
    cast = specjax.load(tmp_path / "o", dtype="bfloat16")
    assert cast.params["final_norm"]["scale"].dtype == jnp.bfloat16
    kernel = cast.params["layer_0"]["mlp"]["down"]["kernel"]
    assert kernel["qscale"].dtype == kernel["qmin"].dtype == jnp.float16 and kernel["qweight"].dtype == jnp.uint8
    assert np.isfinite(np.asarray(specjax.logits(cast, [[1, 2, 3]]))).all()


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8/32", "q4"])
@pytest.mark.parametrize("rows", [1, 6])
def test_an_expert_of_a_quantized_stack_is_multiplied_where_it_lies(fmt, rows):
    """``qdot_expert`` reads expert ``e``'s arrays inside the stack (the kernel is in the
    program and no dynamic slice copies them out), equals ``qdot`` of the indexed matrix
    for each ``e`` and clamps the index as XLA does; each index reads its own expert."""
    matrices = [quant.quantize_matrix(_matrix(40, 128, seed), quant.parse_format(fmt)) for seed in range(5)]
    stack = jax.tree.map(jnp.asarray, quant.stack_matrices(matrices))
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 128), np.float32))
    f = jax.jit(lambda a, w, e: quant.qdot_expert(a, w, e))
    text = f.lower(x, stack, 0).as_text()
    assert "_expert" in text and "dynamic_slice" not in text
    got = [np.asarray(f(x, stack, e)) for e in range(5)]
    for e in range(5):
        one = jax.tree.map(lambda v: v[e], stack)
        np.testing.assert_allclose(got[e], np.asarray(quant.qdot(x, one)), rtol=1e-5, atol=1e-5)
    assert np.abs(got[1] - got[2]).max() > 1e-2
    np.testing.assert_array_equal(np.asarray(f(x, stack, 7)), got[4])
    np.testing.assert_array_equal(np.asarray(f(x, stack, -1)), got[0])
    with pytest.raises(ValueError, match=r"quantized stack \[E, N, K\]; got x"):
        quant.qdot_expert(x[:, :64], stack, 0)

