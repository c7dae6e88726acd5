"""What one training step of the SmolLM2 head's recipe costs on this machine.

    python benchmarks/head_training_step.py --batch 8                     # features stored (a CPU's default)
    python benchmarks/head_training_step.py --batch 128 --features online  # as the shipped head was trained

The step of ``python -m training.smollm2_head`` with the settings the shipped
head's ``train_log.json`` records (blocks 2, 15 and the last fused, 3 unrolled
draft steps, rows of 256 tokens), started from the shipped head, on rows of the
real shapes with random tokens (the cost does not depend on them). ``online``: the target computes
the three blocks inside the step; ``stored``: they come in with the batch.
Prints the step's seconds (``training.eagle.step_seconds``: after compiling, a
host sync per step, as training runs) and the hours that one pass over the
shipped head's data, and its whole schedule, would take at that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

# The shipped head's recipe, data and schedule, as its training recorded them.
SHIPPED = json.loads((common.ROOT / "specjax" / "assets" / "models" / "smollm2-eagle" / "train_log.json")
                     .read_text())["summary"]
TOP_K = 32  # the target's top-32 per position, as the shipped head's loss read them (its MODEL_CARD.md)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="rows per step (default: %(default)s)")
    ap.add_argument("--features", choices=("stored", "online"), default="stored")
    ap.add_argument("--steps", type=int, default=3, help="steps timed after the compiling one")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        ap.error("--batch and --steps must be at least 1")
    sys.path.insert(0, str(common.ROOT))
    import jax
    import jax.numpy as jnp

    import specjax
    from specjax import heads
    from training import eagle

    print(common.header("head training step"))
    target = specjax.load("smollm2-135m-instruct", dtype="float32")
    init = specjax.dequantize(specjax.load("smollm2-135m-instruct-eagle", dtype="float32"))
    layers, seq_len = tuple(SHIPPED["feature_layers"]), SHIPPED["seq_len"]
    head = heads.with_feature_layers(heads.attach_embedding(init, target), layers)
    cfg = head.module.config
    trainable, frozen = eagle.split_params(head.params)
    loss_fn = eagle.make_loss(cfg, unroll=SHIPPED["unroll"], reg_weight=SHIPPED["reg_weight"],
                              num_feature_layers=len(layers))
    rng = np.random.default_rng(0)
    vocab, width = target.module.config.vocab_size, len(layers) * target.module.config.hidden_size
    shape = (args.batch, seq_len)

    def rows(step: int) -> dict:
        out = {"tokens": jnp.asarray(rng.integers(0, vocab, shape), jnp.int32),
               "teacher_ids": jnp.asarray(rng.integers(0, cfg.head_vocab_size, (*shape, TOP_K)), jnp.int32),
               "teacher_logp": jnp.full((*shape, TOP_K), -np.log(TOP_K), jnp.float16),
               "mask": jnp.ones(shape, bool)}
        if args.features == "stored":
            out["features"] = jnp.asarray(rng.standard_normal((*shape, width)), jnp.bfloat16)
        return out

    inner = rows if args.features == "stored" else eagle.online_features(target, layers, rows)
    frozen_dev = jax.tree.map(jnp.asarray, frozen)
    seconds = eagle.step_seconds(loss_fn, trainable, lambda s: {**inner(s), "frozen": frozen_dev},
                                 probe_steps=args.steps)
    tokens = args.batch * (seq_len - 1)
    rows_trained = SHIPPED["steps"] * SHIPPED["batch"]
    report = {"machine": common.machine(), "features": args.features, "batch": args.batch, "seq_len": seq_len,
              "step_s": seconds, "tokens_per_s": tokens / seconds,
              "hours_per_pass_of_shipped_data": SHIPPED["train_rows"] / args.batch * seconds / 3600,
              "hours_for_shipped_schedule": rows_trained / args.batch * seconds / 3600}
    print(f"features {args.features}, batch {args.batch} x {seq_len}: {seconds * 1e3:.1f} ms a step, "
          f"{report['tokens_per_s']:,.0f} tokens/s; a pass over the shipped head's {SHIPPED['train_rows']:,} rows: "
          f"{report['hours_per_pass_of_shipped_data']:.2f} h, its schedule ({rows_trained / SHIPPED['train_rows']:.0f} "
          f"passes): {report['hours_for_shipped_schedule']:.1f} h")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
