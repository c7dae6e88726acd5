"""Shared helpers of the benchmark scripts: alternating timed runs, machine
facts, the embedded pair and its prompts, plain/markdown tables, and a
``specjax serve`` process to send requests to.

Timing discipline (the machine is a shared 2-core CPU): every contender runs
once to compile / warm up, then the contenders alternate ``rounds`` times
(A, B, A, B, ...); we report medians, the min-max spread, and the ratio of
each round's pair of runs (median of the per-round ratios), so slow phases
of the machine hit both sides of a ratio alike.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "specjax" / "assets" / "models"
TASK = ROOT / "specjax" / "assets" / "task"


def load_average() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "load average n/a"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    import jax

    vers = [f"python {platform.python_version()}", f"jax {jax.__version__}"]
    for mod in ("torch", "transformers"):
        if mod in sys.modules:
            vers.append(f"{mod} {sys.modules[mod].__version__}")
    return (f"{os.cpu_count()}-core CPU ({cpu}), shared with other jobs; "
            f"jax devices {[d.platform for d in jax.devices()]}; " + ", ".join(vers))


def header(title: str) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{title}\n{stamp}; {machine()}\n{load_average()} (at start)\ncommand: {' '.join(sys.argv)}"


def alternate(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
              prewarm: dict[str, Callable[[], object]] | None = None) -> dict[str, list[float]]:
    """Wall seconds of each ``fn`` (which must block), run in turn ``rounds`` times
    after ``warmup`` untimed calls each (compile). ``prewarm[name]``, if given,
    runs untimed right before each timed call of ``name`` (wakes thread pools
    and caches after the previous contender). Returns name -> list of times."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if prewarm and name in prewarm:
                prewarm[name]()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def keep_a_core_busy() -> subprocess.Popen:
    """Another process spinning on one core until it is killed: a ``--busy`` run's machine with
    another job on it."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``fn()`` (which must block) after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_once(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def cached_step_timer(model, batch: int, capacity: int, cached: int) -> Callable[[], float]:
    """A ``run()`` that times one token per row of ``model`` (a loaded model: ``module``,
    ``params``) at ``batch`` rows over a ``capacity``-slot cache holding ``cached`` entries per row:
    seconds per call. The cache is donated and carried, as the decode loop carries it (without
    donation each call would copy the whole buffer to write one token); its lengths are reset
    from host ints each call."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    module, params = model.module, model.params
    lengths = np.full((batch,), cached, np.int32)
    fwd = jax.jit(lambda p, c, t: (lambda out: (out.logits, out.cache))(module.apply(p, t, c)), donate_argnums=1)
    tokens, state = jnp.ones((batch, 1), jnp.int32), {"cache": module.init_cache(batch, capacity)}

    def run() -> float:
        t0 = time.perf_counter()
        logits, state["cache"] = fwd(params, state["cache"].replace(lengths=lengths), tokens)
        logits.block_until_ready()
        return time.perf_counter() - t0
    return run


def engine_step_timer(engine, prompt: Sequence[int], live: int, settings, cycles: int) -> Callable[[], float]:
    """A ``run()`` that inserts ``prompt`` into slots ``0 .. live - 1`` of a fresh state, then times one
    ``engine.step`` of ``cycles`` cycles: seconds per cycle (the insert is not timed). ``settings``:
    one ``SlotSettings`` for every slot, or a list of one per slot."""
    if not isinstance(settings, (list, tuple)) or hasattr(settings, "_fields"):
        settings = [settings] * live

    def run() -> float:
        import jax

        state = engine.insert_many(engine.init(), list(range(live)), [prompt] * live, settings)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, out = engine.step(state, num_cycles=cycles)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / cycles
    return run


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
    """Min-max of a list as a compact string."""
    return f"{min(xs):.3g}-{max(xs):.3g}"


def pair_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(num, den)]


def ratio_cell(ratios: Sequence[float]) -> str:
    """Median per-round ratio and its range."""
    return f"{median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def spread_summary(xs: Sequence[float]) -> dict:
    """Mean, median, 10th and 90th percentile of per-prompt ratios, and how many exceed 1."""
    import numpy as np

    arr = np.asarray(xs, float)
    p10, p50, p90 = np.percentile(arr, (10, 50, 90))
    return {"mean": float(arr.mean()), "median": float(p50), "p10": float(p10), "p90": float(p90),
            "faster": int((arr > 1.0).sum()), "n": int(arr.size)}


def percentile_cell(spread: dict) -> str:
    """``median [p10-p90]`` of a :func:`spread_summary`."""
    return f"{spread['median']:.2f}x [{spread['p10']:.2f}-{spread['p90']:.2f}]"


# ---------------------------------------------------------------------------
# The embedded pair and its prompts
# ---------------------------------------------------------------------------


def read_prompt_file(path: Path, ap) -> list[dict]:
    """The ``{"prompt": str[, "kind": str]}`` rows of a JSONL file; a bad file is an argparse error."""
    if not path.is_file():
        ap.error(f"--prompt-file {path} does not exist")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            ap.error(f"--prompt-file {path}, line {number}: not JSON ({e})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            ap.error(f'--prompt-file {path}, line {number}: want {{"prompt": str}}')
        rows.append(row)
    if not rows:
        ap.error(f"--prompt-file {path} has no prompts")
    return rows


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenizer():
    import tokenizers

    from specjax.models import unpacked_dir

    # The embedded target ships tokenizer.json xz-compressed: read its unpacked copy.
    return tokenizers.Tokenizer.from_file(str(Path(unpacked_dir(str(MODELS / "target"))) / "tokenizer.json"))


def eval_prompts(num_task: int, num_code: int, max_len: int) -> list[list[int]]:
    """Held-out arithmetic prompts then code prompts, token ids, each cut to
    its last ``max_len`` tokens."""
    tok = tokenizer()
    task = [r["prompt"] for r in read_jsonl(TASK / "arith_heldout.jsonl")[:num_task]]
    code = [r["prompt"] for r in read_jsonl(TASK / "code_prompts.jsonl")[:num_code]]
    return [tok.encode(t).ids[-max_len:] for t in task + code]


def code_prompts_of_length(n: int, length: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens: code prompt i + 1 followed by
    code prompt i (held-out stdlib snippets, ~49 tokens each), last ``length``
    tokens kept."""
    tok = tokenizer()
    code = [tok.encode(r["prompt"]).ids for r in read_jsonl(TASK / "code_prompts.jsonl")]
    out = []
    for i in range(n):
        ids = code[(i + 1) % len(code)] + code[i % len(code)]
        while len(ids) < length:
            ids = ids + ids
        out.append(ids[-length:])
    return out


def arith_prompts_of_length(n: int, length: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens in the task's format: solved
    held-out problems ("assert a + b == c" lines) as context, ending with an
    unsolved one (prompt i); the context is cut to keep the last ``length``."""
    tok = tokenizer()
    rows = read_jsonl(TASK / "arith_heldout.jsonl")
    out = []
    for i in range(n):
        q = tok.encode(rows[i % len(rows)]["prompt"]).ids
        ctx: list[int] = []
        j = i + 1
        while len(ctx) + len(q) < length:
            r = rows[j % len(rows)]
            ctx = ctx + tok.encode(f"{r['prompt']} {r['answer']}\n").ids
            j += 1
        out.append((ctx + q)[-length:])
    return out


def pad(prompts: Sequence[Sequence[int]], width: int | None = None):
    """Right-padded int32 [B, W] array and lengths."""
    import numpy as np

    width = width or max(len(p) for p in prompts)
    arr = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        arr[i, : len(p)] = p
    return arr, np.array([len(p) for p in prompts], np.int32)


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def table(head: Sequence[str], rows: Sequence[Sequence[object]], markdown: bool = False) -> str:
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(head)]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells])


class Report:
    """Collects printed sections; ``--markdown PATH`` writes them as markdown."""

    def __init__(self, title: str):
        self.parts: list[str] = []
        self.md: list[str] = []
        self.header = h = header(title)
        print(h, flush=True)
        self.md.append("```\n" + h + "\n```")

    def text(self, s: str):
        print(s, flush=True)
        self.md.append(s)

    def table(self, title: str, head, rows):
        print("\n" + title + "\n" + table(head, rows), flush=True)
        self.md.append(f"**{title}**\n\n" + table(head, rows, markdown=True))

    def write(self, path: str | None):
        if path:  # (may be called again as a run goes on: each time the whole file, load average last)
            Path(path).write_text("\n\n".join([*self.md, f"_{load_average()} (at end)_"]) + "\n")
            print(f"\nwrote {path}")


# ---------------------------------------------------------------------------
# A `specjax serve` process
# ---------------------------------------------------------------------------

# `specjax serve` by the CLI's entry point, so that a checkout's own package (first on PYTHONPATH)
# serves, installed or not.
SERVE = "import sys; from specjax.cli import main; sys.exit(main(sys.argv[1:]))"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid``, all its threads, so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    """Process ``pid``'s peak resident memory so far (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """``specjax serve FLAGS`` of ``checkout`` (its own package first on the path) as a subprocess
    on a free port of 127.0.0.1, its model named ``bench``, logging warnings only. ``url`` is its
    base URL, ``proc`` the process. As a context manager it stops the server on exit."""

    ready_path = "/health"  # answers 200 once the server has loaded and compiled

    def __init__(self, flags, checkout: Path = ROOT, stop_timeout: float = 90.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop_timeout = stop_timeout
        cmd = [sys.executable, "-c", SERVE, "serve", *flags, "--port", str(self.port), "--log-level", "warning",
               "--served-model-name", "bench"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(cmd, cwd=checkout, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Waits until ``GET`` of :attr:`ready_path` answers 200 (the server has loaded and compiled);
        returns the seconds waited. Raises if the server exits first or ``timeout`` passes."""
        import httpx

        began = time.perf_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return time.perf_counter() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server was not ready in time")

    def metrics(self) -> dict:
        """``GET /metrics`` as ``{name: value}``."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}

    def peak_rss_mib(self) -> float:
        return peak_rss_mib(self.proc.pid)

    def stop(self) -> int:
        """SIGTERM (the server refuses waiting requests and drains live ones), then a kill after
        ``stop_timeout`` seconds; returns the exit status (``-SIGTERM`` is a clean exit: uvicorn
        shuts down, then re-raises the signal it caught)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
