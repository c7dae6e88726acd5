"""Distil a draft model from a chat target: ``python -m training.draft``.

Three stages, each resumable, in one command:

1. **gather** (:mod:`training.distill_data`): the target answers the training
   chat prompts of :mod:`training.chat_prompts` (greedy, T=0.7 and T=1 in turn)
   and its top-32 next-token log-probabilities are stored per answer token.
2. **train**: a small Llama-layout draft learns the target's distributions
   (cross-entropy to the target's renormalised top-k, i.e. KL to the target up
   to a constant) on answer tokens, with Optax AdamW and Orbax checkpoints that
   resume after an interrupt (batches are a pure function of the step).
3. **export + evaluate**: a Hugging Face-style directory (bf16 safetensors,
   tokenizer, chat template, ``MODEL_CARD.md``) and the measured acceptance of
   lossless speculative decoding with the target on held-out chat prompts
   (topics no training prompt uses), plus ``c_draft / c_AR``.

The draft's LM head scores a reduced, frequency-ranked vocabulary
(``--head-vocab``, the tokens the target writes most): with a 49k vocabulary
the head would otherwise dominate a small draft's per-token cost. Decoding
stays lossless: the draft proposes only those tokens, and the target's
residual covers the rest. Its embedding table covers the full vocabulary
(prompts contain any token) and, like the head, starts from the target's own
embeddings projected on their top principal directions.

Reproduce the shipped draft (see its MODEL_CARD.md for the exact figures)::

    pip install -e ".[smollm2]"
    python -m training.draft --out runs/smollm2-draft --export specjax/assets/models/smollm2-draft

An interrupted run (Ctrl-C included) continues with the same command:
finished shards and the latest checkpoint are reused. If every checkpoint is
damaged, the run stops and says so; ``--fresh`` discards them and trains from
step 0. ``--out`` may not lie inside the installed package.

Answering is the slow stage (about 17 s per 32-prompt shard on 2 CPU cores); the
answers themselves are small. ``--pack-answers FILE.npz`` keeps a gather's token
ids (about 1 MB per pass over all prompts) and ``--answers-from FILE.npz`` rebuilds
``data/`` from them on another machine, recomputing the target's distributions by
teacher forcing instead of answering again. The packed passes live in
``training/answers/``. ``--export`` refuses to overwrite an existing
directory unless ``--force`` (checked before gathering), except this run's own
export by the same command; the export is written, evaluated and carded in a
temporary directory and swapped in whole, keeping the replaced directory's
files it does not write itself (notes, earlier sessions' logs).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import Decoder, Model, ModelConfig
from specjax.heads import is_feature_head
from specjax.models import Transformer, astype
from training import chat_prompts, common, distill_data

DEFAULT_TARGET = "smollm2-135m-instruct"


# ----------------------------------------------------------------------------- data


# Training rows: ``tokens [N, S]``, ``mask [N, S]`` (position predicts an answer
# token), ``teacher_ids [N, S, k]`` (reduced-vocab index, -1 if the token is
# outside it), ``teacher_logp [N, S, k]``.
Rows = dict

def head_vocabulary(shards: dict, size: int, vocab_size: int, always: tuple[int, ...],
                    among: np.ndarray | None = None) -> np.ndarray:
    """The ``size`` token ids the target writes or predicts first most often
    (answer tokens plus its top-1 predictions), with ``always`` (EOS) first;
    only ids in ``among`` when given (narrowing a trained head); sorted by id."""
    width = shards["tokens"].shape[1]
    new = shards["top_ids"].shape[1]
    valid = np.arange(new)[None, :] < shards["answer_lengths"][:, None]
    answers = shards["tokens"][:, width - new:][valid]
    counts = np.bincount(answers, minlength=vocab_size) + np.bincount(
        shards["top_ids"][..., 0][valid], minlength=vocab_size)
    if among is not None:
        allowed = np.zeros(vocab_size, bool)
        allowed[np.asarray(among)] = True
        counts = np.where(allowed, counts, -1)
        always = tuple(t for t in always if allowed[t])
    ranked = np.argsort(-counts, kind="stable")
    if among is not None:
        ranked = ranked[: int(allowed.sum())]
    chosen = list(dict.fromkeys([int(t) for t in always] + ranked.tolist()))[:size]
    return np.sort(np.asarray(chosen, np.int32))


def build_rows(shards: dict, head_ids: np.ndarray, seq_len: int, vocab_size: int) -> Rows:
    """Compacts each (prompt, answer) into one row of ``seq_len`` tokens."""
    to_head = np.full((vocab_size,), -1, np.int32)
    to_head[head_ids] = np.arange(len(head_ids), dtype=np.int32)
    n, width = shards["tokens"].shape
    new, k = shards["top_ids"].shape[1:]
    pw = width - new
    longest = int(np.max(shards["prompt_lengths"], initial=0))
    if longest >= seq_len:
        raise ValueError(f"a row of {seq_len} tokens leaves no room for an answer after a {longest}-token prompt; "
                         f"use rows longer than the longest prompt (seq_len {longest + 64} or more).")
    tokens = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), bool)
    t_ids = np.full((n, seq_len, k), -1, np.int32)
    t_lp = np.zeros((n, seq_len, k), np.float16)
    for i in range(n):
        p, a = int(shards["prompt_lengths"][i]), int(shards["answer_lengths"][i])
        a = min(a, seq_len - p)
        tokens[i, :p] = shards["tokens"][i, :p]
        tokens[i, p:p + a] = shards["tokens"][i, pw:pw + a]
        # Position p-1+t holds the target's distribution over answer token t.
        mask[i, p - 1:p - 1 + a] = True
        t_ids[i, p - 1:p - 1 + a] = to_head[shards["top_ids"][i, :a]]
        t_lp[i, p - 1:p - 1 + a] = shards["top_logprobs"][i, :a]
    return Rows(tokens=tokens, mask=mask, teacher_ids=t_ids, teacher_logp=t_lp)


def batch_fn_for(rows: Rows, batch_size: int, seed: int):
    """``step -> batch``: a pure function of the step (epochs reshuffled by seed)."""
    n = rows["tokens"].shape[0]
    per_epoch = n // batch_size

    def batch(step: int):
        epoch, i = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        idx = np.sort(order[i * batch_size:(i + 1) * batch_size])
        return {k: jnp.asarray(v[idx]) for k, v in rows.items()}

    return batch


# ----------------------------------------------------------------------------- model


def draft_config(target_cfg: ModelConfig, hidden: int, layers: int, heads: int, kv_heads: int,
                 mlp: int, head_vocab: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=target_cfg.vocab_size,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=mlp,
        max_position_embeddings=target_cfg.max_position_embeddings,
        rope_theta=target_cfg.rope_theta,
        norm_eps=target_cfg.norm_eps,
        tie_word_embeddings=False,
        bos_token_id=target_cfg.bos_token_id,
        eos_token_id=target_cfg.eos_token_id,
        eos_token_ids=target_cfg.eos_token_ids,
        pad_token_id=target_cfg.pad_token_id,
        dtype="float32",
        head_vocab_size=head_vocab,
    )


def init_from_target(cfg: ModelConfig, target: Model, head_ids: np.ndarray, seed: int) -> dict:
    """Random blocks; embedding and head from the target's (tied) embedding
    table projected on its top ``hidden`` principal directions, so the draft
    starts from the target's token geometry rather than from noise."""
    params = Decoder(cfg).init(jax.random.key(seed))
    table = np.asarray(target.params["embed"]["embedding"], np.float32)  # [V, H_t]
    _, _, vt = np.linalg.svd(table[head_ids], full_matrices=False)
    proj = vt[: cfg.hidden_size].T  # [H_t, H]
    embed = table @ proj
    embed *= 0.02 / embed.std()
    params["embed"]["embedding"] = jnp.asarray(embed, jnp.float32)
    params["lm_head"] = jnp.asarray(embed[head_ids].T, jnp.float32)
    params["head_vocab_ids"] = jnp.asarray(head_ids, jnp.int32)
    return params


def split_trainable(params: dict) -> tuple[dict, dict]:
    """(trainable float params, the integer head ids)."""
    ids = {"head_vocab_ids": params["head_vocab_ids"]}
    rest = {k: v for k, v in params.items() if k != "head_vocab_ids"}
    return rest, ids


def make_loss(cfg: ModelConfig, head_ids: jax.Array):
    transformer = Transformer(cfg)

    def loss_fn(params, batch):
        full = dict(params, head_vocab_ids=head_ids)
        tokens = batch["tokens"]
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _, _ = transformer.apply({"params": full}, tokens, positions, None, None, None, True)
        logq = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V']
        ids = batch["teacher_ids"]
        in_head = ids >= 0
        teacher = jnp.where(in_head, batch["teacher_logp"].astype(jnp.float32), -jnp.inf)
        p = jax.nn.softmax(teacher, axis=-1)  # the target's top-k within the head, renormalised
        p = jnp.where(in_head, p, 0.0)
        logq_t = jnp.take_along_axis(logq, jnp.maximum(ids, 0), axis=-1)
        ce = -jnp.sum(p * logq_t, axis=-1)  # [B, T]
        mask = batch["mask"] & in_head.any(-1)
        denom = jnp.maximum(mask.sum(), 1)
        loss = jnp.sum(jnp.where(mask, ce, 0.0)) / denom
        agree = (jnp.argmax(logits, -1) == ids[..., 0]) & mask
        return loss, {"top1_agreement": agree.sum() / denom}

    return loss_fn


# ----------------------------------------------------------------------------- evaluation


def measure_acceptance(target: Model, draft: Model, prompts: list[str], *, num_draft: int,
                       max_new_tokens: int, temperature: float, batch_size: int = 8, seed: int = 0) -> dict:
    """Lossless speculative decoding on chat ``prompts``: acceptance and tau.

    ``acceptance_rate`` is alpha = accepted / judged (``DecodeStats``), the
    per-token rate that predicts tau; ``accepted_per_drafted`` is the share of
    drafted tokens kept; ``first_position`` is alpha at slot 0 (always judged).
    """
    pair = specjax.pair(target, draft)
    eos = target.module.config.eos_token_ids
    outs = []
    for start in range(0, len(prompts), batch_size):
        ids = [specjax.encode_chat(target, p) for p in prompts[start:start + batch_size]]
        out = specjax.decode(pair, ids, num_draft=num_draft, max_new_tokens=max_new_tokens,
                             temperature=temperature, eos_token_id=eos, key=jax.random.key(seed + start))
        outs.append(out.stats)
    s = specjax.concatenate_stats(outs)  # pooled counts, not averaged rates
    return {"acceptance_rate": s.acceptance_rate, "accepted_per_drafted": s.accepted_per_drafted,
            "first_position": float(s.acceptance_at_position[0]), "tau": s.tau, "prompts": len(prompts),
            "num_draft": num_draft, "temperature": temperature, "max_new_tokens": max_new_tokens}


def forward_costs(target: Model, draft: Model, *, num_draft: int, batch: int = 1, repeats: int = 20) -> dict:
    """Median wall time of one cached 1-token forward of each model and of the
    target's (K+1)-token verification forward after a 64-token prefix, at
    ``batch`` sequences, after warm-up (``repeats`` timed calls each, the three
    forwards taking turns so that a slow spell of a shared machine hits all of
    them alike). The draft may be a feature head (``specjax.heads``): it is fed
    features too. ``draft=None`` times the target only (``c_draft`` 0)."""
    def forward(model, t):
        module, params = model.module, model.params

        def extra(n):  # a feature head also reads n target features
            return {"features": jnp.ones((batch, n, module.hidden_size))} if is_feature_head(module) else {}

        cache = module.init_cache(batch, 256)
        cache = module.apply(params, jnp.ones((batch, 64), jnp.int32), cache, **extra(64)).cache

        @jax.jit
        def fwd(params, cache, tokens):
            return module.apply(params, tokens, cache, **extra(tokens.shape[1])).logits

        tokens = jnp.ones((batch, t), jnp.int32)
        run = lambda: jax.block_until_ready(fwd(params, cache, tokens))  # noqa: E731
        run()
        return run

    runs = {"ar": forward(target, 1), "verify": forward(target, num_draft + 1)}
    if draft is not None:
        runs["draft"] = forward(draft, 1)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    c_ar, c_verify = float(np.median(times["ar"])), float(np.median(times["verify"]))
    c_draft = float(np.median(times["draft"])) if draft is not None else 0.0
    return {"c_ar_ms": 1e3 * c_ar, "c_draft_ms": 1e3 * c_draft, "c_verify_ms": 1e3 * c_verify,
            "c_draft/c_ar": c_draft / c_ar, "c_verify/c_ar": c_verify / c_ar}


# ----------------------------------------------------------------------------- export


def export(draft: Model, dest: pathlib.Path) -> pathlib.Path:
    """Writes the draft as bf16 safetensors + config + tokenizer into a
    temporary sibling of ``dest`` (returned); ``common.swap_in`` puts it in
    place once its card and logs are written too."""
    tmp = dest.with_name(dest.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    specjax.export_hf(astype(draft, "bfloat16"), str(tmp))
    return tmp


def write_card(path: pathlib.Path, summary: dict) -> None:
    s = summary
    acc = "\n".join(
        f"| T={a['temperature']} | K={a['num_draft']} | {a['acceptance_rate']:.3f} | {a['accepted_per_drafted']:.3f} | "
        f"{a['first_position']:.3f} | {a['tau']:.2f} | "
        f"{a['prompts']} | {a['max_new_tokens']} |" for a in s["acceptance"]
    )
    costs = s["costs"]
    text = f"""# {s['name']}: a draft for {s['target']}

Distilled here by `python -m training.draft` from the target's own answers to
{s['train_prompts']} generated chat prompts ({s['train_rows']} answers,
{s['train_answer_tokens']:,} answer tokens, greedy / T=0.7 / T=1 in turn) and its
top-{s['top_k']} next-token distributions. Loss: cross-entropy to the target's
renormalised top-k within the draft's head vocabulary (KL to the target up to a
constant), on answer tokens only.

Command: `{s['command']}`

| | |
|---|---|
| layout | Llama, {s['config']['num_layers']} layers, hidden {s['config']['hidden_size']}, {s['config']['num_heads']} heads / {s['config']['num_kv_heads']} KV heads, MLP {s['config']['intermediate_size']} |
| head | {s['config']['head_vocab_size']} most frequent target tokens (covers {100 * s['head_coverage']:.2f}% of answer tokens); full 49,152-token embedding |
| params | {s['params']:,} (per-token read excluding the embedding: {s['params_per_token']:,}) |
| steps / batch / tokens | {s['steps']} / {s['batch']} x {s['seq_len']} / {s['tokens_seen']:,} row tokens |
| wall time | {s['train_minutes']:.1f} min training on {s['machine']} |
| final train loss | {s['final_loss']:.4f} |
| held-out loss | {s['heldout']['loss']:.4f} (top-1 agreement {s['heldout']['top1_agreement']:.3f}) on {s['heldout']['rows']} held-out rows |

Acceptance of lossless speculative decoding with the target, batch 8, on
held-out chat prompts (subjects no training prompt uses), float32:

| temperature | K | acceptance rate alpha (accepted / judged) | accepted / drafted | first-slot acceptance | tau | prompts | new tokens |
|---|---|---|---|---|---|---|---|
{acc}

Forward costs (batch 1, float32, median of 20, {s['machine']}): target 1 token
{costs['c_ar_ms']:.2f} ms, draft 1 token {costs['c_draft_ms']:.2f} ms
(**c_draft / c_AR = {costs['c_draft/c_ar']:.3f}**), target {s['num_draft'] + 1}-token verification
{costs['c_verify_ms']:.2f} ms (c_verify / c_AR = {costs['c_verify/c_ar']:.2f}).

Training log (loss, top-1 agreement) every {s['log_every']} steps is in `train_log.json`.
"""
    path.write_text(text)


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.draft", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model (name, dir or .gguf) (default: %(default)s)")
    p.add_argument("--out", default="runs/smollm2-draft", help="run directory: data/, ckpt/ (default: %(default)s)")
    p.add_argument("--export", default=None, help="write the trained draft here (HF-style dir, bf16)")
    p.add_argument("--force", action="store_true", help="replace an existing --export directory or --pack-answers file")
    p.add_argument("--fresh", action="store_true",
                   help="discard the checkpoints in OUT/ckpt (and damaged steps set aside in OUT/ckpt.damaged) and "
                        "train from step 0; gathered data is kept")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("gather")
    g.add_argument("--prompts", type=int, default=None, help="training prompts to answer (default: all)")
    g.add_argument("--gather-batch", type=int, default=32)
    g.add_argument("--new-tokens", type=int, default=192, help="answer budget per prompt (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=32)
    g.add_argument("--gather-pass", type=int, default=0,
                   help="0: the first answers; 1, 2: more, each prompt at another temperature (shards after pass 0's); "
                        "3 on: the cycle again, greedy prompts sampled near greedy instead (distill_data.pass_temperature)")
    g.add_argument("--gather-only", action="store_true", help="stop after gathering")
    g.add_argument("--no-gather", action="store_true", help="train on the shards already gathered")
    g.add_argument("--use-shards", type=int, default=None,
                   help="train on the first N shards only (recorded; resume uses the same)")
    g.add_argument("--answers-from", metavar="FILE.npz", action="append", default=[],
                   help="rebuild data/ from answers packed by --pack-answers (the target's distributions "
                        "recomputed by teacher forcing, not answered again) instead of gathering; repeatable")
    g.add_argument("--pack-answers", metavar="FILE.npz", default=None,
                   help="after gathering, write data/'s answers (token ids only, 0.8 MB for 620k tokens) "
                        "to FILE.npz, so they outlive the run directory (--force replaces it)")
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--mlp", type=int, default=768)
    g.add_argument("--head-vocab", type=int, default=8192)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=1200)
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--init-from", default=None,
                   help="start from an exported draft (e.g. the shipped one) instead of the target's embeddings: "
                        "its layout and head vocabulary are kept; a fresh optimizer and schedule (continue "
                        "training in a later session, on more gathered data)")
    g.add_argument("--heldout-rows", type=int, default=128, help="rows kept out of training for the held-out loss")
    g.add_argument("--train-only", action="store_true", help="skip export and evaluation")
    g.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: simulate a kill
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=int, default=64)
    g.add_argument("--eval-new-tokens", type=int, default=128)
    g.add_argument("--num-draft", type=int, default=5)
    return p


def load_init(args, target: Model) -> Model | None:
    """The ``--init-from`` draft, checked against the target; its layout and head
    vocabulary replace the model flags."""
    if not args.init_from:
        return None
    init = specjax.load(args.init_from, dtype="float32")
    if is_feature_head(init.module) or "head_vocab_ids" not in init.params:
        raise SystemExit(f"error: --init-from {args.init_from} is not a draft made by python -m training.draft "
                         "(no reduced head: head_vocab_ids); pass such an exported draft, or leave --init-from "
                         "out to start from the target's embeddings.")
    if init.vocab_size != target.vocab_size:
        raise SystemExit(f"error: --init-from {args.init_from} has a {init.vocab_size}-token vocabulary, the target "
                         f"{args.target} {target.vocab_size}: it drafts for another target; pass a draft of this "
                         "target, or leave --init-from out.")
    c = init.module.config
    args.hidden, args.layers, args.heads, args.kv_heads = c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads
    args.mlp, args.head_vocab = c.intermediate_size, c.head_vocab_size
    return init


def check_model_flags(args, cfg_t: ModelConfig) -> None:
    """Exits naming the flag where ``init_from_target`` cannot build the draft:
    it projects the target's embeddings of the --head-vocab tokens on their top
    --hidden principal directions, of which there are at most min(both sizes)."""
    if args.hidden > cfg_t.hidden_size:
        raise SystemExit(f"error: --hidden {args.hidden} is wider than the target's hidden size "
                         f"{cfg_t.hidden_size}: the draft's embedding is the target's projected on its top --hidden "
                         f"principal directions; pass --hidden {cfg_t.hidden_size} or less.")
    if args.head_vocab > cfg_t.vocab_size:
        raise SystemExit(f"error: --head-vocab {args.head_vocab} is more than the target's {cfg_t.vocab_size}-token "
                         f"vocabulary; pass --head-vocab {cfg_t.vocab_size} or less.")
    if args.head_vocab < args.hidden:
        raise SystemExit(f"error: --head-vocab {args.head_vocab} is smaller than --hidden {args.hidden}: the "
                         f"{args.head_vocab} head tokens' embeddings have at most {args.head_vocab} principal "
                         f"directions; pass --head-vocab {args.hidden} or more, or --hidden {args.head_vocab} or less.")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gather_pass < 0:
        parser.error(f"--gather-pass must be 0 (the first answers) or more, got {args.gather_pass}")
    command = "python -m training.draft " + " ".join(argv if argv is not None else sys.argv[1:])
    out = pathlib.Path(args.out)
    common.check_outside_package(out, "--out")
    common.check_resumable(out / "ckpt", fresh=args.fresh)
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "log.txt"
    log = lambda m: common._log(m, log_file)  # noqa: E731
    target = specjax.load(args.target)
    cfg_t = target.module.config
    # Bad flags and an occupied --export fail now, not after gathering and training.
    init = load_init(args, target)
    if init is None:
        check_model_flags(args, cfg_t)
    try:
        cfg = draft_config(cfg_t, args.hidden, args.layers, args.heads, args.kv_heads, args.mlp, args.head_vocab)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    run_id = common.run_id(out)
    export_dir = pathlib.Path(args.export) if args.export else out / "export"
    force = args.force or not args.export  # the run's own out/export is always replaced
    if not (args.gather_only or args.train_only or args.stop_after is not None):
        if common.check_export(export_dir, force=force, run_id=run_id, command=command):
            log(f"[draft] {export_dir} holds this run's export by this command: it is made again")

    train_prompts = chat_prompts.train_prompts()
    data_dir = out / "data"
    if args.answers_from:
        for packed in args.answers_from:
            try:
                distill_data.unpack_answers(target, packed, data_dir, log=log)
            except (OSError, ValueError, KeyError) as e:
                raise SystemExit(f"error: --answers-from {packed}: {e}") from None
    elif not args.no_gather:
        distill_data.gather(target, train_prompts, data_dir, batch_size=args.gather_batch,
                            new_tokens=args.new_tokens, top_k=args.top_k, max_prompts=args.prompts,
                            pass_index=args.gather_pass, log=log)
    if args.pack_answers:
        try:
            summary = distill_data.pack_answers(data_dir, args.pack_answers, force=args.force)
        except (FileExistsError, ValueError) as e:
            raise SystemExit(f"error: {e}") from None
        log(f"[pack] {summary['rows']} answers ({summary['answer_tokens']} tokens) of {summary['shards']} shards "
            f"-> {args.pack_answers} ({summary['bytes'] / 1e6:.1f} MB)")
    if args.gather_only:
        return 0

    meta_file = out / "run.json"
    run = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    shard_files = sorted(data_dir.glob("shard_*.npz"))
    num_shards = run.get("num_shards") or (args.use_shards or len(shard_files))
    run["num_shards"] = num_shards
    meta_file.write_text(json.dumps(run))
    shards = distill_data.load_shards(data_dir, limit=num_shards)
    eos = tuple(cfg_t.eos_token_ids)
    if init is not None:
        head_ids = np.asarray(init.params["head_vocab_ids"])
    else:
        head_ids = head_vocabulary(shards, args.head_vocab, cfg_t.vocab_size, eos)
    rows = build_rows(shards, head_ids, args.seq_len, cfg_t.vocab_size)
    coverage = float(np.mean(rows["teacher_ids"][..., 0][rows["mask"]] >= 0))
    n = rows["tokens"].shape[0]
    # Hold out the last rows' prompts in every gather pass, so no held-out prompt is also trained on.
    prompt_index = shards["prompt_index"]  # one row per gathered answer
    is_held = np.isin(prompt_index, prompt_index[n - args.heldout_rows:])
    held = Rows({k: v[is_held] for k, v in rows.items()})
    train = Rows({k: v[~is_held] for k, v in rows.items()})
    answer_tokens = int(train["mask"].sum())
    log(f"[draft] {num_shards} shards: {train['tokens'].shape[0]} train rows ({answer_tokens:,} answer tokens), "
        f"{held['tokens'].shape[0]} held-out rows; head covers {100 * coverage:.2f}% of answer tokens")

    params = init_from_target(cfg, target, head_ids, args.seed) if init is None else dict(init.params)
    trainable, ids = split_trainable(params)
    optimizer = common.adamw(args.lr, args.steps, warmup_steps=min(100, args.steps // 10), weight_decay=0.01)
    loss_fn = make_loss(cfg, ids["head_vocab_ids"])
    train_step = common.make_train_step(loss_fn, optimizer)
    state = common.init_state(trainable, optimizer)
    ckpt = common.Checkpointer(out / "ckpt", every_seconds=120)
    meta = {"config": cfg.to_dict(), "num_shards": num_shards, "seed": args.seed,
            "init_from": args.init_from}
    try:  # all of meta defines the run: other values would reinterpret the saved weights or batches
        restored = ckpt.restore(state, settings=meta, advice=(
            "rerun with the checkpoint's settings to resume it, or choose another --out to start a new run"),
            start_over="rerun with --fresh")
    except ValueError as e:  # CheckpointMismatch, or every step damaged
        ckpt.close()
        raise SystemExit(f"error: {e}") from None
    if restored is not None:
        state, meta = restored
        log(f"[draft] resumed at step {int(state['step'])}")
    batch_fn = batch_fn_for(train, args.batch, args.seed)
    history = []
    heldout_batch = {k: jnp.asarray(v) for k, v in held.items()}
    eval_loss = jax.jit(loss_fn)

    def eval_fn(step, state):
        loss, aux = eval_loss(state["params"], heldout_batch)
        res = {"heldout_loss": float(loss), "heldout_top1": float(aux["top1_agreement"])}
        history.append({"step": step, **res})
        return res

    state, meta = common.train_loop(
        state, train_step, batch_fn, args.steps, checkpointer=ckpt, meta=meta,
        tokens_per_step=args.batch * args.seq_len, eval_fn=eval_fn, eval_every=100, log_every=25,
        desc="draft", log_file=str(log_file), progress=not args.no_progress, stop_after=args.stop_after,
    )
    ckpt.close()
    if args.train_only or args.stop_after is not None:
        return 0

    loss, aux = eval_loss(state["params"], heldout_batch)
    final = dict(state["params"], head_vocab_ids=ids["head_vocab_ids"])
    draft = Model(params=final, module=Decoder(cfg), tokenizer=target.tokenizer,
                  chat_template=target.chat_template)
    # Evaluated, carded and logged in the temporary directory, then swapped in
    # whole: an interruption leaves the old export or the complete new one.
    tmp = export(draft, export_dir)
    draft = specjax.load(tmp, dtype="float32")  # what users get: the bf16 weights

    heldout_prompts = chat_prompts.heldout_prompts()[: args.eval_prompts]
    acceptance = [
        measure_acceptance(target, draft, heldout_prompts, num_draft=args.num_draft,
                           max_new_tokens=args.eval_new_tokens, temperature=t)
        for t in (0.0, 1.0)
    ]
    for a in acceptance:
        log(f"[draft] held-out acceptance: {json.dumps(a)}")
    costs = forward_costs(target, draft, num_draft=args.num_draft)
    log(f"[draft] forward costs: {json.dumps(costs)}")
    n_params = common.param_count(trainable)
    summary = {
        "name": export_dir.name, "target": args.target, "command": command, "run_id": run_id,
        "train_prompts": len(set(train_prompts[: num_shards * args.gather_batch])),
        "train_rows": int(train["tokens"].shape[0]), "train_answer_tokens": answer_tokens,
        "top_k": args.top_k, "config": cfg.to_dict(), "head_coverage": coverage,
        "params": n_params,
        "params_per_token": n_params - cfg.vocab_size * cfg.hidden_size,
        "steps": int(state["step"]), "batch": args.batch, "seq_len": args.seq_len,
        "tokens_seen": int(meta.get("tokens_seen", 0)), "train_minutes": float(meta.get("train_seconds", 0)) / 60,
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)",
        "final_loss": float(meta.get("last_loss", float("nan"))),
        "heldout": {"loss": float(loss), "top1_agreement": float(aux["top1_agreement"]),
                    "rows": int(held["tokens"].shape[0])},
        "acceptance": acceptance, "costs": costs, "num_draft": args.num_draft, "log_every": 100,
    }
    (tmp / "train_log.json").write_text(json.dumps({"summary": summary, "evals": meta.get("evals", history)}, indent=1))
    write_card(tmp / "MODEL_CARD.md", summary)
    common.check_export(export_dir, force=force, run_id=run_id, command=command)  # filled while we trained?
    kept = common.swap_in(tmp, export_dir)
    if kept:
        log(f"[draft] kept from the replaced {export_dir}: {', '.join(kept)} (files the export does not write)")
    log(f"[draft] wrote {export_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(common.exit_on_interrupt("python -m training.draft")(main)())
