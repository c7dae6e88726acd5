"""FLy (arXiv:2511.22972): entropy-gated deferred verification.

A hand-built block with one reason per slot, a loop reference written from
vLLM's kernels (PR #53987, ``vllm/v1/spec_decode/fly.py``), the limits at which
FLy is the lossless rule, the paths, parsing, argument errors and a decode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.rules import Path, any_of, fly, parse_rule, speculative_sampling
from specjax.testing import bigram_model, random_table
from specjax._src.rules.fly import following_run, max_top_k_entropy, top_k_entropy
from tests.test_rules import batched_verify, block, random_batch

H = [1.0, 0.9, 0.8, 0.0]  # uncertain: top-3 entropy ~1.0, argmax 0
L = [10.0, 0.0, 0.0, 0.0]  # confident: top-3 entropy ~0.0014, argmax 0
X, E, R = Path.REJECTED, Path.EXACT, Path.RELAXED


@functools.lru_cache(maxsize=None)
def _verify(rule, greedy):
    return jax.jit(functools.partial(rule.verify, greedy=greedy))


def verify(rule, inputs, *, greedy):
    return _verify(rule, greedy)(inputs, ())


def prefix(accept) -> int:
    return int(np.cumprod(np.asarray(accept, bool)).sum())


# --------------------------------------------------------------------------- the criterion


def test_each_slot_for_its_reason_greedy():
    # slot 0: mismatch, uncertain, slots 1-2 match        -> RELAXED
    # slot 3: mismatch, confident (gate fails)            -> REJECTED
    # slot 5: mismatch, uncertain, slot 7 breaks window   -> REJECTED
    # slot 7: mismatch, uncertain, no window fits         -> REJECTED
    rows = [H, H, L, L, H, H, H, H]
    tokens = [1, 0, 0, 1, 0, 2, 0, 1]
    inputs = block(rows, np.zeros((8, 4)), tokens)
    v = verify(fly(0.3, window=2), inputs, greedy=True)
    np.testing.assert_array_equal(v.path, [R, E, E, X, E, X, E, X])
    np.testing.assert_array_equal(v.accept, np.asarray(v.path) != X)
    # the correction is the lossless one: the target's argmax
    np.testing.assert_array_equal(np.asarray(v.correction).argmax(-1), 0)
    # window 1: slot 5's window is slot 6 alone, which matches
    v1 = verify(fly(0.3, window=1), inputs, greedy=True)
    np.testing.assert_array_equal(v1.path, [R, E, E, X, E, R, E, X])
    # window 3: slot 0's window reaches slot 3, a mismatch
    v3 = verify(fly(0.3, window=3), inputs, greedy=True)
    np.testing.assert_array_equal(v3.path, [X, E, E, X, E, X, E, X])


def test_a_token_the_target_excludes_is_never_kept():
    excluded = [1.0, 0.9, 0.8, -np.inf]  # top-3 entropy high, but p(token 3) = 0
    inputs = block([excluded, H], np.zeros((2, 4)), [3, 0])
    assert float(top_k_entropy(jax.nn.softmax(jnp.asarray(excluded)), 3)) > 0.3
    np.testing.assert_array_equal(verify(fly(0.0, window=1), inputs, greedy=True).path, [X, E])
    kept = block([H, H], np.zeros((2, 4)), [3, 0])  # the same with p(3) > 0
    np.testing.assert_array_equal(verify(fly(0.0, window=1), kept, greedy=True).path, [R, E])


def test_sampling_window_uses_the_later_slots_own_coins():
    # Slot 0 fails U q <= p (q(1) = 1 > p(1)); slot 1's coin decides the window.
    target = [H, H, H]
    draft = np.log(np.asarray([[0, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], np.float32) + 1e-9)
    p0 = float(jax.nn.softmax(jnp.asarray(H))[0])
    ok = block(target, draft, [1, 0, 0], uniforms=[0.99, p0 - 0.05, 0.5])
    bad = block(target, draft, [1, 0, 0], uniforms=[0.99, p0 + 0.05, 0.5])
    np.testing.assert_array_equal(verify(fly(0.3, window=1), ok, greedy=False).path, [R, E, X])
    np.testing.assert_array_equal(verify(fly(0.3, window=1), bad, greedy=False).path, [X, X, X])
    # the correction is the lossless residual at every slot
    sd = verify(speculative_sampling(), ok, greedy=False)
    np.testing.assert_allclose(verify(fly(0.3, window=1), ok, greedy=False).correction, sd.correction)


def test_empty_slots_are_outside_every_window():
    rows = [H, H, H, H]
    inputs = block(rows, np.zeros((4, 4)), [1, 0, 0, 0], valid=[True, True, False, False])
    # two valid slots: slot 0's window of 1 fits, a window of 2 would need the empty slot 2
    np.testing.assert_array_equal(verify(fly(0.3, window=1), inputs, greedy=True).path[:2], [R, E])
    np.testing.assert_array_equal(verify(fly(0.3, window=2), inputs, greedy=True).path[:2], [X, E])


def test_default_window_is_vllms_min_6_k_minus_1_and_one_slot_never_defers():
    r = fly()
    assert [r.window_for(k) for k in (1, 2, 4, 7, 12)] == [1, 1, 3, 6, 6]
    one = block([H], np.zeros((1, 4)), [1])
    for rule in (fly(0.0), fly(0.0, window=1)):
        assert not bool(verify(rule, one, greedy=True).accept[0])
    # K = 4 (decode's default num_draft): window 3
    four = block([H, H, H, H, H], np.zeros((4, 4)), [1, 0, 0, 0])
    np.testing.assert_array_equal(verify(fly(), four, greedy=True).path, [R, E, E, E])
    np.testing.assert_array_equal(verify(fly(), four._replace(draft_tokens=jnp.asarray([1, 0, 0, 2])),
                                         greedy=True).path, [X, E, E, X])


def test_top_k_entropy_and_its_bound():
    p = jnp.asarray([0.5, 0.3, 0.15, 0.05])
    want = -sum(x * math.log(x) for x in (0.5, 0.3, 0.15))
    np.testing.assert_allclose(float(top_k_entropy(p, 3)), want, rtol=1e-6)
    np.testing.assert_allclose(float(top_k_entropy(p, 9)), -sum(x * math.log(x) for x in p.tolist()), rtol=1e-6)
    rng = np.random.default_rng(0)
    probs = jax.nn.softmax(jnp.asarray(3 * rng.standard_normal((2000, 8)), jnp.float32))
    for k in (1, 2, 3, 5):
        entropy = jax.jit(top_k_entropy, static_argnums=1)(probs, k)
        assert float(entropy.max()) <= max_top_k_entropy(k) + 1e-6
    assert abs(float(top_k_entropy(jnp.full((3,), 1 / 3), 3)) - math.log(3)) < 1e-6
    np.testing.assert_array_equal(following_run(jnp.asarray([1, 1, 0, 1, 1, 1, 0, 1], bool)),
                                  [1, 0, 3, 2, 1, 0, 1, 0])


def vllm_reference(inputs, threshold, window, greedy, top_k=3):
    """vLLM's pre-pass kernels, as loops over one block's valid slots: returns
    the accepted prefix length the native kernel then finds."""
    x = np.asarray(inputs.draft_tokens)
    n = int(np.asarray(inputs.valid).sum())
    k = x.shape[0]
    tl = np.asarray(inputs.target_logits[:k], np.float64)
    p = np.exp(tl - tl.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.asarray(inputs.draft_probs, np.float64)
    u = np.asarray(inputs.uniforms, np.float64)
    if greedy:
        native = [x[i] == tl[i].argmax() for i in range(k)]
    else:
        native = [q[i, x[i]] > 0 and p[i, x[i]] / q[i, x[i]] >= u[i] for i in range(k)]
    accepted = list(native)
    for pos in range(n):
        top = np.sort(p[pos])[::-1][:top_k]
        top = top[top > 0]
        entropy = -(top * np.log(top)).sum()
        can_defer = (not native[pos] and p[pos, x[pos]] > 0 and pos + window < n and entropy >= threshold)
        for off in range(1, window + 1):
            can_defer = can_defer and pos + off < n and native[pos + off]
        accepted[pos] = accepted[pos] or can_defer
    return int(np.cumprod(accepted[:n]).sum()) if n else 0


@pytest.mark.parametrize("greedy", [True, False])
def test_matches_a_loop_reference_of_vllms_kernels(greedy):
    inputs = random_batch(3, batch=200, k=6, v=5, greedy=greedy, scale=1.0)
    rng = np.random.default_rng(4)
    valid = np.arange(6)[None, :] < rng.integers(1, 7, (200, 1))
    inputs = inputs._replace(valid=jnp.asarray(valid))
    host = jax.tree.map(np.asarray, inputs)
    relaxed = 0
    for threshold, window in ((0.3, 1), (0.3, 2), (0.6, 3)):
        v = batched_verify(fly(threshold, window=window), inputs, greedy)
        accept = np.asarray(v.accept) & valid
        for b in range(200):
            one = jax.tree.map(lambda a: a[b], host)
            assert prefix(accept[b]) == vllm_reference(one, threshold, window, greedy), (threshold, window, b)
        relaxed += int((np.asarray(v.path) == R).sum())
    assert relaxed > 20  # the reference was exercised where FLy differs from the lossless rule


# ------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("greedy", [True, False])
def test_limits_are_the_lossless_rule_and_the_default_accepts_more(greedy):
    inputs = random_batch(5, batch=256, k=6, v=6, greedy=greedy, scale=1.0)
    sd = batched_verify(speculative_sampling(), inputs, greedy)
    for limit in (fly(max_top_k_entropy(3) + 1e-3), fly(5.0, top_k=8), fly(0.0, window=6)):
        got = batched_verify(limit, inputs, greedy)
        for a, b in zip(got, sd):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the default relaxes: a superset of lossless acceptances, strictly larger somewhere
    got = batched_verify(fly(0.3, window=2), inputs, greedy)
    native = np.asarray(sd.accept)
    accept = np.asarray(got.accept)
    assert (accept | ~native).all()
    n_sd = sum(prefix(a) for a in native)
    n_fly = sum(prefix(a) for a in accept)
    assert n_fly > n_sd
    # paths: EXACT iff the lossless test accepts, RELAXED for the rest accepted
    path = np.asarray(got.path)
    np.testing.assert_array_equal(path == E, native)
    np.testing.assert_array_equal(path == R, accept & ~native)
    np.testing.assert_array_equal(path == X, ~accept)


def test_constructed_block_accepts_more_with_a_negative_control():
    inputs = block([H, H, H, H, H], np.zeros((4, 4)), [1, 0, 0, 0])
    sd = verify(speculative_sampling(), inputs, greedy=True)
    assert prefix(sd.accept) == 0
    assert prefix(verify(fly(), inputs, greedy=True).accept) == 4
    # negative control: the target is confident at the mismatch, FLy is the lossless rule
    confident = block([L, H, H, H, H], np.zeros((4, 4)), [1, 0, 0, 0])
    assert prefix(verify(fly(), confident, greedy=True).accept) == 0
    assert prefix(verify(speculative_sampling(), confident, greedy=True).accept) == 0


def test_threshold_is_traced_top_k_is_static():
    f = jax.jit(lambda rule, inputs: rule.verify(inputs, (), greedy=True))
    inputs = block([H, H, H], np.zeros((3, 4)), [1, 0, 0])
    a = f(fly(0.3, window=2), inputs)
    b = f(fly(5.0, window=1), inputs)  # another threshold and window: the same program
    assert f._cache_size() == 1
    assert bool(a.accept[0]) and not bool(b.accept[0])
    f(fly(0.3, window=2, top_k=4), inputs)
    assert f._cache_size() == 2


# --------------------------------------------------------------------- spec, parsing, errors


def test_spec_and_parse_round_trip():
    assert str(fly().spec) == "fly:entropy_threshold=0.3"
    assert parse_rule("fly") == fly()
    r = parse_rule("fly:entropy_threshold=0.3,top_k=3,window=2")
    assert r == fly(0.3, window=2) and str(r) == "fly:entropy_threshold=0.3,window=2"
    for rule in (fly(), fly(0.5, window=4, top_k=5), fly(0.0, window=1, top_k=1)):
        again = parse_rule(str(rule.spec))
        assert again == rule and again.spec == rule.spec and hash(again) == hash(rule)
    assert parse_rule("any_of(sd,fly:entropy_threshold=0.2,window=3)").rules[1] == fly(0.2, window=3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(entropy_threshold=-0.1), "entropy_threshold must be >= 0"),
    (dict(entropy_threshold=float("nan")), "entropy_threshold must be finite"),
    (dict(entropy_threshold="0.3"), "entropy_threshold must be a real number"),
    (dict(top_k=0), "top_k must be an integer >= 1"),
    (dict(top_k=2.5), "top_k must be an integer >= 1"),
    (dict(window=0), "window must be an integer >= 1"),
    (dict(window=-2), "window must be an integer >= 1"),
    (dict(window=2.0), "window must be an integer >= 1"),
    (dict(window=True), "window must be an integer >= 1"),
])
def test_bad_hyper_parameters_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fly(**kwargs)


def test_bad_strings_are_refused():
    with pytest.raises(ValueError, match="top_k must be an integer >= 1"):
        parse_rule("fly:top_k=0")
    with pytest.raises(ValueError, match="fly has no parameter 'theta'; valid parameters: "
                                         "entropy_threshold, window, top_k"):
        parse_rule("fly:theta=0.3")


# ------------------------------------------------------------------------------- decoding


def target_greedy(table, prompt, n):
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(np.argmax(table[last]))
        out.append(last)
    return out


@pytest.fixture(scope="module")
def near_pair():
    """Bigram target (``random_table(0, 8)``) and a draft that is the target with
    rows 0, 3 and 5's top-2 logits swapped: there the draft proposes the
    target's runner-up, and agrees with the target's argmax elsewhere."""
    from specjax.testing import bigram_model, random_table

    target = random_table(0, 8)
    draft = target.copy()
    for row in (0, 3, 5):
        first, second = np.argsort(-target[row])[:2]
        draft[row, [first, second]] = target[row, [second, first]]
    return specjax.pair(bigram_model(target), bigram_model(draft))


def test_decode_end_to_end(near_pair):
    table = np.asarray(near_pair.target.params["table"])
    prompts = [[3, 1, 4], [1, 5], [2, 6, 5, 3], [0], [7, 7]] * 8
    kw = dict(num_draft=4, max_new_tokens=16, key=jax.random.key(0), eos_token_id=())
    # the lossless limit: the target's own greedy output
    out = specjax.decode(near_pair, prompts, rule=fly(5.0), temperature=0.0, **kw)
    for row, prompt in zip(np.asarray(out.tokens), prompts):
        assert list(row[:16]) == target_greedy(table, prompt, 16)
    assert out.stats.accepted_by_path_total["relaxed"] == 0
    # the gate at 0.3 relaxes: more tokens per cycle than lossless, RELAXED acceptances counted
    # (window 2: the draft's greedy cycles meet a swapped row every third token)
    relaxed = specjax.decode(near_pair, prompts, rule=fly(0.3, window=2), temperature=0.0, **kw)
    sd = specjax.decode(near_pair, prompts, rule=speculative_sampling(), temperature=0.0, **kw)
    assert relaxed.stats.accepted_by_path_total["relaxed"] > 0
    assert relaxed.stats.tau > sd.stats.tau
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(sd.tokens))
    # sampling runs, and every emitted token is one the target allows
    sampled = specjax.decode(near_pair, prompts, rule=parse_rule("fly:window=2"), temperature=1.0,
                             top_k=4, **kw)
    tokens = np.asarray(sampled.tokens)[:, :16]
    assert sampled.stats.accepted_by_path_total["relaxed"] > 0
    for row, prompt in zip(tokens, prompts):
        previous = [prompt[-1]] + list(row[:-1])
        for a, b in zip(previous, row):
            assert table[a, b] >= np.sort(table[a])[-4], (a, b)  # in the target's top-4


def test_trees_are_refused_by_name():
    """FLy's window reads the following slots of a chain; a tree's block is not one."""
    pair = specjax.pair(bigram_model(random_table(0, 8)), bigram_model(random_table(1, 8)))
    for rule in (fly(), any_of(speculative_sampling(), fly(window=1))):
        with pytest.raises(ValueError, match="fly.. judges a chain"):
            specjax.decode(pair, [[1]], rule=rule, tree=specjax.trees.static_tree((2, 2)), temperature=0.0)
