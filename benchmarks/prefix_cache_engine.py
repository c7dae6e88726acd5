"""The prefix cache, paired in one process: the server's scheduler on the real pair with and without it.

    python benchmarks/prefix_cache_engine.py                      # 4 slots of 1,024 positions, 3 rounds
    python benchmarks/prefix_cache_engine.py --rounds 2 --turns 6 --markdown out.md

``specjax serve``'s loop (:class:`specjax._src.serve.scheduler.Scheduler`) drives two slots engines
built alike on SmolLM2-135M-Instruct (float32) with its EAGLE-3-style head, in one process: one with
a :class:`specjax.engine.PrefixCache` (``--budget-mib``, the server's default 1 GiB), one without.
Both compile first (the persistent compilation cache, as the server uses it; then one untimed round
of every workload on each, so that every program a timed round runs is built); then the two
alternate over ``--rounds`` rounds (the order swapped every round), each round's workloads on fresh
prompts that both share, greedy throughout:

* ``nothing shared, short``: ``--requests`` held-out chat prompts at once (each under one 64-token
  block with the chat template: nothing to store or find): output tokens per second;
* ``nothing shared, long``: ``--requests`` prompts at once, each four held-out prompts behind a tag of
  its own (about 130 tokens: the cache stores a block or two of each, and never finds one): tok/s;
* ``shared system prompt``: a system prompt of about ``--system-words`` words and a question of its
  own per request, ``--shared-requests`` requests one after the other (the cache emptied first): the
  time to first token of the first (cold for both) and of the later ones;
* ``conversation``: ``--turns`` turns, each resending the whole history (held-out prompts as the
  user's messages, the engine's own replies as the assistant's; the cache emptied first): the time
  to first token per turn, and the prompt tokens read from the cache.

Timed in process: a request's time to first token runs from its submission to the first event that
carries text (what a streaming client receives first). Reported: medians and ranges, per-round ratios (none over cache for times, cache over
none for throughput), the load average at start and end, and the programs built during the timed
rounds (0: nothing compiled while timed). Hold the machine's CPU lock for the whole run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HELDOUT_64 = common.ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"
WORKLOADS = ("short", "long", "shared", "conversation")


class Result:
    """One request's events: time to first token, text, tokens, cached tokens."""

    def __init__(self):
        self.began = time.perf_counter()
        self.first = None
        self.text, self.tokens = [], 0
        self.cached, self.done, self.error = 0, threading.Event(), None

    def emit(self, event):
        from specjax._src.serve.scheduler import Delta, Done, Failed

        if isinstance(event, Delta):
            if event.text and self.first is None:  # the first text a streaming client receives
                self.first = time.perf_counter() - self.began
            self.text.append(event.text)
        elif isinstance(event, Done):
            if self.first is None:
                self.first = time.perf_counter() - self.began
            self.tokens += event.completion_tokens
            self.cached = event.cached_tokens
            self.done.set()
        elif isinstance(event, Failed):
            self.error = event.message
            self.done.set()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--num-draft", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8, help="requests of each nothing-shared workload")
    ap.add_argument("--shared-requests", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                    help="the workloads to run (default: all four)")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    from specjax._src.kernels import compile_cache

    directory = compile_cache.enable(compile_cache.resolve(None))

    import specjax
    from specjax.engine import Engine, PrefixCache, SlotSettings
    from specjax._src.serve.scheduler import Request, Scheduler

    questions = [row["prompt"] for row in common.read_prompt_file(HELDOUT_64, ap)]
    report = common.Report("prefix_cache_engine: the server's scheduler with and without the prefix cache, "
                           "paired in one process")
    began_load = common.load_average()
    target = specjax.load("smollm2-135m-instruct", dtype="float32")
    head = specjax.load("smollm2-135m-instruct-eagle", dtype="float32")
    eos = tuple(target.module.config.eos_token_ids)
    report.text(f"real pair: smollm2-135m-instruct + its EAGLE-3-style head, float32; {args.slots} slots of "
                f"{args.capacity} positions, K={args.num_draft} (fixed drafting), greedy, up to {args.max_tokens} "
                f"new tokens; the server's engine flags (prompt bucket {min(args.capacity, 512)}, row buckets "
                f"powers, donated state, specialized steps) and scheduler defaults (4 cycles a step, 128-token "
                f"prefill chunks); prefix cache {args.budget_mib} MiB against none; {args.rounds} alternating "
                f"rounds; persistent compilation cache {directory}")

    def build(cache):
        engine = Engine(specjax.pair(target, head), num_slots=args.slots, capacity=args.capacity,
                        num_draft=args.num_draft, prompt_bucket=min(args.capacity, 512), row_buckets="powers",
                        donate_state=True, specialized_steps=True)
        return Scheduler(engine, target.tokenizer, max_queue=256, eos_ids=eos, warmup_widths=[engine.cfg.prompt_bucket],
                         prefix_cache=cache)

    caches = {"prefix cache": PrefixCache(args.budget_mib << 20, namespace="bench"), "no prefix cache": None}
    schedulers = {}
    t0 = time.perf_counter()
    with compile_cache.count_programs() as programs:
        for name, cache in caches.items():
            schedulers[name] = build(cache).start()
            while not schedulers[name].ready.wait(5):
                if schedulers[name].error is not None:
                    raise schedulers[name].error
    report.text(f"warm-up (both schedulers): {time.perf_counter() - t0:.0f} s; {programs.describe()}")

    settings = SlotSettings(temperature=0.0, max_new_tokens=args.max_tokens, seed=0)

    def submit(name, messages, max_tokens=None):
        r = Result()
        s = settings if max_tokens is None else settings._replace(max_new_tokens=max_tokens)
        schedulers[name].submit(Request(specjax.encode_chat(target, messages), s, r.emit))
        return r

    def wait(results):
        for r in results:
            r.done.wait()
            if r.error:
                for s in schedulers.values():
                    if s.error is not None:
                        raise RuntimeError(r.error) from s.error
                raise RuntimeError(r.error)
        return results

    def pick(i):
        return questions[i % len(questions)]

    def clear(name):
        if caches[name] is not None:
            caches[name].clear()

    def nothing_shared(name, rnd, long):
        clear(name)
        msgs = []
        for i in range(args.requests):
            k = rnd * args.requests + i
            if long:
                text = f"Request {rnd}-{i}. " + " ".join(pick(k + 17 * j) for j in range(4))
            else:
                text = pick(k)
            msgs.append([{"role": "user", "content": text}])
        t = time.perf_counter()
        results = wait([submit(name, m) for m in msgs])
        wall = time.perf_counter() - t
        return dict(tok_s=sum(r.tokens for r in results) / wall, tokens=sum(r.tokens for r in results), wall=wall,
                    cached=sum(r.cached for r in results))

    words = " ".join(questions).split()

    def shared(name, rnd):
        clear(name)
        system = (f"You are the assistant of help desk {rnd}. Follow the notes below when you answer.\nNotes: "
                  + " ".join(words[(rnd * 37 + i) % len(words)] for i in range(args.system_words)))
        out = []
        for i in range(args.shared_requests):
            q = pick(rnd * args.shared_requests + i + 32)
            out.append(wait([submit(name, [{"role": "system", "content": system},
                                           {"role": "user", "content": q}], max_tokens=8)])[0])
        return dict(ttft=[r.first for r in out], cached=[r.cached for r in out],
                    prompt=len(specjax.encode_chat(target, [{"role": "system", "content": system},
                                                            {"role": "user", "content": pick(32)}])))

    def conversation(name, rnd):
        clear(name)
        messages, out = [], []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": pick(rnd * args.turns + turn + 7)})
            length = len(specjax.encode_chat(target, messages))
            r = wait([submit(name, messages)])[0]
            messages.append({"role": "assistant", "content": "".join(r.text)})
            out.append((r.first, r.cached, length, "".join(r.text)))
        return dict(ttft=[o[0] for o in out], cached=[o[1] for o in out], prompt=[o[2] for o in out],
                    replies=[o[3] for o in out])

    workloads = {"short": lambda n, r: nothing_shared(n, r, False), "long": lambda n, r: nothing_shared(n, r, True),
                 "shared": shared, "conversation": conversation}
    workloads = {w: fn for w, fn in workloads.items() if w in args.workloads}
    names = list(schedulers)
    t0 = time.perf_counter()
    for name in names:  # untimed: builds every program the workloads run (round -1: prompts of its own)
        for fn in workloads.values():
            fn(name, args.rounds)
    report.text(f"untimed round (both): {time.perf_counter() - t0:.0f} s; {common.load_average()}")

    results = {w: {n: [] for n in names} for w in workloads}
    with compile_cache.count_programs() as timed_programs:
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for w, fn in workloads.items():
                for name in order:
                    results[w][name].append(fn(name, rnd))
            print(f"round {rnd + 1} of {args.rounds} done; {common.load_average()}", flush=True)
    report.text(f"programs built during the timed rounds: {timed_programs.built}")

    cache_name, none_name = names
    med, fmt = statistics.median, (lambda xs, d=2: f"{statistics.median(xs):.{d}f} [{min(xs):.{d}f}-{max(xs):.{d}f}]")

    def ratios(a, b):
        return [x / y for x, y in zip(a, b)]

    rows = []
    for w, label in (("short", "nothing shared, short prompts"), ("long", "nothing shared, ~130-token prompts")):
        if w not in workloads:
            continue
        c = [x["tok_s"] for x in results[w][cache_name]]
        n = [x["tok_s"] for x in results[w][none_name]]
        rr = ratios(c, n)
        rows.append([label + " (tok/s)", fmt(c, 1), fmt(n, 1),
                     f"{med(rr):.3f} [{min(rr):.3f}-{max(rr):.3f}] (cache / none; per round "
                     + ", ".join(f"{x:.3f}" for x in rr) + ")",
                     f"{med([x['cached'] for x in results[w][cache_name]]):.0f}"])
    if "shared" in workloads:
        first_c = [x["ttft"][0] for x in results["shared"][cache_name]]
        first_n = [x["ttft"][0] for x in results["shared"][none_name]]
        later_c = [t for x in results["shared"][cache_name] for t in x["ttft"][1:]]
        later_n = [t for x in results["shared"][none_name] for t in x["ttft"][1:]]
        later_r = ratios([med(x["ttft"][1:]) for x in results["shared"][none_name]],
                         [med(x["ttft"][1:]) for x in results["shared"][cache_name]])
        prompt = results["shared"][cache_name][0]["prompt"]
        rows.append(["shared system prompt, first request TTFT (s)", fmt(first_c), fmt(first_n),
                     f"{med(ratios(first_n, first_c)):.2f} (none / cache)", "0"])
        rows.append([f"shared system prompt, later requests TTFT (s; ~{prompt}-token prompts)", fmt(later_c),
                     fmt(later_n), f"{med(later_r):.2f}x [{min(later_r):.2f}-{max(later_r):.2f}] (none / cache; per "
                     "round " + ", ".join(f"{x:.2f}" for x in later_r) + ")",
                     f"{med([c for x in results['shared'][cache_name] for c in x['cached'][1:]]):.0f} of ~{prompt}"])
    if "conversation" in workloads:
        conv_c, conv_n = results["conversation"][cache_name], results["conversation"][none_name]
        for turn in sorted({0, 1, args.turns // 2, args.turns - 1}):
            c = [x["ttft"][turn] for x in conv_c]
            n = [x["ttft"][turn] for x in conv_n]
            rr = ratios(n, c)
            rows.append([f"conversation turn {turn + 1} TTFT (s; {med([x['prompt'][turn] for x in conv_c]):.0f}-token "
                         "prompt)", fmt(c), fmt(n),
                         f"{med(rr):.2f}x [{min(rr):.2f}-{max(rr):.2f}] (none / cache; per round "
                         + ", ".join(f"{x:.2f}" for x in rr) + ")",
                         f"{med([x['cached'][turn] for x in conv_c]):.0f}"])
    report.table("paired figures (median [range] over rounds, or over requests for the shared prompt's later ones)",
                 ["workload", "prefix cache", "no prefix cache", "ratio", "prompt tokens read from the cache"], rows)
    if "conversation" in workloads:
        per_turn = []
        for name in names:
            xs = results["conversation"][name]
            per_turn.append([name] + [f"{med([x['ttft'][t] for x in xs]):.2f}" for t in range(args.turns)])
        report.table("conversation: median TTFT per turn (s)", ["engine"] + [str(t + 1) for t in range(args.turns)],
                     per_turn)
        report.text("cached prompt tokens per turn (prefix cache, round 1): "
                    + ", ".join(f"{c}/{p}" for c, p in zip(conv_c[0]["cached"], conv_c[0]["prompt"])))
        agree = all(a["replies"] == b["replies"] for a, b in zip(conv_c, conv_n))
        report.text(f"the conversations' replies agree between the engines: {agree}")
    report.text("scheduler time over the whole run (warm-up included), prefix cache / none: steps "
                + " / ".join(f"{schedulers[n].counters.step_seconds:.2f} s" for n in names) + "; inserts "
                + " / ".join(f"{schedulers[n].counters.insert_seconds:.2f} s" for n in names))
    stats = caches[cache_name].stats()
    report.text(f"prefix cache at the end: {stats['blocks']} blocks, {stats['bytes'] / 2**20:.0f} MiB, "
                f"{stats['evictions']} evictions; load average at start of the run: {began_load}; at the end: "
                f"{common.load_average()}")
    for s in schedulers.values():
        s.close()
    report.write(args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
