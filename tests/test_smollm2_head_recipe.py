"""``python -m training.smollm2_head``: the EAGLE-3-shaped SmolLM2 head's recipe.

Training it for real is GPU work (docs/heads.md); here: each stage gets the shipped
answers, the new passes and the EAGLE-3 settings, every setting is one the stage takes,
and new passes are numbered where they cannot land on the shipped passes' shards.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from training import chat_prompts, distill_data, draft, eagle, smollm2_head


def _run(monkeypatch, tmp_path, *argv):
    calls = []
    monkeypatch.setattr(draft, "main", lambda a: calls.append(("draft", a)) or 0)
    monkeypatch.setattr(eagle, "main", lambda a: calls.append(("eagle", a)) or 0)
    assert smollm2_head.main(["--out", str(tmp_path / "run"), "--no-progress", *argv]) == 0
    return calls


def test_the_recipe_rebuilds_the_answers_gathers_new_passes_then_trains_an_eagle3_head(monkeypatch, tmp_path):
    calls = _run(monkeypatch, tmp_path, "--gather-passes", "4,5", "--minutes", "6")
    assert [c[0] for c in calls] == ["draft", "draft", "draft", "eagle"]
    unpack, *passes = [c[1] for c in calls[:3]]
    assert unpack[unpack.index("--answers-from") + 1] == str(smollm2_head.ANSWERS)
    for argv, p in zip(passes, ("4", "5")):
        args = draft.build_parser().parse_args(argv)
        assert args.gather_only and args.gather_pass == int(p) and args.out == str(tmp_path / "run")
        assert args.gather_batch == 32  # the shipped answers' batch: shard numbers follow it
    args = eagle.build_parser().parse_args(calls[3][1])
    assert args.feature_layers == (2, 15, -1) and args.unroll == 3 and args.minutes == 6.0
    assert args.head_vocab == 8192 and args.head_vocab_from == "" and args.target == smollm2_head.TARGET
    assert args.data == str(tmp_path / "run" / "data") and args.export == str(tmp_path / "run" / "export")
    assert args.batch == args.feature_batch == 64


def test_self_written_requests_are_answered_after_the_shipped_answers(monkeypatch, tmp_path):
    done = []
    monkeypatch.setattr(smollm2_head, "answer_self_written", lambda out, n, batch: done.append((out, n, batch)))
    calls = _run(monkeypatch, tmp_path, "--self-prompts", "1000", "--steps", "5")
    assert done == [(tmp_path / "run", 1000, 32)] and [c[0] for c in calls] == ["draft", "eagle"]
    _run(monkeypatch, tmp_path, "--self-prompts", "64", "--self-batch", "128", "--data-only")
    assert done[-1] == (tmp_path / "run", 64, 128)


def test_the_self_written_measuring_set_is_64_requests():
    rows = [json.loads(line) for line in smollm2_head.SELF_WRITTEN_EVAL.read_text().splitlines()]
    assert len(rows) == 64 == len({r["prompt"] for r in rows})
    assert all(r["kind"] == "self-written" and len(r["prompt"].split()) >= 3 for r in rows)


def test_an_init_from_head_keeps_its_vocabulary(monkeypatch, tmp_path):
    (_, argv), = _run(monkeypatch, tmp_path, "--steps", "100", "--init-from", "some/head")[1:]
    args = eagle.build_parser().parse_args(argv)
    assert args.init_from == "some/head" and args.head_vocab is None and args.steps == 100


def test_data_only_stops_after_the_features(monkeypatch, tmp_path):
    args = eagle.build_parser().parse_args(_run(monkeypatch, tmp_path, "--data-only")[-1][1])
    assert args.features_only and args.feature_layers == (2, 15, -1)
    assert not args.online_features
    args = eagle.build_parser().parse_args(_run(monkeypatch, tmp_path, "--online-features", "--steps", "9")[-1][1])
    assert args.online_features and args.steps == 9 and args.time_limit is None
    args = eagle.build_parser().parse_args(_run(monkeypatch, tmp_path, "--time-limit", "9", "--minutes", "5")[-1][1])
    assert 8.9 < args.time_limit <= 9 and args.minutes == 5  # what is left of the recipe's 9 minutes


@pytest.mark.parametrize("bad", [["--gather-passes", "2", "--steps", "1"], ["--gather-passes", "x", "--steps", "1"],
                                 [], ["--steps", "1", "--minutes", "2"], ["--self-prompts", "-1", "--steps", "1"],
                                 ["--self-prompts", "8", "--self-batch", "0", "--steps", "1"],
                                 ["--time-limit", "0", "--steps", "1"], ["--time-limit", "soon", "--steps", "1"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        smollm2_head.main(["--no-progress", *bad])


def test_a_new_pass_at_the_shipped_batch_numbers_its_shards_after_the_shipped_ones():
    shipped = set(np.unique(np.load(smollm2_head.ANSWERS)["shard"]).tolist())
    per_pass = -(-len(chat_prompts.train_prompts()) // 32)
    assert shipped == set(range(per_pass, 4 * per_pass))  # passes 1-3
    assert max(shipped) < 4 * per_pass  # where pass 4 begins
    assert distill_data.pass_temperature(0, 4) in (0.3, 0.7, 1.0)


@pytest.mark.parametrize("bad", [["--steps", "-1"], ["--minutes", "0"], ["--minutes", "soon"],
                                 ["--batch", "0", "--steps", "1"]])
def test_a_bad_budget_is_refused_before_the_data_stages(monkeypatch, tmp_path, bad, capsys):
    """The data stages take minutes: a budget training.eagle would refuse is refused first."""
    monkeypatch.setattr(draft, "main", lambda a: pytest.fail("the data stage ran"))
    with pytest.raises(SystemExit) as e:
        smollm2_head.main(["--out", str(tmp_path / "run"), "--no-progress", *bad])
    assert e.value.code == 2 and f"argument {bad[0]}" in capsys.readouterr().err


def test_an_export_in_the_way_is_refused_before_the_data_stages(monkeypatch, tmp_path):
    """Another head at --export stops the recipe at once, not after the data stages' minutes;
    --force, or --data-only (which exports nothing), goes on."""
    dest = tmp_path / "theirs"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    monkeypatch.setattr(draft, "main", lambda a: pytest.fail("the data stage ran"))
    with pytest.raises(SystemExit, match="pass --force to replace it"):
        smollm2_head.main(["--out", str(tmp_path / "run"), "--no-progress", "--steps", "5", "--export", str(dest)])
    calls = _run(monkeypatch, tmp_path, "--steps", "5", "--export", str(dest), "--force")
    assert [c[0] for c in calls] == ["draft", "eagle"] and "--force" in calls[-1][1]
    assert (dest / "config.json").exists()  # the recipe's own check replaces nothing
    assert [c[0] for c in _run(monkeypatch, tmp_path, "--data-only", "--export", str(dest))] == ["draft", "eagle"]


def test_the_recipes_own_export_is_made_again_without_force(monkeypatch, tmp_path):
    """The documented way to continue (the same command, even with another --time-limit) finds
    the run's own export at --export and goes on; another run's export there is refused."""
    dest = tmp_path / "export"
    argv = ["--steps", "5", "--export", str(dest)]
    (_, eagle_argv), = _run(monkeypatch, tmp_path, *argv, "--time-limit", "9")[1:]
    dest.mkdir()
    run_id = json.loads((tmp_path / "run" / "head" / "run.json").read_text())["run_id"]
    summary = {"run_id": run_id, "command": eagle.command_line(eagle_argv)}
    (dest / "train_log.json").write_text(json.dumps({"summary": summary}))
    assert [c[0] for c in _run(monkeypatch, tmp_path, *argv, "--time-limit", "5")] == ["draft", "eagle"]
    (dest / "train_log.json").write_text(json.dumps({"summary": {**summary, "run_id": "another run"}}))
    with pytest.raises(SystemExit, match="pass --force to replace it"):
        _run(monkeypatch, tmp_path, *argv)
