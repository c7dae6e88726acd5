"""lm-evaluation-harness against `specjax serve`: a loglikelihood task and a generate task.

Starts ``specjax serve`` on 127.0.0.1, writes two small tasks and their data into a temporary
directory (no download: the data is written here, the tokenizer is the served target's own,
saved as a Hugging Face tokenizer directory), and runs lm-eval's ``local-completions`` model on
them:

* ``specjax_mc`` (``multiple_choice``: loglikelihood requests, ``echo`` with ``logprobs: 1`` and
  ``max_tokens: 1``, several prompts per request with ``--batch-size`` > 1);
* ``specjax_gen`` (``generate_until``, with more than 4 stop strings).

lm-eval tokenizes the loglikelihood requests itself, here with the BOS token first
(``add_bos_token=True``, as the server tokenizes text). The script then checks lm-eval's figures
against specjax in process: each choice's loglikelihood must be the sum of the target's
log-softmax over the choice's tokens (``specjax.logits``), within float tolerance. It prints
lm-eval's metrics, the largest difference found and the generated answers.

lm-eval is not a dependency of specjax; install it where this script runs
(``pip install lm-eval==0.4.13``, e.g. in a virtual environment made with
``--system-site-packages`` so that specjax and JAX come from the main one):

    python benchmarks/lm_eval_serve.py --pair embedded
    python benchmarks/lm_eval_serve.py --pair smollm2-eagle --lookup 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Arithmetic (the embedded pair's own domain) and plain facts: lm-eval needs a few documents, not many.
QUESTIONS = [
    ("12 + 7 =", [" 19", " 18", " 20", " 21"], 0),
    ("3 * 4 =", [" 7", " 12", " 34", " 1"], 1),
    ("20 - 5 =", [" 25", " 10", " 15", " 4"], 2),
    ("9 + 9 =", [" 99", " 0", " 81", " 18"], 3),
    ("The capital of France is", [" Paris", " Rome", " Madrid", " Berlin"], 0),
    ("def add(a, b):\n    return a", [" + b", " - b", " * b", " / b"], 0),
]
STOPS = ["\n", "\n\n", "###", "Question:", "</s>", "<|im_end|>"]  # six: more than OpenAI's four


def write_tasks(directory: Path) -> None:
    data = directory / "data.jsonl"
    with data.open("w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    shared = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'doc_to_text: "{{question}}"\n'
    )
    (directory / "specjax_mc.yaml").write_text(
        "task: specjax_mc\noutput_type: multiple_choice\n"
        + shared
        + 'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n"
    )
    (directory / "specjax_gen.yaml").write_text(
        "task: specjax_gen\noutput_type: generate_until\n"
        + shared
        + 'doc_to_target: "{{choices[answer]}}"\ntarget_delimiter: ""\n'
        f"generation_kwargs:\n  until: {json.dumps(STOPS)}\n  max_gen_toks: 16\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def write_tokenizer(target, directory: Path) -> None:
    """The served target's tokenizer as a Hugging Face tokenizer directory (lm-eval counts the
    context's tokens with it)."""
    directory.mkdir(parents=True, exist_ok=True)
    target.tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def start_server(args) -> common.Server:
    flags = ["--pair", args.pair, "--slots", str(args.slots)] + (["--lookup", args.lookup] if args.lookup else [])
    return common.Server(flags)


def reference_loglikelihood(target, context: str, continuation: str) -> float:
    """The sum of the target's log-softmax over ``continuation``'s tokens after ``context``'s."""
    import numpy as np

    import specjax

    ctx = target.tokenizer.encode(context).ids
    whole = target.tokenizer.encode(context + continuation).ids
    logits = np.asarray(specjax.logits(target, [whole])[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="embedded", choices=["embedded", "smollm2", "smollm2-eagle"])
    p.add_argument("--lookup", default=None)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4, help="lm-eval's requests per HTTP request")
    args = p.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        print("lm_eval_serve: lm-eval is not installed here (pip install lm-eval==0.4.13).", file=sys.stderr)
        return 2
    import specjax

    # As the server loads it (float32, the CLI's default dtype), so that the figures compare.
    name = {"embedded": "embedded-target", "smollm2": "smollm2-135m-instruct", "smollm2-eagle": "smollm2-135m-instruct"}
    target = specjax.load(name[args.pair], dtype="float32")
    with start_server(args) as server:
        url = server.url
        server.wait_ready()
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            write_tasks(tmp)
            write_tokenizer(target, tmp / "tokenizer")
            model_args = (
                f"model=bench,base_url={url}/v1/completions,tokenizer={tmp / 'tokenizer'},"
                "tokenizer_backend=huggingface,add_bos_token=True,num_concurrent=1,max_retries=1"
            )
            began = time.perf_counter()
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=model_args,
                tasks=["specjax_mc", "specjax_gen"],
                task_manager=TaskManager(include_path=str(tmp)),
                log_samples=True,
                batch_size=args.batch_size,
            )
            seconds = time.perf_counter() - began
    print(
        f"lm-eval {lm_eval.__version__ if hasattr(lm_eval, '__version__') else ''} local-completions against "
        f"specjax serve --pair {args.pair}: {seconds:.1f} s"
    )
    for task, metrics in results["results"].items():
        print(f"  {task}: " + ", ".join(f"{k} {v}" for k, v in metrics.items() if isinstance(v, float)))
    worst = 0.0
    for sample in results["samples"]["specjax_mc"]:
        doc = sample["doc"]
        for choice, resp in zip(doc["choices"], sample["resps"]):
            got = resp[0][0]
            worst = max(worst, abs(got - reference_loglikelihood(target, doc["question"], choice)))
    print(f"  loglikelihoods against specjax.logits in process: largest difference {worst:.2e}")
    generated = [s["resps"][0][0] for s in results["samples"]["specjax_gen"]]
    print(f"  generated answers: {generated}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
