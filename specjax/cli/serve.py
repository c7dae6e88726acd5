"""``specjax serve``: an OpenAI-compatible HTTP server on the slots engine (see ``docs/server.md``)."""

from __future__ import annotations

import os
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
    from specjax._src.serve.api import ServerConfig, create_app
    from specjax._src.serve.scheduler import Scheduler
    from specjax.engine import Engine
    from specjax.rules import parse_rule

    if getattr(args, "tree", None) is not None:
        raise SystemExit("error: --tree: the slots engine drafts chains; token trees are not served yet.")
    lookup, drafting = common.lookup(args), common.drafting_policy(args)
    rule = parse_rule(args.rule)
    target, draft = common.load_pair(args)
    if target.tokenizer is None:
        raise SystemExit("error: the target has no tokenizer; the server needs one to read and write text.")
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise SystemExit(f"error: --chat-template {path} is not a file; give a Jinja template file.")
        target = target.replace(chat_template=path.read_text())
    num_draft = args.num_draft if args.num_draft is not None else (3 if common.pair_name(args).startswith("smollm2")
                                                                   else 4)
    capacity = args.capacity if args.capacity is not None else default_capacity(target, draft, num_draft)
    # One prompt width up to 512 positions: a prefill runs as many positions as its longest prompt
    # whatever the width, so more widths would only mean more programs to compile.
    engine = Engine(specjax.pair(target, draft), num_slots=args.slots, capacity=capacity, num_draft=num_draft,
                    rule=rule, drafting=drafting, lookup=lookup, controls=not args.no_penalties,
                    prompt_bucket=min(capacity, 512), row_buckets="powers", donate_state=True,
                    specialized_steps=True)
    eos = getattr(target.module.config, "eos_token_id", None)
    eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    scheduler = Scheduler(engine, target.tokenizer, max_queue=args.max_queue, num_cycles=args.cycles_per_step,
                          eos_ids=eos)
    name = args.served_model_name or (args.target or common.pair_name(args))
    app = create_app(scheduler, ServerConfig(name, target), drain_seconds=args.drain_seconds)
    return app, scheduler


def default_capacity(target, draft, num_draft: int, most: int = 512) -> int:
    """``most`` tokens per slot, or fewer where the models' positions end sooner (a slot's caches hold
    ``capacity + num_draft`` positions)."""
    limits = [getattr(getattr(m.module, "config", None), "max_position_embeddings", None) for m in (target, draft)]
    return min([most] + [limit - num_draft for limit in limits if limit is not None])


def use_compilation_cache(directory: Optional[str]) -> Optional[str]:
    """Points JAX's persistent compilation cache at ``directory`` (None: $JAX_COMPILATION_CACHE_DIR,
    else ``~/.cache/specjax/jax``; ``"none"``: no cache) before anything compiles. Returns the
    directory, or None.

    A restart then loads the programs instead of compiling them: on the real pair the server was
    ready in 89-97 s after the start that filled the cache took 237 s (2-core CPU); tracing them
    is not cached.
    """
    import jax

    if directory is None:
        directory = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specjax" / "jax")
    if directory.lower() == "none":
        return None
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: --compilation-cache {directory}: {e.strerror}; give a writable directory, or "
                         "\"none\" to compile at every start.") from None
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory


def run(args) -> int:
    _require_server_packages()
    import uvicorn

    for flag, value in (("--slots", args.slots), ("--capacity", args.capacity),
                        ("--cycles-per-step", args.cycles_per_step)):
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag} must be a positive integer, got {value}.")
    if args.max_queue < 0:
        raise SystemExit(f"error: --max-queue must be >= 0, got {args.max_queue}.")
    app, _ = build(args)
    cache = use_compilation_cache(args.compilation_cache)
    print(f"specjax serve: compiling{f' (programs kept in {cache})' if cache else ''}, then serving on "
          f"http://{args.host}:{args.port} (GET /health answers 200 once ready)", flush=True)
    # uvicorn handles SIGINT / SIGTERM: it stops accepting, lets open requests finish for
    # --drain-seconds, then the app's lifespan refuses what still waits and stops the scheduler.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_seconds)
    return 0


def add_arguments(p) -> None:
    """``specjax serve``'s options (this module imports nothing heavy, so ``--help`` stays fast)."""
    common.add_model_args(p, default_num_draft=None)
    p.add_argument("--rule", default="speculative_sampling",
                   help='acceptance rule spec, e.g. "mars:theta=0.9" (default: lossless speculative sampling)')
    p.add_argument("--slots", type=int, default=8, help="requests generated at once (default 8)")
    p.add_argument("--capacity", type=int,
                   help="tokens per slot, prompt and completion together (default 512, or the models' positions "
                        "minus --num-draft where fewer: 252 on the embedded pair)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; more are refused with 429 (default 64)")
    p.add_argument("--cycles-per-step", type=int, default=4,
                   help="the most draft-verify cycles between two admissions / stream flushes; a step ends "
                        "sooner when a request finishes, and runs one cycle while a slot is free (default 4)")
    p.add_argument("--no-penalties", action="store_true",
                   help="compile the engine without the logits processors: faster cycles, and requests with "
                        "penalties, logit_bias or min_tokens are refused")
    p.add_argument("--chat-template", help="a Jinja chat template file for models without one (the embedded pair)")
    p.add_argument("--served-model-name", help="the model name clients give (default: the pair's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGINT / SIGTERM, how long live requests may finish before they are cancelled")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--compilation-cache", metavar="DIR",
                   help="keep the compiled programs here for the next start (JAX's persistent compilation cache; "
                        "default: $JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/specjax/jax; \"none\": off)")
