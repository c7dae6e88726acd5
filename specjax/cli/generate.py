"""``specjax generate``: decode one prompt with one rule, streaming the text, then print its stats."""

from __future__ import annotations

from specjax.cli import common


def run(args) -> int:
    import jax

    import specjax
    from specjax.rules import parse_rule

    rule = parse_rule(args.rule)
    if (args.prompt is None) == (args.chat is None):
        raise SystemExit("error: pass exactly one of --prompt TEXT or --chat MESSAGE.")
    # Checked before anything loads or prints: --lookup / --drafting with --tree are refused here.
    tree, lookup = common.tree(args), common.lookup(args)
    # Chains default to drafting.auto(): each cycle drafts the K that pays on this machine (at most --num-draft).
    # With a dynamic tree, --drafting auto chooses its size each cycle; otherwise the tree's shape decides.
    chain = (dict(drafting=common.drafting_policy(args, specjax.drafting.auto()), num_draft=args.num_draft,
                  lookup=lookup) if tree is None else dict(drafting=common.drafting_policy(args)))
    target, draft = common.load_pair(args, quantize=args.quantize)
    if target.tokenizer is None:
        raise SystemExit("error: the target has no tokenizer; pass token ids from Python instead.")
    if args.chat is not None:
        ids = specjax.encode_chat(target, args.chat)
    else:
        ids = target.tokenizer.encode(args.prompt).ids
        print(args.prompt, end="", flush=True)
    # Streams: each draft-verify cycle's tokens are printed as the loop commits them.
    text = TextStream(target.tokenizer)
    out = specjax.decode(specjax.pair(target, draft), [ids], on_tokens=text.on_tokens, rule=rule, tree=tree, **chain,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         key=jax.random.key(args.seed))
    text.flush()
    print("\n")
    print(out.stats)
    _print_costs(chain.get("drafting"))
    return 0


def _print_costs(policy) -> None:
    """What drafting.auto() measured on this machine (its choices are in the stats above)."""
    import specjax.drafting
    import specjax.engine

    measured = specjax.engine.last_measured_costs()
    if isinstance(policy, specjax.drafting.Auto) and measured is not None:
        print(f"drafting auto: {measured.describe()}")


class TextStream:
    """Prints token ids as text as they arrive, holding back an incomplete
    UTF-8 sequence (a byte-level token can end mid-character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def on_tokens(self, tokens, counts) -> None:
        """``decode``'s ``on_tokens`` for a batch of one: ``tokens [1, K+1]``, ``counts [1]``."""
        self.push(tokens[0, : counts[0]])

    def push(self, new_ids) -> None:
        self.ids.extend(int(i) for i in new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        print(text[self.printed:], end="", flush=True)
        self.printed = len(text)

    def flush(self) -> None:
        text = self.tokenizer.decode(self.ids)
        print(text[self.printed:], end="", flush=True)
        self.printed = len(text)
