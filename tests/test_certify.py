"""Live certificate diagnostics (specjax._src.theory.certify) and ``specjax certify`` (specjax.cli.certify).

Two decode programs are compiled in this file (the CPU is shared): one strict
greedy run on a tiny random decoder pair, recording every criterion, reused by
the recomputation, soundness, quantile and no-recompile tests; and one
``additive:t=0.3`` run through the CLI on the same models exported to disk.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax._src.theory import certificates as theory, certify
from specjax._src.theory.certify import certificate_diagnostics, certified_decode, histogram_quantile
from specjax.rules import additive, ears, multiplicative, speculative_sampling, top_m, typical

from _hf_models import write_tokenizer
from tiny_models import llama_config, peaked_target_and_draft
from test_decode import count_compilations

VOCAB, K, N = 96, 3, 12
TREES = (2, 4)
ALSO = (additive(0.3), multiplicative(0.1), typical(), top_m(2))


def tiny_pair(target_layers=2):
    """A random Llama target and a 1-layer draft sharing its first layer."""
    return peaked_target_and_draft(llama_config(vocab_size=VOCAB, num_layers=target_layers))


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, size=int(n)).tolist() for n in (2, 5, 3, 6)]


@pytest.fixture(scope="module")
def models():
    return tiny_pair()


@pytest.fixture(scope="module")
def strict_run(models):
    diag = certificate_diagnostics(speculative_sampling(), trees=TREES, also=ALSO)
    out = specjax.decode(specjax.pair(*models), prompts(), rule=speculative_sampling(), temperature=0.0,
                         num_draft=K, max_new_tokens=N, diagnostics=diag)
    return diag, out, diag.summarize(out.stats)


# ---------------------------------------------------------------------------
# A host-side replay of greedy speculative decoding from full forwards
# ---------------------------------------------------------------------------


def replay(models, prompt):
    """Per verified position (slot j <= n of each cycle): p, q, the draft token and
    whether strict greedy accepted it, from full (uncached) forwards."""
    target, draft = models
    width = max(map(len, prompts())) + N + K + 1  # one shape: one compile per model

    def probs(model, seq):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(seq)] = seq
        return np.asarray(jax.nn.softmax(specjax.logits(model, padded)[0].astype(jnp.float32), -1))

    # The first token is the prefill's: the target's at the prompt's last position, judged by no rule.
    seq, generated, recs = list(prompt) + [int(np.argmax(probs(target, prompt)[len(prompt) - 1]))], 1, []
    while generated < N:
        drafts, qs = [], []
        for _ in range(K):
            qs.append(probs(draft, seq + drafts)[len(seq) + len(drafts) - 1])
            drafts.append(int(np.argmax(qs[-1])))
        p_all = probs(target, seq + drafts)
        n = 0
        for j in range(K):
            p, q = p_all[len(seq) + j - 1], qs[j]
            accept = drafts[j] == int(np.argmax(p))
            recs.append((p, q, drafts[j], accept, j))
            if not accept:
                break
            n += 1
        emitted = drafts[:n] + [int(np.argmax(p_all[len(seq) + n - 1]))]
        emitted = emitted[: N - generated]
        seq += emitted
        generated += len(emitted)
    return seq[len(prompt):], recs


def test_recorded_values_equal_recomputation(models, strict_run):
    diag, out, report = strict_run
    recs = []
    for b, prompt in enumerate(prompts()):
        tokens, r = replay(models, prompt)
        assert tokens == out.to_lists()[b]  # the replay follows the engine's trajectory
        recs += r
    p = np.stack([r[0] for r in recs])
    q = np.stack([r[1] for r in recs])
    kl = np.asarray(theory.kl_divergence(p, q))
    assert report.positions == len(recs)
    extra = {k: np.asarray(v).sum(0) for k, v in out.stats.extra.items()}
    np.testing.assert_allclose(extra["kl_sum"], kl.sum(), rtol=1e-4)
    certs = jax.jit(lambda p: [theory.tree_certificate(p, c.tree_m) if c.tree_m else theory.certificate(c.spec, p)
                               for c in diag.criteria])(p)  # one compile for all criteria
    for c, cert in zip(diag.criteria, certs):
        cert = np.asarray(cert)
        finite = np.isfinite(cert)
        np.testing.assert_allclose(extra[f"{c.label}/cert_sum"], cert[finite].sum(), rtol=1e-4, atol=1e-6)
        assert int(extra[f"{c.label}/certified"]) == int((kl < cert).sum()), c.label
        assert report[c.label]["infinite_fraction"] == pytest.approx((~finite).mean())
        # Histogram: the same values binned on the host (a value on a bin edge may flip).
        host = np.bincount(np.asarray(certify._bin_index(jnp.asarray(cert), diag.lo, diag.hi, diag.num_bins)),
                           minlength=diag.num_bins + 2)
        assert np.abs(host - report.histograms[c.label]).sum() <= 2, c.label
        for qq, key in ((0.5, "certificate_median"), (0.05, "certificate_p5")):
            assert_quantile_close(report[c.label][key], cert, qq, diag.resolution, diag.lo)
    # The decode rule's acceptance is the engine's verdict; the replay's strict test agrees.
    assert int(extra["greedy/accepted"]) == sum(r[3] for r in recs)
    assert_quantile_close(report.kl["kl_median"], kl, 0.5, diag.resolution, diag.lo)


def assert_quantile_close(estimate, values, q, res, lo):
    values = np.sort(np.asarray(values, np.float64))
    r = q * (len(values) - 1)
    x0, x1 = values[int(math.floor(r))], values[int(math.ceil(r))]
    expected = np.quantile(values, q)
    if not np.isfinite(x1):
        assert estimate == expected or (np.isinf(estimate) and np.isinf(expected)) or np.isnan(expected)
        return
    assert abs(estimate - expected) <= res * max(x0, x1) + lo + 1e-12, (estimate, expected)


def test_soundness_and_fractions(strict_run):
    diag, out, report = strict_run
    assert report.soundness_checked >= report.positions > 0
    assert report.rule_mismatches == 0
    for c in diag.criteria:
        row = report[c.label]
        assert row["violations"] == 0, c.label  # certified => accepted, on every valid slot
        assert 0.0 <= row["certified_fraction"] <= row["accepted_fraction"] <= 1.0
    # Not vacuous: some positions certified and some rejected by strict greedy.
    assert report["tree:m=4"]["certified_fraction"] > 0
    assert report["greedy"]["accepted_fraction"] < 1
    # The report counts the rule's decisions; stats.accepted leaves out drafts cut by
    # EOS / max_new_tokens, so it can only be smaller.
    decided = int(np.sum(out.stats.extra["greedy/accepted"]))
    assert report["greedy"]["accepted_fraction"] == pytest.approx(decided / report.positions)
    assert int(np.sum(out.stats.accepted)) <= decided
    # Certificates grow with the criterion (larger accepted set / wider tree).
    assert report["greedy"]["certificate_median"] <= report["tree:m=2"]["certificate_median"] \
        <= report["tree:m=4"]["certificate_median"] <= math.log(5)


def test_histogram_quantiles_match_numpy():
    rng = np.random.default_rng(1)
    lo, hi, bins = certify.DEFAULT_LO, math.log(9), certify.DEFAULT_BINS
    res = certify.resolution(lo, hi, bins)
    assert res < 0.004
    sizes = (1, 2, 7, 100, 1001)
    values = np.exp(rng.uniform(math.log(1e-8), math.log(hi), sum(sizes))).astype(np.float32)
    index = np.array(certify._bin_index(jnp.asarray(values), lo, hi, bins))  # one device call
    for values, index in zip(np.split(values, np.cumsum(sizes)[:-1]), np.split(index, np.cumsum(sizes)[:-1])):
        size = len(values)
        values[: size // 10] = 0.0
        index[: size // 10] = 0
        hist = np.bincount(index, minlength=bins + 2)
        for q in (0.0, 0.05, 0.5, 0.9, 1.0):
            assert_quantile_close(histogram_quantile(hist, q, lo, hi), values, q, res, lo)
    assert math.isnan(histogram_quantile(np.zeros(bins + 2), 0.5, lo, hi))
    hist = np.zeros(bins + 2, np.int64)
    hist[-1] = 3  # every token accepted: +inf certificates
    assert histogram_quantile(hist, 0.5, lo, hi) == math.inf


def test_second_decode_compiles_nothing(models, strict_run):
    with count_compilations() as counter:
        diag = certificate_diagnostics(speculative_sampling(), trees=TREES, also=ALSO)  # built anew
        out = specjax.decode(specjax.pair(*models), prompts(), rule=speculative_sampling(), temperature=0.0,
                             num_draft=K, max_new_tokens=N, diagnostics=diag)
        report = diag.summarize(out.stats)
    assert counter["n"] == 0
    assert report.criteria == strict_run[2].criteria


def test_errors(models, strict_run):
    with pytest.raises(ValueError, match="no acceptance certificate.*EARS"):
        certificate_diagnostics(ears(0.1))
    with pytest.raises(ValueError, match="greedy decoding.*temperature=0.7"):
        certified_decode(specjax.pair(*models), prompts(), rule=additive(0.3), temperature=0.7)
    with pytest.raises(ValueError, match="random at T > 0"):
        certificate_diagnostics(speculative_sampling(), temperature=1.0)
    diag, out, _ = strict_run
    with pytest.raises(ValueError, match="does not hold this hook's records"):
        certificate_diagnostics(multiplicative(0.5)).summarize(out.stats)
    sampled = dict(out.stats.extra, sampled=np.ones_like(np.asarray(out.stats.extra["sampled"])))
    with pytest.raises(ValueError, match="greedy decoding"):
        diag.summarize(out.stats.replace(extra=sampled))
    with pytest.raises(ValueError, match="tree widths"):
        certificate_diagnostics(trees=(0,))


def test_cli_writes_table_json_png(tmp_path, capsys):
    from specjax.__main__ import main

    target, draft = tiny_pair(target_layers=1)  # one layer each: a faster compile
    dirs = {}
    for name, model in (("target", target), ("draft", draft)):
        dirs[name] = tmp_path / name
        specjax.export_hf(model, str(dirs[name]))
        write_tokenizer(dirs[name], VOCAB)
    prompt_file = tmp_path / "prompts.jsonl"
    rows = [{"prompt": " ".join(f"w{i}" for i in p)} for p in prompts()[:2]] + [{"ids": p} for p in prompts()[2:]]
    prompt_file.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    rc = main(["certify", "--target", str(dirs["target"]), "--draft", str(dirs["draft"]), "--prompts",
               str(prompt_file), "--rules", "additive:t=0.3", "--trees", "2", "--num-draft", str(K),
               "--max-new-tokens", str(N), "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "additive:t=0.3" in printed and "tree:m=2" in printed and "0.102" in printed  # paper's p5
    data = json.loads((out / "certify.json").read_text())
    by = {r["criterion"]: r for r in data["rows"]}
    assert set(by) == {"additive:t=0.3", "tree:m=2"}
    assert data["meta"]["num_prompts"] == 4
    assert by["additive:t=0.3"]["violations"] == 0  # soundness on a lossy rule's real verdicts
    assert by["additive:t=0.3"]["rule_mismatches"] == 0
    assert 0 <= by["tree:m=2"]["certified_fraction"] <= 1
    assert by["additive:t=0.3"]["paper_p5"] == 0.102
    assert (out / "certify.txt").read_text().startswith("criterion")
    assert (out / "certify.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_soundness_on_embedded_pair():
    """Every criterion of ``specjax certify`` on the embedded pair's held-out prompts:
    no certified position is ever rejected."""
    from specjax.cli import certify as certify_cli
    from specjax.cli import compare

    if not (compare.DEFAULT_TARGET.is_dir() and compare.DEFAULT_DRAFT.is_dir()):
        pytest.skip("the embedded pair is not in specjax/assets/models")
    target, draft = specjax.load(compare.DEFAULT_TARGET), specjax.load(compare.DEFAULT_DRAFT)
    prompts_ = []
    for f in certify_cli.default_prompt_files():
        prompts_ += certify_cli.read_prompts(f, target.tokenizer, 32)
    rows = certify_cli.run_certify(target, draft, prompts_, max_new_tokens=32,
                                   eos_token_id=getattr(target.module.config, "eos_token_id", None))
    rows = [r for r in rows if not r.get("_kl")]
    assert len(rows) == len(certify_cli.CERTIFY_RULES) + len(certify_cli.CERTIFY_TREES)
    for r in rows:
        assert r["positions"] > 0
        assert r["violations"] == 0, r["criterion"]
        assert 0 <= r["certified_fraction"] <= 1
