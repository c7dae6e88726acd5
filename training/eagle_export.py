"""The trained EAGLE-style head written out (:mod:`training.eagle`): stage 5.

The head in bfloat16 (the borrowed embedding left out), saved, and its model card.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Optional

import jax
import jax.numpy as jnp

from specjax import Model, heads
from specjax.heads import FeatureHead


def as_bfloat16(head: Model) -> Model:
    cfg = head.module.config.replace(dtype="bfloat16")
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            x
            if (str(getattr(p[-1], "key", p[-1])) == "head_vocab_ids" or str(getattr(p[0], "key", p[0])) == "embed")
            else jnp.asarray(x, jnp.bfloat16)
        ),
        head.params,
    )
    return head.replace(params=params, module=FeatureHead(cfg, feature_layers=head.module.feature_layers))


def export(head: Model, dest: pathlib.Path, *, extra: dict, weights_format: str = "bfloat16") -> pathlib.Path:
    """Writes the head in bfloat16, or its matrices as int8 (``weights_format``;
    :func:`specjax.heads.save_head`), without the borrowed embedding, into a
    temporary sibling of ``dest`` (returned); ``common.swap_in`` puts it in
    place once its card and logs are written too."""
    tmp = dest.with_name(dest.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    heads.save_head(
        as_bfloat16(head),
        str(tmp),
        extra=extra,
        weights_format=None if weights_format == "bfloat16" else weights_format,
    )
    return tmp


def _stored_as(s: dict) -> str:
    if s.get("weights_format", "bfloat16") == "int8":
        return "int8 (a float16 scale per output channel)"
    return "bfloat16"


def _describe_layers(layers) -> str:
    if list(layers) == [-1]:
        return "its target's last-block features (before its final norm)"
    named = ["the last" if x == -1 else str(x) for x in layers]
    return (
        f"a learned mixture of its target's block outputs {', '.join(named[:-1])} and {named[-1]} "
        "(EAGLE-3's low, middle and high features; the last before the final norm)"
    )


def _temperature_note(s: dict) -> str:
    t = s.get("draft_temperature", 1.0)
    fit = s.get("draft_temperature_fit")
    if t == 1.0 and not fit:
        return ""
    how = (
        f"fitted by `--draft-temperature fit`: the mean T=1 overlap of draft steps 1-3 on "
        f"{s.get('calibration_rows')} training rows went from {fit['1.0']:.4f} at 1.0 to {fit[str(t)]:.4f}"
        if fit
        else "given by `--draft-temperature`"
    )
    return (
        f"\nDraft temperature: the exported head's logits are divided by {t} (its final norm's scale "
        f"times 1/{t}; greedy drafts are unchanged, sampled drafts are sharper), {how}. The held-out "
        "figures above are the exported head's.\n"
    )


def vocab_source(args, init, head_ids, coverage: float) -> str:
    """Where the head's reduced vocabulary came from, for its card."""
    if init is not None:
        if head_ids.size < init.module.config.head_vocab_size:
            return "the ones of its source head's vocabulary the training shards use most"
        return "its source head's vocabulary"
    if args.head_vocab_from:
        return f"the same vocabulary as `{pathlib.Path(args.head_vocab_from).name}`"
    return f"the ids the training answers use most, {100 * coverage:.2f}% of the target's top-1 tokens there"


def block_kind(model_type: str) -> str:
    """The family name of a head's blocks (they copy the target's layout)."""
    return {
        "gemma": "Gemma",
        "gemma2": "Gemma 2",
        "gemma3_text": "Gemma 3",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "mistral": "Mistral",
    }.get(model_type, "Llama")


def _blocks_word(n: int) -> str:
    return {1: "one", 2: "two", 3: "three", 4: "four"}.get(n, str(n))


def write_card(path: pathlib.Path, s: dict) -> None:
    ev = s["heldout"]
    ev0 = s["heldout_init"]
    evals = s.get("evals") or []
    curve = "\n".join(f"| {e['step']} | {e['step1']:.3f} | {e['step2']:.3f} | {e['step3']:.3f} |" for e in evals)
    text = f"""# {s["name"]}: an EAGLE-style feature head for {s["target"]}

A {_blocks_word(s["config"]["num_layers"])}-block draft head that reads {_describe_layers(s.get("feature_layers", [-1]))} and the next token, predicts the next feature and, through a
final norm and a reduced LM head ({s["config"]["head_vocab_size"]} tokens, {s.get("vocab_source") or "the same vocabulary as `smollm2-draft`"}), the token after it
(`specjax/_src/models/feature_head.py`). It borrows the target's embedding
table: the checkpoint stores only the head's own weights; pair it with the
target (`specjax.pair(target, specjax.load(...))`).

Trained by `python -m training.eagle` on the target's own answers gathered by
`python -m training.draft --gather-only` (`training/distill_data.py`: greedy / T=0.7 / T=1
answers to generated chat prompts, top-32 log-probabilities per token):
{s["train_rows"]:,} rows from {s["num_shards"]} shards, {s["train_answer_tokens"]:,} answer tokens.

Command: `{s["command"]}`

Loss per head position on answer tokens: cross-entropy to the target's
renormalised top-32 within the head vocabulary (KL up to a constant), plus
{s["reg_weight"]} x smooth-L1 between RMS-normalised predicted and true next
features (EAGLE-1), {"plus the same cross-entropy for a second draft step that reads the head's own predicted features, attending as when drafting (EAGLE-3's training-time test, " + str(s["unroll"]) + " steps)" if s["unroll"] > 1 else "no unrolled steps"}{", plus " + str(s["tv_weight"]) + " x (1 - sum min(p, q)) per step, the T=1 rejection chance (total variation, DistillSpec arXiv:2310.08461)" if s.get("tv_weight") else ""}. Embedding frozen.

| | |
|---|---|
| head | {"reduce [" + str(len(s.get("feature_layers", [-1]))) + "H -> H] over the RMS-normalised blocks, " if len(s.get("feature_layers", [-1])) > 1 else ""}fuse [2H -> H], feature norm, {s["config"]["num_layers"]} {s.get("block_kind", "Llama")} block{"s" if s["config"]["num_layers"] > 1 else ""} (the target's width: hidden {s["config"]["hidden_size"]}, {s["config"]["num_heads"]} / {s["config"]["num_kv_heads"]} heads, MLP {s["config"]["intermediate_size"]}), final norm, LM head over {s["config"]["head_vocab_size"]} tokens |
| init | the target's last block, final norm and embedding rows; fuse = identity on the feature half{", I / rms(embedding) on the token half (`balance_fuse`)" if s.get("balanced_fuse") else ""}{"; then " + s["init_note"] if s.get("init_note") else ""} |
| params (without the borrowed embedding) | {s["params"]:,} ({s["bytes"]:,} bytes of {_stored_as(s)} safetensors) |
| steps / batch | {s["steps"]}{f" (of {s['planned_steps']} planned: the time limit came first)" if s.get("planned_steps", s["steps"]) > s["steps"] else ""} / {s["batch"]} rows x {s["seq_len"]} tokens, AdamW lr {s["lr"]} (warmup, cosine) |
| wall time | {"features computed in each step, " if s.get("online_features") else f"features {s['feature_minutes']:.1f} min, "}training {s["train_minutes"]:.1f} min on {s["machine"]} |
| final train loss | {s["final_loss"]:.4f} |

Offline top-1 agreement with the target on {ev["rows"]} held-out chat prompts
(subjects no training prompt uses; the target's greedy answers, up to
{s["heldout_new_tokens"]} tokens, {ev["answer_positions"]:,} answer positions),
float32 evaluation of the exported {s.get("weights_format", "bfloat16")} weights. Step 1 reads the target's
feature (= first-slot acceptance at T=0); steps 2 and 3 read the head's own
predicted features with the target's tokens. `chain k`: share of chains whose
first k drafts all agree. `T=1 overlap`: mean `sum_v min(p_v, q_v)` over the
target's top 32 (the acceptance chance of speculative sampling at T=1).

| | step 1 | step 2 | step 3 | chain 2 | chain 3 | expected accepted of 3 | T=1 overlap, step 1 / 3 |
|---|---|---|---|---|---|---|---|
| {s["init_label"]} | {ev0["step1"]:.3f} | {ev0["step2"]:.3f} | {ev0["step3"]:.3f} | {ev0["chain2"]:.3f} | {ev0["chain3"]:.3f} | {ev0["expected_accepted"]:.2f} | {ev0["overlap1"]:.3f} / {ev0["overlap3"]:.3f} |
| **this head** | **{ev["step1"]:.3f}** | **{ev["step2"]:.3f}** | **{ev["step3"]:.3f}** | {ev["chain2"]:.3f} | {ev["chain3"]:.3f} | {ev["expected_accepted"]:.2f} | {ev["overlap1"]:.3f} / {ev["overlap3"]:.3f} |

{s.get("compare_note", "")}End-to-end acceptance and speed with the engine are not measured here.

Held-out agreement during training:

| step | step 1 | step 2 | step 3 |
|---|---|---|---|
{curve}
{_temperature_note(s)}
{s.get("notes", "")}
Training log in `train_log.json`.
"""
    path.write_text(text)


def write_derived_card(path: pathlib.Path, s: dict, source_card: Optional[str]) -> None:
    """The card of an untrained export (``--steps 0``): what was done to the
    ``--init-from`` head, both heads' held-out agreement, then the source
    head's own card (how it was trained), one heading level down."""
    ev, ev0 = s["heldout"], s["heldout_source"]
    row = lambda label, e: (
        f"| {label} | {e['step1']:.3f} | {e['step2']:.3f} | {e['step3']:.3f} | "  # noqa: E731
        f"{e['chain3']:.3f} | {e['expected_accepted']:.2f} | {e['overlap1']:.3f} / {e['overlap3']:.3f} |"
    )
    source = ""
    if source_card:
        demoted = "\n".join("#" + line if line.startswith("#") else line for line in source_card.splitlines())
        source = f"\n## The head it comes from: its own card\n\n{demoted}\n"
    text = f"""# {s["name"]}: an EAGLE-style feature head for {s["target"]}

{s["init_note"][0].upper() + s["init_note"][1:]}; not trained further. The LM head
scores {s["config"]["head_vocab_size"]:,} tokens ({100 * s["head_coverage"]:.2f}% of the target's top-1 tokens on the
training shards), {s["params"]:,} parameters ({s["bytes"]:,} bytes of {_stored_as(s)} safetensors) without the
embedding it borrows from the target.

Command: `{s["command"]}`

Offline top-1 agreement with the target on {ev["rows"]} held-out chat prompts ({ev["answer_positions"]:,} answer
positions; step 1 reads the target's feature, steps 2 and 3 the head's own; float32 evaluation of the exported
{s.get("weights_format", "bfloat16")} weights):

| | step 1 | step 2 | step 3 | chain 3 | expected accepted of 3 | T=1 overlap, step 1 / 3 |
|---|---|---|---|---|---|---|
{row(f"the head it comes from ({s['init_from']})", ev0)}
{row("**this head**", ev)}
{source}"""
    path.write_text(text)
