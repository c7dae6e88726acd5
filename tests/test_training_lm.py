"""Tests for the embedded pair's training code (training/{tokenizer,data,common,lm}.py)."""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax._src.models.decoder import Decoder
from training import common, data, lm
from training import tokenizer as tokenizer_lib

TASK_RE = re.compile(r"assert (\d+) \+ (\d+) == (\d+)\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    # A few stdlib files and a 320-token vocab keep this at a few seconds.
    return data.build_corpus(tmp_path_factory.mktemp("corpus"), vocab_size=320, max_files=6)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_splits_digits_and_round_trips(corpus):
    tok = corpus.tokenizer
    assert tok.token_to_id("<pad>") == tokenizer_lib.PAD_ID
    assert tok.token_to_id("<bos>") == tokenizer_lib.BOS_ID
    assert tok.token_to_id("<eos>") == tokenizer_lib.EOS_ID
    enc = tok.encode("x = 12345 + 678")
    assert enc.ids[0] == tokenizer_lib.BOS_ID  # the post-processor adds <bos>
    digit_pieces = [t for t in enc.tokens if any(c.isdigit() for c in t)]
    assert digit_pieces == list("12345678")
    text = 'def f(a, b=3):\n    """Doc ü"""\n\treturn {a: b ** 2}  # 42\n'
    ids = tokenizer_lib.encode_batch(tok, [text])[0]
    assert tokenizer_lib.decode(tok, ids) == text


def test_task_prompt_tokens_are_a_prefix_of_the_line(corpus):
    tok = corpus.tokenizer
    for a, b in [(0, 0), (7, 95), (99, 99), (37, 48)]:
        full = tokenizer_lib.encode_batch(tok, [data.task_line(a, b)])[0]
        prompt = tokenizer_lib.encode_batch(tok, [data.task_prompt(a, b)])[0]
        assert full[: len(prompt)] == prompt
        assert tokenizer_lib.decode(tok, full[len(prompt) :]) == f" {a + b}\n"


# ----------------------------------------------------------------------------- task and data


def test_heldout_set_is_deterministic_and_disjoint_from_training():
    h1, h2 = data.heldout_pairs(), data.heldout_pairs()
    np.testing.assert_array_equal(h1, h2)
    assert len({tuple(p) for p in h1.tolist()}) == data.HELDOUT_SIZE
    assert not np.array_equal(h1, data.heldout_pairs(seed=data.HELDOUT_SEED + 1))
    train = data.train_pairs(h1)
    assert len(train) + len(h1) == (data.MAX_OPERAND + 1) ** 2
    assert not ({tuple(p) for p in train.tolist()} & {tuple(p) for p in h1.tolist()})


def test_batches_are_pure_functions_of_seed_and_step_and_never_hold_heldout(corpus):
    kw = dict(batch_size=8, seq_len=64, task_fraction=0.75)
    b1 = data.make_batch(corpus, seed=3, step=11, **kw)
    np.testing.assert_array_equal(b1, data.make_batch(corpus, seed=3, step=11, **kw))
    assert not np.array_equal(b1, data.make_batch(corpus, seed=3, step=12, **kw))
    assert not np.array_equal(b1, data.make_batch(corpus, seed=4, step=11, **kw))
    assert b1.shape == (8, 65) and (b1[:, 0] == tokenizer_lib.BOS_ID).all()
    held = {tuple(p) for p in corpus.task_heldout.tolist()}
    seen = 0
    for step in range(20):
        rows = data.make_batch(corpus, seed=0, step=step, **kw)
        for row in rows[:6]:  # the task rows
            text = tokenizer_lib.decode(corpus.tokenizer, row)
            for a, b, c in TASK_RE.findall(text):
                assert int(a) + int(b) == int(c)
                assert (int(a), int(b)) not in held
                seen += 1
    assert seen > 300


def test_answer_mask_marks_exactly_the_answers(corpus):
    tokens, answer = data.make_batch(corpus, seed=1, step=0, batch_size=4, seq_len=48,
                                     task_fraction=0.5, with_answer_mask=True)
    np.testing.assert_array_equal(
        tokens, data.make_batch(corpus, seed=1, step=0, batch_size=4, seq_len=48, task_fraction=0.5))
    tok = corpus.tokenizer
    for row, mask in zip(tokens[:2], answer[:2]):
        text = tokenizer_lib.decode(tok, row)
        full = TASK_RE.findall(text)
        want = "".join(f" {c}\n" for _, _, c in full)
        got = tokenizer_lib.decode(tok, row[mask])
        assert got.startswith(want) and len(full) >= 2  # (+ the truncated last line's answer part)
    assert not answer[2:].any()  # code rows


def test_exact_match_scorer():
    assert data.score_answer(" 85\nassert 1 + 2 == 3", "85")
    assert data.score_answer("85", "85")
    assert data.score_answer(" 85 \n", "85")
    assert not data.score_answer(" 851\n", "85")
    assert not data.score_answer(" 8\n5", "85")
    assert not data.score_answer("", "85")
    assert not data.score_answer(" 85.0\n", "85")
    assert not data.score_answer("\n85", "85")


# ----------------------------------------------------------------------------- model and loop

SHAPE = dict(batch_size=2, seq_len=16, task_fraction=0.5)


def _noisy(params, scale, seed):
    # NumPy noise: one jitted op per leaf shape would cost a compile each.
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + scale * rng.standard_normal(x.shape).astype(x.dtype), params)


@pytest.fixture(scope="module")
def tiny(corpus):
    """One tiny model, optimizer and jitted train step shared by the tests (one compile)."""
    cfg = lm.model_config("tiny", corpus.tokenizer.get_vocab_size())
    module = Decoder(cfg)
    opt = common.adamw(1e-2, 20, warmup_steps=2)
    step = common.make_train_step(functools.partial(lm.lm_loss, module, answer_weight=5.0), opt)
    return cfg, module, opt, step


def test_train_forward_matches_the_decoder(corpus, tiny):
    cfg, module, _, _ = tiny
    params = _noisy(module.init(jax.random.key(0)), 0.05, 1)
    tokens = jnp.asarray(data.make_batch(corpus, seed=0, step=0, **SHAPE))
    np.testing.assert_allclose(
        jax.jit(functools.partial(lm.train_logits, cfg))(params, tokens),
        jax.jit(module.apply)(params, tokens).logits,
        rtol=1e-5, atol=1e-5)


def test_answer_weight_weighs_answer_tokens(corpus, tiny):
    _, module, _, _ = tiny
    params = module.init(jax.random.key(0))
    tokens, answer = map(jnp.asarray, data.make_batch(corpus, seed=0, step=0, with_answer_mask=True,
                                                      **SHAPE))
    plain, _ = lm.lm_loss(module, params, tokens)
    same, aux = lm.lm_loss(module, params, (tokens, answer), answer_weight=1.0)
    np.testing.assert_allclose(plain, same, rtol=1e-6)
    heavy, _ = lm.lm_loss(module, params, (tokens, answer), answer_weight=5.0)
    a = float(aux["answer_nll"])
    n_ans = float((answer[:, 1:] & (tokens[:, 1:] != 0)).sum())
    n_all = float((tokens[:, 1:] != 0).sum())
    want = (float(plain) * n_all + 4.0 * a * n_ans) / (n_all + 4.0 * n_ans)
    np.testing.assert_allclose(float(heavy), want, rtol=1e-5)


def test_few_steps_reduce_loss_on_a_fixed_batch(corpus, tiny):
    _, module, opt, step = tiny
    state = common.init_state(module.init(jax.random.key(0)), opt)
    batch = tuple(map(jnp.asarray, data.make_batch(corpus, seed=0, step=0, with_answer_mask=True,
                                                   **SHAPE)))
    losses = []
    for _ in range(12):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 1.0, losses
    assert int(state["step"]) == 12


def test_killed_run_resumes_exactly(corpus, tiny, tmp_path):
    _, module, opt, train_step = tiny
    total = 7
    batch_fn = lambda s: tuple(map(jnp.asarray, data.make_batch(  # noqa: E731
        corpus, seed=5, step=s, with_answer_mask=True, **SHAPE)))
    fresh = lambda: common.init_state(module.init(jax.random.key(0)), opt)  # noqa: E731
    run = dict(num_steps=total, tokens_per_step=32, progress=False, log_every=0)

    ref, ref_meta = common.train_loop(fresh(), train_step, batch_fn, **run)

    ckpt = common.Checkpointer(tmp_path / "ck", every_seconds=1e9, every_steps=2)
    # "Killed" after 5 steps: the last checkpoint is step 4; step 5 is lost.
    common.train_loop(fresh(), train_step, batch_fn, checkpointer=ckpt, meta={"seed": 5},
                      stop_after=5, **run)
    ckpt.close()

    ckpt = common.Checkpointer(tmp_path / "ck", every_seconds=1e9, every_steps=2)
    assert ckpt.latest_step() == 4
    state, meta = ckpt.restore(fresh())
    assert int(state["step"]) == 4 and meta["seed"] == 5 and meta["tokens_seen"] == 4 * 32
    state, meta = common.train_loop(state, train_step, batch_fn, checkpointer=ckpt, meta=meta, **run)
    ckpt.close()
    assert int(state["step"]) == total and meta["tokens_seen"] == ref_meta["tokens_seen"]
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_deadline_ends_training_early_and_checkpoints_the_step_reached(corpus, tiny, tmp_path):
    _, module, opt, train_step = tiny

    def slow_batch(s):
        time.sleep(0.05)
        return tuple(map(jnp.asarray, data.make_batch(corpus, seed=5, step=s, with_answer_mask=True, **SHAPE)))

    fresh = lambda: common.init_state(module.init(jax.random.key(0)), opt)  # noqa: E731
    ckpt = common.Checkpointer(tmp_path / "ck", every_seconds=1e9, every_steps=1000)
    # The first step starts before the deadline (checked before each step) unless the machine stalls
    # this thread for the whole margin: 2 s, not 0.5, for a busy machine; 1000 steps of 50 ms never fit.
    state, meta = common.train_loop(fresh(), train_step, slow_batch, 1000, checkpointer=ckpt, progress=False,
                                    log_every=0, deadline=time.monotonic() + 2.0)
    ckpt.close()
    reached = int(state["step"])
    assert 1 <= reached < 1000 and meta["stopped_at_deadline"] == reached
    assert common.Checkpointer(tmp_path / "ck").latest_step() == reached
    state, meta = common.train_loop(fresh(), train_step, slow_batch, 1000, progress=False, log_every=0,
                                    deadline=time.monotonic())
    assert int(state["step"]) == 0 and meta["stopped_at_deadline"] == 0


def test_greedy_fill_matches_step_by_step_argmax(tiny):
    _, module, _, _ = tiny
    params = _noisy(module.init(jax.random.key(3)), 0.1, 4)
    prompts = [[1, 40, 41, 42], [1, 50]]
    width, steps = 8, 3
    buf = np.zeros((2, width), np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    out = np.asarray(lm.greedy_fill(module, params, jnp.asarray(buf),
                                    jnp.asarray([4, 2], jnp.int32), steps))
    forward = jax.jit(lambda p, t: module.apply(p, t).logits)
    for i, p in enumerate(prompts):
        seq = list(p)
        for _ in range(steps):  # one sequence at a time, read at its last token
            row = np.zeros((1, width), np.int32)
            row[0, : len(seq)] = seq
            seq.append(int(jnp.argmax(forward(params, jnp.asarray(row))[0, len(seq) - 1])))
        assert out[i, : len(seq)].tolist() == seq


def test_export_into_a_non_empty_directory_is_refused_before_training(tmp_path):
    from training import lm

    dest = tmp_path / "shipped"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        lm.main(["--model", "draft", "--out", str(tmp_path / "run"), "--export", str(dest),
                 "--corpus-cache", str(tmp_path / "never-built")])
    assert not (tmp_path / "never-built").exists()  # refused before any work
    assert (dest / "config.json").read_text() == "{}"
