"""training.draft: distillation rows, the reduced-head draft, resumable training,
and that a draft which never proposes some tokens keeps decoding lossless."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import specjax
from specjax._src.models.lm import Model
from specjax._src.models import loading
from tests.bigram import bigram_model, random_table
from tests.test_decode import exact_two_token_distribution, goodness_of_fit, two_token_counts
from tests.tiny_models import llama_config
from training import distill_data, draft

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory):
    """A random 2-layer Llama with the embedded tokenizer and a chat template, on disk."""
    embedded = specjax.load("embedded-target")
    cfg = llama_config(vocab_size=embedded.vocab_size, eos_token_id=2, eos_token_ids=(2,), max_position_embeddings=256)
    params = specjax.Decoder(cfg).init(jax.random.key(3))
    params["lm_head"] = params["lm_head"] * 40.0  # peaked, so answers are not uniform noise
    path = tmp_path_factory.mktemp("target") / "t"
    loading.export_hf(Model(params, specjax.Decoder(cfg), embedded.tokenizer, chat_template=TEMPLATE), str(path))
    return str(path)


def test_rows_align_teacher_with_answer_tokens():
    shards = {
        "tokens": np.array([[5, 6, 7, 0, 10, 11, 12, 13]], np.int32),  # prompt width 4, 4 new tokens
        "prompt_lengths": np.array([3], np.int32),
        "answer_lengths": np.array([3], np.int32),
        "top_ids": np.array([[[10, 9], [11, 4], [12, 2], [0, 1]]], np.int32),
        "top_logprobs": np.log(np.array([[[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [1, 1e-9]]])).astype(np.float16),
    }
    head = draft.head_vocabulary(shards, 5, 20, always=(2,))
    assert 2 in head and {10, 11, 12} <= set(head.tolist())
    rows = draft.build_rows(shards, head, seq_len=8, vocab_size=20)
    to_head = {t: i for i, t in enumerate(head.tolist())}
    assert rows["tokens"][0].tolist() == [5, 6, 7, 10, 11, 12, 0, 0]
    assert rows["mask"][0].tolist() == [False, False, True, True, True, False, False, False]
    # position 2 (last prompt token) predicts answer token 0 (= 10), etc.
    for pos, tok in [(2, 10), (3, 11), (4, 12)]:
        assert rows["tokens"][0, pos + 1] == tok
        assert rows["teacher_ids"][0, pos, 0] == to_head[tok]
    assert rows["teacher_ids"][0, 3, 1] == (to_head[4] if 4 in to_head else -1)


def _run(target, out, *extra):
    args = ["--target", target, "--out", str(out), "--prompts", "6", "--gather-batch", "3", "--new-tokens", "8",
            "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--mlp", "64",
            "--head-vocab", "48", "--steps", "6", "--batch", "2", "--seq-len", "96", "--heldout-rows", "2",
            "--lr", "1e-2", "--no-progress", *extra]
    assert draft.main(args) == 0


def test_gather_resumes_shard_by_shard(tiny_chat_target, tmp_path):
    target = specjax.load(tiny_chat_target)
    prompts = ["What is rain?", "Name a color.", "Say hi.", "Count to 3."]
    distill_data.gather(target, prompts, tmp_path / "a", batch_size=2, new_tokens=6, log=lambda m: None)
    first = dict(np.load(tmp_path / "a" / "shard_00001.npz"))
    (tmp_path / "a" / "shard_00001.npz").unlink()
    distill_data.gather(target, prompts, tmp_path / "a", batch_size=2, new_tokens=6, log=lambda m: None)
    again = dict(np.load(tmp_path / "a" / "shard_00001.npz"))
    for k in first:
        np.testing.assert_array_equal(first[k], again[k], err_msg=k)
    rows = distill_data.load_shards(tmp_path / "a")
    assert rows["tokens"].shape[0] == 4 and rows["top_ids"].shape[1:] == (6, 32)
    # greedy rows follow the target's own top-1
    greedy = rows["temperatures"] == 0
    width = rows["tokens"].shape[1] - 6
    for i in np.nonzero(greedy)[0]:
        n = rows["answer_lengths"][i]
        np.testing.assert_array_equal(rows["tokens"][i, width:width + n], rows["top_ids"][i, :n, 0])


def test_shards_of_longer_prompts_load_beside_shorter_ones(tiny_chat_target, tmp_path):
    # A gather pads its prompts to its own longest, so two gathers into one directory
    # (the shipped answers, then self-written requests) can differ in width.
    target = specjax.load(tiny_chat_target)
    quiet = dict(batch_size=2, new_tokens=6, log=lambda m: None)
    short, long = ["Say hi.", "Name a color."], ["Tell me a long story about a dragon who guards old maps and books."]
    for d, first_shard, prompts in (("a", 0, short), ("b", 100, long)):
        distill_data.gather(target, prompts, tmp_path / d, first_shard=first_shard, **quiet)
        distill_data.gather(target, prompts, tmp_path / "both", first_shard=first_shard, **quiet)
    a, b = (distill_data.load_shards(tmp_path / d) for d in "ab")
    assert a["tokens"].shape[1] < b["tokens"].shape[1]
    both = distill_data.load_shards(tmp_path / "both")
    head_ids = np.arange(target.module.config.vocab_size, dtype=np.int32)
    rows = lambda s: draft.build_rows(s, head_ids, 64, target.module.config.vocab_size)  # noqa: E731
    alone, together = [rows(a), rows(b)], rows(both)
    for k in together:
        np.testing.assert_array_equal(together[k], np.concatenate([r[k] for r in alone]), err_msg=k)
    distill_data.gather(target, short, tmp_path / "both", first_shard=200, **{**quiet, "new_tokens": 5})
    with pytest.raises(ValueError, match="different answer lengths"):
        distill_data.load_shards(tmp_path / "both")


def test_a_second_gather_pass_adds_shards_at_other_temperatures(tiny_chat_target, tmp_path):
    target = specjax.load(tiny_chat_target)
    prompts = ["What is rain?", "Name a color.", "Say hi.", "Count to 3."]
    quiet = dict(batch_size=2, new_tokens=6, log=lambda m: None)
    distill_data.gather(target, prompts, tmp_path, **quiet)
    first = {f.name: f.read_bytes() for f in tmp_path.glob("shard_*.npz")}
    distill_data.gather(target, prompts, tmp_path, pass_index=1, **quiet)
    names = sorted(f.name for f in tmp_path.glob("shard_*.npz"))
    assert names == [f"shard_{i:05d}.npz" for i in range(4)]
    for name, data in first.items():  # pass 0 untouched
        assert (tmp_path / name).read_bytes() == data
    rows = distill_data.load_shards(tmp_path)
    np.testing.assert_array_equal(rows["prompt_index"], [0, 1, 2, 3, 0, 1, 2, 3])
    cycle = distill_data.TEMPERATURE_CYCLE
    np.testing.assert_allclose(rows["temperatures"][:4], [cycle[i % 3] for i in range(4)])
    np.testing.assert_allclose(rows["temperatures"][4:], [cycle[(i + 1) % 3] for i in range(4)])
    # a pass counts its shards on the whole prompt list, so a limit never shifts it
    distill_data.gather(target, prompts, tmp_path / "b", max_prompts=2, pass_index=1, **quiet)
    assert [f.name for f in (tmp_path / "b").glob("shard_*.npz")] == ["shard_00002.npz"]
    with pytest.raises(ValueError, match="pass_index"):
        distill_data.gather(target, prompts, tmp_path / "c", pass_index=-1, **quiet)
    # pass 3 would answer prompts 0 and 3 greedily again, as pass 0 did: it samples them near greedy
    distill_data.gather(target, prompts, tmp_path / "d", pass_index=3, **quiet)
    temps = distill_data.load_shards(tmp_path / "d")["temperatures"]
    near = distill_data.NEAR_GREEDY_TEMPERATURE
    np.testing.assert_allclose(temps, [near, cycle[1], cycle[2], near])
    assert 0 < near < min(t for t in cycle if t > 0)


def test_held_out_prompts_stay_out_of_training_in_every_gather_pass(tiny_chat_target, tmp_path):
    _run(tiny_chat_target, tmp_path, "--gather-only")
    _run(tiny_chat_target, tmp_path, "--gather-only", "--gather-pass", "1")
    _run(tiny_chat_target, tmp_path, "--train-only")
    log = (tmp_path / "log.txt").read_text()
    # 6 prompts answered twice; the last 2 rows' prompts are held out in both passes
    assert "8 train rows" in log and "4 held-out rows" in log, log
    with pytest.raises(SystemExit):
        _run(tiny_chat_target, tmp_path, "--gather-only", "--gather-pass", "-1")


def test_interrupted_training_resumes_to_the_same_draft(tiny_chat_target, tmp_path):
    _run(tiny_chat_target, tmp_path / "full", "--train-only")
    (tmp_path / "cut").mkdir()
    # the same gathered data, then a run killed after 3 steps and resumed
    import shutil

    shutil.copytree(tmp_path / "full" / "data", tmp_path / "cut" / "data")
    _run(tiny_chat_target, tmp_path / "cut", "--stop-after", "3")
    _run(tiny_chat_target, tmp_path / "cut", "--train-only")
    from training import common

    states = []
    for run in ("full", "cut"):
        ckpt = common.Checkpointer(tmp_path / run / "ckpt")
        step = ckpt.latest_step()
        assert step == 6
        raw = ckpt._manager.restore(step)
        states.append(jax.tree.leaves(raw["state"]["params"]))
        ckpt.close()
    for a, b in zip(*states):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_exported_draft_is_lossless_with_its_target(tiny_chat_target, tmp_path):
    _run(tiny_chat_target, tmp_path, "--export", str(tmp_path / "draft"), "--eval-prompts", "2",
         "--eval-new-tokens", "6")
    d = specjax.load(tmp_path / "draft")
    cfg = d.module.config
    assert cfg.head_vocab_size == 48 and d.params["head_vocab_ids"].dtype == np.int32
    assert d.chat_template == TEMPLATE
    card = (tmp_path / "draft" / "MODEL_CARD.md").read_text()
    assert "c_draft / c_AR" in card and "python -m training.draft" in card
    log = json.loads((tmp_path / "draft" / "train_log.json").read_text())
    assert log["summary"]["steps"] == 6
    # the draft never proposes a token outside its head vocabulary ...
    logits = np.asarray(specjax.logits(d, [[5, 6, 7, 8]]))
    outside = np.setdiff1d(np.arange(cfg.vocab_size), np.asarray(d.params["head_vocab_ids"]))
    assert np.isneginf(logits[..., outside]).all()
    # ... and greedy speculative decoding still equals the target's greedy output
    target = specjax.load(tiny_chat_target)
    prompts = [specjax.encode_chat(target, p) for p in ["What is rain?", "Tell me a joke.", "2 + 2?"]]
    ref = specjax.generate(target, prompts, max_new_tokens=12, temperature=0.0)
    out = specjax.decode(specjax.pair(target, d), prompts, num_draft=3, max_new_tokens=12, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))


def test_lossless_sampling_with_a_draft_that_never_proposes_some_tokens():
    """A reduced head gives q = 0 off its vocabulary; the residual must cover those tokens."""
    vocab = 8  # two_token_counts' vocabulary
    target_table = random_table(0, vocab)
    draft_table = random_table(1, vocab)
    draft_table[:, [0, 4, 7]] = -np.inf  # tokens the draft can never propose
    pair = specjax.pair(bigram_model(target_table), bigram_model(draft_table))
    expected = exact_two_token_distribution(target_table, 3, 1.0, None, None)
    counts = two_token_counts(pair, rule=specjax.rules.speculative_sampling(), num_draft=3, temperature=1.0,
                              top_k=None, top_p=None)
    pvalue, tv = goodness_of_fit(counts, expected)
    assert pvalue > 1e-3 and tv < 0.03, (pvalue, tv)
    assert counts[[0, 4, 7]].sum() > 0  # the target still emits them


def test_training_continues_from_an_exported_draft(tiny_chat_target, tmp_path, quick_evaluation):
    # The export's real acceptance and timing run in test_exported_draft_is_lossless_with_its_target;
    # here only what --init-from reads of an export matters.
    _run(tiny_chat_target, tmp_path / "a", "--export", str(tmp_path / "a_draft"), "--eval-prompts", "1",
         "--eval-new-tokens", "4")
    first = specjax.load(tmp_path / "a_draft", dtype="float32")
    import shutil

    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "data", tmp_path / "b" / "data")
    # a different --head-vocab is overridden by the exported draft's own layout and vocabulary
    _run(tiny_chat_target, tmp_path / "b", "--init-from", str(tmp_path / "a_draft"), "--head-vocab", "40",
         "--export", str(tmp_path / "b_draft"), "--eval-prompts", "1", "--eval-new-tokens", "4")
    second = specjax.load(tmp_path / "b_draft", dtype="float32")
    np.testing.assert_array_equal(np.asarray(second.params["head_vocab_ids"]), np.asarray(first.params["head_vocab_ids"]))
    assert second.module.config == first.module.config
    assert not np.allclose(np.asarray(second.params["lm_head"]), np.asarray(first.params["lm_head"]))


def test_packed_answers_rebuild_the_gathered_shards(tiny_chat_target, tmp_path):
    target = specjax.load(tiny_chat_target)
    prompts = ["What is rain?", "Name a color.", "Say hi.", "Count to 3.", "Why is the sky blue?"]
    distill_data.gather(target, prompts, tmp_path / "a", batch_size=2, new_tokens=6, pass_index=1,
                        log=lambda m: None)
    summary = distill_data.pack_answers(tmp_path / "a", tmp_path / "answers.npz")
    assert summary["rows"] == 5 and summary["shards"] == 3
    with pytest.raises(FileExistsError, match="force"):
        distill_data.pack_answers(tmp_path / "a", tmp_path / "answers.npz")
    assert distill_data.unpack_answers(target, tmp_path / "answers.npz", tmp_path / "b", batch_size=2,
                                       log=lambda m: None) == 3
    names = sorted(f.name for f in (tmp_path / "b").glob("shard_*.npz"))
    assert names == sorted(f.name for f in (tmp_path / "a").glob("shard_*.npz")) == [
        "shard_00003.npz", "shard_00004.npz", "shard_00005.npz"]
    for name in names:
        a, b = dict(np.load(tmp_path / "a" / name)), dict(np.load(tmp_path / "b" / name))
        for k in ("tokens", "prompt_lengths", "answer_lengths", "temperatures", "prompt_index"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{name}: {k}")
        # the recomputed distributions over the answer tokens (what training reads)
        for i, n in enumerate(a["answer_lengths"]):
            np.testing.assert_array_equal(a["top_ids"][i, :n, :4], b["top_ids"][i, :n, :4], err_msg=name)
            np.testing.assert_allclose(a["top_logprobs"][i, :n].astype(np.float32),
                                       b["top_logprobs"][i, :n].astype(np.float32), atol=2e-2, err_msg=name)
    # resumable: an existing shard is kept, a missing one rebuilt
    (tmp_path / "b" / names[0]).unlink()
    assert distill_data.unpack_answers(target, tmp_path / "answers.npz", tmp_path / "b", batch_size=2,
                                       log=lambda m: None) == 1


def test_packed_answers_refuse_another_vocabulary(tmp_path):
    np.savez(tmp_path / "x.npz", format=np.int32(distill_data.ANSWERS_FORMAT),
             token_ids=np.array([5, 70000], np.int32), shards=np.zeros((0, 4), np.int32),
             shard=np.zeros(1, np.int32), prompt_lengths=np.ones(1, np.int32), answer_lengths=np.ones(1, np.int32),
             temperatures=np.zeros(1, np.float32), prompt_index=np.zeros(1, np.int32))
    target = specjax.testing.bigram_model(specjax.testing.random_table(0, 64))
    with pytest.raises(ValueError, match="vocabulary"):
        distill_data.unpack_answers(target, tmp_path / "x.npz", tmp_path / "out", log=lambda m: None)


def test_cli_packs_answers_and_rebuilds_a_run_from_them(tiny_chat_target, tmp_path):
    packed = tmp_path / "answers.npz"
    _run(tiny_chat_target, tmp_path / "a", "--gather-only", "--pack-answers", str(packed))
    with pytest.raises(SystemExit, match="force"):
        _run(tiny_chat_target, tmp_path / "a", "--gather-only", "--pack-answers", str(packed))
    _run(tiny_chat_target, tmp_path / "b", "--gather-only", "--answers-from", str(packed))
    with pytest.raises(SystemExit, match="--answers-from .*missing.npz"):
        _run(tiny_chat_target, tmp_path / "c", "--gather-only", "--answers-from", str(tmp_path / "missing.npz"))
    a, b = (distill_data.load_shards(tmp_path / d / "data") for d in "ab")
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["prompt_index"], b["prompt_index"])


@pytest.fixture
def other_vocab_draft(tmp_path):
    """A reduced-head draft exported for a 96-token vocabulary (another target)."""
    cfg = llama_config(num_layers=1, head_vocab_size=16, num_heads=2, num_kv_heads=1, head_dim=16)
    params = specjax.Decoder(cfg).init(jax.random.key(0))
    params["head_vocab_ids"] = np.arange(16, dtype=np.int32)
    path = tmp_path / "other_vocab_draft"
    loading.export_hf(Model(params, specjax.Decoder(cfg)), str(path))
    return str(path)


@pytest.mark.parametrize("flags, message", [
    (["--hidden", "48"], "--hidden 48 is wider than the target's hidden size 32"),
    (["--head-vocab", "24"], "--head-vocab 24 is smaller than --hidden 32"),
    (["--head-vocab", "5000"], "--head-vocab 5000 is more than the target's 2048-token"),
    (["--init-from", "TARGET"], "--init-from .*/t is not a draft made by python -m training.draft"),
    (["--init-from", "OTHER"], "--init-from .*other_vocab_draft has a 96-token vocabulary, the target .* 2048"),
])
def test_bad_model_flags_are_refused_before_gathering(tiny_chat_target, other_vocab_draft, tmp_path, flags, message):
    flags = [{"TARGET": tiny_chat_target, "OTHER": other_vocab_draft}.get(f, f) for f in flags]
    with pytest.raises(SystemExit, match="^error: " + message):
        _run(tiny_chat_target, tmp_path / "run", *flags)
    assert not (tmp_path / "run" / "data").exists()


@pytest.fixture
def quick_evaluation(monkeypatch):
    """Stand-ins for the export's acceptance and timing measurements (not under test here)."""
    def acceptance(target, d, prompts, *, num_draft, max_new_tokens, temperature, **kw):
        return {"acceptance_rate": 0.5, "accepted_per_drafted": 0.5, "first_position": 0.5, "tau": 2.0,
                "prompts": len(prompts), "num_draft": num_draft, "temperature": temperature,
                "max_new_tokens": max_new_tokens}

    costs = {"c_ar_ms": 1.0, "c_draft_ms": 0.1, "c_verify_ms": 1.2, "c_draft/c_ar": 0.1, "c_verify/c_ar": 1.2}
    monkeypatch.setattr(draft, "measure_acceptance", acceptance)
    monkeypatch.setattr(draft, "forward_costs", lambda *a, **k: costs)
    return acceptance


def test_an_interrupted_export_continues_with_the_same_command(tiny_chat_target, tmp_path, monkeypatch,
                                                               quick_evaluation):
    dest = tmp_path / "draft"
    command = (tiny_chat_target, tmp_path / "run", "--export", str(dest), "--eval-prompts", "1")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(draft, "measure_acceptance", interrupted)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C during the evaluation: no export without its card
        _run(*command)
    assert not dest.exists()
    monkeypatch.setattr(draft, "measure_acceptance", quick_evaluation)
    _run(*command)
    assert {"MODEL_CARD.md", "train_log.json", "model.safetensors"} <= {p.name for p in dest.iterdir()}
    # Stopped after the swap or run again: this run's own export by this command needs no --force ...
    _run(*command)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "run"]  # no temporary left
    # ... another run's does, refused before it gathers
    with pytest.raises(SystemExit, match="exists and is not empty; pass --force"):
        _run(tiny_chat_target, tmp_path / "other", "--export", str(dest), "--eval-prompts", "1")
    assert not (tmp_path / "other" / "data").exists()


def test_a_forced_export_keeps_the_files_it_does_not_write(tiny_chat_target, tmp_path, quick_evaluation):
    dest = tmp_path / "draft"
    dest.mkdir()
    (dest / "NOTES.md").write_text("hand-written\n")
    (dest / "train_log_session1.json").write_text("{}")
    (dest / "model.safetensors.index.json").write_text("{}")  # the old model's weights go with it
    with pytest.raises(SystemExit, match="pass --force"):
        _run(tiny_chat_target, tmp_path / "run", "--export", str(dest), "--eval-prompts", "1")
    assert not (tmp_path / "run" / "data").exists()
    _run(tiny_chat_target, tmp_path / "run", "--export", str(dest), "--eval-prompts", "1", "--force")
    assert (dest / "NOTES.md").read_text() == "hand-written\n"
    assert (dest / "train_log_session1.json").read_text() == "{}"
    assert not (dest / "model.safetensors.index.json").exists()
    assert specjax.load(dest).module.config.head_vocab_size == 48
    assert "kept from the replaced" in (tmp_path / "run" / "log.txt").read_text()


def test_self_written_prompts_keep_finished_new_requests_of_enough_words(tiny_chat_target, monkeypatch):
    target = specjax.load(tiny_chat_target)
    tok = target.tokenizer
    words = lambda text: tok.encode(text).ids  # noqa: E731
    eos = 2
    a, b, short, excluded, e = (words(t) for t in ("x = 1 + 2", "y = 3 * 4", "1", "z = 5 - 6", "w = 7 + 8"))
    batches = iter([
        [a + [eos], a + [eos], b, short + [eos], excluded + [eos]],  # a twice; b cut off; short; excluded
        [e + [eos], [eos]],                                            # e; an empty request
    ])
    calls = []

    def fake_generate(model, prompts, *, max_new_tokens, temperature, eos_token_id, key):
        calls.append(prompts[0])
        rows = next(batches)
        width = max(map(len, rows))
        tokens = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        return type("Out", (), {"tokens": tokens, "lengths": np.asarray([len(r) for r in rows])})

    monkeypatch.setattr(distill_data, "generate", fake_generate)
    got = distill_data.self_written_prompts(target, 2, exclude=[tok.decode(excluded).strip()], log=lambda m: None)
    assert got == [tok.decode(a).strip(), tok.decode(e).strip()]
    prefix = specjax.render_chat(target, [{"role": "user", "content": "Q"}]).split("Q")[0]
    assert calls[0] == tok.encode(prefix).ids  # the template up to the user's message


def test_self_written_prompts_say_when_the_target_cannot_write_them(tiny_chat_target, monkeypatch):
    target = specjax.load(tiny_chat_target)
    cut_off = type("Out", (), {"tokens": np.full((4, 8), 7, np.int32), "lengths": np.full((4,), 8)})
    monkeypatch.setattr(distill_data, "generate", lambda *a, **k: cut_off)
    with pytest.raises(ValueError, match="no new usable request in 20 batches"):
        distill_data.self_written_prompts(target, 3, log=lambda m: None)
    monkeypatch.setattr(distill_data, "render_chat", lambda model, messages: "<assistant>")
    with pytest.raises(ValueError, match="does not show the user's message"):
        distill_data.self_written_prompts(target, 3, log=lambda m: None)


def test_first_shard_numbers_a_gather_apart(tiny_chat_target, tmp_path):
    target = specjax.load(tiny_chat_target)
    distill_data.gather(target, ["Say hi.", "Count to 3.", "Hello!"], tmp_path, batch_size=2, new_tokens=4,
                        first_shard=distill_data.SELF_WRITTEN_SHARDS, log=lambda m: None)
    names = sorted(p.name for p in tmp_path.glob("shard_*.npz"))
    assert names == [f"shard_{distill_data.SELF_WRITTEN_SHARDS + i:05d}.npz" for i in range(2)]
    assert distill_data.load_shards(tmp_path)["tokens"].shape[0] == 3


def test_a_gather_refuses_shards_numbered_for_another_batch_size(tiny_chat_target, tmp_path):
    """Shard numbers follow the batch size: a gather resumed with another one would take shards of
    other prompts as its own. It stops, naming the shard, and leaves the data as it was."""
    target = specjax.load(tiny_chat_target)
    prompts = ["Say hi.", "Count to 3.", "Hello!", "Name a color."]
    distill_data.gather(target, prompts, tmp_path, batch_size=2, new_tokens=4, log=lambda m: None)
    before = sorted(p.name for p in tmp_path.glob("shard_*.npz"))
    with pytest.raises(ValueError, match="shard_00000.npz holds answers to prompts 0-1, not to prompts 0-2"):
        distill_data.gather(target, prompts, tmp_path, batch_size=3, new_tokens=4, log=lambda m: None)
    assert sorted(p.name for p in tmp_path.glob("shard_*.npz")) == before
    assert distill_data.gather(target, prompts, tmp_path, batch_size=2, new_tokens=4, log=lambda m: None) == 4
