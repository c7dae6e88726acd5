"""training.eagle: target features per shard (resumable), the unrolled head's
attention equals cached drafting, training lowers the loss and resumes to the
same params, export refuses to overwrite and reloads to the same logits."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax._src.models.lm import Model
from specjax._src.models import feature_head, feature_head_build, loading
from specjax.testing import llama_config
from training import common, distill_data, draft, eagle, eagle_head

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
SEQ = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama target on disk (embedded tokenizer, chat template) and
    two distill_data shards of its answers (3 prompts each, 8 new tokens)."""
    embedded = specjax.load("embedded-target")
    cfg = llama_config(vocab_size=embedded.vocab_size, eos_token_id=2, eos_token_ids=(2,),
                       max_position_embeddings=256)
    params = specjax.Decoder(cfg).init(jax.random.key(3))
    params["lm_head"] = params["lm_head"] * 40.0  # peaked, so answers are not uniform noise
    root = tmp_path_factory.mktemp("eagle")
    path = root / "target"
    loading.export_hf(Model(params, specjax.Decoder(cfg), embedded.tokenizer, chat_template=TEMPLATE), str(path))
    target = specjax.load(path)
    prompts = ["What is rain?", "Name a color.", "Say hi.", "Count to 3.", "Why is the sky blue?", "Hello!"]
    distill_data.gather(target, prompts, root / "data", batch_size=3, new_tokens=8, log=lambda m: None)
    return str(path), root / "data"


def _args(target, data, out, *extra):
    return ["--target", target, "--data", str(data), "--out", str(out), "--head-vocab-from", "",
            "--head-vocab", "48", "--seq-len", str(SEQ), "--feature-batch", "2", "--steps", "6", "--batch", "2",
            "--lr", "1e-2", "--eval-prompts", "2", "--eval-new-tokens", "6", "--eval-batch", "2",
            "--eval-every", "3", "--no-progress", *extra]


def _head_ids(data, vocab):
    return draft.head_vocabulary(distill_data.load_shards(data), 48, vocab, (2,))


def test_features_are_the_targets_last_block_and_resume(tiny, tmp_path):
    target_path, data = tiny
    target = specjax.load(target_path)
    files = sorted(data.glob("shard_*.npz"))
    ids = _head_ids(data, target.vocab_size)
    assert eagle.extract_features(target, files, tmp_path, ids, seq_len=SEQ, batch=2, log=lambda m: None) == 2
    rows = eagle.load_rows(files, tmp_path, ids, SEQ, target.vocab_size)
    h = target.module.config.hidden_size
    assert rows["features"].shape == (6, SEQ, h) and rows["features"].dtype == jnp.bfloat16
    want = target.module.apply(target.params, jnp.asarray(rows["tokens"]), hidden_layers=(-1,)).hidden[0]
    np.testing.assert_allclose(np.asarray(rows["features"], np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
    # the prompt and the answer are contiguous (no padding between them)
    shard = dict(np.load(files[0]))
    p, a = int(shard["prompt_lengths"][0]), int(shard["answer_lengths"][0])
    width = shard["tokens"].shape[1] - shard["top_ids"].shape[1]
    np.testing.assert_array_equal(rows["tokens"][0, p:p + a], shard["tokens"][0, width:width + a])
    stamp = (tmp_path / files[0].name).stat().st_mtime_ns
    assert eagle.extract_features(target, files, tmp_path, ids, seq_len=SEQ, batch=2, log=lambda m: None) == 0
    assert (tmp_path / files[0].name).stat().st_mtime_ns == stamp


def _tiny_head(target_path, data):
    target = specjax.load(target_path)
    ids = _head_ids(data, target.vocab_size)
    head = feature_head_build.init_from_target(target, jax.random.key(0), ids)
    # perturb, so that the head is not the target's top and the steps differ
    params = dict(head.params)
    params["fuse"] = {"kernel": params["fuse"]["kernel"] + 0.05 * jax.random.normal(
        jax.random.key(1), params["fuse"]["kernel"].shape)}
    return target, head.replace(params=params), ids


def test_unrolled_steps_attend_as_cached_drafting(tiny):
    target, head, ids = _tiny_head(*tiny)
    cfg = head.module.config
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 3, cfg.vocab_size)
    feats = target.module.apply(target.params, tokens, hidden_layers=(-1,)).hidden[0]
    # Both sides jitted: op by op, every primitive was dispatched (and compiled) for each prefix width.
    apply = jax.jit(head.module.apply)
    outs = jax.jit(eagle_head.make_unrolled(cfg, 3))(head.params, tokens, feats)
    full = apply(head.params, tokens, features=feats)
    # step 1 = the plain forward; the reduced logits are its columns at head_vocab_ids
    np.testing.assert_allclose(np.asarray(outs[0][0]), np.asarray(full.logits[..., ids]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(outs[0][1]), np.asarray(full.hidden[0]), rtol=1e-4, atol=1e-4)
    for j in (3, 7, 11):
        # drafting with a cache: the prefix with the target's features, then the head's own
        cache = head.module.init_cache(2, 32)
        out = apply(head.params, tokens[:, :j - 1], cache, features=feats[:, :j - 1])
        f, cache = out.hidden[0][:, -1:], out.cache
        for step in (2, 3):
            pos = j - 3 + step  # chain started at j - 2: step 2 at j - 1, step 3 at j
            out = apply(head.params, tokens[:, pos:pos + 1], cache, features=f)
            np.testing.assert_allclose(np.asarray(outs[step - 1][0][:, pos]), np.asarray(out.logits[:, 0, ids]),
                                       rtol=1e-4, atol=1e-4, err_msg=f"step {step} at {pos}")
            f, cache = out.hidden[0], out.cache
        del f


def test_training_lowers_the_loss(tiny, tmp_path):
    target_path, data = tiny
    target, head, ids = _tiny_head(target_path, data)
    files = sorted(data.glob("shard_*.npz"))
    eagle.extract_features(target, files, tmp_path, ids, seq_len=SEQ, batch=2, log=lambda m: None)
    rows = eagle.load_rows(files, tmp_path, ids, SEQ, target.vocab_size)
    trainable, frozen = eagle.split_params(head.params)
    assert set(frozen) == {"embed", "head_vocab_ids"}
    loss_fn = eagle.make_loss(head.module.config, unroll=2, reg_weight=1.0)
    opt = common.adamw(3e-3, 30, warmup_steps=2, weight_decay=0.0)
    step = common.make_train_step(loss_fn, opt)
    state = common.init_state(trainable, opt)
    batch = {**{k: jnp.asarray(v) for k, v in rows.items()}, "frozen": frozen}
    first, aux = jax.jit(loss_fn)(trainable, batch)
    assert {"ce_1", "ce_2", "reg", "top1_1", "top1_2"} <= set(aux)
    for _ in range(30):
        state, metrics = step(state, batch)
    last, _ = jax.jit(loss_fn)(state["params"], batch)
    assert float(last) < 0.7 * float(first), (float(first), float(last))
    # the frozen table is never part of what is trained
    assert "embed" not in state["params"] and "head_vocab_ids" not in state["params"]


def test_interrupted_training_resumes_and_the_export_reloads(tiny, tmp_path):
    """An uninterrupted run (exported), and one killed after 4 steps then resumed by the
    same command: the same params at step 6. The export refuses to be overwritten by another run,
    reloads with specjax.load and, given the target's table, gives the trained logits."""
    target_path, data = tiny
    dest = tmp_path / "head"
    assert eagle.main(_args(target_path, data, tmp_path / "full", "--export", str(dest))) == 0
    (tmp_path / "cut").mkdir()
    for d in ("features", "heldout"):
        shutil.copytree(tmp_path / "full" / d, tmp_path / "cut" / d)
    assert eagle.main(_args(target_path, data, tmp_path / "cut", "--stop-after", "4", "--checkpoint-seconds", "0",
                            "--eval-every", "0")) == 0
    assert eagle.main(_args(target_path, data, tmp_path / "cut", "--train-only", "--eval-every", "0")) == 0
    assert "resumed at step 4" in (tmp_path / "cut" / "log.txt").read_text()
    with pytest.raises(SystemExit, match="unroll_weight: 1.0 in the checkpoint, 0.5 now"):  # it defines the loss
        eagle.main(_args(target_path, data, tmp_path / "cut", "--train-only", "--eval-every", "0",
                         "--unroll-weight", "0.5"))
    states = []
    for run in ("full", "cut"):
        ckpt = common.Checkpointer(tmp_path / run / "ckpt")
        assert ckpt.latest_step() == 6
        raw = ckpt._manager.restore(6)
        states.append(raw["state"]["params"])
        ckpt.close()
    leaves = [jax.tree.leaves(s) for s in states]
    assert len(leaves[0]) == len(leaves[1]) > 5
    for a, b in zip(*leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    assert {"config.json", "head.safetensors", "MODEL_CARD.md", "train_log.json"} <= {p.name for p in dest.iterdir()}
    log = json.loads((dest / "train_log.json").read_text())
    assert log["summary"]["steps"] == 6 and 0 <= log["summary"]["heldout"]["step1"] <= 1
    assert "python -m training.eagle" in (dest / "MODEL_CARD.md").read_text()
    meta = json.loads((dest / "config.json").read_text())[feature_head.CONFIG_KEY]
    assert meta["target"] == target_path and meta["config"]["dtype"] == "bfloat16"
    with pytest.raises(SystemExit, match="--force"):  # another run's export
        eagle.main(_args(target_path, data, tmp_path / "cut", "--export", str(dest)))
    target = specjax.load(target_path)
    loaded = specjax.load(dest)
    assert feature_head.is_feature_head(loaded.module)
    assert loaded.params["head_vocab_ids"].dtype == jnp.int32 and "embed" not in loaded.params
    paired = feature_head_build.attach_embedding(loaded, target)
    ids = np.asarray(loaded.params["head_vocab_ids"])
    init = feature_head_build.init_from_target(target, jax.random.key(0), ids)
    trained = jax.tree.map(jnp.asarray, states[0])
    assert not np.allclose(np.asarray(trained["lm_head"]), np.asarray(init.params["lm_head"]))
    ref = init.replace(params={**init.params, **trained})
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10]])
    feats = target.module.apply(target.params, tokens, hidden_layers=(-1,)).hidden[0]
    la = np.asarray(ref.module.apply(ref.params, tokens, features=feats).logits[..., ids])
    lb = np.asarray(paired.module.apply(paired.params, tokens, features=feats).logits[..., ids], np.float32)
    np.testing.assert_allclose(lb, la, rtol=0.05, atol=0.05 * np.abs(la).max())
    assert (lb.argmax(-1) == la.argmax(-1)).mean() >= 0.8


def test_a_head_grown_to_several_blocks_starts_where_it_was(tiny, tmp_path):
    """Features of blocks (0, -1) are both blocks' outputs side by side, and a
    one-block head grown to read them (with_feature_layers) has the same
    held-out agreement through the trainer's unrolled steps: training it
    starts from the trained head, not from scratch."""
    target_path, data = tiny
    target, head, ids = _tiny_head(target_path, data)
    files = sorted(data.glob("shard_*.npz"))
    h = target.module.config.hidden_size
    one, two = tmp_path / "one", tmp_path / "two"
    eagle.extract_features(target, files, one, ids, seq_len=SEQ, batch=2, log=lambda m: None)
    eagle.extract_features(target, files, two, ids, seq_len=SEQ, batch=2, layers=(0, -1), log=lambda m: None)
    rows1 = eagle.load_rows(files, one, ids, SEQ, target.vocab_size, h)
    rows2 = eagle.load_rows(files, two, ids, SEQ, target.vocab_size, 2 * h)
    assert rows2["features"].shape == (6, SEQ, 2 * h)
    want = target.module.apply(target.params, jnp.asarray(rows2["tokens"]), hidden_layers=(0, -1)).hidden
    np.testing.assert_allclose(np.asarray(rows2["features"], np.float32), np.asarray(jnp.concatenate(want, -1)),
                               rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="64-wide"):
        eagle.load_rows(files, two, ids, SEQ, target.vocab_size, h)
    grown = feature_head_build.with_feature_layers(head, (0, -1))
    cfg = head.module.config
    a = eagle.agreement(cfg, head.params, rows1)
    b = eagle.agreement(cfg, grown.params, rows2, num_feature_layers=2)
    assert a["answer_positions"] == b["answer_positions"] > 0
    for k in ("step1", "step2", "step3"):
        assert abs(a[k] - b[k]) <= 0.02, (k, a[k], b[k])
    # the loss trains reduce (the regression target is held constant)
    loss_fn = eagle.make_loss(cfg, unroll=2, reg_weight=1.0, num_feature_layers=2)
    trainable, frozen = eagle.split_params(grown.params)
    batch = {**{k: jnp.asarray(v) for k, v in rows2.items()}, "frozen": frozen}
    grads = jax.jit(jax.grad(lambda p: loss_fn(p, batch)[0]))(trainable)  # one program, not op by op
    assert float(jnp.abs(grads["reduce"]["kernel"][:h]).max()) > 0  # block 0's weights move


def test_feature_layers_on_the_command_line(tiny, tmp_path):
    target_path, data = tiny
    dest = tmp_path / "head"
    assert eagle.main(_args(target_path, data, tmp_path / "run", "--feature-layers", "0,-1", "--steps", "2",
                            "--export", str(dest))) == 0
    loaded = specjax.load(dest)
    assert loaded.module.feature_layers == (0, -1) and "reduce" in loaded.params
    assert "block outputs 0 and the last" in (dest / "MODEL_CARD.md").read_text()
    with pytest.raises(SystemExit, match="started with --feature-layers 0,-1"):
        eagle.main(_args(target_path, data, tmp_path / "run", "--feature-layers", "-1"))
    with pytest.raises(SystemExit):
        eagle.build_parser().parse_args(["--feature-layers", "0,1"])  # no -1


def test_minutes_sets_the_step_count_once_from_a_measured_step(tiny, tmp_path, monkeypatch):
    """--minutes M trains for M * 60 / (a step's seconds) steps; the count is recorded, so a
    resumed run keeps the schedule even if the machine has become faster or slower."""
    target_path, data = tiny
    target, head, ids = _tiny_head(target_path, data)
    files = sorted(data.glob("shard_*.npz"))
    eagle.extract_features(target, files, tmp_path / "f", ids, seq_len=SEQ, batch=2, log=lambda m: None)
    rows = eagle.load_rows(files, tmp_path / "f", ids, SEQ, target.vocab_size)
    trainable, frozen = eagle.split_params(head.params)
    loss_fn = eagle.make_loss(head.module.config, unroll=2, reg_weight=1.0)
    batch = {**{k: jnp.asarray(v) for k, v in rows.items()}, "frozen": frozen}
    secs = eagle.step_seconds(loss_fn, trainable, lambda step: batch, probe_steps=2)
    assert 0 < secs < 60

    monkeypatch.setattr(eagle, "step_seconds", lambda *a, **k: 0.25)
    dest, run = tmp_path / "head", tmp_path / "run"
    argv = _args(target_path, data, run, "--minutes", "0.05", "--eval-every", "0", "--export", str(dest))
    assert eagle.main(argv + ["--stop-after", "3", "--checkpoint-seconds", "0"]) == 0
    assert json.loads((run / "run.json").read_text())["steps_for_minutes"] == 12  # 3 s / 0.25 s
    assert "12 steps fit 0.05 minutes" in (run / "log.txt").read_text()
    monkeypatch.setattr(eagle, "step_seconds", lambda *a, **k: 1.0)  # not asked again
    assert eagle.main(argv) == 0
    assert json.loads((dest / "train_log.json").read_text())["summary"]["steps"] == 12
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(SystemExit):
            eagle.build_parser().parse_args(["--minutes", bad])


def test_a_draft_temperature_divides_the_logits_and_the_fit_finds_it(tiny, tmp_path):
    target_path, data = tiny
    target, head, ids = _tiny_head(target_path, data)
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10]])
    feats = target.module.apply(target.params, tokens, hidden_layers=(-1,)).hidden[0]
    plain = np.asarray(head.module.apply(head.params, tokens, features=feats).logits[..., ids])
    sharp = eagle.with_draft_temperature(head, 0.5)
    halved = np.asarray(sharp.module.apply(sharp.params, tokens, features=feats).logits[..., ids])
    np.testing.assert_allclose(halved, 2.0 * plain, rtol=1e-5, atol=1e-5)
    # A teacher whose law is the head's own at t0 = 0.8: the fit's best is t0 (ties only
    # where a sharper q still covers every top-32 id), flatter drafts lose.
    files = sorted(data.glob("shard_*.npz"))
    eagle.extract_features(target, files, tmp_path, ids, seq_len=SEQ, batch=2, log=lambda m: None)
    rows = eagle.load_rows(files, tmp_path, ids, SEQ, target.vocab_size)
    h = eagle_head.head_inputs(rows)
    (logits, _), = eagle_head._jitted_unrolled(head.module.config, 1, 1)(
        head.params, jnp.asarray(h["tokens"]), jnp.asarray(h["features"]))
    logp = np.asarray(jax.nn.log_softmax(logits / 0.8, -1))
    top = np.argsort(-logp, -1)[..., :32]
    rows["teacher_ids"][:, 1:] = top
    rows["teacher_logp"][:, 1:] = np.take_along_axis(logp, top, -1)
    t, table = eagle.fit_draft_temperature(head.module.config, head.params, rows, steps=1)
    assert table[t] == max(table.values()) and abs(table[0.8] - table[t]) < 1e-6
    assert table[1.0] < table[0.8] - 1e-3 and table[1.2] < table[1.0]


def test_draft_temperature_on_the_command_line(tiny, tmp_path):
    target_path, data = tiny
    run = tmp_path / "run"
    assert eagle.main(_args(target_path, data, run, "--steps", "2", "--export", str(tmp_path / "a"))) == 0
    assert eagle.main(_args(target_path, data, run, "--steps", "2", "--draft-temperature", "0.5",
                            "--export", str(tmp_path / "b"))) == 0  # resumes at step 2, exports again
    a, b = (specjax.load(tmp_path / d, dtype="float32") for d in ("a", "b"))
    np.testing.assert_allclose(np.asarray(b.params["final_norm"]["scale"]),
                               2.0 * np.asarray(a.params["final_norm"]["scale"]), rtol=1e-2)
    assert "divided by 0.5" in (tmp_path / "b" / "MODEL_CARD.md").read_text()
    assert eagle.main(_args(target_path, data, run, "--steps", "2", "--draft-temperature", "fit",
                            "--calibration-rows", "4", "--export", str(tmp_path / "c"))) == 0
    summary = json.loads((tmp_path / "c" / "train_log.json").read_text())["summary"]
    assert summary["draft_temperature"] in eagle_head.DRAFT_TEMPERATURES and summary["calibration_rows"] == 4
    assert "fitted by `--draft-temperature fit`" in (tmp_path / "c" / "MODEL_CARD.md").read_text()
    for bad in ("0", "-1", "hot"):
        with pytest.raises(SystemExit):
            eagle.main(_args(target_path, data, run, "--draft-temperature", bad))


def test_a_head_grown_to_more_blocks_drafts_as_before_then_trains_its_new_block(tiny, tmp_path):
    """with_num_layers adds blocks that start as the identity: the same logits and
    features, the same greedy drafts through the engine; the loss moves the new
    block's output projections at once; a head cannot shrink."""
    target_path, data = tiny
    target, head, ids = _tiny_head(target_path, data)
    grown = feature_head_build.with_num_layers(head, 3)
    assert grown.module.config.num_layers == 3 and {"layer_1", "layer_2"} <= set(grown.params)
    assert feature_head_build.with_num_layers(head, 1) is head
    with pytest.raises(ValueError, match="grow, not shrink"):
        feature_head_build.with_num_layers(grown, 2)
    tokens = jnp.asarray([[5, 6, 7, 8, 9, 10]])
    feats = target.module.apply(target.params, tokens, hidden_layers=(-1,)).hidden[0]
    a = head.module.apply(head.params, tokens, features=feats)
    b = grown.module.apply(grown.params, tokens, features=feats)
    np.testing.assert_allclose(np.asarray(b.logits[..., ids]), np.asarray(a.logits[..., ids]), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(b.hidden), np.asarray(a.hidden), rtol=1e-6, atol=1e-5)
    prompt = jnp.asarray([[5, 6, 7, 8]])
    runs = [specjax.decode(specjax.pair(target, h), prompt, max_new_tokens=12, num_draft=3, temperature=0.0)
            for h in (head, grown)]
    np.testing.assert_array_equal(np.asarray(runs[0].tokens), np.asarray(runs[1].tokens))
    np.testing.assert_array_equal(np.asarray(runs[0].stats.accepted_at), np.asarray(runs[1].stats.accepted_at))
    files = sorted(data.glob("shard_*.npz"))
    eagle.extract_features(target, files, tmp_path, ids, seq_len=SEQ, batch=2, log=lambda m: None)
    rows = eagle.load_rows(files, tmp_path, ids, SEQ, target.vocab_size)
    trainable, frozen = eagle.split_params(grown.params)
    loss_fn = eagle.make_loss(grown.module.config, unroll=2, reg_weight=1.0)
    batch = {**{k: jnp.asarray(v) for k, v in rows.items()}, "frozen": frozen}
    grads = jax.jit(jax.grad(lambda p: loss_fn(p, batch)[0]))(trainable)  # one program, not op by op
    for name in ("layer_1", "layer_2"):
        assert float(jnp.abs(grads[name]["mlp"]["down"]["kernel"]).max()) > 0
        assert float(jnp.abs(grads[name]["attn"]["o"]["kernel"]).max()) > 0


def test_layers_on_the_command_line(tiny, tmp_path):
    """--layers 2 grows an exported one-block head; the run remembers it."""
    target_path, data = tiny
    one, two = tmp_path / "one", tmp_path / "two"
    assert eagle.main(_args(target_path, data, tmp_path / "a", "--steps", "2", "--export", str(one))) == 0
    assert eagle.main(_args(target_path, data, tmp_path / "b", "--steps", "2", "--init-from", str(one),
                            "--layers", "2", "--export", str(two))) == 0
    loaded = specjax.load(two)
    assert loaded.module.config.num_layers == 2 and "layer_1" in loaded.params
    assert "two-block draft head" in (two / "MODEL_CARD.md").read_text()
    with pytest.raises(SystemExit, match="started with --layers 2"):
        eagle.main(_args(target_path, data, tmp_path / "b", "--layers", "3"))
    with pytest.raises(SystemExit, match="grow, not shrink"):
        eagle.main(_args(target_path, data, tmp_path / "c", "--init-from", str(two), "--layers", "1"))
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            eagle.build_parser().parse_args(["--layers", bad])


def test_head_vocab_narrows_an_init_from_head_to_its_most_used_ids(tiny, tmp_path):
    """--init-from with a smaller --head-vocab keeps the ids the shards use most
    (heads.with_head_vocab), says so in the card, and the run remembers them."""
    target_path, data = tiny
    wide, narrow = tmp_path / "wide", tmp_path / "narrow"
    assert eagle.main(_args(target_path, data, tmp_path / "a", "--steps", "2", "--export", str(wide))) == 0
    args = _args(target_path, data, tmp_path / "b", "--init-from", str(wide), "--export", str(narrow))
    args[args.index("--head-vocab") + 1], args[args.index("--steps") + 1] = "24", "0"  # narrowed, untrained
    assert eagle.main(args) == 0
    old = np.asarray(specjax.load(wide).params["head_vocab_ids"])
    new = np.asarray(specjax.load(narrow).params["head_vocab_ids"])
    cols = np.searchsorted(old, new)
    np.testing.assert_array_equal(np.asarray(specjax.load(narrow).params["lm_head"]),
                                  np.asarray(specjax.load(wide).params["lm_head"])[:, cols])
    shards = distill_data.load_shards(data)
    vocab = specjax.load(target_path).vocab_size
    np.testing.assert_array_equal(new, draft.head_vocabulary(shards, 24, vocab, (2,), among=old))
    assert new.size == 24 and np.isin(new, old).all() and 2 in new
    counts = np.bincount(shards["top_ids"][..., 0].ravel(), minlength=vocab)
    assert counts[new].sum() > counts[np.setdiff1d(old, new)].sum()  # the kept ids are the frequent ones
    assert "narrowed from 48 to the 24 ids" in (narrow / "MODEL_CARD.md").read_text()
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    assert run["head_vocab_ids"] == new.tolist()
    trained = tmp_path / "trained"  # narrowed, then trained: the usual card, saying where its ids came from
    args = _args(target_path, data, tmp_path / "d", "--steps", "2", "--init-from", str(wide), "--export", str(trained))
    args[args.index("--head-vocab") + 1] = "24"
    assert eagle.main(args) == 0
    card = (trained / "MODEL_CARD.md").read_text()
    assert "24 tokens, the ones of its source head's vocabulary" in card and "narrowed from 48" in card
    np.testing.assert_array_equal(np.asarray(specjax.load(trained).params["head_vocab_ids"]), new)
    for flag, bad in (("--head-vocab", "1"), ("--head-vocab", "many"), ("--steps", "-1")):
        with pytest.raises(SystemExit):
            eagle.build_parser().parse_args([flag, bad])
    grow = _args(target_path, data, tmp_path / "e", "--init-from", str(wide))
    grow[grow.index("--head-vocab") + 1] = "60"
    with pytest.raises(SystemExit, match="narrow, not grow"):
        eagle.main(grow)
    with pytest.raises(SystemExit, match="nothing to export"):
        eagle.main(_args(target_path, data, tmp_path / "c", "--steps", "0"))


def test_an_export_is_checked_first_kept_whole_and_a_forced_one_keeps_other_files(tiny, tmp_path, monkeypatch):
    target_path, data = tiny
    dest = tmp_path / "head"
    dest.mkdir()
    (dest / "train_log_session1.json").write_text("{}")
    (dest / "model.safetensors").write_text("old weights")  # the old model goes with --force
    args = _args(target_path, data, tmp_path / "a", "--steps", "2", "--eval-every", "0", "--export", str(dest))
    with pytest.raises(SystemExit, match="exists and is not empty; pass --force"):
        eagle.main(args)
    assert not (tmp_path / "a" / "features").exists()  # refused before extracting features
    measure = eagle.agreement

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(eagle, "agreement", interrupted)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C in the export's evaluation: the old directory is intact
        eagle.main(args + ["--force"])
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors", "train_log_session1.json"]
    monkeypatch.setattr(eagle, "agreement", measure)
    assert eagle.main(args + ["--force"]) == 0
    assert (dest / "train_log_session1.json").read_text() == "{}"
    assert not (dest / "model.safetensors").exists()
    assert feature_head.is_feature_head(specjax.load(dest).module)
    assert "kept from the replaced" in (tmp_path / "a" / "log.txt").read_text()
    # A new export without --force; the same command again finds this run's own export
    # (as after a stop just past the swap) and replaces it, where another command may not.
    again = _args(target_path, data, tmp_path / "a", "--steps", "2", "--eval-every", "0", "--export",
                  str(tmp_path / "b"))
    assert eagle.main(again) == 0 and eagle.main(again) == 0
    assert json.loads((tmp_path / "b" / "train_log.json").read_text())["summary"]["steps"] == 2
    with pytest.raises(SystemExit, match="pass --force"):
        eagle.main(again + ["--eval-batch", "1"])
    assert not list(tmp_path.glob("*-export"))  # no temporary left


def test_online_features_train_the_head_as_stored_ones_do(tiny, tmp_path):
    """--online-features computes each batch's target features in the step (for an
    accelerator): nothing is stored, and the trained head is the one stored features give."""
    target_path, data = tiny
    heads_ = {}
    for mode, extra in (("stored", []), ("online", ["--online-features"])):
        dest = tmp_path / f"{mode}-head"
        assert eagle.main(_args(target_path, data, tmp_path / mode, "--steps", "4", "--eval-every", "0",
                                "--export", str(dest), *extra)) == 0
        heads_[mode] = specjax.load(dest, dtype="float32")
    assert (tmp_path / "stored" / "features").is_dir() and not (tmp_path / "online" / "features").exists()
    stored, online = (jax.tree.leaves(heads_[m].params) for m in ("stored", "online"))
    target = specjax.load(target_path)
    init = feature_head_build.init_from_target(target, jax.random.key(0), _head_ids(data, target.vocab_size))
    moved = {k: not np.allclose(np.asarray(heads_["stored"].params[k]["kernel"], np.float32),
                                np.asarray(init.params[k]["kernel"], np.float32), atol=1e-3) for k in ("fuse",)}
    assert all(moved.values())  # the comparison below is between trained heads
    for a, b in zip(stored, online):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0, atol=1e-6)
    assert "features computed in each step" in (tmp_path / "online-head" / "MODEL_CARD.md").read_text()


def test_a_time_limit_stops_training_and_the_export_says_so(tiny, tmp_path):
    target_path, data = tiny
    dest, run = tmp_path / "head", tmp_path / "run"
    assert eagle.main(_args(target_path, data, run, "--eval-every", "0", "--time-limit", "0.0001",
                            "--export", str(dest))) == 0
    assert "time limit reached: stopped at step 0 of 6" in (run / "log.txt").read_text()
    summary = json.loads((dest / "train_log.json").read_text())["summary"]
    assert summary["steps"] == 0 and summary["planned_steps"] == 6
    assert "0 (of 6 planned: the time limit came first)" in (dest / "MODEL_CARD.md").read_text()
    for bad in ("0", "-2", "inf", "later"):
        with pytest.raises(SystemExit):
            eagle.build_parser().parse_args(["--time-limit", bad])


def test_weights_format_int8_exports_a_smaller_head_that_loads_int8(tiny, tmp_path):
    target_path, data = tiny
    wide, small = tmp_path / "wide", tmp_path / "int8"
    assert eagle.main(_args(target_path, data, tmp_path / "a", "--steps", "2", "--export", str(wide))) == 0
    args = _args(target_path, data, tmp_path / "b", "--init-from", str(wide), "--export", str(small),
                 "--weights-format", "int8")
    args[args.index("--steps") + 1] = "0"
    assert eagle.main(args) == 0
    assert json.loads((small / "config.json").read_text())[feature_head.CONFIG_KEY]["weights_format"] == "int8"
    assert "int8 (a float16 scale per output channel) safetensors" in (small / "MODEL_CARD.md").read_text()
    assert (small / "head.safetensors").stat().st_size < 0.8 * (wide / "head.safetensors").stat().st_size
    a = np.asarray(specjax.load(wide, dtype="float32").params["lm_head"])
    loaded = specjax.load(small, dtype="float32")
    assert loaded.module.config.quantization == "int8"
    b = np.asarray(specjax.dequantize(loaded).params["lm_head"])
    step = np.abs(a).max(axis=0) / 127  # a scale per output channel (one vocabulary id)
    assert np.all(np.abs(a - b) <= step * 0.51 + 1e-6) and not np.array_equal(a, b)
    with pytest.raises(SystemExit):
        eagle.build_parser().parse_args(["--weights-format", "q4"])


def _eagle3_variant_head(target_path, dest):
    """A head in the published EAGLE-3 block layout (saved by save_head), for --init-from."""
    target = specjax.load(target_path)
    cfg = feature_head_build.head_config(target.module.config, head_vocab_size=48)
    params = feature_head._init_params(cfg, jax.random.key(0), 2, "eagle3")
    params["head_vocab_ids"] = np.arange(48, dtype=np.int32)
    module = feature_head.FeatureHead(cfg, feature_layers=(0, -1), variant="eagle3")
    feature_head.save_head(Model(params, module, None, chat_template=None), str(dest))
    return str(dest)


def test_bad_arguments_are_refused_by_name_before_any_work(tiny, tmp_path, capsys):
    """Each bad value stops the command with an argparse error naming it (no traceback from JAX or
    NumPy), and a refused --feature-layers is not recorded: the corrected command then runs."""
    target_path, data = tiny
    published = _eagle3_variant_head(target_path, tmp_path / "e3")
    cases = [
        (["--batch", "0"], "--batch: expected a batch size"),
        (["--feature-batch", "0"], "--feature-batch: expected a batch size"),
        (["--unroll", "0"], "--unroll: expected a number of draft steps"),
        (["--lr", "-1"], "--lr: expected a learning rate"),
        (["--seq-len", "12"], "leaves no room for an answer"),
        (["--head-vocab", "100000"], "more than the target's"),
        (["--feature-layers=50,-1"], "the target has 2 blocks (indices -2 .. 1); [50]"),
        (["--feature-layers=1,-1"], "name one of the target's 2 blocks twice"),
        (["--init-from", str(tmp_path / "missing")], "--init-from"),
        (["--init-from", target_path, "--steps", "0"], "holds a Decoder"),
        (["--init-from", published, "--steps", "0"], "holds a published 'eagle3' head"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as e:
            eagle.main(_args(target_path, data, tmp_path / "run", *extra))
        assert e.value.code == 2, extra
        assert message in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        eagle.main(["--target", str(tmp_path / "missing"), "--data", str(data), "--out", str(tmp_path / "run")])
    assert "--target" in capsys.readouterr().err
    assert eagle.main(_args(target_path, data, tmp_path / "run", "--feature-layers=0,-1", "--features-only")) == 0


def _saved_head(target_path, dest, **overrides):
    """An untrained head saved by save_head: of the tiny target, or of a target with ``overrides``."""
    target = specjax.load(target_path)
    if overrides:
        cfg = target.module.config.replace(**overrides)
        target = Model(specjax.Decoder(cfg).init(jax.random.key(0)), specjax.Decoder(cfg), None, chat_template=None)
    head = feature_head_build.init_from_target(target, jax.random.key(0), np.arange(40, dtype=np.int32))
    feature_head.save_head(head, str(dest))
    return str(dest)


def test_data_and_heads_of_another_model_are_refused_by_name(tiny, tmp_path, capsys):
    """Shards, an --init-from head or a --head-vocab-from vocabulary made for another target, a
    --batch the shards cannot fill, and a --head-vocab that --head-vocab-from would override:
    each an argparse error naming it, before any features are computed."""
    target_path, data = tiny
    other = tmp_path / "other"
    other.mkdir()
    for f in sorted(data.glob("shard_*.npz")):
        z = dict(np.load(f))
        z["tokens"], z["top_ids"] = z["tokens"] + 3000, z["top_ids"] + 3000
        np.savez(other / f.name, **z)
    wide = _saved_head(target_path, tmp_path / "wide", hidden_size=48, head_dim=12)
    own = _saved_head(target_path, tmp_path / "own")
    cases = [
        (["--data", str(other)], "these shards are another model's"),
        (["--batch", "7"], "--batch 7 is more than the 6 rows"),
        (["--init-from", wide], "is a head for a target of hidden size 48"),
        (["--head-vocab-from", eagle.DEFAULT_VOCAB_FROM], "it was made for another target"),
        (["--head-vocab-from", str(tmp_path / "missing")], "--head-vocab-from"),
        (["--head-vocab-from", own], "--head-vocab 48 sizes a vocabulary ranked from the shards"),
    ]
    for extra, message in cases:
        argv = _args(target_path, data, tmp_path / "run", "--features-only")
        argv = argv[:argv.index("--head-vocab-from")] + argv[argv.index("--head-vocab-from") + 2:] + extra
        if extra[0] == "--head-vocab-from" and extra[1] != own:
            argv.remove("--head-vocab"), argv.remove("48")
        with pytest.raises(SystemExit) as e:
            eagle.main(argv)
        assert e.value.code == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "run" / "features").exists()


def test_a_resume_with_other_settings_or_another_target_is_refused_by_name(tiny, tmp_path):
    """run.json records the target, --seq-len, --shards, the head vocabulary and the held-out
    set's size: a rerun that differs says which, before it reads stored features of another
    target or other rows, or evaluates on held-out answers made with other settings."""
    target_path, data = tiny
    run = tmp_path / "run"
    assert eagle.main(_args(target_path, data, run, "--features-only", "--shards", "1")) == 0
    recorded = json.loads((run / "run.json").read_text())
    assert recorded["seq_len"] == SEQ and recorded["target"] == target_path and len(recorded["head_vocab_ids"]) == 48
    for extra, message in ((["--seq-len", "128"], "started with --seq-len 96"),
                           (["--shards", "2"], "started with --shards 1"),
                           (["--head-vocab", "24"], "started with --head-vocab 48"),
                           (["--eval-prompts", "3"], "started with --eval-prompts 2"),
                           (["--eval-new-tokens", "7"], "started with --eval-new-tokens 6")):
        argv = _args(target_path, data, run, "--features-only", "--shards", "1")
        for flag, value in zip(extra[::2], extra[1::2]):
            argv[len(argv) - 1 - argv[::-1].index(flag) + 1] = value
        with pytest.raises(SystemExit, match=message):
            eagle.main(argv)
    (run / "run.json").write_text(json.dumps({**recorded, "target": "another/model", "target_fingerprint": "0" * 16}))
    with pytest.raises(SystemExit, match="started with --target another/model, another model than"):
        eagle.main(_args(target_path, data, run, "--features-only", "--shards", "1"))
