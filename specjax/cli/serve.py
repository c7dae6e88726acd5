"""``specjax serve``: an OpenAI-compatible HTTP server on the slots engine (see ``docs/server.md``)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Optional

from specjax.cli import common


def _require_server_packages():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"specjax serve needs FastAPI and uvicorn ({e}); install them with "
                          "pip install -e \".[serve]\" (or pip install \"specjax[serve]\").") from None


def build(args):
    """``(app, scheduler)`` from the parsed options: the pair loaded, the engine built, nothing compiled yet."""
    _require_server_packages()
    import specjax
    from specjax._src.serve.api import MAX_STOP_TOKEN_IDS, ServerConfig, create_app
    from specjax._src.serve.config import parse_bytes
    from specjax._src.foundation.memory import release_free_heap
    from specjax._src.serve.scheduler import Scheduler
    from specjax.engine import Engine

    tree, lookup = common.tree(args), common.lookup(args)
    # Chains default to drafting.auto(): costs measured at each row bucket of the engine's slots, K chosen per cycle.
    drafting = common.drafting_policy(args, None if tree is not None else specjax.drafting.auto())
    if tree is not None and args.num_draft is not None and args.num_draft != tree.max_depth:
        raise SystemExit(f"error: --num-draft {args.num_draft} with --tree {args.tree!r}: the tree's depth "
                         f"({tree.max_depth}) is its K; drop --num-draft.")
    rule = served_rule(args)
    target, draft = common.load_pair(args, quantize=args.quantize)
    if target.tokenizer is None:
        raise SystemExit("error: the target has no tokenizer; the server needs one to read and write text.")
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise SystemExit(f"error: --chat-template {path} is not a file; give a Jinja template file.")
        target = target.replace(chat_template=path.read_text())
    if tree is not None:
        num_draft, room = None, tree.num_nodes  # a slot's caches hold the tree's nodes past the capacity
    else:
        num_draft = args.num_draft if args.num_draft is not None else (
            3 if common.pair_name(args) in common.CHAT_PAIRS else 4)
        room = num_draft
    capacity = args.capacity if args.capacity is not None else default_capacity(target, draft, room)
    # One prompt width up to 512 positions: a prefill runs as many positions as its longest prompt
    # whatever the width, so more widths would only mean more programs to compile.
    # max_bias: OpenAI's limit of logit_bias entries per request.
    try:
        engine = Engine(specjax.pair(target, draft), num_slots=args.slots, capacity=capacity, num_draft=num_draft,
                        rule=rule, drafting=drafting, lookup=lookup, tree=tree,
                        controls=not args.no_penalties,
                        prompt_bucket=min(capacity, 512), row_buckets="powers", donate_state=True,
                        specialized_steps=True, max_bias=300, max_eos=MAX_STOP_TOKEN_IDS + 4,
                        logprobs=args.max_logprobs)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    release_free_heap()  # what measuring the costs compiled and freed (1.6 GB on the real pair's 4-bit server)
    costs = getattr(engine.drafting, "costs", None)
    if costs is not None:
        print(f"specjax serve: drafting auto (up to K={num_draft}); {costs.describe()}", file=sys.stderr)
    # Every end id the model declares (Gemma's chat turns end at <end_of_turn>, beside its EOS).
    model_config = target.module.config
    eos = getattr(model_config, "eos_token_ids", None) or getattr(model_config, "eos_token_id", None)
    eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    name = args.served_model_name or (args.target or common.pair_name(args))
    prefix_cache = None
    budget = 0 if args.no_prefix_cache else parse_bytes(args.prefix_cache)
    if budget:
        from specjax._src.engine.prefix_cache import PrefixCache

        # Keyed by the models' identity (weights and format) and the chat template, beside the tokens.
        prefix_cache = PrefixCache(budget, namespace=f"{name}\0{target.chat_template or ''}")
        try:
            prefix_cache.identity(engine)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    scheduler = Scheduler(engine, target.tokenizer, max_queue=args.max_queue, num_cycles=args.cycles_per_step,
                          eos_ids=eos, prefill_chunk=args.prefill_chunk, prefix_cache=prefix_cache,
                          live_costs=not args.no_live_costs, admission_wait=args.admission_wait_ms / 1e3)
    api_key = args.api_key or os.environ.get("SPECJAX_API_KEY") or None
    config = ServerConfig(name, target, api_key=api_key, max_body_bytes=args.max_body_bytes, seed=args.seed)
    app = create_app(scheduler, config, drain_seconds=args.drain_seconds)
    return app, scheduler


def served_rule(args):
    """The engine's rule: ``--rules A,B,...`` as ``one_of(A,B,...)`` (each request picks one; A is the
    default), else ``--rule`` (default lossless speculative sampling). Exits with a message for a spec
    that does not parse, or a set holding a rule whose numbers are arrays (PAD)."""
    import jax

    from specjax.rules import OneOf, parse_rule

    rules = getattr(args, "rules", None)
    if rules is not None and getattr(args, "rule", None) is not None:
        raise SystemExit("error: give --rule (one rule) or --rules (a set requests choose from), not both.")
    text = rules if rules is not None else (args.rule or "speculative_sampling")
    flag = "--rules" if rules is not None else "--rule"
    try:
        rule = parse_rule(f"one_of({text})" if rules is not None else text)
    except (TypeError, ValueError, RecursionError) as e:
        raise SystemExit(f"error: {flag} {text!r}: {e}") from None
    if isinstance(rule, OneOf):
        if len(rule.rules) == 1:
            return rule.rules[0]
        shared = [str(r) for r in rule.rules if any(jax.numpy.ndim(x) for x in jax.tree_util.tree_leaves(r))]
        if shared:
            raise SystemExit(f"error: --rules: {shared[0]} holds arrays (PAD's pivot head), which a per-request set "
                             "cannot hold per slot; serve it alone with --rule.")
    return rule


def default_capacity(target, draft, room: int, most: int = 512) -> int:
    """``most`` tokens per slot, or fewer where the models' positions end sooner (a slot's caches hold
    ``capacity + room`` positions: ``num_draft``, or a tree's nodes)."""
    limits = [getattr(getattr(m.module, "config", None), "max_position_embeddings", None) for m in (target, draft)]
    return min([most] + [limit - room for limit in limits if limit is not None])


def use_compilation_cache(directory: Optional[str], enabled: bool = True) -> Optional[str]:
    """Points JAX's persistent compilation cache at ``directory`` (None: the default of
    :func:`specjax._src.kernels.compile_cache.resolve`; ``"none"`` or ``enabled=False``: no cache)
    before anything compiles. Returns the directory, or None.

    A restart then loads the programs instead of compiling them: on the real pair the server was
    ready in 89-97 s after the start that filled the cache took 237 s (2-core CPU); tracing them
    is not cached.
    """
    from specjax._src.kernels import compile_cache

    try:
        return compile_cache.enable(compile_cache.resolve(directory, enabled=enabled))
    except ValueError as e:
        raise SystemExit(f"error: --compilation-cache: {e}") from None


def check_args(args) -> None:
    """Exits with a one-line message for an option out of range (before anything loads)."""
    for flag, value in (("--slots", args.slots), ("--capacity", args.capacity),
                        ("--cycles-per-step", args.cycles_per_step), ("--max-body-bytes", args.max_body_bytes)):
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag} must be a positive integer, got {value}.")
    if not 0.0 <= args.admission_wait_ms < 3.6e6:
        raise SystemExit(f"error: --admission-wait-ms must be milliseconds >= 0, got {args.admission_wait_ms}.")
    for flag, value in (("--max-queue", args.max_queue), ("--max-logprobs", args.max_logprobs)):
        if value < 0:
            raise SystemExit(f"error: {flag} must be >= 0, got {value}.")
    if args.prefill_chunk < 0 or args.prefill_chunk % 64:
        raise SystemExit(f"error: --prefill-chunk must be 0 (off) or a positive multiple of 64, got "
                         f"{args.prefill_chunk}.")
    if not getattr(args, "no_prefix_cache", False):
        from specjax._src.serve.config import parse_bytes

        try:
            parse_bytes(args.prefix_cache)
        except ValueError as e:
            raise SystemExit(f"error: --prefix-cache: {e}") from None
    if args.drain_seconds < 0:
        raise SystemExit(f"error: --drain-seconds must be >= 0, got {args.drain_seconds}.")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise SystemExit(f"error: --seed must be a non-negative integer, got {args.seed}.")


def run(args) -> int:
    _require_server_packages()
    from specjax._src.serve.server import bind, make_server

    check_args(args)
    sock = bind(args.host, args.port)  # a port in use fails now, not after the models load
    app, scheduler = build(args)
    cache = use_compilation_cache(args.compilation_cache, enabled=not args.no_compile_cache)
    host, port = sock.getsockname()[:2]
    print(f"specjax serve: compiling{f' (programs kept in {cache})' if cache else ''}, then serving on "
          f"http://{args.host}:{port} (GET /health answers 200 once ready)", flush=True)
    if scheduler.live_costs is not None:
        threading.Thread(target=_print_timed_costs, args=(scheduler,), daemon=True).start()
    # On SIGINT / SIGTERM the server stops accepting, refuses what waits, lets live requests finish
    # for --drain-seconds and ends the rest with an error event (specjax._src.serve.server).
    make_server(app, scheduler, drain_seconds=args.drain_seconds, log_level=args.log_level).run(sockets=[sock])
    return 0


def _print_timed_costs(scheduler) -> None:
    """Once the server is ready: what its steps cost at each draft length, timed before any request,
    and the costs auto plans with from them (refreshed from the served steps after)."""
    scheduler.ready.wait()
    if scheduler.error is None:
        print("specjax serve: each row bucket's step timed at each draft length (ms per cycle, samples):\n"
              + scheduler.live_costs.describe(), file=sys.stderr, flush=True)


def add_arguments(p) -> None:
    """``specjax serve``'s options (this module imports nothing heavy, so ``--help`` stays fast)."""
    common.add_model_args(p, default_num_draft=None)
    p.add_argument("--rule",
                   help='acceptance rule spec, e.g. "mars:theta=0.9" (default: lossless speculative sampling)')
    p.add_argument("--rules", metavar="RULE,RULE,...",
                   help='the acceptance rules a request may choose ("speculative": {"rule": ...}), e.g. '
                        '"sd,mars:theta=0.9,ears,typical"; the first is the default (instead of --rule)')
    p.add_argument("--quantize", metavar="FORMAT", help=common.QUANTIZE_HELP)
    p.add_argument("--slots", type=int, default=8, help="requests generated at once (default 8)")
    p.add_argument("--capacity", type=int,
                   help="tokens per slot, prompt and completion together (default 512, or the models' positions "
                        "minus --num-draft where fewer: 252 on the embedded pair)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait beyond the free slots; more are refused with 429 (default 64; 0: "
                        "serve only while a slot is free)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most alternatives per token a request may ask for (logprobs / top_logprobs; "
                        "default 20, 0: refuse logprobs)")
    p.add_argument("--max-body-bytes", type=int, default=2 * 2**20,
                   help="the largest request body; larger ones are refused with 413 (default 2 MiB)")
    p.add_argument("--api-key", help="requests to /v1 must send `Authorization: Bearer KEY` (default: "
                                     "$SPECJAX_API_KEY, else no key)")
    p.add_argument("--cycles-per-step", type=int, default=4,
                   help="the most draft-verify cycles between two admissions / stream flushes; a step ends "
                        "sooner when a request finishes (default 4)")
    p.add_argument("--admission-wait-ms", type=float, default=100.0, metavar="MS",
                   help="while a slot is free and no request waits, a step runs as many cycles as fit in MS "
                        "milliseconds, timed from the server's own steps (at least 1): a request that arrives "
                        "meanwhile waits about that long at most for its slot. Lower starts requests sooner; "
                        "higher spreads each step's fixed cost (dispatch, reading back, detokenizing) over more "
                        "tokens (default 100; 0: one cycle)")
    p.add_argument("--prefill-chunk", type=int, default=128,
                   help="prefill a prompt longer than this many tokens this many at a time, between steps, so "
                        "that running streams keep going while it is prefilled (a multiple of 64; default 128; "
                        "0: prefill every prompt whole)")
    p.add_argument("--prefix-cache", default="1GiB", metavar="SIZE",
                   help="device memory for the prefix cache: prompts that begin with an earlier prompt's blocks "
                        "of 64 tokens copy them instead of prefilling them (e.g. 512MiB, 2GB; default 1GiB; 0: off)")
    p.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt from its first token")
    p.add_argument("--no-live-costs", action="store_true",
                   help="with drafting auto, plan with the costs measured at start only; by default the server's "
                        "own steps re-time every draft length per row bucket (one step in 32 runs the length "
                        "timed longest ago) and auto plans with those times (/metrics: specjax_cycle_seconds)")
    p.add_argument("--no-penalties", action="store_true",
                   help="compile the engine without the logits processors: faster cycles, and requests with "
                        "penalties, logit_bias or min_tokens are refused")
    p.add_argument("--chat-template", help="a Jinja chat template file for models without one (the embedded pair)")
    p.add_argument("--served-model-name", help="the model name clients give (default: the pair's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    p.set_defaults(seed=None)  # the model options' --seed: here it seeds requests that give none
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGINT / SIGTERM, how long live requests may finish before they are cancelled")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--compilation-cache", metavar="DIR",
                   help="keep the compiled programs here for the next start (JAX's persistent compilation cache; "
                        "default: $JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/specjax/jax; \"none\": off)")
