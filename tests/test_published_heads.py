"""Published draft heads (EAGLE-1/2, EAGLE-3, Medusa) load from their authors' layouts.

No weights can be downloaded, so each test writes a tiny random checkpoint in
the published layout (tensor names, shapes, ``config.json`` fields, ``.bin`` or
safetensors) for a tiny Llama target, then checks:

* the loaded head's logits equal an independent PyTorch reimplementation of
  the published forward (SafeAILab/EAGLE ``cnets1.py`` / ``cnets.py``,
  FasterDecoding/Medusa ``medusa_model.py``) on the same weights, with the
  target's features taken from ``transformers``' own forward of the target
  (``output_hidden_states``: entry ``i`` enters layer ``i``, the last is after
  the final norm), so the layer indexing is checked too;
* greedy speculative decoding with the head returns the target's greedy tokens;
* with a reduced draft vocabulary (``d2t`` / ``t2d``) the lossless rule
  samples the target's law (chi-square), and a rule that accepts every draft
  (the draft's own law) is rejected by the same test, drafting only mapped ids;
* bad input is refused by name.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import specjax  # noqa: E402
from specjax._src.models import published_heads as ph  # noqa: E402
from specjax.rules import Path, Verdict, from_functions, speculative_sampling  # noqa: E402
from specjax.testing import llama_config, peaked_target_and_draft  # noqa: E402
from specjax.trees import static_tree  # noqa: E402
from test_decode import goodness_of_fit, random_prompts  # noqa: E402

H, INNER, HEADS, KV, HEAD_DIM, LAYERS = 32, 64, 4, 2, 8, 7
EPS, THETA = 1e-6, 10000.0


# --------------------------------------------------------------------------- #
# the target and its features from transformers
# --------------------------------------------------------------------------- #


def _target(vocab, scale=1.0):
    cfg = llama_config(num_layers=LAYERS, vocab_size=vocab, norm_eps=EPS, rope_theta=THETA)
    target = peaked_target_and_draft(cfg)[0]
    if scale != 1.0:
        target = target.replace(params={**target.params, "lm_head": target.params["lm_head"] * scale})
    return target


@pytest.fixture(scope="module")
def target():
    return _target(96)


@pytest.fixture(scope="module")
def hf_target(target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf_target") / "t")
    specjax.export_hf(target, path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_hidden(hf_model, tokens):
    """``transformers``' hidden states of ``tokens [T]``: entry ``i`` enters layer ``i``; the last is normed."""
    with torch.no_grad():
        out = hf_model(torch.tensor([tokens]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


# --------------------------------------------------------------------------- #
# checkpoints in the published layouts
# --------------------------------------------------------------------------- #


def _rand(rng, *shape, std=0.2):
    return (std * rng.standard_normal(shape)).astype(np.float32)


def _norm_w(rng):
    return (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)


def _llama_block(rng, prefix, in_width, norms):
    t = {f"{prefix}self_attn.q_proj.weight": _rand(rng, HEADS * HEAD_DIM, in_width),
         f"{prefix}self_attn.k_proj.weight": _rand(rng, KV * HEAD_DIM, in_width),
         f"{prefix}self_attn.v_proj.weight": _rand(rng, KV * HEAD_DIM, in_width),
         f"{prefix}self_attn.o_proj.weight": _rand(rng, H, HEADS * HEAD_DIM),
         f"{prefix}mlp.gate_proj.weight": _rand(rng, INNER, H),
         f"{prefix}mlp.up_proj.weight": _rand(rng, INNER, H),
         f"{prefix}mlp.down_proj.weight": _rand(rng, H, INNER)}
    for name in norms:
        t[f"{prefix}{name}.weight"] = _norm_w(rng)
    return t


def _llama_config(vocab, layers=1, **extra):
    return dict(model_type="llama", hidden_size=H, intermediate_size=INNER, num_attention_heads=HEADS,
                num_key_value_heads=KV, num_hidden_layers=layers, vocab_size=vocab, rms_norm_eps=EPS,
                rope_theta=THETA, max_position_embeddings=128, torch_dtype="float32", **extra)


def _write(path, config, tensors, fmt, file=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if fmt == "bin":
        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
                   os.path.join(path, file or "pytorch_model.bin"))
    else:
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                  os.path.join(path, file or "model.safetensors"))
    return path


def eagle1_checkpoint(path, vocab, *, seed=0, layers=2, fmt="bin", embed=None, bias=True):
    """EAGLE-1/2 (cnets1.py): fc [H, 2H] (+ bias), layers.{i} (layer 0 without input_layernorm)."""
    rng = np.random.default_rng(seed)
    t = {"fc.weight": _rand(rng, H, 2 * H)}
    if bias:
        t["fc.bias"] = _rand(rng, H)
    for i in range(layers):
        norms = ["post_attention_layernorm"] + (["input_layernorm"] if i else [])
        t.update(_llama_block(rng, f"layers.{i}.", H, norms))
    if embed is not None:
        t["embed_tokens.weight"] = embed
    return _write(path, _llama_config(vocab, layers, architectures=["LlamaForCausalLM"], bias=bias), t, fmt), t


def eagle3_checkpoint(path, vocab, *, seed=0, draft_ids=None, fmt="bin", extra_config=None, arch=True, layers=1):
    """EAGLE-3 (cnets.py): fc [H, 3H], midlayer (q/k/v over 2H), norm, lm_head [Vd, H], d2t, t2d;
    with ``layers`` > 1, vLLM's later layers.{i} (standard blocks over H)."""
    rng = np.random.default_rng(seed)
    ids = np.arange(vocab) if draft_ids is None else np.sort(np.asarray(draft_ids))
    t = {"fc.weight": _rand(rng, H, 3 * H), "norm.weight": _norm_w(rng), "lm_head.weight": _rand(rng, len(ids), H, std=1.0)}
    t.update(_llama_block(rng, "midlayer.", 2 * H, ["input_layernorm", "hidden_norm", "post_attention_layernorm"]))
    for i in range(1, layers):
        t.update(_llama_block(rng, f"layers.{i}.", H, ["input_layernorm", "post_attention_layernorm"]))
    t["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    t["t2d"] = t2d
    config = _llama_config(vocab, layers, draft_vocab_size=len(ids), **(extra_config or {}))
    if arch:
        config["architectures"] = ["LlamaForCausalLMEagle3"]
    return _write(path, config, t, fmt), t


def medusa_checkpoint(path, vocab, *, seed=0, heads=3, res_layers=1, fmt="safetensors"):
    """Medusa (medusa_model.py): medusa_lm_head.* with {i}.{j}.linear.weight/bias and {i}.{n}.weight."""
    rng = np.random.default_rng(seed)
    t = {}
    for i in range(heads):
        for j in range(res_layers):
            t[f"{i}.{j}.linear.weight"] = _rand(rng, H, H)
            t[f"{i}.{j}.linear.bias"] = _rand(rng, H)
        t[f"{i}.{res_layers}.weight"] = _rand(rng, vocab, H, std=1.0)
    config = {"medusa_num_heads": heads, "medusa_num_layers": res_layers, "base_model_name_or_path": "tiny"}
    file = "medusa_lm_head.pt" if fmt == "bin" else "medusa_lm_head.safetensors"
    return _write(path, config, t, fmt, file=file), t


# --------------------------------------------------------------------------- #
# the reference: the published forwards, in PyTorch
# --------------------------------------------------------------------------- #


def _t(x):
    return torch.as_tensor(np.array(x), dtype=torch.float32)


def _rms(x, w):
    return _t(w) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _attention(x, w, prefix):
    """LlamaAttention of EAGLE's cnets: causal, GQA, rotary positions 0 .. T-1."""
    t = x.shape[0]
    q = (x @ _t(w[f"{prefix}q_proj.weight"]).T).view(t, HEADS, HEAD_DIM).transpose(0, 1)
    k = (x @ _t(w[f"{prefix}k_proj.weight"]).T).view(t, KV, HEAD_DIM).transpose(0, 1)
    v = (x @ _t(w[f"{prefix}v_proj.weight"]).T).view(t, KV, HEAD_DIM).transpose(0, 1)
    inv = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = q @ k.transpose(1, 2) / HEAD_DIM**0.5
    scores = scores + torch.triu(torch.full((t, t), float("-inf")), 1)
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, HEADS * HEAD_DIM)
    return out @ _t(w[f"{prefix}o_proj.weight"]).T


def _mlp(x, w, prefix):
    silu = torch.nn.functional.silu
    gate, up = x @ _t(w[f"{prefix}gate_proj.weight"]).T, x @ _t(w[f"{prefix}up_proj.weight"]).T
    return (silu(gate) * up) @ _t(w[f"{prefix}down_proj.weight"]).T


def eagle1_reference(w, embed, tokens, feature, lm_head, layers):
    """cnets1.py Model.forward, then the base model's lm_head on the output (no norm)."""
    x = torch.cat((_t(embed)[tokens], feature), -1) @ _t(w["fc.weight"]).T
    if "fc.bias" in w:
        x = x + _t(w["fc.bias"])
    for i in range(layers):
        p = f"layers.{i}."
        residual = x
        h = _rms(x, w[p + "input_layernorm.weight"]) if i else x  # index 0: no input_layernorm
        x = residual + _attention(h, w, p + "self_attn.")
        x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    return x @ _t(lm_head).T, x


def eagle3_reference(w, embed, tokens, aux, vocab, norm_before_residual=False):
    """cnets.py: fc over the concatenated aux states, LlamaDecoderLayeremb, lm_head(norm(.)), d2t to target ids
    (vLLM's norm_before_residual: the residual is the normed fused state)."""
    hidden = torch.cat(aux, -1) @ _t(w["fc.weight"]).T
    p = "midlayer."
    h = _rms(hidden, w[p + "hidden_norm.weight"])
    residual = h if norm_before_residual else hidden
    e = _rms(_t(embed)[tokens], w[p + "input_layernorm.weight"])
    x = residual + _attention(torch.cat((e, h), -1), w, p + "self_attn.")
    x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    i = 1
    while f"layers.{i}.input_layernorm.weight" in w:  # vLLM's later layers: pre-norm blocks over the stream
        p = f"layers.{i}."
        x = x + _attention(_rms(x, w[p + "input_layernorm.weight"]), w, p + "self_attn.")
        x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
        i += 1
    draft = _rms(x, w["norm.weight"]) @ _t(w["lm_head.weight"]).T
    ids = torch.arange(draft.shape[-1]) + torch.as_tensor(w["d2t"])
    full = torch.full((draft.shape[0], vocab), float("-inf"))
    full[:, ids] = draft
    return full, x


def medusa_reference(w, feature, heads, res_layers):
    """medusa_model.py: head i = Sequential(ResBlock * n, Linear(H, V)) on the normed last hidden state."""
    out = []
    for i in range(heads):
        x = feature
        for j in range(res_layers):
            x = x + torch.nn.functional.silu(x @ _t(w[f"{i}.{j}.linear.weight"]).T + _t(w[f"{i}.{j}.linear.bias"]))
        out.append(x @ _t(w[f"{i}.{res_layers}.weight"]).T)
    return torch.stack(out, -2)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), "the -inf pattern differs"
    return float(np.max(np.abs(a[finite] - b[finite])) / np.max(np.abs(b[finite])))


def _head_forward(pair, seq):
    """The paired head's cache-free forward over ``seq``: position i reads the target's f_i and x_{i+1}."""
    head, target = pair.draft, pair.target
    tokens = jnp.asarray([seq], jnp.int32)
    out = target.module.apply(target.params, tokens, hidden_layers=head.module.feature_layers)
    feats = head.module.target_features(head.params, jnp.concatenate(out.hidden, -1))
    res = head.module.apply(head.params, tokens[:, 1:], features=feats[:, :-1])
    return np.asarray(res.logits[0]), np.asarray(res.hidden[0][0])


SEQ = [3, 17, 5, 60, 2, 41, 9, 33, 70, 12]


# --------------------------------------------------------------------------- #
# logits against the references
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmt, embedded", [("bin", False), ("safetensors", True)])
def test_eagle1_logits_equal_the_published_forward(tmp_path, target, hf_target, fmt, embedded):
    table = np.asarray(target.params["embed"]["embedding"])
    ship = _rand(np.random.default_rng(9), *table.shape, std=1.0) if embedded else None
    path, w = eagle1_checkpoint(str(tmp_path / "e1"), 96, fmt=fmt, embed=ship)
    head = specjax.load(path)
    assert head.module.variant == "eagle" and head.module.borrows_embedding == (not embedded)
    pair = specjax.pair(target, head)
    logits, f_hat = _head_forward(pair, SEQ)
    hidden = _hf_hidden(hf_target, SEQ)
    lm_head = np.asarray(target.params["lm_head"]).T
    ref, ref_hat = eagle1_reference(w, ship if embedded else table, torch.tensor(SEQ[1:]), hidden[-1][:-1],
                                    lm_head, layers=2)
    assert rel_err(logits, ref.numpy()) < 1e-5
    assert rel_err(f_hat, ref_hat.numpy()) < 1e-5


def test_eagle1_with_a_tied_target_scores_with_its_embedding_table(tmp_path, target, hf_target):
    cfg = target.module.config.replace(tie_word_embeddings=True)
    tied = target.replace(params={k: v for k, v in target.params.items() if k != "lm_head"},
                          module=specjax.Decoder(cfg))  # the same blocks and norm: the same features
    path, w = eagle1_checkpoint(str(tmp_path / "e1"), 96, bias=False)
    pair = specjax.pair(tied, specjax.load(path))
    assert "lm_head_table" in pair.draft.params and "lm_head" not in pair.draft.params
    logits, _ = _head_forward(pair, SEQ)
    table = np.asarray(target.params["embed"]["embedding"])
    ref, _ = eagle1_reference(w, table, torch.tensor(SEQ[1:]), _hf_hidden(hf_target, SEQ)[-1][:-1], table, layers=2)
    assert rel_err(logits, ref.numpy()) < 1e-5


@pytest.mark.parametrize("fmt, explicit, layers", [("bin", False, 1), ("safetensors", True, 1), ("safetensors", False, 3)],
                         ids=["bin-defaults", "safetensors-explicit", "three-layers"])
def test_eagle3_logits_equal_the_published_forward(tmp_path, target, hf_target, fmt, explicit, layers):
    ids = np.random.default_rng(4).choice(96, 40, replace=False)
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}} if explicit else None
    path, w = eagle3_checkpoint(str(tmp_path / "e3"), 96, draft_ids=ids, fmt=fmt, extra_config=extra, layers=layers)
    head = specjax.load(path)
    assert head.module.variant == "eagle3" and head.module.num_layers == layers
    pair = specjax.pair(target, head)
    # defaults: the states entering layers (2, L // 2, L - 3); explicit ids name block outputs (SGLang's + 1)
    enter = [1, 4, 6] if explicit else [2, LAYERS // 2, LAYERS - 3]
    logits, f_hat = _head_forward(pair, SEQ)
    hidden = _hf_hidden(hf_target, SEQ)
    table = np.asarray(target.params["embed"]["embedding"])
    ref, ref_hat = eagle3_reference(w, table, torch.tensor(SEQ[1:]), [hidden[i][:-1] for i in enter], 96)
    assert rel_err(logits, ref.numpy()) < 1e-5
    assert rel_err(f_hat, ref_hat.numpy()) < 1e-5
    assert np.isfinite(logits).sum(-1).tolist() == [40] * (len(SEQ) - 1)  # only the draft vocabulary


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_medusa_logits_equal_the_published_forward(tmp_path, target, hf_target, fmt):
    path, w = medusa_checkpoint(str(tmp_path / "m"), 96, heads=3, res_layers=2, fmt=fmt)
    head = specjax.load(path)
    assert isinstance(head.module, ph.MedusaHead) and head.module.num_heads == 3
    pair = specjax.pair(target, head)
    hidden = _hf_hidden(hf_target, SEQ)[-1]  # the target's normed last hidden state
    tokens = jnp.asarray([SEQ], jnp.int32)
    out = target.module.apply(target.params, tokens, hidden_layers=(-1,))
    feats = pair.draft.module.target_features(pair.draft.params, out.hidden[0])
    ref = medusa_reference(w, hidden, 3, 2).numpy()
    allheads = ph.medusa_logits(pair.draft.params, feats[0, :, :H])
    assert rel_err(allheads, ref) < 1e-5
    # through the draft protocol: step k (carried in the feature) scores with head k
    step = feats
    for k in range(3):
        res = pair.draft.module.apply(pair.draft.params, tokens, features=step)
        assert rel_err(res.logits[0], ref[:, k]) < 1e-5
        step = res.hidden[0]


# --------------------------------------------------------------------------- #
# decoding
# --------------------------------------------------------------------------- #


def test_greedy_with_each_published_head_is_target_greedy(tmp_path, target):
    heads = {
        "eagle1": eagle1_checkpoint(str(tmp_path / "e1"), 96)[0],
        "eagle3": eagle3_checkpoint(str(tmp_path / "e3"), 96, draft_ids=np.arange(0, 96, 2), layers=2)[0],
        "medusa": medusa_checkpoint(str(tmp_path / "m"), 96)[0],
    }
    prompts = random_prompts(3, 6, 96, 9, min_len=1)
    ref = specjax.generate(target, prompts, max_new_tokens=12, temperature=0.0, eos_token_id=())
    for name, path in heads.items():
        out = specjax.decode(specjax.pair(target, specjax.load(path)), prompts, num_draft=3, max_new_tokens=12,
                             temperature=0.0, eos_token_id=())
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), err_msg=name)
        assert int(np.sum(out.stats.drafted)) > 0, name
    # a tree: Medusa's depth-d nodes score with head d (the step channel counts the depth)
    out = specjax.decode(specjax.pair(target, specjax.load(heads["medusa"])), prompts, tree=static_tree((2, 2)),
                         max_new_tokens=12, temperature=0.0, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    # the slots engine (a server's loop): its chunked prefill hands Medusa the same features
    from specjax.engine import Engine, SlotSettings

    engine = Engine(specjax.pair(target, specjax.load(heads["medusa"])), num_slots=2, capacity=64, num_draft=3)
    state, got = engine.init(), {0: [], 1: []}
    for slot in got:
        state = engine.insert(state, slot, prompts[slot], SlotSettings(temperature=0.0, max_new_tokens=12))
    for _ in range(12):  # at least one token per cycle: 12 steps of 4 cycles are plenty
        if all(len(g) >= 12 for g in got.values()):
            break
        state, step = engine.step(state, num_cycles=4)
        step = jax.device_get(step)
        for slot in got:
            got[slot] += step.tokens[slot, : step.counts[slot]].tolist()
    for slot in got:
        assert got[slot][:12] == np.asarray(ref.tokens)[slot, :12].tolist()


# --------------------------------------------------------------------------- #
# the lossless law with a reduced draft vocabulary
# --------------------------------------------------------------------------- #


def _accept_all():
    """Deliberately wrong: accepts every draft, so the output follows the draft's own law."""

    def verify(inputs, state, *, greedy):
        del state, greedy
        k = inputs.draft_tokens.shape[0]
        return Verdict(accept=jnp.ones((k,), bool), path=jnp.full((k,), Path.EXACT, jnp.int32),
                       correction=inputs.target_probs[:k])

    base = speculative_sampling()
    return from_functions(verify, init=base.init, update=base.update, name="accept_all")


# Slow-only (about 29 s): a loaded EAGLE-3 head is a feature head with its own vocabulary ids, and
# the law with a head reduced to 12 of 16 ids runs by default
# (test_feature_head.py::test_lossless_sampling_with_a_head_follows_the_target); the EAGLE-3 head
# drafts with its d2t ids by default in test_greedy_with_each_published_head_is_target_greedy.
@pytest.mark.slow
def test_lossless_sampling_with_a_reduced_draft_vocabulary_follows_the_target(tmp_path):
    from test_feature_head import _exact_two_tokens, _sampled_two_tokens

    vocab, prompt, samples = 16, [5, 3], 20000
    target = _target(vocab, scale=0.1)  # flatter laws: many cells are tested
    ids = np.asarray([0, 2, 3, 5, 8, 11, 12, 15])
    path, _ = eagle3_checkpoint(str(tmp_path / "e3"), vocab, draft_ids=ids, seed=3)
    pair = specjax.pair(target, specjax.load(path))
    exact = _exact_two_tokens(target, prompt, vocab)
    counts, stats = _sampled_two_tokens(pair, prompt, vocab, samples, num_draft=3, key=jax.random.key(7),
                                        rule=speculative_sampling())
    pvalue, tv = goodness_of_fit(counts, exact)
    # (256 cells of a flat law: 20,000 samples leave a TV of about 0.05 by chance alone)
    assert pvalue > 1e-3 and tv < 0.07, f"chi-square p={pvalue:.2e}, TV={tv:.4f}"
    assert int(np.sum(stats.accepted)) > samples // 10  # the head's drafts took part
    assert counts[np.setdiff1d(np.arange(vocab), ids)].sum() > 0  # tokens outside the draft vocabulary too
    # negative control: every draft accepted is the draft's law, which the same test rejects; and the
    # drafts are target ids of the draft vocabulary only (d2t applied before sampling)
    wrong, _ = _sampled_two_tokens(pair, prompt, vocab, 4000, num_draft=3, key=jax.random.key(7),
                                   rule=_accept_all())
    outside = np.setdiff1d(np.arange(vocab), ids)
    assert wrong[outside].sum() == 0 and wrong[:, outside].sum() == 0
    pvalue, tv = goodness_of_fit(wrong, exact)
    assert pvalue < 1e-6 and tv > 0.2


# --------------------------------------------------------------------------- #
# bad input
# --------------------------------------------------------------------------- #


def test_bad_published_heads_are_refused_by_name(tmp_path, target):
    # a head of another width than its target
    path, _ = eagle3_checkpoint(str(tmp_path / "ok"), 96)
    wide = peaked_target_and_draft(llama_config(num_layers=LAYERS, hidden_size=48, head_dim=12))[0]
    with pytest.raises(ValueError, match="32-wide features but the target's hidden size is 48"):
        specjax.pair(wide, specjax.load(path))
    # EAGLE-3's default blocks need a deep enough target
    shallow = peaked_target_and_draft(llama_config(num_layers=4))[0]
    with pytest.raises(ValueError, match="at least 7 blocks"):
        specjax.pair(shallow, specjax.load(path))
    # an unpaired EAGLE-3 head does not know its blocks yet
    head = specjax.load(path)
    with pytest.raises(ValueError, match="known once it is paired"):
        head.module.target_features(head.params, jnp.zeros((1, 2, 3 * H)))

    def edit(name, config=None, drop=(), **tensors):
        src, t = eagle3_checkpoint(str(tmp_path / name), 96, draft_ids=np.arange(40))
        with open(os.path.join(src, "config.json")) as f:
            cfg = {**json.load(f), **(config or {})}
        t = {k: v for k, v in {**t, **tensors}.items() if k not in drop}
        return _write(src, cfg, t, "bin")

    with pytest.raises(ValueError, match="d2t has 5 entries but lm_head.weight scores 40"):
        specjax.load(edit("d2t", d2t=np.zeros(5, np.int64)))
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target vocabulary"):
        specjax.load(edit("range", d2t=np.full(40, 90, np.int64)))
    with pytest.raises(ValueError, match="two draft ids to one target id"):
        specjax.load(edit("dup", d2t=-np.arange(40, dtype=np.int64)))
    with pytest.raises(ValueError, match="t2d .* does not mark exactly"):
        specjax.load(edit("t2d", t2d=np.ones(96, bool)))
    with pytest.raises(ValueError, match="lacks tensor 'midlayer.hidden_norm.weight'"):
        specjax.load(edit("missing", drop=("midlayer.hidden_norm.weight",)))
    with pytest.raises(ValueError, match="draft_vocab_size 41"):
        specjax.load(edit("dvocab", config={"draft_vocab_size": 41}))
    with pytest.raises(ValueError, match="does not load.*EAGLE-3"):
        specjax.load(edit("arch", config={"architectures": ["Eagle3DeepseekV2ForCausalLM"]}))
    with pytest.raises(ValueError, match="ids >= 1 .0 would be the embeddings"):
        specjax.load(edit("toplevel", config={"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}))
    with pytest.raises(ValueError, match="names eagle_aux_hidden_state_layer_ids twice"):
        specjax.load(edit("twice", config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                                           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}))
    with pytest.raises(ValueError, match="lacks tensor 'layers.1.self_attn.q_proj.weight'"):
        specjax.load(edit("layers", config={"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="tensors this layout does not use: extra.weight"):
        specjax.load(edit("extra", **{"extra.weight": np.zeros(3, np.float32)}))
    # a pickle holding anything but tensors is refused (torch's weights_only unpickler), not run
    evil = str(tmp_path / "evil")
    eagle1_checkpoint(evil, 96)
    torch.save({"fc.weight": torch.zeros(H, 2 * H), "x": _Pickled()}, os.path.join(evil, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="cannot be read as a PyTorch state dict"):
        ph.read_tensors([os.path.join(evil, "pytorch_model.bin")])
    assert not _Pickled.ran
    # EAGLE-1/2: fc.bias missing although the config does not say bias: false
    e1, t = eagle1_checkpoint(str(tmp_path / "e1"), 96)
    _write(e1, json.load(open(os.path.join(e1, "config.json"))) | {"bias": True},
           {k: v for k, v in t.items() if k != "fc.bias"}, "bin")
    with pytest.raises(ValueError, match="lacks tensor 'fc.bias'"):
        specjax.load(e1)
    # Medusa: a head for another vocabulary
    m, _ = medusa_checkpoint(str(tmp_path / "m"), 80)
    with pytest.raises(ValueError, match="scores a 80-token vocabulary and the target 96.*trained on"):
        specjax.pair(target, specjax.load(m))
    with pytest.raises(ValueError, match="scores 80 tokens but the target's vocabulary has 96"):
        specjax.pair(target, specjax.load(m), vocab_size=80)
    m2, t = medusa_checkpoint(str(tmp_path / "m2"), 96, heads=2)
    _write(m2, {"medusa_num_heads": 2, "medusa_num_layers": 2}, t, "safetensors",
           file="medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match="medusa_num_layers 2 but the heads hold 1"):
        specjax.load(m2)
    _write(m2, {"medusa_num_heads": 5, "medusa_num_layers": 1}, t, "safetensors",
           file="medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match="medusa_num_heads 5 but the weights hold 2"):
        specjax.load(m2)
    with pytest.raises(ValueError, match="d2t must be a 1-D integer tensor"):
        specjax.load(edit("d2tfloat", d2t=np.zeros(40, np.float32)))
    # helpers that take specjax's own heads say so for the published layouts
    from specjax import heads

    with pytest.raises(ValueError, match="EAGLE-1/2 head scores with its target's full LM head"):
        heads.with_head_vocab(specjax.load(eagle1_checkpoint(str(tmp_path / "e1b"), 96)[0]), np.arange(4))
    medusa = specjax.load(medusa_checkpoint(str(tmp_path / "m3"), 96)[0])
    with pytest.raises(TypeError, match="dequantize needs a specjax Decoder or feature head, got MedusaHead"):
        specjax.dequantize(medusa)
    with pytest.raises(TypeError, match="with_num_layers needs a feature head.*MedusaHead"):
        heads.with_num_layers(medusa, 2)


class _Pickled:
    """An object a full unpickler would rebuild by running code (``__reduce__``)."""

    ran = False

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    _Pickled.ran = True
    return None


def test_a_loaded_eagle3_head_saves_as_a_specjax_head_and_loads_back(tmp_path, target):
    from specjax import heads

    path, _ = eagle3_checkpoint(str(tmp_path / "e3"), 96, draft_ids=np.arange(0, 96, 3),
                                extra_config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}})
    head = specjax.load(path)
    heads.save_head(head, str(tmp_path / "saved"))
    again = specjax.load(str(tmp_path / "saved"))
    assert (again.module.variant, again.module.feature_layers) == ("eagle3", (1, 3, 5))
    a, _ = _head_forward(specjax.pair(target, head), SEQ)
    b, _ = _head_forward(specjax.pair(target, again), SEQ)
    np.testing.assert_array_equal(a, b)



@pytest.mark.parametrize("norm_before_residual", [None, False], ids=["default", "after-residual"])
def test_a_speculators_eagle3_head_equals_the_published_forward(tmp_path, target, hf_target, norm_before_residual):
    """The speculators format (vLLM's Eagle3Speculator configs): the block's LlamaConfig under
    transformer_layer_config, the tensors under layers.0.*, norm_before_residual true unless the
    config says otherwise, and a top-level eagle_aux_hidden_state_layer_ids naming the states
    entering target layers (vLLM's convention: 1, 4, 6 are SpecForge's block outputs 0, 3, 5)."""
    ids = np.random.default_rng(5).choice(96, 40, replace=False)
    src, w = eagle3_checkpoint(str(tmp_path / "e3"), 96, draft_ids=ids, fmt="safetensors", arch=False)
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in w.items()}
    with open(os.path.join(src, "config.json")) as f:
        layer_config = json.load(f)
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.2.0", "draft_vocab_size": len(ids), "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": [1, 4, 6],
              "transformer_layer_config": {k: v for k, v in layer_config.items() if k != "draft_vocab_size"},
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "a-target", "architectures": ["LlamaForCausalLM"]}}}
    if norm_before_residual is not None:
        config["norm_before_residual"] = norm_before_residual
    path = _write(str(tmp_path / "speculators"), config, tensors, "safetensors")
    assert ph.detect(path) == "eagle3"
    head = specjax.load(path)
    before = norm_before_residual is None
    assert head.module.variant == ("eagle3_norm_before_residual" if before else "eagle3")
    logits, f_hat = _head_forward(specjax.pair(target, head), SEQ)
    hidden = _hf_hidden(hf_target, SEQ)
    table = np.asarray(target.params["embed"]["embedding"])
    ref, ref_hat = eagle3_reference(w, table, torch.tensor(SEQ[1:]), [hidden[i][:-1] for i in (1, 4, 6)], 96,
                                    norm_before_residual=before)
    assert rel_err(logits, ref.numpy()) < 1e-5 and rel_err(f_hat, ref_hat.numpy()) < 1e-5
    other, _ = eagle3_reference(w, table, torch.tensor(SEQ[1:]), [hidden[i][:-1] for i in (1, 4, 6)], 96,
                                norm_before_residual=not before)
    assert rel_err(logits, other.numpy()) > 1e-3  # the two residual conventions differ on these weights
    # a speculators config without its block's fields is refused by name
    flat = _write(str(tmp_path / "flat"), {k: v for k, v in config.items() if k != "transformer_layer_config"},
                  tensors, "safetensors")
    with pytest.raises(ValueError, match="needs transformer_layer_config, an object .* it has none"):
        specjax.load(flat)
    # another speculators algorithm is refused by its name
    config["speculators_model_type"] = "mlp"
    config["architectures"] = ["MLPSpeculator"]
    other_path = _write(str(tmp_path / "mlp"), config, tensors, "safetensors")
    with pytest.raises(ValueError, match="speculators_model_type 'mlp'.*does not load"):
        specjax.load(other_path)


def test_published_configs_are_recognised_and_parsed(tmp_path):
    """The fields of real published configs (SpecForge's Qwen3-4B and Llama-3-70B EAGLE-3 configs,
    EAGLE's LLaMA3-Instruct-8B EAGLE-1 config): detected by kind, parsed to the head's block shape."""
    qwen3 = dict(architectures=["LlamaForCausalLMEagle3"], attention_bias=False, head_dim=80, hidden_act="silu",
                 hidden_size=2560, intermediate_size=9728, max_position_embeddings=40960, model_type="llama",
                 num_attention_heads=32, num_hidden_layers=1, num_key_value_heads=8, rms_norm_eps=1e-06,
                 rope_scaling=None, rope_theta=1000000, sliding_window=None, tie_word_embeddings=True,
                 torch_dtype="bfloat16", use_sliding_window=False, vocab_size=151936, draft_vocab_size=32000)
    llama70 = dict(architectures=["LlamaForCausalLMEagle3"], eos_token_id=[128001, 128008, 128009], head_dim=128,
                   hidden_act="silu", hidden_size=8192, intermediate_size=28672, max_position_embeddings=4096,
                   model_type="llama", num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=1,
                   rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="float16",
                   vocab_size=128256, draft_vocab_size=32000,
                   rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                     original_max_position_embeddings=4096, rope_type="llama3"))
    eagle8b = dict(architectures=["LlamaForCausalLM"], hidden_act="silu", hidden_size=4096, intermediate_size=14336,
                   max_position_embeddings=2048, model_type="llama", num_attention_heads=32, num_key_value_heads=8,
                   num_hidden_layers=1, rms_norm_eps=1e-05, tie_word_embeddings=False, torch_dtype="float16",
                   vocab_size=128256, rope_theta=500000.0, bias=False)
    for name, config, kind in (("qwen3", qwen3, "eagle3"), ("llama70", llama70, "eagle3"), ("e8b", eagle8b, "eagle")):
        path = _write(str(tmp_path / name), config, {"fc.weight": np.zeros((1,), np.float32)}, "bin")
        assert ph.detect(path) == kind, name
    cfg = ph._head_config(qwen3, "float32", head_vocab_size=32000, what="qwen3")
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (2560, 80, 32,
                                                                                                         8, False)
    cfg = ph._head_config(llama70, "float32", head_vocab_size=32000, what="llama70")
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0 and cfg.rope_theta == 500000.0
    # a plain model's pickles are not opened to look for a head (2 layers, no EAGLE field)
    plain = _write(str(tmp_path / "plain"), _llama_config(96, 2), {"fc.weight": np.zeros((1,), np.float32)}, "bin")
    assert ph.detect(plain) is None


def test_an_eagle3_head_over_the_whole_vocabulary_needs_no_d2t(tmp_path, target):
    path, t = eagle3_checkpoint(str(tmp_path / "full"), 96)
    _write(path, json.load(open(os.path.join(path, "config.json"))),
           {k: v for k, v in t.items() if k not in ("d2t", "t2d")}, "bin")
    head = specjax.load(path)
    np.testing.assert_array_equal(np.asarray(head.params["head_vocab_ids"]), np.arange(96))
    path, t = eagle3_checkpoint(str(tmp_path / "part"), 96, draft_ids=np.arange(40))
    _write(path, json.load(open(os.path.join(path, "config.json"))),
           {k: v for k, v in t.items() if k not in ("d2t", "t2d")}, "bin")
    with pytest.raises(ValueError, match="no d2t to map it"):
        specjax.load(path)


# --------------------------------------------------------------------------- #
# careless or hostile checkpoints: refused at load, by name
# --------------------------------------------------------------------------- #


def _edited(path, checkpoint, config=None, drop=(), **tensors):
    """``checkpoint(path)`` rewritten with ``config`` fields set (None: removed) and tensors replaced or dropped."""
    src, t = checkpoint(path)
    with open(os.path.join(src, "config.json")) as f:
        cfg = {**json.load(f), **(config or {})}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    t = {k: v for k, v in {**t, **tensors}.items() if k not in drop}
    medusa = "medusa_num_heads" in cfg
    return _write(src, cfg, t, "safetensors", file="medusa_lm_head.safetensors" if medusa else None)


def _e3(path):
    return eagle3_checkpoint(path, 96, draft_ids=np.arange(40))


def _e1(path):
    return eagle1_checkpoint(path, 96, layers=1)


def _medusa(path):
    return medusa_checkpoint(path, 96, heads=2)


_NAN = np.full((H, 3 * H), np.nan, np.float32)

BAD_CHECKPOINTS = {
    # config.json: missing or mistyped fields (a KeyError, a silent int("96"), bool("false"), int() noise before)
    "no_vocab_size": (_e3, dict(config={"vocab_size": None}), "lacks 'vocab_size'"),
    "eagle1_no_vocab_size": (_e1, dict(config={"vocab_size": None}), "lacks 'vocab_size'"),
    "vocab_size_string": (_e3, dict(config={"vocab_size": "96"}), "vocab_size '96'; it must be a positive integer"),
    "vocab_size_float": (_e3, dict(config={"vocab_size": 96.5}), "vocab_size 96.5; it must be a positive integer"),
    "layers_string": (_e3, dict(config={"num_hidden_layers": "one"}), "num_hidden_layers 'one'"),
    "norm_before_residual_string": (_e3, dict(config={"norm_before_residual": "false"}), "must be true or false"),
    "medusa_heads_string": (_medusa, dict(config={"medusa_num_heads": "2"}), "medusa_num_heads '2'"),
    # weights: not floating point (a quantized release, cast to garbage before) or not finite (NaN at decode)
    "int_weight": (_e3, {"midlayer.self_attn.q_proj.weight": np.ones((HEADS * HEAD_DIM, 2 * H), np.int32)},
                   "'midlayer.self_attn.q_proj.weight' is int32, not floating point"),
    "nan_weight": (_e3, {"fc.weight": _NAN}, "'fc.weight' holds NaN or inf"),
    "eagle1_inf_weight": (_e1, {"layers.0.post_attention_layernorm.weight": np.full(H, np.inf, np.float32)},
                          "holds NaN or inf"),
    "medusa_nan_weight": (_medusa, {"1.1.weight": np.full((96, H), np.nan, np.float32)}, "'1.1.weight' holds NaN"),
    # EAGLE-3's vocabulary maps
    "t2d_wrong_length": (_e3, {"t2d": np.ones(40, bool)}, r"t2d has shape \(40,\) .* \[96\]"),
    "draft_vocab_above_target": (_e3, {"lm_head.weight": np.ones((120, H), np.float32), "d2t": np.zeros(120, np.int64),
                                       "config": {"draft_vocab_size": 120}}, "120 draft tokens .* vocab_size .* is 96"),
    # Medusa: a bias on a (bias-free) LM head was dropped silently; a bad bias was reported as the weight's shape
    "medusa_lm_head_bias": (_medusa, {"0.1.bias": np.zeros(96, np.float32)}, "does not use: 0.1.bias"),
    "medusa_bias_shape": (_medusa, {"0.0.linear.bias": np.zeros(5, np.float32)}, r"bias \(5,\), expected"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoints_are_refused_at_load(tmp_path, case):
    checkpoint, edits, message = BAD_CHECKPOINTS[case]
    edits = dict(edits)
    path = _edited(str(tmp_path / case), checkpoint, edits.pop("config", None), **edits)
    with pytest.raises(ValueError, match=message):
        specjax.load(path)


def test_a_head_given_as_another_layout_is_refused_by_name(tmp_path):
    medusa = medusa_checkpoint(str(tmp_path / "m"), 96, heads=2)[0]
    with pytest.raises(ValueError, match="laid out as Medusa, not the EAGLE-3 head kind='eagle3'"):
        ph.load_published_head(medusa, kind="eagle3")
    eagle3 = _e3(str(tmp_path / "e3"))[0]
    with pytest.raises(ValueError, match="laid out as EAGLE-3, not the Medusa head"):
        ph.load_published_head(eagle3, kind="medusa")
    with pytest.raises(ValueError, match="kind must be 'eagle', 'eagle3' or 'medusa'.*'EAGLE3'"):
        ph.load_published_head(eagle3, kind="EAGLE3")


def test_public_helpers_refuse_bad_shapes_by_name(tmp_path):
    from specjax import heads

    with pytest.raises(ValueError, match="draft vocabulary is empty"):
        heads.draft_to_target_ids(np.zeros(0, np.int64), None, 0, 96)
    medusa = specjax.load(medusa_checkpoint(str(tmp_path / "m"), 96, heads=2)[0])
    with pytest.raises(ValueError, match=r"feature must be \[\.\.\., 32\]"):
        heads.medusa_logits(medusa.params, jnp.zeros((2, 31)))
