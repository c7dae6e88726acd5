"""Training checkpoints carry checksums; a damaged latest step falls back to the previous one.

Fault injection on ``training.common.Checkpointer`` (used by training.lm,
training.pivot and training.draft): a truncated data file, a flipped byte, a
deleted file or item, garbage or edited metadata in the latest step are each
reported in one line naming the step and the problem, the step is moved aside,
and training resumes from the previous good step, ending with exactly the
parameters of an uninterrupted run. A checkpoint written with other settings
(training.draft / eagle / pivot flags, other shapes) is not damage: the run
stops naming the differences and nothing is moved, so the original command
still resumes it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from training import common, eagle, pivot
from test_draft_training import _run, tiny_chat_target  # noqa: F401 (a fixture)
from test_pivot import CFG, synthetic
from test_training_eagle import _args as _eagle_args, tiny  # noqa: F401 (a fixture)


def _data_files(step_dir) -> list[str]:
    files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
             if os.path.isfile(f)]
    assert files, os.listdir(step_dir)
    return sorted(files, key=os.path.getsize)


def _truncate(step_dir):
    for f in _data_files(step_dir):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)


def _flip(step_dir):
    for f in _data_files(step_dir):
        blob = bytearray(open(f, "rb").read())
        blob[len(blob) // 2] ^= 0x10
        open(f, "wb").write(bytes(blob))


def _delete_chunk(step_dir):
    # The data of the merged OCDBT store under state/d/ (what Orbax reads back;
    # the per-process stores it was merged from are not read).
    merged = [f for f in _data_files(step_dir) if "ocdbt.process_" not in f]
    assert merged
    for f in merged:
        os.remove(f)


def _delete_state(step_dir):
    shutil.rmtree(os.path.join(step_dir, "state"))


def _delete_meta(step_dir):
    shutil.rmtree(os.path.join(step_dir, "meta"))


def _garbage_meta(step_dir):
    open(os.path.join(step_dir, "meta", "metadata"), "w").write("{not json")


def _edited_meta(step_dir):
    file = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(file))
    meta["tokens_seen"] = 12345  # valid JSON, wrong content
    json.dump(meta, open(file, "w"))


def _garbage_state_metadata(step_dir):
    open(os.path.join(step_dir, "state", "_METADATA"), "w").write("\x00garbage")


def _garbage_step_metadata(step_dir):
    open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "w").write("][")


def _foreign_state(step_dir):
    # Readable data, but not what was saved: only the recorded CRC32s notice.
    other = step_dir + ".other"
    ckpt = common.Checkpointer(other, every_steps=1)
    ckpt.save(2, _state(7), {})
    ckpt.close()
    shutil.rmtree(os.path.join(step_dir, "state"))
    shutil.copytree(os.path.join(other, "2", "state"), os.path.join(step_dir, "state"))
    shutil.rmtree(other)


DAMAGES = {
    "truncate": (_truncate, "truncated data file"),
    "flip": (_flip, "corrupted data file"),
    "delete_chunk": (_delete_chunk, "missing data file"),
    "delete_state": (_delete_state, "state"),
    "delete_meta": (_delete_meta, "meta"),
    "garbage_meta": (_garbage_meta, "meta/metadata"),
    "edited_meta": (_edited_meta, "meta"),
    "garbage_state_metadata": (_garbage_state_metadata, "_METADATA"),
    "foreign_state": (_foreign_state, "do not match their checksums"),
}


def _state(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (16, 8)), "b": jax.random.normal(k2, (8,))}
    return common.init_state(params, optax.adam(1e-3))


def _restore(directory):
    ckpt = common.Checkpointer(directory)
    try:
        return ckpt.restore(_state(0))
    finally:
        ckpt.close()


def _equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_latest_step_falls_back_to_the_previous_one(tmp_path, damage):
    logs = []
    ckpt = common.Checkpointer(tmp_path / "ck", every_steps=1, log=logs.append)
    ckpt.save(1, _state(1), {"tokens_seen": 1})
    ckpt.save(2, _state(2), {"tokens_seen": 2})
    ckpt.close()
    hurt, named = DAMAGES[damage]
    hurt(str(tmp_path / "ck" / "2"))

    ckpt = common.Checkpointer(tmp_path / "ck", every_steps=1, log=logs.append)
    state, meta = ckpt.restore(_state(0))
    _equal(state, _state(1))
    assert meta == {"tokens_seen": 1}
    damaged = [m for m in logs if "step 2" in m]
    assert len(damaged) == 1 and "damaged" in damaged[0] and "\n" not in damaged[0], logs
    assert named in damaged[0]
    assert "Traceback" not in damaged[0]
    # The damaged step is kept aside (nothing deleted), out of the way of the next save.
    assert os.path.isdir(tmp_path / "ck.damaged" / "2")
    assert ckpt.latest_step() == 1
    ckpt.save(2, _state(3), {"tokens_seen": 3})
    ckpt.close()
    state, meta = _restore(tmp_path / "ck")
    _equal(state, _state(3))
    assert meta == {"tokens_seen": 3}


def test_garbage_in_orbax_step_metadata_is_harmless(tmp_path):
    # Orbax does not need its _CHECKPOINT_METADATA to restore; the data itself
    # still matches its checksums, so the step is used.
    ckpt = common.Checkpointer(tmp_path / "ck", every_steps=1)
    ckpt.save(1, _state(1), {"a": 1})
    ckpt.save(2, _state(2), {"a": 2})
    ckpt.close()
    _garbage_step_metadata(str(tmp_path / "ck" / "2"))
    state, meta = _restore(tmp_path / "ck")
    _equal(state, _state(2))
    assert meta == {"a": 2}


def test_every_step_damaged_is_a_clear_error(tmp_path):
    ckpt = common.Checkpointer(tmp_path / "ck", every_steps=1, log=lambda _: None)
    ckpt.save(1, _state(1), {})
    ckpt.save(2, _state(2), {})
    ckpt.close()
    _flip(str(tmp_path / "ck" / "1"))
    _delete_meta(str(tmp_path / "ck" / "2"))
    ckpt = common.Checkpointer(tmp_path / "ck", log=lambda _: None)
    with pytest.raises(ValueError, match=r"no intact checkpoint.*step 2.*step 1") as err:
        ckpt.restore(_state(0))
    ckpt.close()
    assert str(tmp_path / "ck") in str(err.value)


def test_checksums_are_recorded_and_hidden_from_the_meta(tmp_path):
    ckpt = common.Checkpointer(tmp_path / "ck", every_steps=1)
    ckpt.save(1, _state(1), {"a": 1})
    ckpt.close()
    raw = json.load(open(tmp_path / "ck" / "1" / "meta" / "metadata"))
    sums = raw[common.CHECKSUM_KEY]
    assert set(sums["state"]) == {"step", "params/w", "params/b", *[
        k for k in sums["state"] if k.startswith("opt_state")]}
    assert all(isinstance(v[2], int) for v in sums["state"].values())
    _, meta = _restore(tmp_path / "ck")
    assert meta == {"a": 1}


@pytest.fixture(scope="module")
def uninterrupted():
    return pivot.train_head(*synthetic(), config=CFG, progress=False, log=lambda *_: None)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_chunk"])
def test_pivot_training_resumes_from_the_last_good_step_with_the_same_head(tmp_path, damage, uninterrupted):
    data = synthetic()
    quiet = lambda *_: None  # noqa: E731
    whole, rep_whole = uninterrupted
    ckpt = tmp_path / "ckpt"
    # "Killed" after 50 steps: checkpoints at steps 20 and 40; then step 40 is damaged.
    pivot.train_head(*data, config=CFG, ckpt_dir=ckpt, progress=False, stop_after=50, log=quiet)
    assert sorted(os.listdir(ckpt)) == ["20", "40"]
    DAMAGES[damage][0](str(ckpt / "40"))
    logs = []
    resumed, rep = pivot.train_head(*data, config=CFG, ckpt_dir=ckpt, progress=False, log=logs.append)
    assert any("step 40" in m and "damaged" in m for m in logs), logs
    assert any("resuming from step 20" in m for m in logs), logs
    assert rep["steps_run"] == CFG.steps and rep["best_step"] == rep_whole["best_step"]
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- #
# python -m training.pivot never writes into the package's assets by default
# --------------------------------------------------------------------------- #


def _labelled_set(path) -> str:
    from training.rollouts import LabelledSet

    hidden, scalars, labels = synthetic(n=60)
    n = len(labels)
    z = np.zeros(n, np.float32)
    i = np.zeros(n, np.int32)
    LabelledSet(hidden, scalars, labels, np.ones(n, bool), z, z, i, i, i, i,
                meta={"layer": -1, "target_num_layers": 2}).save(path)
    return str(path)


def test_pivot_default_out_is_outside_the_package():
    out = pathlib.Path(pivot.resolve_out(pivot.build_parser().parse_args([]))).resolve()
    assert not out.is_relative_to(pivot.ASSETS.resolve())
    assert not out.is_relative_to((pivot.REPO / "specjax").resolve())
    shipped = pivot.resolve_out(pivot.build_parser().parse_args(["--export-to-assets"]))
    assert shipped == pivot.SHIPPED_HEAD


def test_pivot_cli_refuses_to_overwrite_a_head_without_force(tmp_path, monkeypatch, capsys):
    shipped = tmp_path / "assets" / "pivot"  # stands in for specjax/assets/pivot
    monkeypatch.setattr(pivot, "SHIPPED_HEAD", shipped)
    monkeypatch.setattr(pivot, "DEFAULT_OUT", tmp_path / "runs" / "head")
    base = ["--dataset", _labelled_set(tmp_path / "labels.npz"), "--steps", "10", "--no-progress",
            "--target", str(tmp_path / "no-target")]

    # The default writes under runs/, never into the (stand-in) assets.
    assert pivot.main(base + ["--ckpt-dir", str(tmp_path / "ck1")]) == 0
    assert (tmp_path / "runs" / "head" / "params.npz").is_file() and not shipped.exists()

    # Asked by name, it writes the shipped head; then refuses to replace it without --force.
    assert pivot.main(base + ["--ckpt-dir", str(tmp_path / "ck2"), "--export-to-assets"]) == 0
    assert (shipped / "params.npz").is_file()
    assert 'head="shipped"' in (shipped / "README.md").read_text()
    (shipped / "eval.json").write_text("{}")  # an old evaluation of the old head
    before = (shipped / "params.npz").read_bytes()
    capsys.readouterr()
    assert pivot.main(base + ["--ckpt-dir", str(tmp_path / "ck3"), "--export-to-assets", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "non-empty directory" in err and "--force" in err and err.count("\n") == 1
    assert (shipped / "params.npz").read_bytes() == before

    # --force swaps in a whole new head: the old eval.json is gone with the old head,
    # a hand-written NOTES.md (as specjax/assets/pivot has) is kept and quoted by the card.
    (shipped / "NOTES.md").write_text("## Findings\n\nhand-written\n")
    capsys.readouterr()
    assert pivot.main(base + ["--ckpt-dir", str(tmp_path / "ck3"), "--export-to-assets", "--seed", "1",
                              "--force"]) == 0
    assert (shipped / "params.npz").read_bytes() != before
    assert not (shipped / "eval.json").exists()
    assert (shipped / "NOTES.md").read_text() == "## Findings\n\nhand-written\n"
    assert "hand-written" in (shipped / "README.md").read_text()
    assert "kept from the replaced" in capsys.readouterr().out
    assert sorted(p.name for p in shipped.parent.iterdir()) == ["pivot"]


# --------------------------------------------------------------------------- #
# A checkpoint of another configuration is not damage: refused, kept in place
# --------------------------------------------------------------------------- #


def _kept(ckpt_dir, steps) -> None:
    """The steps are where they were and nothing was set aside as damaged."""
    assert sorted(os.listdir(ckpt_dir)) == sorted(str(s) for s in steps)
    assert not os.path.exists(str(ckpt_dir) + ".damaged")


def test_other_shapes_or_settings_are_a_mismatch_not_damage(tmp_path):
    logs = []
    ckpt = common.Checkpointer(tmp_path / "ck", every_steps=1, log=logs.append)
    ckpt.save(1, _state(1), {"config": {"hidden": 8, "heads": 2}})
    ckpt.close()
    wider = common.init_state({"w": jnp.zeros((16, 12)), "b": jnp.zeros((12,))}, optax.adam(1e-3))
    ckpt = common.Checkpointer(tmp_path / "ck", log=logs.append)
    with pytest.raises(common.CheckpointMismatch, match=r"params/w: float32\[16, 8\] in the checkpoint, "
                                                        r"float32\[16, 12\] now") as err:
        ckpt.restore(wider)
    assert "Nothing was moved" in str(err.value) and "damaged" not in str(err.value)
    # Same shapes, other settings: the meta tells, before any weight is read.
    with pytest.raises(common.CheckpointMismatch, match="config.heads: 2 in the checkpoint, 4 now") as err:
        ckpt.restore(_state(0), settings={"config": {"hidden": 8, "heads": 4}}, advice="use --out X")
    assert str(err.value).endswith("use --out X.") and "hidden" not in str(err.value)
    ckpt.close()
    _kept(tmp_path / "ck", [1])
    assert not logs
    state, meta = _restore(tmp_path / "ck")  # the run that wrote it still resumes it
    _equal(state, _state(1))


def test_pivot_with_another_arch_is_refused_and_the_run_still_resumes(tmp_path):
    data = synthetic()
    quiet = lambda *_: None  # noqa: E731
    ckpt = tmp_path / "ckpt"
    pivot.train_head(*data, config=CFG, ckpt_dir=ckpt, progress=False, stop_after=20, log=quiet)
    linear = dataclasses.replace(CFG, arch="linear")  # other parameter shapes
    with pytest.raises(common.CheckpointMismatch, match='run.train.arch: "pad" in the checkpoint, "linear" now'):
        pivot.train_head(*data, config=linear, ckpt_dir=ckpt, progress=False, log=quiet)
    _kept(ckpt, [20])
    logs = []
    _, rep = pivot.train_head(*data, config=CFG, ckpt_dir=ckpt, progress=False, log=logs.append)
    assert any("resuming from step 20" in m for m in logs), logs
    assert rep["steps_run"] == CFG.steps


def test_draft_resumed_with_another_width_is_refused_then_resumes(tiny_chat_target, tmp_path):
    out = tmp_path / "run"
    _run(tiny_chat_target, out, "--train-only")  # --hidden 32: a checkpoint at step 6
    with pytest.raises(SystemExit) as err:
        _run(tiny_chat_target, out, "--train-only", "--steps", "8", "--hidden", "16")
    msg = str(err.value.code)
    assert "made with different settings" in msg and "hidden_size: 32 in the checkpoint, 16 now" in msg
    assert "--out" in msg and "--fresh" not in msg and "damaged" not in msg, msg
    _kept(out / "ckpt", [6])
    _run(tiny_chat_target, out, "--train-only", "--steps", "8")  # the original command
    assert "resumed at step 6" in (out / "log.txt").read_text()
    _kept(out / "ckpt", [6, 8])


def test_draft_resumed_with_another_head_layout_of_the_same_shapes_is_refused(tiny_chat_target, tmp_path):
    out = tmp_path / "run"
    _run(tiny_chat_target, out, "--train-only")  # 2 heads / 1 KV head of 16
    with pytest.raises(SystemExit) as err:  # 4 heads / 2 KV heads of 8: every shape the same
        _run(tiny_chat_target, out, "--train-only", "--steps", "8", "--heads", "4", "--kv-heads", "2")
    msg = str(err.value.code)
    assert "num_heads: 2 in the checkpoint, 4 now" in msg and "num_kv_heads: 1 in the checkpoint, 2 now" in msg
    _kept(out / "ckpt", [6])
    assert "resumed" not in (out / "log.txt").read_text()


def test_eagle_resumed_with_another_loss_is_refused(tiny, tmp_path):
    target, data = tiny
    out = tmp_path / "run"
    assert eagle.main(_eagle_args(target, data, out, "--steps", "2", "--train-only")) == 0
    with pytest.raises(SystemExit) as err:  # same shapes, another objective and schedule
        eagle.main(_eagle_args(target, data, out, "--steps", "4", "--train-only", "--unroll", "1", "--lr", "1e-3"))
    msg = str(err.value.code)
    assert "unroll: 2 in the checkpoint, 1 now" in msg and "lr: 0.01 in the checkpoint, 0.001 now" in msg
    assert "steps" not in msg.split("Nothing")[0]  # --steps may grow to continue a run
    _kept(out / "ckpt", [2])


def test_an_export_swap_killed_between_its_renames_is_put_back(tmp_path):
    """common.swap_in renames the old export aside, then the new one in: a kill
    between the two leaves only the old one, which the next run restores."""
    dest, aside = tmp_path / "export", tmp_path / "export.old-export"
    aside.mkdir()
    (aside / "NOTES.md").write_text("hand-written")
    with pytest.raises(SystemExit, match="pass --force"):
        common.check_export(dest, force=False, run_id="run", command="cmd")
    assert (dest / "NOTES.md").read_text() == "hand-written" and not aside.exists()


def test_the_same_command_with_other_minutes_left_replaces_its_own_export(tmp_path):
    """A recipe resumed in a second call passes training.eagle the --time-limit it has left, so
    the command differs there; the export is still this run's own (no --force). Another --steps
    is another command: refused without --force, the export kept."""
    dest = tmp_path / "export"
    dest.mkdir()
    recorded = "python -m training.eagle --data d --steps 100 --time-limit 8.3"
    (dest / "train_log.json").write_text(json.dumps({"summary": {"run_id": "run", "command": recorded}}))
    assert common.check_export(dest, force=False, run_id="run", command=recorded.replace("8.3", "4.5"))
    assert common.check_export(dest, force=False, run_id="run",
                               command="python -m training.eagle --data d --steps 100 --time-limit=2")
    with pytest.raises(SystemExit, match="pass --force"):
        common.check_export(dest, force=False, run_id="run", command=recorded.replace("100", "50"))
    with pytest.raises(SystemExit, match="pass --force"):
        common.check_export(dest, force=False, run_id="other", command=recorded)
    assert (dest / "train_log.json").exists()
