"""Generation controls: logits processors applied to target and draft alike, and stop strings on the text."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.engine import Engine, GenerationControls, SlotSettings, TextStream, check_stop_strings, cut_at_stop
from specjax.testing import bigram_model, llama_config, peaked_target_and_draft, random_table
from specjax.trees import dynamic_tree, static_tree
from test_decode import NO_BUCKETS, goodness_of_fit

PENALTIES = GenerationControls(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3,
                               logit_bias={1: 1.0, 6: -2.0})


@pytest.fixture(scope="module")
def llama_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config()))


def test_greedy_speculative_with_penalties_equals_target_only_with_them(llama_pair):
    prompts = [[5, 9, 3, 5, 9], [7] * 6, [1, 2, 3]]
    controls = GenerationControls(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                                  logit_bias={10: 3.0})
    sd = specjax.decode(llama_pair, prompts, num_draft=3, max_new_tokens=24, temperature=0.0, controls=controls)
    target_only = specjax.generate(llama_pair, prompts, max_new_tokens=24, temperature=0.0, controls=controls)
    plain = specjax.generate(llama_pair, prompts, max_new_tokens=24, temperature=0.0)
    assert sd.to_lists() == target_only.to_lists()
    assert sd.to_lists() != plain.to_lists()  # the controls changed what was generated
    # Per request: a list of controls, the defaults on row 1 leave it as it was without controls.
    mixed = specjax.decode(llama_pair, prompts, num_draft=3, max_new_tokens=24, temperature=0.0,
                           controls=[controls, GenerationControls(), controls])
    assert mixed.to_lists() == [sd.to_lists()[0], plain.to_lists()[1], sd.to_lists()[2]]


def test_slot_with_controls_equals_decode_with_them(llama_pair):
    settings = SlotSettings(temperature=0.8, seed=4, max_new_tokens=16, controls=PENALTIES)
    engine = Engine(llama_pair, num_slots=4, capacity=48, num_draft=3)  # test_slots.py's engine
    state = engine.insert(engine.init(), 1, [4, 4, 8], settings)
    state, out = engine.step(state, 64)
    out = jax.device_get(out)
    got = out.tokens[1, : out.counts[1]].tolist()
    alone = specjax.decode(llama_pair, [[4, 4, 8]], num_draft=3, max_new_tokens=16, temperature=0.8,
                           key=jax.random.key(4), max_length=48 + 3, controls=PENALTIES)
    assert got == alone.to_lists()[0]


VOCAB = 8


def processed_law(table, controls: GenerationControls, prompt_token: int):
    """The exact law of the first two tokens after ``[prompt_token]`` under the processors (numpy)."""

    def probs(row, seen, counts):
        z = np.asarray(table[row], np.float64).copy()
        for token, bias in (controls.logit_bias or {}).items():
            z[token] += bias
        r = controls.repetition_penalty
        z = np.where(seen, np.where(z > 0, z / r, z * r), z)
        z = z - controls.presence_penalty * (counts > 0) - controls.frequency_penalty * counts
        p = np.exp(z - z.max())
        return p / p.sum()

    seen = np.zeros(VOCAB, bool)
    seen[prompt_token] = True
    first = probs(prompt_token, seen, np.zeros(VOCAB))
    joint = np.zeros((VOCAB, VOCAB))
    for x in range(VOCAB):
        counts = np.zeros(VOCAB)
        counts[x] = 1
        joint[x] = first[x] * probs(x, seen | (counts > 0), counts)
    return joint


def assert_follows_the_processed_law(pair, out):
    """The first two tokens after ``[3]`` fit the law under ``PENALTIES`` (chi-square) and not the unprocessed one."""
    toks = np.asarray(out.tokens)
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    table = np.asarray(pair.target.params["table"])
    pvalue, tv = goodness_of_fit(counts, processed_law(table, PENALTIES, 3))
    assert pvalue > 1e-3 and tv < 0.03, (pvalue, tv)
    pvalue, tv = goodness_of_fit(counts, processed_law(table, GenerationControls(), 3))
    assert pvalue < 1e-6 and tv > 0.05, (pvalue, tv)


def test_sampled_law_is_the_processed_target():
    """Sampled speculative decoding with processors follows the processed target's law;
    negative control: the unprocessed target's law is rejected by the same test."""
    pair = specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB)))
    samples = 20000
    out = specjax.decode(pair, [[3]] * samples, num_draft=3, max_new_tokens=2, temperature=1.0,
                         key=jax.random.key(0), eos_token_id=(), controls=PENALTIES, buckets=NO_BUCKETS)
    assert_follows_the_processed_law(pair, out)


# ---------------------------------------------------------------------------
# The text level: min_new_tokens and stop strings with the embedded tokenizer
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return specjax.load("embedded-target").tokenizer
    except Exception as e:  # pragma: no cover - the assets ship with the package
        pytest.skip(f"the embedded pair is not available: {e}")


def test_min_new_tokens_at_the_text_level(tokenizer):
    """A bias makes EOS (id 2) the likeliest token; min_new_tokens holds it off for 5 tokens."""
    vocab = tokenizer.get_vocab_size()
    pair = specjax.pair(bigram_model(random_table(0, vocab), tokenizer=tokenizer),
                        bigram_model(random_table(1, vocab), tokenizer=tokenizer))
    prompt = [tokenizer.encode("x = ", add_special_tokens=False).ids]
    eager = GenerationControls(logit_bias={2: 50.0})
    early = specjax.decode(pair, prompt, num_draft=3, max_new_tokens=12, temperature=0.0, eos_token_id=2,
                           controls=eager)
    assert early.to_lists()[0] == [2]
    assert tokenizer.decode(early.to_lists()[0], skip_special_tokens=True) == ""
    held = specjax.decode(pair, prompt, num_draft=3, max_new_tokens=12, temperature=0.0, eos_token_id=2,
                          controls=eager.replace(min_new_tokens=5))
    tokens = held.to_lists()[0]
    assert len(tokens) == 6 and tokens[-1] == 2 and 2 not in tokens[:5]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert text == tokenizer.decode(tokens[:5]) and text


def test_stop_strings_cut_the_text_before_the_stop(tokenizer):
    text = "def f(x):\n    return x\n\nprint(f(2))"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    # "\n\n" alone is one token, but here it spans two: matched on the text, not on ids.
    assert tokenizer.encode("\n\n", add_special_tokens=False).ids[0] not in ids
    for chunk in (1, 3, len(ids)):
        stream = TextStream(tokenizer, stop=["\n\n", "never"])
        pieces = []
        for i in range(0, len(ids), chunk):
            pieces.append(stream.push(ids[i : i + chunk]))
            if stream.stopped:
                break
        pieces.append(stream.finish())
        assert stream.stopped
        assert "".join(pieces) == stream.text == "def f(x):\n    return x"
        # The tokens the output counts: the fewest whose text reaches the cut (not those past it).
        covered = stream.covered_tokens()
        assert tokenizer.decode(ids[:covered]).startswith(stream.text)
        assert not tokenizer.decode(ids[: covered - 1]).startswith(stream.text)
        assert covered < len(stream.tokens) or chunk == 1
    stream = TextStream(tokenizer, stop=["zzz"])
    assert stream.push(ids) + stream.finish() == text and not stream.stopped
    assert stream.covered_tokens() == len(ids)
    # min_tokens: a stop string within the first tokens' text does not end it (vLLM's min_tokens).
    first = tokenizer.decode(ids[:3])
    early = first[-2:]
    assert early.strip() and early in first
    held = TextStream(tokenizer, stop=[early], min_tokens=len(ids))
    assert held.push(ids) + held.finish() == text and not held.stopped
    plain = TextStream(tokenizer, stop=[early])
    assert plain.push(ids) + plain.finish() == text[: text.find(early)] and plain.stopped
    assert cut_at_stop("a STOP b stop", ["stop", "STOP"]) == ("a ", True)


def test_bad_controls_and_stop_strings_name_the_field(llama_pair, tokenizer):
    for controls, field in [(GenerationControls(repetition_penalty=0.0), "repetition_penalty"),
                            (GenerationControls(frequency_penalty=-2.5), "frequency_penalty"),
                            (GenerationControls(min_new_tokens=-1), "min_new_tokens"),
                            (GenerationControls(logit_bias={3: float("nan")}), r"logit_bias\[3\]")]:
        with pytest.raises(ValueError, match=field):
            specjax.decode(llama_pair, [[1, 2]], temperature=0.0, controls=controls)
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        specjax.decode(llama_pair, [[1, 2]], temperature=0.0, controls=[PENALTIES, PENALTIES])
    with pytest.raises(ValueError, match="stop\\[0\\] is empty"):
        TextStream(tokenizer, stop=[""])

    class DropsUnknown:  # a tokenizer that encodes characters outside its alphabet to nothing
        def encode(self, text):
            return [ord(c) for c in text if c.isascii()]

    with pytest.raises(ValueError, match="stop\\[1\\] = 'é' encodes to no tokens"):
        check_stop_strings(["ok", "é"], DropsUnknown())


def ban_token_5(logits, ctx):
    """A processor of one's own: token 5 is never generated."""
    del ctx
    return logits.at[5].set(-np.inf)


def test_an_engine_runs_processors_of_ones_own():
    pair = specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB)))
    settings = [SlotSettings(temperature=t, seed=i, max_new_tokens=8, eos_token_id=())
                for i, t in enumerate([0.0, 1.0] * 16)]
    seen = {}
    for name, processors in (("banned", (ban_token_5,)), ("free", ())):
        engine = Engine(pair, num_slots=32, capacity=12, num_draft=3, processors=processors)
        state = engine.insert_many(engine.init(), list(range(32)), [[5, 3]] * 32, settings)
        state, out = engine.step(state, 8)
        out = jax.device_get(out)
        assert (out.counts == 8).all()
        seen[name] = out.tokens[:, :8]
    assert not (seen["banned"] == 5).any()
    assert (seen["free"] == 5).any()  # the control: token 5 is generated without the processor


# ---------------------------------------------------------------------------
# Token trees: each node processed after the tokens on its path
# ---------------------------------------------------------------------------


def test_greedy_on_a_tree_with_penalties_equals_target_only_with_them(llama_pair):
    controls = GenerationControls(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                                  logit_bias={10: 3.0}, min_new_tokens=3)
    prompts = [[5, 9, 3, 5, 9], [7] * 6, [1, 2, 3]]
    target_only = specjax.generate(llama_pair, prompts, max_new_tokens=24, temperature=0.0, controls=controls)
    out = specjax.decode(llama_pair, prompts, tree=dynamic_tree(3, 2, 5), max_new_tokens=24, temperature=0.0,
                         controls=controls)
    assert out.to_lists() == target_only.to_lists()
    assert out.stats.tau > 1.5  # the tree's drafts were accepted, not only the target's own tokens


@pytest.mark.parametrize("tree, temperature", [
    (static_tree((2, 2)), 1.0), (dynamic_tree(2, 2, 4), 0.0), (dynamic_tree(2, 2, 4, sampled=True), 1.0),
], ids=["static-sampled", "dynamic-greedy", "dynamic-sampled"])
def test_a_draft_equal_to_the_target_is_accepted_everywhere_under_penalties(tree, temperature):
    """A draft with the target's own table agrees with it only if both are processed after the
    same path: then every judged node is accepted (the first child's p / q is 1). Skipping the
    draft's processing below the root accepted 86-91% here."""
    table = random_table(0, VOCAB)
    same = specjax.pair(bigram_model(table), bigram_model(table))
    out = specjax.decode(same, [[3]] * 64, tree=tree, max_new_tokens=9, temperature=temperature,
                         key=jax.random.key(0), eos_token_id=(), controls=PENALTIES, buckets=NO_BUCKETS)
    stats = jax.device_get(out.stats)
    assert np.sum(stats.judged) > 64 and np.sum(stats.accepted) == np.sum(stats.judged), stats


@pytest.mark.parametrize("tree", [
    pytest.param(static_tree((2, 2)), marks=pytest.mark.slow), dynamic_tree(2, 2, 4, sampled=True),
], ids=["static", "dynamic-sampled"])
def test_sampled_law_on_a_tree_is_the_processed_target(tree):
    """The first two tokens follow the processed target's law: the second one's processing counts
    the first, whether it was a drafted node or the emitted token; negative control: the
    unprocessed law is rejected."""
    pair = specjax.pair(bigram_model(random_table(0, VOCAB)), bigram_model(random_table(1, VOCAB)))
    out = specjax.decode(pair, [[3]] * 20000, tree=tree, max_new_tokens=2, temperature=1.0,
                         key=jax.random.key(0), eos_token_id=(), controls=PENALTIES, buckets=NO_BUCKETS)
    assert_follows_the_processed_law(pair, out)
