"""PAD's rule: collapse to lossless, features from the verify pass, head files, errors.

A tiny random Llama pair (hidden 32, vocabulary 96) as in test_decode; heads
are hand-built ``linear`` heads whose bias fixes P(pivot), so the outcome is
known without training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.rules import (
    Path,
    PivotHead,
    PivotHeadConfig,
    load_pivot_head,
    pad,
    parse_rule,
    pivot_features,
    resolve_layer,
    speculative_sampling,
)
from specjax._src.models.pivot_head import init_head_params
from test_decode import count_compilations
from tiny_models import llama_config, peaked_target_and_draft

H, V = 32, 96


def tiny_pair():
    return specjax.pair(*peaked_target_and_draft(llama_config(vocab_size=V, hidden_size=H)))


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 60], [7]]
KW = dict(num_draft=3, max_new_tokens=12)


def constant_head(p_pivot_logit: float, hidden_size: int = H, layer: int = -2) -> PivotHead:
    """A linear head with zero weights: P(pivot) = sigmoid(2 * logit) everywhere."""
    cfg = PivotHeadConfig(hidden_size=hidden_size, layer=layer, target_num_layers=2, arch="linear")
    params = init_head_params(cfg, jax.random.key(0))
    net = jax.tree.map(jnp.zeros_like, params["net"])
    net["out"]["bias"] = jnp.array([-p_pivot_logit, p_pivot_logit], jnp.float32)
    return PivotHead(cfg, {"net": net, "norm": params["norm"]})


ALWAYS_PIVOT = constant_head(10.0)
NEVER_PIVOT = constant_head(-10.0)


def test_all_pivot_head_is_lossless(pair):
    """Sampling (T=1): same key, same tokens as the lossless rule, no pardons;
    then another head of the same shape (and another sigma) reuses the compiled
    loop, its params being traced, and does pardon."""
    key = jax.random.key(3)
    ref = specjax.decode(pair, PROMPTS, rule=speculative_sampling(), temperature=1.0, key=key, **KW)
    same = specjax.decode(pair, PROMPTS, rule=pad(ALWAYS_PIVOT, sigma=0.5), temperature=1.0, key=key, **KW)
    np.testing.assert_array_equal(np.asarray(same.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(same.lengths), np.asarray(ref.lengths))
    assert same.stats.accepted_by_path_total["pardon"] == 0
    assert ref.stats.accepted_by_path_total["exact"] < ref.stats.drafted.sum()  # SD did reject some
    with count_compilations() as compiled:
        loose = specjax.decode(pair, PROMPTS, rule=pad(NEVER_PIVOT, sigma=0.3), temperature=1.0, key=key, **KW)
        jax.block_until_ready(loose.tokens)
    assert compiled["n"] == 0
    assert loose.stats.accepted_by_path_total["pardon"] > 0


def test_features_from_the_verify_pass_match_a_full_forward(pair):
    """The hidden state the engine hands the rule is the target's layer output at
    the draft token's own position; entropy / p(x) come from the preceding slot."""
    layer = -2
    spec_rule = pad(ALWAYS_PIVOT)  # declares hidden_layers, so the engine feeds hidden states

    def diag(inputs, verdict, n):
        h, s = pivot_features(inputs.features["hidden"][layer], inputs.target_probs, inputs.draft_tokens)
        return {"hidden": h, "scalars": s, "draft": inputs.draft_tokens.astype(jnp.float32)}

    out = specjax.decode(pair, [PROMPTS[1]], rule=spec_rule, temperature=0.0, num_draft=3,
                         max_new_tokens=2, diagnostics=diag)  # the prefill's first token, then exactly one cycle
    prompt = PROMPTS[1] + [int(out.tokens[0, 0])]
    extra = out.stats.extra
    drafts = np.asarray(extra["draft"][0]).astype(np.int32)
    seq = jnp.asarray([prompt + drafts.tolist()], jnp.int32)
    full = pair.target.module.apply(pair.target.params, seq, hidden_layers=(layer,))
    p = jax.nn.softmax(full.logits[0, :, :V], -1)
    n = len(prompt)
    want_hidden = np.asarray(full.hidden[0][0, n: n + 3])  # each draft token's own position
    judge = p[n - 1: n + 2]  # the slot before each draft token
    want_ent = -np.sum(np.asarray(jax.scipy.special.xlogy(judge, judge)), -1)
    want_prob = np.asarray(judge)[np.arange(3), drafts]
    np.testing.assert_allclose(np.asarray(extra["hidden"][0]), want_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(extra["scalars"][0, :, 0]), want_ent, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(extra["scalars"][0, :, 1]), want_prob, rtol=1e-4, atol=1e-6)


def test_pad_is_an_any_of_with_pardon_path():
    """Hand-built block: slot 0 passes the lossless test, slot 1 only the head, slot 2 fails p >= min_prob."""
    from specjax.rules import VerifyInputs

    probs = jnp.array([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.99995, 0.00004, 0.00001], [1 / 3] * 3])
    inputs = VerifyInputs(
        draft_tokens=jnp.array([0, 1, 1]), draft_logits=jnp.zeros((3, 3)), draft_probs=jnp.full((3, 3), 1 / 3),
        target_logits=jnp.log(probs), target_probs=probs, uniforms=jnp.array([0.1, 0.99, 0.99]),
        valid=jnp.ones((3,), bool), features={"hidden": {-2: jnp.zeros((3, H))}},
    )
    def verdict(rule):  # jitted: one compile beats hundreds of eager dispatches
        return jax.jit(lambda x: rule.verify(x, ((), ()), greedy=False))(inputs)

    v = verdict(pad(NEVER_PIVOT, min_prob=1e-4))
    np.testing.assert_array_equal(np.asarray(v.accept), [True, True, False])
    np.testing.assert_array_equal(np.asarray(v.path), [Path.EXACT, Path.PARDON, Path.REJECTED])
    v = verdict(pad(ALWAYS_PIVOT))
    np.testing.assert_array_equal(np.asarray(v.accept), [True, False, False])


def test_head_files_roundtrip_and_parse(tmp_path):
    head = constant_head(-1.0)
    head.params["net"]["out"]["kernel"] = jnp.ones_like(head.params["net"]["out"]["kernel"]) * 0.01
    head.save(tmp_path / "h")
    loaded = load_pivot_head(tmp_path / "h")
    assert loaded.source == str(tmp_path / "h")
    # The source is a label, not part of the compiled program's key.
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(head)
    x, s = jnp.ones((4, H)), jnp.ones((4, 2))
    np.testing.assert_allclose(np.asarray(loaded.prob_pivot(x, s)), np.asarray(head.prob_pivot(x, s)), rtol=1e-6)
    rule = pad(str(tmp_path / "h"), sigma=0.7)
    assert rule.spec.get("hidden_layers") == -2
    again = parse_rule(str(rule.spec))
    assert again.spec == rule.spec
    assert parse_rule(f"pad:head={tmp_path / 'h'},sigma=0.7").spec == rule.spec


def test_resolve_layer_clamps():
    assert resolve_layer(-8, 4) == -4
    assert resolve_layer(-2, 4) == -2
    assert resolve_layer(10, 4) == -1
    assert resolve_layer(0, 4) == -4


def test_errors(pair, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        pad(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="size 16.*size 32"):
        specjax.decode(pair, PROMPTS, rule=pad(constant_head(1.0, hidden_size=16)), temperature=0.0, **KW)
    with pytest.raises(ValueError, match="trained on layer -2"):
        pad(ALWAYS_PIVOT, hidden_layer=-1)
    assert pad(ALWAYS_PIVOT, hidden_layer=-8).spec.get("hidden_layers") == -2  # clamped: same layer
    with pytest.raises(ValueError, match="sigma"):
        pad(ALWAYS_PIVOT, sigma=1.5)
    with pytest.raises(TypeError, match="PivotHead"):
        pad(3)


def test_shipped_heads_load_by_name_and_fit_their_targets():
    """Each named head reads its own target: the real pair's is SmolLM2-135M-Instruct's
    layer -8 (hidden 576, 30 blocks); its source is the name, for the spec."""
    from specjax._src.models.pivot_head import NAMED_HEADS
    from specjax.rules import pad, parse_rule

    assert set(NAMED_HEADS) == {"shipped", "smollm2-135m-instruct"}
    rule = pad(head="smollm2-135m-instruct")
    head = rule.pardon.head
    assert (head.config.hidden_size, head.config.target_num_layers) == (576, 30)
    assert head.layer % 30 == 22 and head.source == "smollm2-135m-instruct"
    assert "head=smollm2-135m-instruct" in str(parse_rule("pad:head=smollm2-135m-instruct,sigma=0.5"))
    assert pad(head="shipped").pardon.head.config.hidden_size != 576  # the embedded pair's
    with pytest.raises(FileNotFoundError, match="config.json"):
        pad(head="smollm2-135m")  # not a name, not a directory


def test_a_fresh_head_standardises_its_features_by_the_training_split():
    cfg = PivotHeadConfig(hidden_size=H, layer=-2, target_num_layers=2, arch="linear")
    rng = np.random.default_rng(0)
    hidden, scalars = rng.normal(3.0, 2.0, (64, H)), rng.uniform(0.0, 1.0, (64, 2))
    norm = PivotHead.init(cfg, jax.random.key(0), hidden, scalars).params["norm"]
    np.testing.assert_allclose(np.asarray(norm["hidden_mean"]), hidden.mean(0), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(norm["scalar_std"]), scalars.std(0), rtol=1e-5)
    identity = PivotHead.init(cfg, jax.random.key(0)).params["norm"]
    assert float(jnp.abs(identity["hidden_mean"]).max()) == 0.0 and float(identity["hidden_std"].min()) == 1.0
    with pytest.raises(ValueError, match="both hidden and scalars"):
        PivotHead.init(cfg, jax.random.key(0), hidden)
