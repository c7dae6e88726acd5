"""`specjax serve` under load: clients with Poisson arrivals against the server, with speculative
decoding on and off, and against static-batch ``decode`` of the same requests.

For each number of concurrent clients C (default 1, 2, 4, 8), C client threads each send
``--requests-per-client`` streaming requests, waiting an exponential gap (mean ``--mean-gap`` s)
before each one (Poisson arrivals per client) on one kept-alive HTTP connection, as an application's
client does. The same requests run three ways:

* ``speculative``: the server as started (the pair's draft, ``--lookup``, the lossless rule);
* ``no drafts``: the same server, each request with ``num_draft: 0`` (one target token per cycle);
* ``static decode``: ``specjax.decode`` in this process (the server idle meanwhile), the
  requests in batches of C, each batch running until its longest request ends.

Request ``i`` carries ``seed: i``, and its static row samples with the key that seed gives a
request (``SlotSettings.seed``), so the speculative server and the static batches sample the same
text and do the same work: their token counts, printed side by side, agree.

The three take turns: for each round (``--rounds``) and each C, the speculative row, the
no-drafts row, then the static row, so that a load change on a shared machine hits them alike.
With ``--baseline DIR`` (a checkout of another revision) a second server runs from it beside the
first, and its row follows each speculative row: the same requests, one revision against the other.
With ``--tree SPEC`` the second server is this checkout's with ``--tree SPEC`` (a token tree per
cycle in every slot, no lookup), and its rows ('tree') follow each speculative (chain) row; with
``--second-flags FLAGS`` it is this checkout's with those flags added (``--prefill-chunk 0``:
long prompts prefilled whole). ``--long-every N`` gives every N-th request a long prompt
(``--long-words`` words of the other prompts' text before its own); the "short gap" columns are
then the gaps between the text deltas of the other requests' streams, what a long prompt's
prefill holds up.

Reported per row: output tokens per second over the row's wall time (for the server rows that
includes the clients' gaps, so it measures capacity only where the gaps are short; the static rows
have every request at the start and no gaps), time to first token and
inter-token latency (a request's time from its first to its last token over its tokens after
the first) at p50 and p99, requests lost (neither completed nor refused with an error: must be 0);
per run, the server's peak RSS, its scheduler loop's host share and prefill share (the loop's time
in ``insert`` and ``release`` over its busy time) and requests per prefill (all from ``/metrics``), and
whether ``/health`` still answers 200 after the load. The CPU seconds per row tell where a 2-core
machine's time went: the server process's (XLA, the scheduler, the HTTP stack) and the client
threads' for a server row; the benchmark process's (XLA) for a static row.

Everything runs on 127.0.0.1; the run is bounded by ``--requests-per-client``, ``--max-tokens``
and ``--max-seconds`` (per row).

The full run on the real pair:

    python benchmarks/serve_load.py --pair smollm2-eagle --lookup 2 --slots 8 --capacity 384 \\
        --clients 1 2 4 8 --requests-per-client 4 --max-tokens 96 --mean-gap 0.5

A smoke run (the embedded pair; a few minutes, most of it compiling):

    python benchmarks/serve_load.py --pair embedded --slots 4 --capacity 128 --clients 1 2 \\
        --requests-per-client 2 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAT_PROMPTS = ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"
CODE_PROMPTS = ["def fib(n):", "class Stack:", "import os\n\ndef main():", "x = [1, 2, 3]\nfor",
                "def parse(line):", "def add(a, b):", "with open(path) as f:", "def __init__(self):"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2-eagle", choices=["smollm2", "smollm2-eagle", "embedded"])
    p.add_argument("--lookup", default="2", help='context lookup "MIN[,MAX]" ("" for none)')
    p.add_argument("--rule", default="speculative_sampling")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--capacity", type=int, default=384)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--mean-gap", type=float, default=0.5, help="mean seconds between a client's requests")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-seconds", type=float, default=600.0, help="per row: no new request after this")
    p.add_argument("--skip-decode", action="store_true", help="leave out the static-batch decode rows")
    p.add_argument("--skip-no-drafts", action="store_true", help="leave out the server rows with num_draft 0")
    p.add_argument("--rounds", type=int, default=1, help="times each row runs, the contenders in turn")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--baseline", metavar="DIR",
                   help="also serve from this checkout of another revision (e.g. `git worktree add /tmp/base "
                        "main`): its server runs beside this one and its rows ('baseline') alternate with the "
                        "speculative rows, the same requests")
    p.add_argument("--tree", metavar="SPEC",
                   help='also serve the pair with --tree SPEC (e.g. "dynamic:3,3,8"; no lookup) beside the chain '
                        "server: its rows ('tree') alternate with the speculative rows, the same requests")
    p.add_argument("--second-flags", metavar="FLAGS",
                   help='also serve the pair with these `specjax serve` flags added (e.g. "--prefill-chunk 0"): '
                        "its rows alternate with the speculative rows, the same requests")
    p.add_argument("--second-label", default="second", help="the rows' name for --second-flags' server")
    p.add_argument("--also", metavar="LABEL=FLAGS", action="append", default=[],
                   help='one more server with these flags added (e.g. "fixed-K1=--drafting fixed --num-draft 1"), '
                        "its rows labelled LABEL; repeatable, each server's rows alternate with the others'")
    p.add_argument("--flags", default="",
                   help='`specjax serve` flags every server gets (e.g. "--quantize gguf")')
    p.add_argument("--long-every", type=int, default=0, metavar="N",
                   help="every N-th request gets a long prompt (--long-words words of held-out text); the "
                        "'short gap' columns are the gaps between the text deltas of the other requests")
    p.add_argument("--long-words", type=int, default=300)
    args = p.parse_args(argv)
    if sum(bool(x) for x in (args.tree, args.baseline, args.second_flags)) > 1:
        p.error("give one of --baseline, --tree and --second-flags (each runs the second server)")
    for item in args.also:
        if "=" not in item or not item.split("=", 1)[0]:
            p.error(f"--also takes LABEL=FLAGS, got {item!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


# ---------------------------------------------------------------------------
# The server (a subprocess, ended by its PID)
# ---------------------------------------------------------------------------


def start_server(args, checkout: Path = ROOT, extra: list | tuple = ()) -> common.Server:
    """``specjax serve`` of ``checkout`` with the run's flags and ``extra``; a ``--tree`` among them
    drafts that tree instead of chains with the lookup."""
    flags = ["--pair", args.pair, "--rule", args.rule, "--slots", str(args.slots), "--capacity", str(args.capacity),
             "--max-queue", str(max(64, max(args.clients) * args.requests_per_client))]
    if args.lookup and "--tree" not in extra:
        flags += ["--lookup", args.lookup]
    return common.Server(flags + args.flags.split() + list(extra), checkout)


def second_server(args) -> tuple:
    """``(label, checkout, extra flags)`` of the server whose rows alternate with the first's, or
    ``(None, None, ())``: another checkout (``--baseline``), a tree (``--tree``), or these flags
    (``--second-flags``)."""
    if args.baseline:
        return "baseline", Path(args.baseline).resolve(), ()
    if args.tree:
        return "tree", ROOT, ("--tree", args.tree)
    if args.second_flags:
        return args.second_label, ROOT, tuple(args.second_flags.split())
    return None, None, ()


def more_servers(args) -> list[tuple[str, tuple]]:
    """``(label, extra flags)`` of each ``--also`` server."""
    return [(item.split("=", 1)[0], tuple(item.split("=", 1)[1].split())) for item in args.also]


def own_cpu_seconds() -> float:
    """This process's CPU time (the client threads' during a server row)."""
    t = os.times()
    return t.user + t.system


# ---------------------------------------------------------------------------
# Clients
# ---------------------------------------------------------------------------


def one_request(httpx, client, url: str, body: dict) -> dict:
    """Streams one request on ``client`` (an ``httpx.Client``); returns its send, first-token and
    last-token times, the gaps between its text deltas and its token count."""
    sent = time.perf_counter()
    first = last = None
    arrivals = []
    tokens, error, done = 0, None, False
    try:
        with client.stream("POST", url, json=body, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                return dict(sent=sent, error=f"{r.status_code}: {r.text[:200]}", done=False)
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: ") or done:
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]["message"]
                    break
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                choices = data.get("choices") or []
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    last = time.perf_counter()
                    first = first or last
                    arrivals.append(last)
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return dict(sent=sent, first=first, last=last, tokens=tokens, error=error, done=done,
                gaps=list(np.diff(arrivals)))


def run_load(httpx, server: common.Server, requests: list[dict], clients: int, args, num_draft) -> dict:
    """``clients`` threads share ``requests`` round-robin; each waits an exponential gap before each one."""
    results, lock = [], threading.Lock()
    deadline = time.monotonic() + args.max_seconds

    def client(index: int):
        # One connection pool per client, kept alive between its requests, as an application's
        # client (the openai SDK's) keeps one: a new httpx.Client per request builds an SSL context
        # each time, about 40 ms of CPU on this machine, taken from the server beside it.
        with httpx.Client() as http:
            send_all(index, http)

    def send_all(index: int, http):
        rng = np.random.default_rng(index)
        for body in requests[index::clients]:
            time.sleep(rng.exponential(args.mean_gap))
            if time.monotonic() > deadline:
                break
            long = body.get("_long", False)
            body = {k: v for k, v in body.items() if k != "_long"}
            body = dict(body, stream=True, stream_options={"include_usage": True})
            if num_draft is not None:
                body["num_draft"] = num_draft
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = one_request(httpx, http, server.url + path, body)
            r["long"] = long
            with lock:
                results.append(r)

    before = server.metrics()
    cpu0, own0 = common.cpu_seconds(server.pid), own_cpu_seconds()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    server_cpu, client_cpu = common.cpu_seconds(server.pid) - cpu0, own_cpu_seconds() - own0
    after = server.metrics()
    ok = [r for r in results if not r["error"] and r["done"]]
    timed = [r for r in ok if r["first"] is not None]
    busy = after["specjax_busy_seconds_total"] - before["specjax_busy_seconds_total"]
    prefill = after["specjax_prefill_seconds_total"] - before["specjax_prefill_seconds_total"]
    engine = after["specjax_step_seconds_total"] - before["specjax_step_seconds_total"] + prefill
    return dict(
        requests=len(results), completed=len(ok), errors=len(results) - len(ok),
        lost=sum(1 for r in results if not r["error"] and not r["done"]),
        tokens=sum(r["tokens"] for r in ok), wall=wall, tok_s=sum(r["tokens"] for r in ok) / wall,
        ttft=[r["first"] - r["sent"] for r in timed],
        itl=[(r["last"] - r["first"]) / (r["tokens"] - 1) for r in timed if r["tokens"] > 1],
        # the gaps between text deltas of the requests with short prompts (all of them without --long-every)
        short_gaps=[g for r in timed if not r["long"] for g in r["gaps"]],
        host_share=(busy - engine) / busy if busy > 0 else float("nan"),
        server_cpu=server_cpu, client_cpu=client_cpu,
        prefill_share=prefill / busy if busy > 0 else float("nan"),
        per_prefill=((after["specjax_prefilled_requests_total"] - before["specjax_prefilled_requests_total"])
                     / max(1.0, after["specjax_prefills_total"] - before["specjax_prefills_total"])),
        acceptance=(after["specjax_accepted_tokens_total"] - before["specjax_accepted_tokens_total"])
        / max(1.0, after["specjax_drafted_tokens_total"] - before["specjax_drafted_tokens_total"]),
    )


# ---------------------------------------------------------------------------
# Static batches
# ---------------------------------------------------------------------------


def static_runner(args, texts: list[str]):
    """``clients -> row``: the same requests through ``decode`` in this process (the pair loaded once)."""
    import specjax
    from specjax.cli import common as cli_common

    ns = argparse.Namespace(pair=args.pair, target=None, draft=None, dtype="float32", default_pair=args.pair)
    target, draft = cli_common.load_pair(ns)
    pair = specjax.pair(target, draft)
    if args.pair == "embedded":
        ids = [target.tokenizer.encode(t).ids for t in texts]
    else:
        ids = [specjax.encode_chat(target, t) for t in texts]
    compiled: set = set()
    return lambda clients: static_decode(args, pair, ids[: clients * args.requests_per_client], clients, compiled)


def width_bucket(n: int) -> int:
    """The prompt width ``decode`` pads ``n`` to with its default buckets (16, 32, 64, ...)."""
    width = 16
    while width < n:
        width *= 2
    return width


def static_decode(args, pair, prompts: list[list[int]], clients: int, compiled: set) -> dict:
    """The same requests through ``specjax.decode``, ``clients`` per batch (compiled before timing)."""
    import jax

    import specjax
    from specjax.cli import common as cli_common
    from specjax.rules import parse_rule

    ns = argparse.Namespace(lookup=args.lookup or None)
    kw = dict(num_draft=3 if args.pair.startswith("smollm2") else 4, max_new_tokens=args.max_tokens,
              temperature=args.temperature, rule=parse_rule(args.rule), lookup=cli_common.lookup(ns))
    starts = range(0, len(prompts), clients)
    batches = [prompts[i:i + clients] for i in starts]
    # Request i carries seed i; the server samples it with decode's key of sequence 0 for that seed
    # (SlotSettings.seed), so each static row gets that key and both sample the same text.
    keys = [jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 0))(np.arange(i, i + len(b)))
            for i, b in zip(starts, batches)]
    for batch, key in zip(batches, keys):  # compile each (batch size, prompt width bucket) before timing
        shape = (len(batch), width_bucket(max(len(p) for p in batch)))
        if shape not in compiled:
            specjax.decode(pair, batch, key=key, **kw)
            compiled.add(shape)
    t0, cpu0 = time.perf_counter(), own_cpu_seconds()
    tokens = 0
    for batch, key in zip(batches, keys):
        out = specjax.decode(pair, batch, key=key, **kw)
        tokens += sum(len(x) for x in out.to_lists())
    wall, cpu = time.perf_counter() - t0, own_cpu_seconds() - cpu0
    return dict(requests=len(prompts), completed=len(prompts), errors=0, lost=0, tokens=tokens, wall=wall,
                tok_s=tokens / wall, ttft=[], itl=[], short_gaps=[], host_share=float("nan"), server_cpu=cpu,
                client_cpu=0.0,
                prefill_share=float("nan"),
                per_prefill=float("nan"), acceptance=float("nan"))


# ---------------------------------------------------------------------------


def pct(xs, q) -> str:
    return f"{np.percentile(xs, q) * 1000:.0f}" if xs else "-"


def draft_length_counts(httpx, srv) -> dict[int, int]:
    """The server's sequence-cycles by draft length so far (``specjax_draft_length_cycles_total``)."""
    counts = {}
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("specjax_draft_length_cycles_total{"):
            length = int(line.split('length="')[1].split('"')[0])
            counts[length] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx

    print(common.header("serve_load: specjax serve under Poisson load"))
    total = max(args.clients) * args.requests_per_client
    if args.pair == "embedded":
        texts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(total)]
        requests = [dict(model="bench", prompt=t, max_tokens=args.max_tokens, temperature=args.temperature, seed=i)
                    for i, t in enumerate(texts)]
    else:
        texts = [json.loads(line)["prompt"] for line in CHAT_PROMPTS.read_text().splitlines()][:total]
        requests = [dict(model="bench", messages=[{"role": "user", "content": t}], max_tokens=args.max_tokens,
                         temperature=args.temperature, seed=i) for i, t in enumerate(texts)]
    if args.long_every:  # every N-th request: its text after a long passage of the other prompts' texts
        passage = " ".join(texts * (1 + args.long_words // max(1, sum(len(t.split()) for t in texts))))
        passage = " ".join(passage.split()[: args.long_words])
        for i in range(args.long_every - 1, total, args.long_every):
            long = f"Read this, then answer the question after it.\n\n{passage}\n\n{texts[i]}"
            key = "messages" if "messages" in requests[i] else "prompt"
            requests[i] = dict(requests[i], _long=True,
                               **{key: [{"role": "user", "content": long}] if key == "messages" else long})

    server = start_server(args)
    other = None
    more: dict[str, common.Server] = {}
    rows = []
    try:
        print(f"server ready after {server.wait_ready():.0f} s (load and compile)", flush=True)
        second, checkout, extra = second_server(args)
        if second:  # started after the first is ready: the two do not compile at once
            other = start_server(args, checkout, extra)
            print(f"{second} server ({args.baseline or ' '.join(extra)}) ready after {other.wait_ready():.0f} s",
                  flush=True)
        for label, extra in more_servers(args):  # one at a time: they do not compile at once
            more[label] = start_server(args, ROOT, extra)
            print(f"{label} server ({' '.join(extra)}) ready after {more[label].wait_ready():.0f} s", flush=True)
        static = None if args.skip_decode else static_runner(args, texts)
        for rnd in range(args.rounds):
            for clients in args.clients:
                share = requests[: clients * args.requests_per_client]
                modes = [("speculative", None), (second, None), *((label, None) for label in more),
                         ("no drafts", 0), ("static decode", None)]
                for mode, num_draft in modes:
                    if mode is None or (mode == "no drafts" and args.skip_no_drafts):
                        continue
                    if mode == "static decode":
                        if static is None:
                            continue
                        row = static(clients)
                    else:
                        target = other if mode == second else more.get(mode, server)
                        # Per row: the default server also runs the "no drafts" rows, so its counters
                        # over the whole run mix the two.
                        before = draft_length_counts(httpx, target)
                        row = run_load(httpx, target, share, clients, args, num_draft)
                        after = draft_length_counts(httpx, target)
                        row["draft_lengths"] = {k: after[k] - before.get(k, 0) for k in sorted(after)}
                    rows.append(dict(mode=mode, clients=clients, round=rnd, **row))
                    lengths = row.get("draft_lengths")
                    drafted = "" if not lengths else ", cycles by draft length " + " ".join(
                        f"{k}:{n}" for k, n in lengths.items())
                    print(f"  {mode:13s} C={clients} round {rnd}: {row['tok_s']:.1f} tok/s, {row['tokens']} tokens, "
                          f"{row['completed']}/{row['requests']} completed, lost {row['lost']}{drafted}", flush=True)
        health = httpx.get(server.url + "/health", timeout=10).status_code
        for label, srv in [("speculative", server), *more.items()]:  # what auto planned with, and chose
            text = httpx.get(srv.url + "/metrics", timeout=10).text
            lines = [line for line in text.splitlines() if line.startswith(("specjax_cycle_cost", "specjax_cycle_refreshes", "specjax_draft_length"))]
            if lines:
                print(f"{label} server's /metrics after the rows (its draft-length counters hold every "
                      f"row it ran{', the no-drafts rows too' if label == 'speculative' else ''}):\n  "
                      + "\n  ".join(lines))
        rss = server.peak_rss_mib()
        other_rss = other.peak_rss_mib() if other is not None else None
    finally:
        code = server.stop()
        if other is not None:
            other.stop()
        for extra_server in more.values():
            extra_server.stop()
    # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM is a clean exit.
    clean = code in (0, -signal.SIGTERM)
    print(f"server: peak RSS {rss:.0f} MiB; /health after the load: {health}; after SIGTERM it exited "
          f"{'cleanly' if clean else f'with status {code}'}")
    if other_rss is not None:
        print(f"{second} server: peak RSS {other_rss:.0f} MiB")

    head = ["mode", "C", "round", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
            "short gap p99 ms", "short gap max ms", "done/sent",
            "lost", "host share", "prefill share", "requests per prefill", "accept", "CPU s: model, clients"]
    table = [[r["mode"], r["clients"], r["round"], f"{r['tok_s']:.1f}", pct(r["ttft"], 50), pct(r["ttft"], 99),
              pct(r["itl"], 50), pct(r["itl"], 99), pct(r["short_gaps"], 99),
              f"{max(r['short_gaps']) * 1000:.0f}" if r["short_gaps"] else "-",
              f"{r['completed']}/{r['requests']}", r["lost"],
              "-" if r["host_share"] != r["host_share"] else f"{r['host_share']:.3f}",
              "-" if r["prefill_share"] != r["prefill_share"] else f"{r['prefill_share']:.3f}",
              "-" if r["per_prefill"] != r["per_prefill"] else f"{r['per_prefill']:.2f}",
              "-" if r["acceptance"] != r["acceptance"] else f"{r['acceptance']:.2f}",
              f"{r['server_cpu']:.1f}, {r['client_cpu']:.1f}"] for r in rows]
    print(common.table(head, table, markdown=True))
    for clients in args.clients:
        of = lambda mode: [r for r in rows if r["mode"] == mode and r["clients"] == clients]  # noqa: E731
        spec, off, static_rows = of("speculative"), of("no drafts"), of("static decode")
        itl = lambda rs: [x for r in rs for x in r["itl"]]  # noqa: E731
        if itl(spec) and itl(off):
            print(f"C={clients}: median ITL no drafts / speculative = "
                  f"{statistics.median(itl(off)) / statistics.median(itl(spec)):.2f}x")
        base_rows = of(second) if second else []
        if base_rows:  # the two servers, round by round: this checkout / baseline, or tree / chain
            ratios = [(a["tok_s"] / b["tok_s"]) if second == "baseline" else (b["tok_s"] / a["tok_s"])
                      for a, b in zip(spec, base_rows)]
            label = ("this checkout / baseline" if second == "baseline"
                     else f"{second} / speculative")
            print(f"C={clients}: tok/s {label} = {common.ratio_cell(ratios)}; median TTFT "
                  f"{statistics.median([x for r in spec for x in r['ttft']]) * 1000:.0f} against "
                  f"{statistics.median([x for r in base_rows for x in r['ttft']]) * 1000:.0f} ms (speculative "
                  f"against {second}), median ITL {statistics.median(itl(spec)) * 1000:.1f} against "
                  f"{statistics.median(itl(base_rows)) * 1000:.1f} ms")
            gaps = lambda rs: [g for r in rs for g in r["short_gaps"]]  # noqa: E731
            if args.long_every and gaps(spec) and gaps(base_rows):
                print(f"C={clients}: short requests' gaps between text deltas, p99 / max: "
                      f"{pct(gaps(spec), 99)} / {max(gaps(spec)) * 1000:.0f} ms (speculative) against "
                      f"{pct(gaps(base_rows), 99)} / {max(gaps(base_rows)) * 1000:.0f} ms ({second})")
        contenders = [m for m in ("speculative", second, *more) if m and of(m)]
        for mode in contenders if off else []:  # every server against the same requests with drafts off
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(of(mode), off)]
            print(f"C={clients}: tok/s {mode} / no drafts = {common.ratio_cell(ratios)}")
        if more:  # the default server against the best of the others, round by round
            best = [max([r["tok_s"] for m in contenders[1:] for r in of(m) if r["round"] == a["round"]]
                        + ([o["tok_s"] for o in off if o["round"] == a["round"]] if off else []))
                    for a in of("speculative")]
            ratios = [a["tok_s"] / b for a, b in zip(of("speculative"), best)]
            print(f"C={clients}: tok/s speculative / best of the others and no drafts = {common.ratio_cell(ratios)}")
        if static_rows:  # rows of one round ran one after the other: their ratio is the fair one
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(spec, static_rows)]
            print(f"C={clients}: tok/s speculative server / static decode = {common.ratio_cell(ratios)} "
                  f"({len(ratios)} round{'s' if len(ratios) > 1 else ''})")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows, peak_rss_mib=rss, health_after=health,
                                                  exit_status=code), indent=1))
    lost = sum(r["lost"] for r in rows)
    return 0 if lost == 0 and health == 200 and clean else 1


if __name__ == "__main__":
    sys.exit(main())
