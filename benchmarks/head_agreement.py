"""How a feature head's agreement with SmolLM2 holds up on prompts unlike its training prompts.

    python benchmarks/head_agreement.py                                  # the shipped head
    python benchmarks/head_agreement.py --heads eagle new=runs/x/export  # a new head beside it

Offline, untimed: the target answers each prompt set greedily (up to
``--max-new-tokens``), and each head predicts those answers as it would draft
them (``training.eagle.agreement``: step 1 reads the target's features, steps 2
and 3 its own), giving top-1 agreement at draft steps 1-3 and the expected
accepted drafts of a K=3 chain at T=0. The prompt sets:

* ``template, held-out subjects``: the first 64 held-out chat prompts
  (``training.chat_prompts.heldout_prompts``; the model cards' figure);
* ``template, training prompts``: every 20th training prompt whose greedy answer
  no shipped drafter was trained on (prompt ``i`` with ``i % 3 == 1``, answered
  greedily only in gather pass 2);
* ``self-written``: ``benchmarks/prompts/self_written_64.jsonl``, requests the
  target wrote itself (``training.distill_data.self_written_prompts``), free
  form as users write, none of them in any training data.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SELF_WRITTEN = common.ROOT / "benchmarks" / "prompts" / "self_written_64.jsonl"


def _head(text: str) -> tuple[str, str]:
    label, _, path = text.partition("=")
    return (label, path) if path else (label, {"eagle": "smollm2-135m-instruct-eagle"}.get(label, label))


def prompt_sets(ap) -> dict[str, list[str]]:
    from training import chat_prompts

    train = chat_prompts.train_prompts()
    return {
        "template, held-out subjects": chat_prompts.heldout_prompts()[:64],
        "template, training prompts": [p for i, p in enumerate(train) if i % 3 == 1][::20][:64],
        "self-written": [r["prompt"] for r in common.read_prompt_file(SELF_WRITTEN, ap)],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", nargs="+", type=_head, default=[_head("eagle")],
                    help="LABEL=DIR, or 'eagle' for the shipped head")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    import specjax
    from specjax import heads
    from training import eagle

    report = common.Report("feature heads' agreement with SmolLM2-135M-Instruct, by prompt set")
    target = specjax.load("smollm2-135m-instruct")
    # agreement's forward takes float matrices: an int8-stored head's, dequantized exactly
    loaded = {label: heads.attach_embedding(specjax.dequantize(specjax.load(path, dtype="float32")), target)
              for label, path in args.heads}
    report.text("float32; greedy answers of the target, up to "
                f"{args.max_new_tokens} tokens; heads: " + ", ".join(f"{label} = {p}" for label, p in args.heads))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, prompts in prompt_sets(ap).items():
            d = pathlib.Path(tmp) / str(len(rows))
            shard = eagle.gather_heldout(target, prompts, d, new_tokens=args.max_new_tokens, batch=32,
                                         log=lambda m: None)
            for label, head in loaded.items():
                ids = np.asarray(head.params["head_vocab_ids"])
                layers = head.module.feature_layers
                feats = d / ("features-" + "_".join(map(str, layers)))  # heads reading the same blocks share them
                eagle.extract_features(target, [shard], feats, ids, seq_len=256, batch=16, layers=layers,
                                       log=lambda m: None)
                data = eagle.load_rows([shard], feats, ids, 256, target.vocab_size)
                res = eagle.agreement(head.module.config, head.params, data, num_feature_layers=len(layers))
                rows.append([name, label, len(prompts), int(data["mask"].sum()),
                             " / ".join(f"{res[f'step{k}']:.3f}" for k in (1, 2, 3)),
                             f"{res['expected_accepted']:.3f}"])
                print(rows[-1], flush=True)
    report.table("top-1 agreement with the target's greedy answers", [
        "prompt set", "head", "prompts", "answer positions", "agreement at draft step 1 / 2 / 3",
        "expected accepted of 3 (T=0)"], rows)
    report.write(args.markdown)


if __name__ == "__main__":
    main()
