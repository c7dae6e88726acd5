"""Streaming: ``decode`` / ``generate`` with ``on_tokens=`` report each cycle's
committed tokens from inside the jitted loop; without it nothing is compiled in."""

import re

import jax
import numpy as np
import pytest

import specjax
from specjax._src.engine import loop as decode_lib

from bigram import bigram_model, random_table
from tiny_models import llama_config, peaked_target_and_draft

K = 3
# 3 sequences: the batch bucket is 4, so one padding row exists and must never be reported.
PROMPTS = [[5, 17, 3, 40, 2], [9, 1], [60, 61, 62]]


@pytest.fixture(scope="module")
def tiny():
    return peaked_target_and_draft(llama_config())


class Recorder:
    """An ``on_tokens`` that concatenates each sequence's chunks."""

    def __init__(self, batch):
        self.seqs = [[] for _ in range(batch)]
        self.calls = 0
        self.shapes = set()

    def __call__(self, tokens, counts):
        assert tokens.dtype == np.int32 and counts.dtype == np.int32
        assert tokens.shape[0] == counts.shape[0] == len(self.seqs)
        assert counts.any() and (counts >= 0).all() and (counts <= tokens.shape[1]).all()
        self.calls += 1
        self.shapes.add(tokens.shape)
        for b, n in enumerate(counts):
            self.seqs[b] += tokens[b, :n].tolist()


def _check(out, rec, width):
    assert rec.calls > 1
    assert rec.shapes == {(len(PROMPTS), width)}
    lengths = np.asarray(out.lengths)
    toks = np.asarray(out.tokens)
    for b, seq in enumerate(rec.seqs):
        assert seq == toks[b, : lengths[b]].tolist(), b


def _eos_hit_by_one_sequence(out) -> int:
    """A token that ends sequence 0 early (its 4th token), so the batch is ragged."""
    return int(np.asarray(out.tokens)[0, 3])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_decode_streams_exactly_the_committed_tokens(tiny, temperature):
    pair = specjax.pair(*tiny)
    kw = dict(num_draft=K, max_new_tokens=12, temperature=temperature, key=jax.random.key(3))
    rec = Recorder(len(PROMPTS))
    out = specjax.decode(pair, PROMPTS, eos_token_id=(), on_tokens=rec, **kw)
    _check(out, rec, K + 1)
    assert (np.asarray(out.lengths) == 12).all()  # cut at max_new_tokens (its buffer bucket is 16)

    eos = _eos_hit_by_one_sequence(out)
    rec = Recorder(len(PROMPTS))
    out = specjax.decode(pair, PROMPTS, eos_token_id=eos, on_tokens=rec, **kw)
    _check(out, rec, K + 1)
    lengths = np.asarray(out.lengths)
    assert lengths[0] <= 4 and lengths.max() > lengths.min()  # ragged: cut at EOS
    assert rec.seqs[0][-1] == eos


def test_streaming_does_not_change_the_output(tiny):
    pair = specjax.pair(*tiny)
    kw = dict(num_draft=K, max_new_tokens=12, temperature=1.0, key=jax.random.key(4), eos_token_id=(7, 11))
    plain = specjax.decode(pair, PROMPTS, **kw)
    rec = Recorder(len(PROMPTS))
    streamed = specjax.decode(pair, PROMPTS, on_tokens=rec, **kw)
    assert streamed.to_lists() == plain.to_lists() == rec.seqs
    np.testing.assert_array_equal(np.asarray(streamed.stats.accepted), np.asarray(plain.stats.accepted))


def test_generate_streams_one_token_per_step(tiny):
    target, _ = tiny
    kw = dict(max_new_tokens=10, temperature=1.0, key=jax.random.key(1))
    rec = Recorder(len(PROMPTS))
    out = specjax.generate(target, PROMPTS, eos_token_id=(), on_tokens=rec, **kw)
    _check(out, rec, 1)
    assert rec.calls == 10

    eos = _eos_hit_by_one_sequence(out)
    rec = Recorder(len(PROMPTS))
    out = specjax.generate(target, PROMPTS, eos_token_id=eos, on_tokens=rec, **kw)
    _check(out, rec, 1)
    lengths = np.asarray(out.lengths)
    assert lengths[0] <= 4 and lengths.max() == 10


def _lowered(monkeypatch, name, run) -> list[str]:
    """The lowered programs ``run`` dispatches to ``decode_lib.<name>``."""
    jitted, texts = getattr(decode_lib, name), []

    def spy(*args, **kwargs):
        texts.append(jitted.lower(*args, **kwargs).as_text())
        return jitted(*args, **kwargs)

    monkeypatch.setattr(decode_lib, name, spy)
    run()
    monkeypatch.setattr(decode_lib, name, jitted)
    return texts


def _callbacks(hlo: str) -> set:
    return {c for c in re.findall(r"custom_call @(\w+)", hlo) if "callback" in c}


def test_without_on_tokens_no_callback_is_compiled(monkeypatch):
    target, draft = bigram_model(random_table(0, 96)), bigram_model(random_table(1, 96))
    pair = specjax.pair(target, draft)
    kw = dict(max_new_tokens=8, temperature=0.0, eos_token_id=())
    plain, streamed = _lowered(
        monkeypatch, "_decode_jit",
        lambda: (specjax.decode(pair, PROMPTS, **kw), specjax.decode(pair, PROMPTS, on_tokens=lambda t, c: None, **kw)),
    )
    assert "callback" not in plain and _callbacks(streamed)
    plain, streamed = _lowered(
        monkeypatch, "_generate_jit",
        lambda: (specjax.generate(target, PROMPTS, **kw), specjax.generate(target, PROMPTS, on_tokens=lambda t, c: None, **kw)),
    )
    assert "callback" not in plain and _callbacks(streamed)

    # A new callback object reuses the streaming program (it is not part of the static config).
    size = decode_lib._decode_jit._cache_size()
    specjax.decode(pair, PROMPTS, on_tokens=Recorder(len(PROMPTS)), **kw)
    assert decode_lib._decode_jit._cache_size() == size


def test_on_tokens_errors():
    target, draft = bigram_model(random_table(0, 96)), bigram_model(random_table(1, 96))
    pair = specjax.pair(target, draft)
    kw = dict(max_new_tokens=8, temperature=0.0, eos_token_id=())

    def boom(tokens, counts):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):  # re-raised as itself, after the loop
        specjax.decode(pair, PROMPTS, on_tokens=boom, **kw)
    with pytest.raises(TypeError, match="on_tokens must be callable"):
        specjax.generate(target, PROMPTS, on_tokens=3, **kw)
    mesh = specjax.sharding.make_mesh(1, 1)
    with pytest.raises(ValueError, match="not supported on a mesh"):
        specjax.decode(pair, PROMPTS, on_tokens=print, mesh=mesh, **kw)


def test_cli_generate_streams(capsys, monkeypatch):
    from specjax.__main__ import main
    from specjax.cli import compare

    if not (compare.DEFAULT_DRAFT / "config.json").exists():
        pytest.skip("the embedded draft model is not present")
    model = specjax.load(compare.DEFAULT_DRAFT)
    real_decode, pieces = specjax.decode, []

    def spy(params, prompts, *, on_tokens=None, **kw):
        assert on_tokens is not None  # the CLI streams

        def on(tokens, counts):
            before = capsys.readouterr().out
            on_tokens(tokens, counts)
            pieces.append((before, capsys.readouterr().out))

        return real_decode(params, prompts, on_tokens=on, **kw)

    monkeypatch.setattr(specjax, "decode", spy)
    code = main(["generate", "--target", str(compare.DEFAULT_DRAFT), "--draft", str(compare.DEFAULT_DRAFT),
                 "--prompt", "def add(a, b):", "--max-new-tokens", "12"])
    rest = capsys.readouterr().out
    assert code == 0 and len(pieces) > 1
    printed = "".join(before + now for before, now in pieces) + rest
    assert printed.startswith("def add(a, b):") and "tau" in printed
    # Text appeared while decoding ran (during the callbacks), not only at the end.
    assert sum(bool(now) for _, now in pieces) > 1
    # What was streamed is the decoded answer.
    ids = model.tokenizer.encode("def add(a, b):").ids
    out = real_decode(specjax.pair(model, model), [ids], max_new_tokens=12, temperature=0.0,
                      key=jax.random.key(0), num_draft=4)
    answer = model.tokenizer.decode(out.to_lists()[0])
    assert printed.startswith("def add(a, b):" + answer)
