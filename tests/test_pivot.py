"""The pivot head's trainer and PAD's labelling.

Training runs on a small separable synthetic set (full batch, deterministic on
CPU), so a run killed between checkpoints and resumed must end with exactly
the parameters of an uninterrupted run. Labelling runs a tiny random pair with
a toy utility whose values are known in advance.
"""

from __future__ import annotations

import numpy as np
import pytest

from training import pivot, rollouts
from training.rollouts import LabelConfig, decide_pivot, training_filter

H = 8


def synthetic(n=160, seed=0):
    """Pivots have a shifted hidden direction and a low p(x): linearly separable."""
    rng = np.random.default_rng(seed)
    y = (np.arange(n) % 3 == 0).astype(np.int32)  # imbalanced: 1/3 pivots
    hidden = rng.normal(size=(n, H)).astype(np.float32) * 3.0 + 10.0
    hidden[:, 0] += np.where(y == 1, 8.0, -8.0)
    scalars = np.stack([rng.uniform(0, 3, n), np.where(y == 1, 0.1, 0.4) + rng.uniform(0, 0.1, n)], 1)
    return hidden, scalars.astype(np.float32), y


CFG = pivot.TrainConfig(steps=60, lr=3e-3, warmup=5, checkpoint_every=20)


def test_training_reduces_heldout_loss_and_separates():
    head, report = pivot.train_head(*synthetic(), config=CFG, progress=False, log=lambda *_: None)
    assert report["best_val_loss"] < 0.5 * report["initial_val_loss"]
    assert report["heldout"]["auc"] > 0.95
    assert report["heldout"]["recall@0.5"] > 0.9
    assert head.config.hidden_size == H and head.layer == -8


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path):
    data = synthetic()
    whole, rep_whole = pivot.train_head(*data, config=CFG, progress=False, log=lambda *_: None)
    ckpt = tmp_path / "ckpt"
    # "Kill" after 30 steps: the last checkpoint is at step 20, so 10 steps are replayed.
    pivot.train_head(*data, config=CFG, ckpt_dir=ckpt, progress=False, stop_after=30, log=lambda *_: None)
    logs = []
    resumed, rep_resumed = pivot.train_head(*data, config=CFG, ckpt_dir=ckpt, progress=False, log=logs.append)
    assert any("resuming from step 20" in m for m in logs)
    assert rep_resumed["steps_run"] == CFG.steps
    assert rep_resumed["best_step"] == rep_whole["best_step"]
    import jax
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # A checkpoint directory of another run is refused, not silently mixed in.
    other = pivot.TrainConfig(steps=60, lr=1e-2, warmup=5, checkpoint_every=20)
    with pytest.raises(ValueError, match="different run"):
        pivot.train_head(*data, config=other, ckpt_dir=ckpt, progress=False, log=lambda *_: None)


def test_clear_errors_for_bad_labelled_sets(tmp_path):
    h, s, y = synthetic(20)
    with pytest.raises(ValueError, match="empty"):
        pivot.train_head(h[:0], s[:0], y[:0], config=CFG, progress=False)
    with pytest.raises(ValueError, match="one class only"):
        pivot.train_head(h, s, np.zeros_like(y), config=CFG, progress=False)
    with pytest.raises(ValueError, match="one class only"):
        pivot.train_head(h, s, np.ones_like(y), config=CFG, progress=False)
    with pytest.raises(FileNotFoundError, match="--gather"):
        rollouts.LabelledSet.load(tmp_path / "missing.npz")


def test_pivot_formula_and_filter_by_hand():
    u_d = np.array([0.5, 0.5, 0.9, 0.0, 0.3])
    u_t = np.array([0.8, 0.8, 0.9, 0.0, 0.9])
    # mul: 0.5 < 0.7*0.8=0.56 yes; 0.5 < 0.56 yes; 0.9 < 0.63 no; 0 < 0 no; 0.3 < 0.63 yes
    np.testing.assert_array_equal(decide_pivot(u_d, u_t, 0.7, "mul"), [1, 1, 0, 0, 1])
    np.testing.assert_array_equal(decide_pivot(u_d, u_t, 1.0, "mul"), [1, 1, 0, 0, 1])
    np.testing.assert_array_equal(decide_pivot(u_d, u_t, 0.6, "mul"), [0, 0, 0, 0, 1])
    # add: u_d < u_t - 0.25 -> 0.5<0.55 yes, yes, 0.9<0.65 no, 0<-0.25 no, 0.3<0.65 yes
    np.testing.assert_array_equal(decide_pivot(u_d, u_t, 0.25, "add"), [1, 1, 0, 0, 1])
    pv = decide_pivot(u_d, u_t, 1.0)
    # positives kept if u_d <= 0.3; negatives if u_d >= 0.8; u_t == 0 dropped
    np.testing.assert_array_equal(training_filter(u_d, u_t, pv, 0.3, 0.8), [0, 0, 1, 0, 1])


def test_labelling_follows_the_formula_on_a_toy_utility():
    """Utility depends only on the first generated token: 1 if even, else 0.25.

    So at the first position u_draft = f(x_d), u_target = f(x_t) whatever the
    rollouts do; later every rollout shares that first token and
    u_draft = u_target (never a pivot with thr <= 1). The trajectory keeps
    x_d unless it is a pivot.
    """
    import jax

    from test_pad import tiny_pair

    f = lambda c: 1.0 if c[0] % 2 == 0 else 0.25  # noqa: E731
    calls = []

    def utility(ex, comps):
        calls.append(len(comps))
        return np.array([f(c) for c in comps])

    prompts = [[5, 17, 3], [40, 2, 9, 11, 60], [7], [33, 34], [1, 2, 3, 4], [90, 80, 70], [12], [64, 65]]
    cfg = LabelConfig(num_rollouts=3, max_new_tokens=4, batch_size=8, thr=0.5, all_layers=True)
    ds, traj = rollouts.gather_labels(tiny_pair(), prompts, utility, cfg, progress=False,
                                      return_trajectories=True)
    assert len(ds) > 0 and ds.meta["layer"] == -2 and ds.hidden.shape[1] == 32  # -8 clamped to 2 layers
    assert ds.hidden_by_layer.shape == (len(ds), 2, 32)
    np.testing.assert_array_equal(ds.hidden_at(-8), ds.hidden)
    np.testing.assert_array_equal(ds.hidden_at(-1), ds.hidden_by_layer[:, 1])
    # batched: per step at most one direct-scoring call and one rollout call (8 rows <= one pack of 16 sides)
    assert len(calls) <= 2 * ds.meta["steps"]
    assert ds.meta["sides_rolled_out"] > 0
    first = ds.position == 0
    assert first.any()
    fx = np.vectorize(lambda t: f([t]))
    np.testing.assert_allclose(ds.u_draft[first], fx(ds.draft_token[first]))
    np.testing.assert_allclose(ds.u_target[first], fx(ds.target_token[first]))
    np.testing.assert_array_equal(ds.labels, (ds.u_draft < 0.5 * ds.u_target).astype(int))
    np.testing.assert_array_equal(ds.u_draft[~first], ds.u_target[~first])
    assert (ds.labels[~first] == 0).all()
    for i in range(len(ds)):
        t = traj[ds.example[i]][ds.position[i]]
        assert t == (ds.target_token[i] if ds.labels[i] else ds.draft_token[i])
    del jax


TERMINATORS = frozenset(range(0, 96, 4))  # the toy task's "newline": a quarter of the vocabulary


class ToyTask:
    """Utility decided at the first terminator token, like the arithmetic task's first line:
    1 if the tokens before it sum to an even number, 0 if odd or if no terminator yet."""

    def __init__(self, finals: bool = True, always_final: bool = False):
        self.calls = 0
        if finals:
            self.is_final = self._always if always_final else self._is_final

    @staticmethod
    def _value(c):
        for i, t in enumerate(c):
            if t in TERMINATORS:
                return float(sum(c[:i]) % 2 == 0)
        return 0.0

    def __call__(self, ex, comps):
        self.calls += len(comps)
        return np.array([self._value(c) for c in comps])

    def _is_final(self, ex, comps):
        return np.array([any(t in TERMINATORS for t in c) for c in comps])

    def _always(self, ex, comps):  # wrong on purpose: claims every prefix is decided
        return np.ones(len(comps), bool)


TOY_PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60], [7], [33, 34], [1, 2, 3, 5], [90, 81, 70], [13], [65, 66]]


@pytest.fixture(scope="module")
def toy_runs():
    """Labels on the toy task with a budget past the terminator: with the is_final
    shortcut, without it (every side rolled out), and with a wrong is_final."""
    from test_pad import tiny_pair

    pair = tiny_pair()
    cfg = LabelConfig(num_rollouts=4, max_new_tokens=8, batch_size=8, temperature=1.0, seed=3)
    out = {}
    for name, util in (("shortcut", ToyTask()), ("rollouts", ToyTask(finals=False)),
                       ("wrong", ToyTask(always_final=True))):
        ds, traj = rollouts.gather_labels(pair, TOY_PROMPTS, util, cfg, progress=False,
                                          rollout_eos_token_ids=sorted(TERMINATORS), return_trajectories=True)
        out[name] = (ds, traj, util.calls)
    return out


def test_is_final_shortcut_gives_the_labels_of_full_rollouts(toy_runs):
    fast, traj_fast, calls_fast = toy_runs["shortcut"]
    slow, traj_slow, calls_slow = toy_runs["rollouts"]
    assert len(fast) > 0 and fast.meta["sides_rolled_out"] > 0
    assert traj_fast == traj_slow
    for f in ("labels", "keep", "u_draft", "u_target", "example", "position", "draft_token", "target_token"):
        np.testing.assert_array_equal(getattr(fast, f), getattr(slow, f), err_msg=f)
    np.testing.assert_array_equal(fast.hidden, slow.hidden)
    # ... while rolling out fewer sides
    assert fast.meta["sides_final"] > slow.meta["sides_final"]
    assert fast.meta["sides_rolled_out"] < slow.meta["sides_rolled_out"]
    assert calls_fast < calls_slow
    # The comparison can fail: an is_final that lies changes the labels.
    wrong = toy_runs["wrong"][0]
    assert wrong.meta["sides_rolled_out"] == 0
    assert not (len(wrong) == len(fast) and np.array_equal(wrong.u_draft, fast.u_draft)
                and np.array_equal(wrong.u_target, fast.u_target))


def test_budget_past_the_answer_yields_nonpivots_the_filter_keeps(toy_runs):
    """Rejections after the trajectory's terminator cannot change the outcome:
    u_draft == u_target there; where the answer is right they are non-pivots the
    authors' filter keeps, so both classes survive it."""
    ds, traj, _ = toy_runs["shortcut"]
    first_term = {e: next((i for i, t in enumerate(traj[e]) if t in TERMINATORS), len(traj[e]))
                  for e in range(len(traj))}
    after = np.array([p > first_term[e] for e, p in zip(ds.example, ds.position)])
    assert after.any()
    np.testing.assert_array_equal(ds.u_draft[after], ds.u_target[after])
    assert (ds.labels[after] == 0).all()
    kept_neg = ds.keep & (ds.labels == 0)
    assert (kept_neg & after).any()
    assert (ds.keep & (ds.labels == 1)).any()


def test_class_weights_balance_then_weight_pivots():
    y = np.array([0, 0, 0, 1])
    np.testing.assert_allclose(pivot._class_weights(y), [4 / 6, 2.0])  # n / (2 * count): the authors'
    np.testing.assert_allclose(pivot._class_weights(y, pivot_weight=10.0), [4 / 6, 20.0])
    with pytest.raises(ValueError, match="bad budget"):
        pivot.parse_budget("6:eos")
    assert pivot.parse_budget("40") == (40, False) and pivot.parse_budget("6:newline") == (6, True)


def test_greedy_rollouts_score_the_targets_own_greedy_continuation():
    """rollout_temperature 0: each side's utility is the toy task's value of the
    target's greedy continuation of ``prefix + candidate``, cut at the budget."""
    import specjax
    from test_pad import tiny_pair

    pair = tiny_pair()
    budget = 6
    cfg = LabelConfig(num_rollouts=1, rollout_temperature=0.0, max_new_tokens=budget, batch_size=8, seed=1)
    ds, traj = rollouts.gather_labels(pair, TOY_PROMPTS, ToyTask(finals=False), cfg, progress=False,
                                      return_trajectories=True)
    assert len(ds) > 0 and ds.meta["sides_rolled_out"] > 0
    for i in range(len(ds)):
        e, pos = int(ds.example[i]), int(ds.position[i])
        for token, util in ((ds.draft_token[i], ds.u_draft[i]), (ds.target_token[i], ds.u_target[i])):
            completion = traj[e][:pos] + [int(token)]
            left = budget - len(completion)
            if left > 0:
                out = specjax.generate(pair.target, [TOY_PROMPTS[e] + completion], max_new_tokens=left,
                                       temperature=0.0)
                completion += np.asarray(out.tokens)[0, : int(np.asarray(out.lengths)[0])].tolist()
            assert util == ToyTask._value(completion), (i, token)


def test_label_config_refuses_repeated_greedy_rollouts():
    with pytest.raises(ValueError, match="--rollouts 1"):
        LabelConfig(num_rollouts=4, rollout_temperature=0.0)
    with pytest.raises(ValueError, match="rollout_temperature"):
        LabelConfig(rollout_temperature=-0.5)
    with pytest.raises(ValueError, match="rollout_chunk"):
        LabelConfig(rollout_chunk=0)


class _WordTokenizer:
    """Token i decodes to WORDS[i]: enough of a tokenizer for the chat utility."""

    WORDS = ["The", " capital", " is", " Paris", ".", "ian", " PARIS", "!", " Lyon"]

    def decode(self, ids):
        return "".join(self.WORDS[i] for i in ids)


def test_chat_task_utility_scores_a_whole_word_and_finalises_only_when_it_cannot_change():
    util = rollouts.ChatTaskUtility(_WordTokenizer(), ["Paris"])
    cases = {  # completion: (utility, final)
        (0, 1, 2, 3, 4): (1.0, True),  # "The capital is Paris."
        (0, 1, 2, 3): (1.0, False),  # "... Paris": "ian" could still follow
        (0, 1, 2, 3, 5): (0.0, False),  # "... Parisian"
        (0, 1, 2, 6, 7): (1.0, True),  # case-insensitive
        (0, 1, 2, 8, 4): (0.0, False),  # a wrong answer is never final: a later line may still name Paris
    }
    comps = [list(c) for c in cases]
    np.testing.assert_array_equal(util(np.zeros(len(comps), int), comps), [v[0] for v in cases.values()])
    np.testing.assert_array_equal(util.is_final(np.zeros(len(comps), int), comps), [v[1] for v in cases.values()])


def test_chat_training_questions_are_never_evaluation_questions():
    from training import chat_prompts

    train, held = chat_prompts.pivot_task_items(), chat_prompts.task_items()
    prompts = [it["prompt"] for it in train]
    assert len(prompts) == len(set(prompts)) == 174
    assert not set(prompts) & {it["prompt"] for it in held}
    assert all(str(it["answer"]).strip() for it in train)
    for it in train:  # sums are right
        if it["prompt"].startswith("What is ") and "+" in it["prompt"]:
            a, b = it["prompt"][8:-1].split(" + ")
            assert int(it["answer"]) == int(a) + int(b)


def test_chat_task_defaults_and_refused_evaluate(capsys):
    args = pivot.build_parser().parse_args(["--task", "chat"])
    pivot.resolve_task_defaults(args)
    assert (args.target, args.draft) == (pivot.CHAT_TARGET, pivot.CHAT_DRAFT)
    assert args.dataset.startswith(str(pivot.CHAT_RUNS)) and args.max_new_tokens == pivot.CHAT_MAX_NEW_TOKENS
    assert pivot.resolve_out(args) == pivot.CHAT_RUNS / "head"
    args.export_to_assets = True
    assert pivot.resolve_out(args) == pivot.SHIPPED_CHAT_HEAD
    plain = pivot.build_parser().parse_args([])
    pivot.resolve_task_defaults(plain)
    assert plain.max_new_tokens == 32 and plain.dataset == str(pivot.DEFAULT_DATASET)
    assert pivot.main(["--task", "chat", "--evaluate"]) == 2
    assert "specjax compare --pair smollm2-eagle" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--steps", "-5"], ["--lr", "-1"], ["--lr", "nan"],
                                 ["--weight-decay", "nan"], ["--val-fraction", "0"], ["--val-fraction", "1.5"],
                                 ["--pivot-weight", "-1"], ["--sigma", "2"], ["--prompts", "0"], ["--batch", "0"],
                                 ["--rollouts", "0"], ["--max-new-tokens", "0"]])
def test_bad_numbers_are_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit) as e:
        pivot.build_parser().parse_args(bad)
    assert e.value.code == 2 and f"argument {bad[0]}: expected" in capsys.readouterr().err


def _labelled_set(path, meta):
    h, s, y = synthetic(20)
    z = np.zeros(len(y), np.int32)
    rollouts.LabelledSet(hidden=h, scalars=s, labels=y, keep=np.ones(len(y), bool), u_draft=z.astype(np.float32),
                         u_target=z.astype(np.float32), example=z, position=z, draft_token=z, target_token=z,
                         meta=meta).save(path)


def test_a_bad_dataset_is_refused_before_any_gathering_or_training(tmp_path, monkeypatch, capsys):
    """A --dataset directory once gathered for minutes, then failed to save; another .npz and
    an unavailable --hidden-layer ended in tracebacks."""
    monkeypatch.setattr(pivot, "gather_task_labels", lambda args: pytest.fail("gathered"))
    monkeypatch.setattr(pivot, "train_head", lambda *a, **k: pytest.fail("trained"))
    base = ["--out", str(tmp_path / "head"), "--ckpt-dir", str(tmp_path / "ckpt"), "--no-progress"]
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    _labelled_set(tmp_path / "labels.npz", {"layer": -8, "target_num_layers": 2})
    for extra, message in ((["--dataset", str(tmp_path)], "is not a file"),
                           (["--dataset", str(tmp_path), "--gather"], "is not a file"),
                           (["--dataset", str(tmp_path / "other.npz")], "is not a labelled set written by --gather"),
                           (["--dataset", str(tmp_path / "labels.npz"), "--hidden-layer", "-1"],
                            "--hidden-layer -1: this labelled set holds layer -8 only")):
        assert pivot.main(base + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "head").exists()
