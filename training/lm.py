"""Train the embedded target/draft pair: ``python -m training.lm --model target|draft``.

Corpus and task: :mod:`training.data` (CPython stdlib source + ``assert A + B
== C`` with 0..99 operands; held-out task pairs and held-out stdlib files are
never trained on). Tokenizer: :mod:`training.tokenizer` (byte-level BPE, 2048
tokens, digits split). Models: Llama-layout :class:`specjax.Decoder`, float32
training, AdamW with warmup + cosine (:mod:`training.common`), Orbax
checkpoints every few minutes under ``--out``; ``--resume`` continues an
interrupted run exactly (step, params, optimizer state; batches are a pure
function of ``(seed, step)``).

At the end: held-out code and task loss, greedy exact match on the held-out
task, ``MODEL_CARD.md``, and a Hugging Face directory (config.json,
model.safetensors in bf16, tokenizer.json) written through the project's
exporter into ``--export`` (default ``<run dir>/export``; the shipped pair is
replaced only by naming ``--export specjax/assets/models/<model> --force``).

Reproduce the shipped pair (2-core CPU, both runs side by side, one XLA
thread each; the first command builds the tokenizer/corpus cache in
``runs/corpus`` and writes ``specjax/assets/task/``)::

    python -m training.lm --prepare-only
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \\
        python -m training.lm --model target --out runs/target --export specjax/assets/models/target --force &
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \\
        python -m training.lm --model draft --out runs/draft --export specjax/assets/models/draft --force &
    wait
    for m in target draft; do
        python -m specjax._src.models.packed specjax/assets/models/$m model.safetensors tokenizer.json
    done

(defaults: 2,400 steps of batch 16 x 96 tokens, 75% task rows, task-answer
tokens weighted 5x in the loss, seed 0). The last step stores the weights and
the tokenizer xz-compressed, as the shipped pair keeps them
(:mod:`specjax._src.models.packed`). The corpus is this interpreter's
stdlib, so the tokenizer and code data are exactly reproducible only on the
same CPython version (the pair shipped was trained on 3.11.7). An interrupted
run continues with the same command plus ``--resume`` (``--rehorizon`` also
accepts a new ``--steps``); ``--export-only`` re-runs the final evaluation and
export from the last checkpoint.

Measured for the shipped pair (shared 2-core CPU, other jobs running):

=========================  ======================  ======================
                           target                  draft
=========================  ======================  ======================
params                     1,377,408 (4 layers)    184,512 (1 layer)
steps / tokens seen        2,400 / 3.69M           2,400 / 3.69M
wall time                  37.6 min                13.8 min
held-out code loss         3.99 nats/token         4.08 nats/token
held-out task loss         0.708 nats/token        0.960 nats/token
held-out task exact match  97.2% (500 problems)    4.4% (500 problems)
=========================  ======================  ======================

Task accuracy of the target during training (200 held-out problems): 4% at
step 250, 14% at 750, 56% at 1,000, 82% at 1,250, 90% at 1,500, 95% at
2,250. A first attempt without the answer-token weight was at 2% at step 500.
Lossless speculative sampling with K=4 on 32 held-out stdlib code prompts
(48 new tokens): acceptance rate 0.18 (first draft position 0.35, tau 1.70)
at T=0 and 0.36 (first position 0.62, tau 2.37) at T=1: the one-layer
draft agrees with the target's greedy choice on code far less often than it
samples alike. Export parity: ``transformers`` logits of both exported
directories match ``specjax`` within 1.2e-6 relative error (float32), and
the bf16 weights score the same task accuracy as the float32 ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import platform
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import Decoder, ModelConfig, models
from training import common, data
from training import tokenizer as tokenizer_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
ASSETS = REPO / "specjax" / "assets"

# Model presets (Llama layout). Sizes chosen for a shared 2-core CPU: the
# target (1.38M params, 4 layers) and the draft (0.18M, one layer) train the
# same steps on the same batches; the draft scores lower on the task because
# one layer cannot carry digits reliably, not because it trained less.
PRESETS = {
    "target": dict(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
        intermediate_size=384, tie_word_embeddings=False, peak_lr=3e-3,
    ),
    "draft": dict(
        hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32,
        intermediate_size=192, tie_word_embeddings=True, peak_lr=5e-3,
    ),
    # For tests only.
    "tiny": dict(
        hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
        intermediate_size=64, tie_word_embeddings=True, peak_lr=3e-3,
    ),
}
MAX_POSITIONS = 256  # RoPE has no table; trained on 97-token windows.


def model_config(name: str, vocab_size: int) -> ModelConfig:
    p = {k: v for k, v in PRESETS[name].items() if k != "peak_lr"}
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        norm_eps=1e-5,
        bos_token_id=tokenizer_lib.BOS_ID,
        eos_token_id=tokenizer_lib.EOS_ID,
        pad_token_id=tokenizer_lib.PAD_ID,
        dtype="float32",
        **p,
    )


# ----------------------------------------------------------------------------- loss


def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * y.astype(x.dtype)


def train_logits(cfg: ModelConfig, params, tokens):
    """``Decoder(cfg).apply(params, tokens).logits`` for the plain Llama layout, faster to train.

    Reads the Decoder's own params tree and reuses its RoPE and attention
    helpers; the only difference is that every dense layer runs on
    ``[B * T, H]`` matrices instead of ``[B, T, H]``. On XLA's CPU backend the
    weight gradient of a dot that contracts over two dimensions (batch and
    time, what ``[B, T, H] @ W`` gives) is 2-5x slower than the same 2-D
    matmul, and that made the whole train step ~1.5x slower. The test suite
    checks this forward against ``Decoder.apply`` (equal logits), and the
    task evaluation runs the Decoder itself.
    """
    if cfg.model_type != "llama" or cfg.attention_bias or cfg.qk_norm or cfg.is_gpt2:
        raise ValueError("train_logits covers the plain Llama layout only")
    b, t = tokens.shape
    n, kv, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    x = params["embed"]["embedding"][tokens].reshape(b * t, h)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    rope = models.rope_cos_sin(positions, models.rope_inv_freq(cfg))
    mask = models.attention_mask(positions, t, cfg.sliding_window)
    for i in range(cfg.num_layers):
        lp = params[f"layer_{i}"]
        a, m = lp["attn"], lp["mlp"]
        y = _rms(x, lp["attn_norm"]["scale"], cfg.norm_eps)
        q = (y @ a["q"]["kernel"]).reshape(b, t, n, d)
        k = (y @ a["k"]["kernel"]).reshape(b, t, kv, d)
        v = (y @ a["v"]["kernel"]).reshape(b, t, kv, d)
        q, k = models.rotate(q, *rope), models.rotate(k, *rope)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # heads-major, as the cache
        o = models.grouped_attention(q, k, v, mask, d**-0.5).reshape(b * t, n * d)
        x = x + o @ a["o"]["kernel"]
        y = _rms(x, lp["mlp_norm"]["scale"], cfg.norm_eps)
        x = x + (jax.nn.silu(y @ m["gate"]["kernel"]) * (y @ m["up"]["kernel"])) @ m["down"]["kernel"]
    x = _rms(x, params["final_norm"]["scale"], cfg.norm_eps)
    head = params["embed"]["embedding"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(x, head, preferred_element_type=jnp.float32).reshape(b, t, -1)


def lm_loss(module: Decoder, params, batch, *, answer_weight: float = 1.0):
    """Weighted mean next-token NLL over non-pad targets.

    ``batch`` is ``tokens[B, L + 1]`` or ``(tokens, answer_mask[B, L + 1])``;
    target tokens inside a task answer weigh ``answer_weight``, the rest 1.
    The answer digits are the only learnable part of a task line (operands
    are uniform noise), so weighting them speeds up learning the task at a
    fixed number of steps.
    """
    tokens, answer = batch if isinstance(batch, (tuple, list)) else (batch, None)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = train_logits(module.config, params, inputs)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = (targets != tokenizer_lib.PAD_ID).astype(jnp.float32)
    weights = mask
    aux = {"tokens": mask.sum()}
    if answer is not None:
        ans = answer[:, 1:].astype(jnp.float32) * mask
        weights = mask + (answer_weight - 1.0) * ans
        aux["answer_nll"] = (nll * ans).sum() / jnp.maximum(ans.sum(), 1.0)
    loss = (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)
    return loss, aux


@functools.partial(jax.jit, static_argnums=0)
def _sum_nll(module, params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logp = jax.nn.log_softmax(module.apply(params, inputs).logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = (targets != tokenizer_lib.PAD_ID).astype(jnp.float32)
    return (nll * mask).sum(), mask.sum()


def heldout_loss(module, params, corpus, *, task_fraction, batches=16, batch_size=16,
                 seq_len=128, seed=12345) -> float:
    tot, n = 0.0, 0.0
    for i in range(batches):
        rows = data.make_batch(corpus, seed=seed, step=i, batch_size=batch_size,
                               seq_len=seq_len, task_fraction=task_fraction, split="heldout")
        s, c = _sum_nll(module, params, jnp.asarray(rows))
        tot, n = tot + float(s), n + float(c)
    return tot / max(n, 1.0)


# ----------------------------------------------------------------------------- task eval


@functools.partial(jax.jit, static_argnums=(0, 4))
def greedy_fill(module, params, buf, lengths, steps: int):
    """Greedy continuation in a right-padded buffer with full causal forwards.

    ``buf[B, S]`` holds prompts of ``lengths[B]`` tokens; writes ``steps``
    greedy tokens after each. Padding after a prompt never influences it
    (causal attention), so no cache or mask is needed.
    """
    rows = jnp.arange(buf.shape[0])

    def body(i, carry):
        buf, lengths = carry
        logits = module.apply(params, buf).logits
        nxt = jnp.argmax(logits[rows, lengths - 1], axis=-1).astype(buf.dtype)
        buf = buf.at[rows, lengths].set(nxt)
        return buf, lengths + 1

    buf, _ = jax.lax.fori_loop(0, steps, body, (buf, lengths))
    return buf


def task_accuracy(module, params, corpus, pairs=None, *, chunk=250, steps=6):
    """Greedy exact match on ``pairs`` (default: the whole held-out set)."""
    tok = corpus.tokenizer
    pairs = corpus.task_heldout if pairs is None else pairs
    prompts = [[tokenizer_lib.BOS_ID] + ids for ids in tokenizer_lib.encode_batch(
        tok, [data.task_prompt(int(a), int(b)) for a, b in pairs])]
    width = max(len(p) for p in prompts) + steps
    correct, examples = 0, []
    for s in range(0, len(prompts), chunk):
        part = prompts[s : s + chunk]
        buf = np.full((chunk, width), tokenizer_lib.PAD_ID, np.int32)
        lengths = np.ones((chunk,), np.int32)
        for i, p in enumerate(part):
            buf[i, : len(p)] = p
            lengths[i] = len(p)
        out = np.asarray(greedy_fill(module, params, jnp.asarray(buf), jnp.asarray(lengths), steps))
        for i, p in enumerate(part):
            a, b = pairs[s + i]
            text = tokenizer_lib.decode(tok, out[i, len(p) : len(p) + steps])
            ok = data.score_answer(text, data.task_answer(int(a), int(b)))
            correct += ok
            if len(examples) < 5:
                examples.append(f"{data.task_prompt(int(a), int(b))}{text.split(chr(10))[0]}")
    return correct / len(prompts), examples


# ----------------------------------------------------------------------------- export


def _write_card(path: pathlib.Path, name: str, summary: dict, cfg: ModelConfig) -> None:
    cfgd = dataclasses.asdict(cfg)
    lines = [
        f"# specjax embedded {name} model",
        "",
        f"A {summary['params'] / 1e6:.2f}M-parameter Llama-layout decoder trained from scratch by "
        f"`python -m training.lm --model {name}` on CPython {platform.python_version()}'s "
        "standard-library source (held-out files excluded) mixed with a verifiable "
        "arithmetic task written as Python (`assert A + B == C`, operands 0..99; the "
        f"held-out pairs are never trained on). It is the {'target' if name == 'target' else 'draft'} "
        "half of specjax's embedded default pair, made for studying speculative decoding "
        "rules, not for use as a code model.",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {summary['params']:,} |",
        f"| optimizer steps | {summary['steps']:,} (batch {summary['batch']} x {summary['seq_len']} tokens, "
        f"{summary['task_fraction']:.0%} task rows) |",
        f"| tokens seen | {summary['tokens_seen']:,} |",
        f"| wall time | {summary['train_seconds'] / 60:.1f} min ({summary['hardware']}) |",
        f"| held-out code loss | {summary['heldout_code_loss']:.3f} nats/token |",
        f"| held-out task loss | {summary['heldout_task_loss']:.3f} nats/token |",
        f"| held-out task exact match (greedy) | {summary['task_accuracy']:.1%} "
        f"({summary['task_examples']} problems) |",
        f"| final train loss | {summary['final_train_loss']:.3f} |",
        "",
        "Training: AdamW (b2 0.95, weight decay 0.1, clip 1.0), linear warmup "
        f"{summary['warmup']} steps to {summary['peak_lr']:g} then cosine to 10%, float32; "
        f"task-answer tokens weigh {summary['answer_weight']:g}x in the loss; "
        "weights stored in bfloat16. Every row starts with `<bos>` (the tokenizer adds it).",
        *[f"The run was resumed at step {r['at_step']} with its cosine horizon moved from "
          f"{r['old_steps']} to {r['new_steps']} steps (to fit the time budget)."
          for r in summary.get("rehorizon", [])],
        f"Context: trained on {summary['seq_len'] + 1}-token windows; keep prompt + generation "
        "within about that length.",
        "",
        "Task prompt format: `<bos>assert 37 + 48 ==`; the answer is the greedy "
        "continuation up to the newline (` 85`).",
        "",
        "Sample greedy answers on held-out problems:",
        "",
        *[f"    {e}" for e in summary["task_samples"]],
        "",
        "## Config",
        "",
        "```json",
        json.dumps(cfgd, indent=2, default=str),
        "```",
        "",
        "## Eval curve (held-out task exact match during training)",
        "",
        *[f"- step {e['step']}: {e.get('task_acc', float('nan')):.1%}" for e in summary.get("evals", [])],
        "",
    ]
    path.write_text("\n".join(lines))


def export(module: Decoder, params, tokenizer, out_dir: pathlib.Path, force: bool = False) -> bool:
    """Writes a Hugging Face directory (:func:`specjax.export_hf`) in bf16; returns True."""
    import specjax

    cfg = module.config.replace(dtype="bfloat16")
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    model = specjax.Model(params=bf16, module=Decoder(cfg), tokenizer=tokenizer)
    specjax.export_hf(model, str(out_dir), overwrite=force)
    if not (out_dir / "tokenizer.json").exists():
        tokenizer.save(str(out_dir / "tokenizer.json"))
    # So that transformers' AutoTokenizer knows the special tokens too.
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer_lib.BOS, "eos_token": tokenizer_lib.EOS,
        "pad_token": tokenizer_lib.PAD, "model_max_length": MAX_POSITIONS,
    }, indent=2))
    return True


def write_task_assets(corpus: data.Corpus, out_dir: pathlib.Path, n_code: int = 64) -> None:
    """Held-out task problems and held-out stdlib code prompts, as JSONL."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "arith_heldout.jsonl", "w") as f:
        for a, b in corpus.task_heldout:
            a, b = int(a), int(b)
            f.write(json.dumps({"prompt": data.task_prompt(a, b), "answer": data.task_answer(a, b)}) + "\n")
    with open(out_dir / "code_prompts.jsonl", "w") as f:
        for p in data.heldout_code_prompts(corpus, n_code):
            f.write(json.dumps({"prompt": p}) + "\n")
    (out_dir / "README.md").write_text(
        "Held-out evaluation data for the embedded pair (never trained on).\n\n"
        "- `arith_heldout.jsonl`: `{prompt, answer}`; feed `<bos>` + prompt, greedy-decode to the "
        "newline, compare the stripped line to `answer` (exact match).\n"
        "- `code_prompts.jsonl`: `{prompt}`: ~48-token snippets cut at line starts from "
        f"held-out CPython {platform.python_version()} stdlib files.\n\n"
        "Written by `python -m training.lm` (see `training/data.py`).\n"
    )


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m training.lm", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="target")
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=96)
    p.add_argument("--task-fraction", type=float, default=0.75)
    p.add_argument("--answer-weight", type=float, default=5.0,
                   help="loss weight of task-answer tokens (others weigh 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (preset default)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=tokenizer_lib.DEFAULT_VOCAB_SIZE)
    p.add_argument("--out", default=None, help="run dir (default runs/<model>)")
    p.add_argument("--corpus-cache", default="runs/corpus")
    p.add_argument("--export", default=None,
                   help="HF export dir (default <run dir>/export; the shipped pair: specjax/assets/models/<model>)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --export directory")
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--rehorizon", action="store_true",
                   help="with --resume: accept a different --steps (the cosine re-targets it)")
    p.add_argument("--export-only", action="store_true", help="evaluate + export the latest checkpoint")
    p.add_argument("--prepare-only", action="store_true", help="build the tokenizer/corpus cache and task assets")
    p.add_argument("--ckpt-minutes", type=float, default=3.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    out = pathlib.Path(args.out or f"runs/{args.model}")
    if not args.prepare_only:
        dest = pathlib.Path(args.export or out / "export")
        if not args.no_export and not args.force and dest.is_dir() and any(dest.iterdir()):
            raise SystemExit(f"error: export directory {dest} is not empty; pass --force to replace it "
                             "(checked now, before training, so no run is lost at the end).")
    corpus = data.build_corpus(args.corpus_cache, vocab_size=args.vocab)
    if args.prepare_only:
        write_task_assets(corpus, ASSETS / "task")
        print(f"corpus ready in {args.corpus_cache}: {len(corpus.code_train):,} train code tokens, "
              f"{len(corpus.code_heldout):,} held-out; task assets in {ASSETS / 'task'}")
        return
    tok = corpus.tokenizer
    cfg = model_config(args.model, tok.get_vocab_size())
    module = Decoder(cfg)
    peak_lr = args.lr if args.lr is not None else PRESETS[args.model]["peak_lr"]
    optimizer = common.adamw(peak_lr, args.steps, warmup_steps=args.warmup)
    state = common.init_state(module.init(jax.random.key(args.seed)), optimizer)
    n_params = common.param_count(state["params"])
    tokens_per_step = args.batch * args.seq
    meta = {
        "model": args.model, "config": dataclasses.asdict(cfg), "seed": args.seed,
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq,
        "task_fraction": args.task_fraction, "peak_lr": peak_lr, "warmup": args.warmup,
        "answer_weight": args.answer_weight,
        "params": n_params,
    }
    out.mkdir(parents=True, exist_ok=True)
    log_file = str(out / "train.log")
    ckpt = common.Checkpointer(out / "checkpoints", every_seconds=60 * args.ckpt_minutes)
    if ckpt.latest_step() is not None:
        if not (args.resume or args.export_only):
            raise SystemExit(f"{out} already has checkpoints; pass --resume (or use a new --out).")
        state, saved = ckpt.restore(state)
        for k in ("seed", "steps", "batch", "seq_len", "task_fraction", "config", "answer_weight"):
            if k == "steps" and args.rehorizon:
                continue
            if json.dumps(saved.get(k)) != json.dumps(meta[k]):
                raise SystemExit(f"--resume with different {k}: checkpoint has {saved.get(k)}, now {meta[k]}")
        if saved["steps"] != args.steps:
            # The schedule is a function of the optimizer's step count: the
            # cosine continues from the current step towards the new horizon.
            saved.setdefault("rehorizon", []).append(
                {"at_step": int(state["step"]), "old_steps": saved["steps"], "new_steps": args.steps})
            saved["steps"] = args.steps
        meta = saved
        print(f"resumed {out} at step {int(state['step'])}", flush=True)
    elif args.export_only:
        raise SystemExit(f"no checkpoint in {out}")
    print(f"{args.model}: {n_params:,} params, {args.steps} steps x {tokens_per_step} tokens, "
          f"devices {jax.devices()}", flush=True)

    train_step = common.make_train_step(
        functools.partial(lm_loss, module, answer_weight=args.answer_weight), optimizer)
    batch_fn = lambda step: tuple(map(jnp.asarray, data.make_batch(  # noqa: E731
        corpus, seed=args.seed, step=step, batch_size=args.batch, seq_len=args.seq,
        task_fraction=args.task_fraction, with_answer_mask=True)))
    eval_pairs = corpus.task_heldout[:200]

    def eval_fn(step, st):
        acc, _ = task_accuracy(module, st["params"], corpus, eval_pairs)
        return {"task_acc": acc}

    if not args.export_only:
        state, meta = common.train_loop(
            state, train_step, batch_fn, args.steps, checkpointer=ckpt, meta=meta,
            tokens_per_step=tokens_per_step, eval_fn=eval_fn, eval_every=args.eval_every,
            log_every=args.log_every, desc=args.model, log_file=log_file,
            progress=not args.no_progress,
        )
    ckpt.close()

    params = state["params"]
    t0 = time.time()
    acc, samples = task_accuracy(module, params, corpus)
    code_loss = heldout_loss(module, params, corpus, task_fraction=0.0, seq_len=args.seq)
    task_loss = heldout_loss(module, params, corpus, task_fraction=1.0, seq_len=args.seq)
    summary = {
        **{k: meta[k] for k in ("params", "steps", "batch", "task_fraction", "peak_lr", "warmup")},
        "seq_len": args.seq,
        "tokens_seen": int(meta["tokens_seen"]),
        "train_seconds": float(meta["train_seconds"]),
        "final_train_loss": float(meta.get("last_loss", float("nan"))),
        "heldout_code_loss": code_loss,
        "heldout_task_loss": task_loss,
        "task_accuracy": acc,
        "task_examples": len(corpus.task_heldout),
        "task_samples": samples,
        "evals": meta.get("evals", []),
        "rehorizon": meta.get("rehorizon", []),
        "answer_weight": meta.get("answer_weight", 1.0),
        "hardware": f"{os.cpu_count()}-core CPU, {platform.machine()}, jax {jax.__version__}",
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "evals"}, indent=1), flush=True)
    print(f"final eval took {time.time() - t0:.1f}s", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _write_card(out / "MODEL_CARD.md", args.model, summary, cfg)
    if not args.no_export:
        if export(module, params, tok, dest, force=args.force):
            shutil.copy(out / "MODEL_CARD.md", dest / "MODEL_CARD.md")
            print(f"exported to {dest}", flush=True)


if __name__ == "__main__":
    main()
