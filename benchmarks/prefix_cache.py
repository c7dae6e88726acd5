"""`specjax serve` with and without its prefix cache: conversations, a shared system prompt, and
requests that share nothing.

Starts ``specjax serve`` on 127.0.0.1 once with the prefix cache (its default) and once with
``--no-prefix-cache``, the same flags otherwise, and runs three workloads against each, by chat
completions streamed as a chat client sends them:

* ``conversation``: one client, ``--turns`` turns, each resending the whole history (the held-out
  chat prompts as the user's messages, the server's greedy replies as the assistant's): the time
  to the first token of each turn;
* ``shared system prompt``: ``--clients`` clients at once, each sending ``--requests-per-client``
  requests with one system prompt of ``--system-words`` words and a question of its own:
  the time to first token of each client's first request (the cache is cold for the first one to
  arrive) and of the later ones (steady state);
* ``nothing shared``: ``--clients`` clients, each sending ``--requests-per-client`` requests with a
  prompt of its own: output tokens per second over the wall time (what a cache that never hits
  costs: storing every prompt's blocks). It runs twice: first, on the fresh server, and last,
  after the other workloads (the cache then holds their blocks, and each server's live cost
  estimates have seen a different history), with the server's counters over each (steps and
  their seconds, prefill seconds, cycles and the draft lengths chosen).

Reported per server: time to first token (median and range), the prompt tokens the server read from
its cache (``usage.prompt_tokens_details.cached_tokens``), throughput, and from ``/metrics`` the
cache's hit rate, blocks, bytes and budget; the server's peak RSS. Every request is greedy, so the
two servers generate the same text (checked: the conversation's replies must agree).

    python benchmarks/prefix_cache.py --pair smollm2-eagle --lookup 2 --slots 8 --capacity 2048
    python benchmarks/prefix_cache.py --pair embedded --capacity 250 --turns 3 --system-words 40  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import common

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout_chat_64.jsonl"
# The embedded pair has no chat template of its own (the server takes one).
TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:{% endif %}"
)


def start_server(args, extra: list, template: Path) -> common.Server:
    flags = [
        "--pair",
        args.pair,
        "--slots",
        str(args.slots),
        "--capacity",
        str(args.capacity),
        "--max-queue",
        "256",
        *extra,
    ]
    if args.lookup:
        flags += ["--lookup", args.lookup]
    if args.pair == "embedded":
        flags += ["--chat-template", str(template)]
    return common.Server(flags, stop_timeout=120)


def chat(http, url: str, messages: list, max_tokens: int) -> dict:
    """One streamed, greedy chat request: its text, time to first token and usage."""
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began, first, text, usage = time.perf_counter(), None, [], None
    with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    return {"text": "".join(text), "ttft": (first or time.perf_counter()) - began, "usage": usage}


def questions() -> list[str]:
    return [row["prompt"] for row in common.read_jsonl(PROMPTS)]


def system_prompt(words: int) -> str:
    """A long system prompt: house rules made of the held-out prompts' words (about 1.3 tokens a word)."""
    pool = " ".join(questions()).split()
    body = " ".join(pool[i % len(pool)] for i in range(words))
    return "You are the assistant of a help desk. Follow the notes below when you answer.\nNotes: " + body


def run_conversation(httpx, url: str, args) -> list[dict]:
    messages, turns = [], []
    with httpx.Client() as http:
        for question in questions()[: args.turns]:
            messages.append({"role": "user", "content": question})
            r = chat(http, url, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": r["text"]})
            turns.append(r)
    return turns


def run_clients(httpx, url: str, args, make_messages) -> tuple[list[list[dict]], float]:
    """``--clients`` threads, each sending its requests one after the other: results per client
    (in order) and the wall time."""
    results = [[] for _ in range(args.clients)]
    errors = []

    def client(c: int):
        try:
            with httpx.Client() as http:
                for r in range(args.requests_per_client):
                    results[c].append(chat(http, url, make_messages(c, r), args.max_tokens))
        except Exception as e:  # noqa: BLE001 -- reported after the threads end
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - began


def run_unshared(httpx, server, args, tag: str) -> tuple[list[list[dict]], float, dict]:
    """The nothing-shared workload: each client's prompts its own (tagged ``tag``, so that two runs of
    it share nothing either); its results, wall time, and the server's counters over it."""
    offset = args.turns + args.clients * args.requests_per_client
    own = questions()[offset:] + questions()[:offset]
    before = server.metrics()
    results, wall = run_clients(
        httpx,
        server.url,
        args,
        lambda c, r: [
            {"role": "user", "content": f"Request {tag}{c}-{r}. " + own[(c * args.requests_per_client + r) % len(own)]}
        ],
    )
    after = server.metrics()
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0].endswith("_total")}
    delta.update({k: v for k, v in after.items() if k.startswith("specjax_cycle_cost{")})  # gauges: as they end
    return results, wall, delta


def measure_unshared(httpx, server, args, out: dict, key: str, when: str) -> None:
    """Runs the nothing-shared workload into ``out[key]`` (results), ``out[key + "_wall"]`` and
    ``out[key + "_delta"]`` (the server's counters over it, and auto's cycle costs as it ends), and
    prints its line."""
    tag = "A" if key == "fresh" else "B"
    out[key], out[key + "_wall"], out[key + "_delta"] = run_unshared(httpx, server, args, tag)
    tokens = sum(r["usage"]["completion_tokens"] for reqs in out[key] for r in reqs)
    print(
        f"[{out['label']}] nothing shared, {when}: {tokens} tokens in {out[key + '_wall']:.1f} s; "
        f"{where_time_went(out[key + '_delta'])}; {planned_costs(out[key + '_delta'])}",
        flush=True,
    )


def planned_costs(metrics: dict) -> str:
    """The relative cycle costs auto planned with at the end of a workload (``specjax_cycle_cost``, in
    plain cycles by draft length), for the largest row bucket: what a choice of draft length read."""
    by_rows: dict[int, dict[int, float]] = {}
    for key, value in metrics.items():
        if key.startswith("specjax_cycle_cost{"):
            labels = dict(part.split("=") for part in key[key.index("{") + 1 : -1].split(","))
            by_rows.setdefault(int(labels["rows"].strip('"')), {})[int(labels["draft_length"].strip('"'))] = value
    if not by_rows:
        return "auto's cycle costs: none (fixed drafting)"
    rows = max(by_rows)
    costs = ", ".join(f"{by_rows[rows][k]:.2f}" for k in sorted(by_rows[rows]))
    return f"auto's cycle costs at {rows} rows by draft length 0..: {costs}"


def where_time_went(delta: dict) -> str:
    """The server's steps, their seconds, prefill and loop seconds, cycles and the draft lengths
    its cycles chose, over one workload."""
    lengths = {
        k.split('"')[1]: int(v) for k, v in delta.items() if k.startswith("specjax_draft_length_cycles_total{") and v
    }
    cycles = delta.get("specjax_cycles_total", 0.0)
    tokens = delta.get("specjax_generation_tokens_total", 0.0)
    return (
        f"{delta.get('specjax_steps_total', 0):.0f} steps in {delta.get('specjax_step_seconds_total', 0):.2f} s, "
        f"prefill {delta.get('specjax_prefill_seconds_total', 0):.2f} s, "
        f"loop busy {delta.get('specjax_busy_seconds_total', 0):.2f} s, {cycles:.0f} cycles "
        f"({tokens / cycles if cycles else 0:.2f} tokens each), draft lengths {lengths}"
    )


def serve_and_measure(httpx, args, label: str, extra: list, template: Path) -> dict:
    with start_server(args, extra, template) as server:
        url = server.url
        print(f"[{label}] ready after {server.wait_ready(3600.0):.0f} s; {common.load_average()}", flush=True)
        out = {"label": label}
        measure_unshared(httpx, server, args, out, "fresh", "fresh server")
        out["conversation"] = run_conversation(httpx, url, args)
        print(
            f"[{label}] conversation: TTFT per turn " + ", ".join(f"{t['ttft']:.2f}" for t in out["conversation"]),
            flush=True,
        )
        system = system_prompt(args.system_words)
        qs = questions()[args.turns :]
        out["shared"], out["shared_wall"] = run_clients(
            httpx,
            url,
            args,
            lambda c, r: [
                {"role": "system", "content": system},
                {"role": "user", "content": qs[(c * args.requests_per_client + r) % len(qs)]},
            ],
        )
        print(
            f"[{label}] shared system prompt: TTFT "
            + "; ".join(", ".join(f"{r['ttft']:.2f}" for r in reqs) for reqs in out["shared"]),
            flush=True,
        )
        measure_unshared(httpx, server, args, out, "unshared", "after the others")
        out["metrics"] = server.metrics()
        out["rss"] = server.peak_rss_mib()
        print(f"[{label}] done; {common.load_average()}", flush=True)
        return out


def spread(xs) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.3f} [{xs[0]:.3f}-{xs[-1]:.3f}]" if xs else "-"


def throughput(run: dict, key: str) -> float:
    """Output tokens per second of one run's nothing-shared workload (``fresh`` or ``unshared``)."""
    return sum(r["usage"]["completion_tokens"] for reqs in run[key] for r in reqs) / run[key + "_wall"]


def report(runs: list[dict], args) -> str:
    by = {}
    for run in runs:
        by.setdefault(run["label"], []).append(run)
    lines = [common.header("prefix_cache: specjax serve with and without its prefix cache"), ""]
    rows = []
    for label, group in by.items():
        conv = [run["conversation"] for run in group]
        turn1 = [c[0]["ttft"] for c in conv]
        last = [c[-1]["ttft"] for c in conv]
        last_prompt = conv[0][-1]["usage"]["prompt_tokens"]
        last_cached = conv[0][-1]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        first_wave = [reqs[0]["ttft"] for run in group for reqs in run["shared"]]
        steady = [r["ttft"] for run in group for reqs in run["shared"] for r in reqs[1:]]
        shared_prompt = group[0]["shared"][0][0]["usage"]["prompt_tokens"]
        steady_cached = [
            r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            for run in group
            for reqs in run["shared"]
            for r in reqs[1:]
        ]
        tput = [throughput(run, "unshared") for run in group]
        fresh = [throughput(run, "fresh") for run in group]
        m = group[-1]["metrics"]
        cache = (
            f"hit rate {m['specjax_prefix_cache_hit_rate']:.2f}, {int(m['specjax_prefix_cache_blocks'])} blocks, "
            f"{m['specjax_prefix_cache_bytes'] / 2**20:.0f} of {m['specjax_prefix_cache_budget_bytes'] / 2**20:.0f}"
            " MiB"
            if "specjax_prefix_cache_blocks" in m
            else "off"
        )
        rows.append(
            [
                label,
                spread(turn1),
                f"{spread(last)} ({last_cached} of {last_prompt} cached)",
                f"{spread(first_wave)}",
                f"{spread(steady)} ({statistics.median(steady_cached):.0f} of {shared_prompt} cached)",
                spread(fresh),
                spread(tput),
                cache,
                f"{max(run['rss'] for run in group):.0f}",
            ]
        )
    head = [
        "server",
        "conversation TTFT turn 1 (s)",
        f"TTFT turn {args.turns} (s)",
        "shared prompt TTFT, first requests (s)",
        "shared prompt TTFT, later requests (s)",
        "nothing shared, fresh server: tok/s",
        "nothing shared, after the others: tok/s",
        "prefix cache (at the end)",
        "peak RSS MiB",
    ]
    lines.append(common.table(head, rows, markdown=True))
    labels = list(by)
    if len(labels) == 2:
        a, b = by[labels[0]], by[labels[1]]
        lines.append("")
        lines.append(
            f"ratios ({labels[1]} / {labels[0]}): TTFT turn {args.turns} "
            f"{statistics.median([r['conversation'][-1]['ttft'] for r in b]) / statistics.median([r['conversation'][-1]['ttft'] for r in a]):.2f}x; "
            f"shared-prompt steady TTFT "
            f"{statistics.median([x['ttft'] for r in b for q in r['shared'] for x in q[1:]]) / statistics.median([x['ttft'] for r in a for q in r['shared'] for x in q[1:]]):.2f}x; "
            "nothing-shared throughput (cache / none): fresh server "
            f"{statistics.median([throughput(r, 'fresh') for r in a]) / statistics.median([throughput(r, 'fresh') for r in b]):.3f}x, "
            "after the others "
            f"{statistics.median([throughput(r, 'unshared') for r in a]) / statistics.median([throughput(r, 'unshared') for r in b]):.3f}x"
        )
        for label, group in ((labels[0], a), (labels[1], b)):
            for run in group:
                for key in ("fresh", "unshared"):
                    lines.append(
                        f"{label}, nothing shared ({'fresh server' if key == 'fresh' else 'after the others'}): "
                        f"{throughput(run, key):.1f} tok/s; {where_time_went(run[key + '_delta'])}; "
                        f"{planned_costs(run[key + '_delta'])}"
                    )
        same = all(
            x["text"] == y["text"] for ra, rb in zip(a, b) for x, y in zip(ra["conversation"], rb["conversation"])
        )
        lines.append(f"the conversation's replies agree between the servers: {same}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2-eagle")
    p.add_argument("--lookup", default=None)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--system-words", type=int, default=770, help="about 1,000 tokens of SmolLM2's tokenizer")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1, help="each round runs the cached server, then the other")
    p.add_argument("--prefix-cache", default="1GiB")
    p.add_argument("--markdown", help="also write the report to this file")
    args = p.parse_args(argv)
    import httpx

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "template.jinja"
        template.write_text(TEMPLATE)
        servers = [("prefix cache", ["--prefix-cache", args.prefix_cache]), ("no prefix cache", ["--no-prefix-cache"])]
        for round_ in range(args.rounds):  # the order swapped every round
            for label, extra in servers if round_ % 2 == 0 else servers[::-1]:
                runs.append(serve_and_measure(httpx, args, label, extra, template))
    if args.markdown:  # the raw figures first: a report that fails leaves them
        Path(args.markdown).with_suffix(".json").write_text(json.dumps(runs))
    text = report(runs, args)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
