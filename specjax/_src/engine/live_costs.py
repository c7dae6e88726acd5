"""Cycle costs timed while serving: the slots engine's own steps refresh what
:func:`specjax.drafting.auto` believes a draft costs.

The costs measured at start-up (:func:`specjax.engine.measure_costs`) are a
sum of parts timed in isolation, once. They miss what the loop adds (on a
2-core CPU a drafting cycle cost a fifth to a quarter more than its parts), and
they go stale when the machine's load changes (with another process keeping
one core busy, a two-token verification was timed at 1.63 one-token forwards
and ``auto`` drafted too little). A server steps the engine from the host, so
every step's wall time is known: :class:`LiveCosts` keeps, per row bucket and
draft length ``k``, the recent seconds per cycle of the steps that drafted
``k``, and once every length has been timed, sets
:attr:`~specjax.drafting.CostModel.measured` to their ratios to a plain cycle.

A length's cost is the median, over its samples, of its time over the plain
cycles' timed nearest it (the ``neighbours`` plain samples closest in the
order the steps were timed, those of the same compiled program and key width
first; a step at a program and width with no plain sample runs plain cycles to
get one), not its
median over the plain cycles' median: a
busy spell that slowed the few steps timing a length slowed the plain steps
around them as much, and does not make that length look dear for the hundreds
of steps its samples stay in the window. (Comparing medians, a server on a
2-core CPU whose first requests ran beside a test job kept a one-draft cycle at
four rows at 2.3 plain ones for the rest of the run, where it cost 1.3 measured
alone, and auto drafted too little.)

Lengths the policy stops choosing would never be timed again, so every
``explore_every`` steps of a row bucket two steps are run at the length timed
longest ago (every ``warmup_explore_every`` steps while some length has too
few samples). A forced step is an ordinary cycle with another draft length:
the sampled law and greedy output do not change, only its speed, by at most
two steps in ``explore_every``. Exploration skips lengths that no error in
their costs would make worth drafting, so a length priced too dear once would
keep that price: a length with no sample from its bucket's last
``refresh_every`` steps is explored whatever it promises, and where a drafting
length has samples that recent, only they price it.

Only the second of the two is timed, and no step that runs a branch of the
compiled step for the first time is a sample: the draft length and the
attention's key width (:meth:`specjax.engine.Engine.attention_widths`) each
pick a branch of a ``lax.switch``, and XLA's CPU runtime prepares a branch's
kernels the first time it runs it. The real pair's step at four rows, every
program compiled, ran 100-150 ms longer the first time a draft length met a
new key width, and not the second time. A length the policy rarely chooses is
mostly timed at such first encounters, so they made it look dear: a served
run planned with two and three drafts at eight rows costing 2.1 and 2.4 plain
cycles, where their parts sum to 1.6 and 1.75, and one with a one-draft cycle
at two rows costing 4.2. Nor is the first step after the draft length, the row
bucket or the program changes a sample (before the cause was found, that kept
out most of them: 11 of 27 single forced steps ran 80-150 ms long, against 1
of 257 steps that kept their length).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import isotonic_regression

from specjax._src.foundation.checks import check_positive_int
from specjax._src.engine.costs import forcing
from specjax._src.proposals.drafting import Auto, CostModel, DraftingPolicy


class LiveCosts:
    """Seconds per cycle by row bucket and draft length, from the engine's own steps.

    Args:
      costs: the start-up :class:`~specjax.drafting.CostModel` (stacked over
        the row buckets for an engine with several; ``Engine.costs``).
      window: the most recent samples kept per row bucket and length (their
        median is used: a step that compiled or met a busy spell is one sample).
      min_samples: samples every length of a row bucket needs before that
        bucket's costs are taken from the timings instead of the parts.
      explore_every: once every length has ``min_samples``, two steps in this
        many (per row bucket) run at the length timed longest ago, the second timed.
      warmup_explore_every: the same while some length has fewer samples.
      neighbours: the plain cycles' samples each sample of a drafting length is
        compared with (those timed nearest it); the plain cycles keep
        ``4 * window`` samples for it.
      explore_within: with a ``promise`` (:meth:`explore`), only lengths whose promised rate
        lies within this factor of the best length's are explored.
      refresh_every: a length with no sample from its row bucket's last ``refresh_every``
        steps is stale: it is explored even where it promises little (two forced steps), and
        where a drafting length has samples that recent, only they price it. It bounds how long
        a price timed once, at start-up or in a busy spell, keeps a length from being chosen:
        one served client on the real pair ran about 230 steps in 16 requests, so a bound of
        512 steps never fired there; each stale length costs at most two forced steps in 128.
    """

    def __init__(
        self,
        costs: CostModel,
        *,
        window: int = 16,
        min_samples: int = 3,
        explore_every: int = 32,
        warmup_explore_every: int = 4,
        neighbours: int = 4,
        explore_within: float = 0.2,
        refresh_every: int = 128,
    ):
        if not isinstance(costs, CostModel):
            raise TypeError(f"LiveCosts takes a CostModel (Engine.costs), got {type(costs).__name__}.")
        self.window = check_positive_int("window", window)
        self.min_samples = check_positive_int("min_samples", min_samples)
        self.explore_every = check_positive_int("explore_every", explore_every)
        self.warmup_explore_every = check_positive_int("warmup_explore_every", warmup_explore_every)
        self.neighbours = check_positive_int("neighbours", neighbours)
        if not 0.0 <= explore_within <= 100.0:
            raise ValueError(f"explore_within must lie in [0, 100], got {explore_within}.")
        self.explore_within = float(explore_within)
        self.refresh_every = check_positive_int("refresh_every", refresh_every)
        if self.min_samples > self.window:
            raise ValueError(f"min_samples ({min_samples}) cannot exceed window ({window}).")
        self.start = costs
        self.batches = tuple(int(b) for b in np.atleast_1d(np.asarray(costs.batch)))
        self.num_lengths = costs.max_draft + 1
        # (clock, seconds, widest key width index or -1, cycles the step ran or 0, program id, step) per
        # row bucket and length; the clock counts a bucket's timed steps, the step all its steps.
        self._samples = [[collections.deque(maxlen=self.window * (4 if k == 0 else 1)) for k in range(self.num_lengths)]
                         for _ in self.batches]
        self._clock = np.zeros(len(self.batches), np.int64)
        self._last_seen = np.full((len(self.batches), self.num_lengths), -1, np.int64)
        self._refreshes = np.zeros((len(self.batches), self.num_lengths), np.int64)  # stale lengths forced
        self._steps = np.zeros(len(self.batches), np.int64)
        self._forcing = [None] * len(self.batches)  # the length the next step repeats, after a first forced step
        self._previous = (None, -1)  # the last step's program (its row bucket and kind) and length (-1: not known)
        self._programs: dict[str, int] = {}  # a program's name to the id its samples carry
        self._partnered: dict[tuple, int] = {}  # (bucket, program id, width) to the step that last forced plain cycles
        self._ran: set = set()  # (rows, program, length, key width index) of every branch a step has run
        self._costs: Optional[CostModel] = None
        self._forced: dict[int, CostModel] = {}
        self._lock = threading.Lock()  # a server's metrics are read from other threads

    def bucket(self, rows: int) -> int:
        """The index of the costs a step of ``rows`` rows reads (as :meth:`specjax.drafting.CostModel.at_batch`)."""
        return next((i for i, b in enumerate(self.batches) if b >= rows), len(self.batches) - 1)

    def explore(self, rows: int, program: str = "", width: int = -1,
                promise: Optional[Callable[[], Optional[np.ndarray]]] = None) -> Optional[int]:
        """Counts a step of ``rows`` rows about to run; returns the draft length
        it should be forced to (:meth:`forced_costs`), or None to let the policy choose.
        A length is forced for two steps in a row: the first changes the length, the second is timed.

        ``program`` and ``width`` (the index of the key width holding the longest row now; -1: not
        known): where the bucket holds fewer than ``min_samples`` plain samples of that program and
        width, the step runs plain cycles (at most once in ``explore_every`` steps per program and width), so that the
        drafting lengths timed there have plain cycles to be priced against (:meth:`relative`).
        Without them, a server at T=1 priced its one-draft cycles at eight rows, 60 ms over wide
        contexts, against the start-up's greedy plain cycles over the narrowest width (40 ms):
        1.48 plain cycles where they cost 1.33, and auto went plain. They are run whatever plain
        cycles promise: where drafting pays, the lengths the policy chooses later in a request
        (wider contexts) were otherwise priced against plain cycles timed only over the narrowest
        width. One served client on the 4-bit real pair priced two drafts at 1.64 plain cycles,
        where its full two-draft steps ran 1.38 times its plain ones, and drafted one token in
        most cycles where fixed K=3 ran 1.08x faster.

        ``promise``: called only when a length is due to be explored, it returns the committed
        tokens a cycle of each length ``0 .. K`` promises the live rows (``[K + 1]``, the policy's
        own estimates; None: not known). Once every length is timed, only lengths whose promised
        rate (tokens over :meth:`relative` cost) lies within the factor ``1 + explore_within`` of
        the best length's are explored: at eight rows at T=1 on the real pair, exploring two and
        three drafts (95-175 ms a cycle, against 62 ms for the one draft auto chose) took 2 s of
        a 19 s round, for lengths no error in the costs would make worth drafting."""
        i = self.bucket(rows)
        self._steps[i] += 1
        if self._forcing[i] is not None:
            k, self._forcing[i] = self._forcing[i], None
            return k
        if width >= 0 and not self._has_plain(i, program, width):
            key = (i, self._program_id(program), int(width))
            last = self._partnered.get(key)
            # Whatever plain cycles promise: they are every drafting length's unit of cost here.
            if last is None or self._steps[i] - last >= self.explore_every:
                self._partnered[key] = int(self._steps[i])
                self._forcing[i] = 0
                return 0
        counts = np.array([len(s) for s in self._samples[i]])
        warming = (counts < self.min_samples).any()
        if self._steps[i] % (self.warmup_explore_every if warming else self.explore_every):
            return None
        worth, stale = np.ones(self.num_lengths, bool), np.zeros(self.num_lengths, bool)
        if promise is not None and not warming:
            stale = self._fresh(i) == 0
            promising = self._worth_timing(rows, np.arange(self.num_lengths), promise(), exclude_best=True)
            stale &= ~promising
            worth = promising | stale
            if not worth.any():
                return None
        # Fewest samples first (a length never timed), then the one timed longest ago.
        order = np.lexsort((self._last_seen[i], np.minimum(counts, self.min_samples), ~worth))
        k = int(order[0])
        self._forcing[i] = k
        self._refreshes[i, k] += int(stale[k])
        return k

    def _worth_timing(self, rows: int, lengths, promised: Optional[np.ndarray], exclude_best: bool = False):
        """Whether each of ``lengths`` promises, at the costs timed so far, a rate within the factor
        ``1 + explore_within`` of the best length's (True where not known); with ``exclude_best``,
        False for the best length itself (the policy chooses it: its steps time it)."""
        relative = self.relative(rows)
        lengths = np.asarray(lengths)
        if promised is None or not np.isfinite(relative).all():
            return np.ones(lengths.shape, bool)
        rate = np.asarray(promised, np.float64) / relative
        best = int(np.argmax(rate))
        worth = rate[lengths] * (1.0 + self.explore_within) >= rate[best]
        return worth & (lengths != best) if exclude_best else worth

    def _fresh(self, i: int) -> np.ndarray:
        """``[K + 1]`` bucket ``i``'s samples by length from its last ``refresh_every`` steps."""
        since = self._steps[i] - self.refresh_every
        with self._lock:
            return np.array([sum(x[5] > since for x in s) for s in self._samples[i]])

    def _program_id(self, program: str) -> int:
        return self._programs.setdefault(program, len(self._programs))

    def _has_plain(self, i: int, program: str, width: int) -> bool:
        """Whether bucket ``i`` holds ``min_samples`` plain samples of ``program`` whose widest key
        width is ``width``: one would price every drafting length timed there alone, and on a
        noisy VM a single plain step at a wider width ran 129 ms where its neighbours ran 34,
        which priced every drafting length there below a plain cycle."""
        p = self._program_id(program)
        with self._lock:
            return sum(x[2] == width and x[4] == p for x in self._samples[i][0]) >= self.min_samples

    def observe(self, rows: int, draft_length: Optional[int], seconds_per_cycle: Optional[float],
                program: str = "", widths: Sequence[int] = (), cycles: int = 0) -> None:
        """Records a step of ``rows`` rows whose cycles all drafted ``draft_length`` tokens.

        ``draft_length`` None: the step's cycles drafted several lengths; ``seconds_per_cycle``
        None: the step is not a timing (its length is still noted); ``program``: the compiled
        step it ran (``StepPlan.program``); ``widths``: the indices of the key widths its
        attention read (this module's ``widths_read``); ``cycles``: how many cycles the step ran
        (0: not known). A step whose length, row bucket or program differs
        from the last step's, or that ran a length at a key width for the first time, is not
        recorded (see the module's docstring)."""
        i = self.bucket(rows)
        k = -1 if draft_length is None else int(draft_length)
        if not -1 <= k < self.num_lengths:
            raise ValueError(f"draft_length must lie in 0 .. {self.num_lengths - 1}, got {draft_length}.")
        switched = ((rows, program), k) != self._previous
        self._previous = ((rows, program), k)
        branches = {(rows, program, k, int(w)) for w in widths} if k >= 0 else set()
        first_run = not branches <= self._ran
        self._ran |= branches
        if switched or first_run or k < 0 or seconds_per_cycle is None:
            return
        if not np.isfinite(seconds_per_cycle) or seconds_per_cycle <= 0:
            return  # a clock that went backwards tells nothing
        with self._lock:
            width = max(int(w) for w in widths) if len(widths) else -1
            self._samples[i][k].append((int(self._clock[i]), float(seconds_per_cycle), width, int(cycles),
                                        self._program_id(program), int(self._steps[i])))
            self._clock[i] += 1
            self._last_seen[i, k] = self._steps[i]
            self._costs = None

    def has_run(self, rows: int, program: str, draft_length: int, width: int) -> bool:
        """Whether a step of ``rows`` rows in ``program`` has run ``draft_length`` at the key width
        index ``width`` (:meth:`observe` records no sample at such a branch's first run)."""
        return (int(rows), program, int(draft_length), int(width)) in self._ran

    def seconds(self) -> np.ndarray:
        """``[R, K + 1]`` median seconds per cycle by row bucket and draft length (NaN: not timed)."""
        with self._lock:
            return np.array([[np.median([x[1] for x in s]) if s else np.nan for s in row] for row in self._samples])

    def refreshes(self) -> np.ndarray:
        """``[R, K + 1]`` times each length was explored only because its samples were stale
        (``refresh_every``), by row bucket and draft length."""
        return self._refreshes.copy()

    def samples(self) -> np.ndarray:
        """``[R, K + 1]`` samples held by row bucket and draft length."""
        with self._lock:
            return np.array([[len(s) for s in row] for row in self._samples])

    def relative(self, rows: int) -> np.ndarray:
        """``[K + 1]`` each length's cost in plain cycles at ``rows``' bucket: the median over its
        samples of the sample over the median of the ``neighbours`` plain samples timed nearest it,
        those of the same compiled program and key width and as many cycles a step first
        (NaN where the plain cycle has no sample; a length with none takes the shorter one's;
        none costs less than a plain cycle).
        A length costs at least what a shorter one does: where the estimates say otherwise, the
        lengths out of order are pooled, each weighted by its samples (isotonic regression), so
        a length priced from a few dear samples (a start-up timing, a busy spell) does not set the
        price of every longer length, as a running maximum did: at one served row, one draft timed
        at start-up at 2.4 plain cycles (3 samples) priced two and three drafts, timed at 1.35 and
        1.45 over 12 and 16 samples, at 1.69 as well. Where some of a
        length's samples have plain samples of their program and width, only those are priced,
        and where some are from the bucket's last ``refresh_every`` steps, only those.

        The same width first: plain cycles are timed rarely while drafting pays, so the plain
        samples nearest in time may be from shorter contexts, whose attention read fewer keys,
        and would make every drafting length look dearer than it is against a plain cycle now.
        The same program: a sampled step does work a greedy one does not, in plain and drafting
        cycles alike. As many cycles a step first: a step's fixed host cost (dispatch, the read
        back) is spread over its cycles, so a one-cycle step's seconds per cycle hold all of it.
        At eight rows on the real pair, one-draft one-cycle steps (68 ms a cycle) against plain
        four-cycle steps (44 ms) price a draft at 1.55 plain cycles, where in four-cycle steps
        (60 ms) it costs 1.36."""
        i = self.bucket(rows)
        with self._lock:
            plain = np.array(self._samples[i][0], np.float64).reshape(-1, 6)
            drafting = [np.array(self._samples[i][k], np.float64).reshape(-1, 6) for k in range(1, self.num_lengths)]
        out, weight = np.full(self.num_lengths, np.nan), np.zeros(self.num_lengths)
        if not len(plain):
            return out
        out[0] = 1.0
        since = self._steps[i] - self.refresh_every
        drafting = [d[d[:, 5] > since] if (d[:, 5] > since).any() else d for d in drafting]  # the recent, if any
        unlike = 1e12  # farther than any two steps' clocks: another program's, width's or cycle count's come last
        for k, samples in enumerate(drafting, start=1):
            if not len(samples):
                continue
            other_kind = (plain[None, :, 2] != samples[:, 2:3]) | (plain[None, :, 4] != samples[:, 4:5])
            partnered = (~other_kind).any(axis=1)
            if partnered.any():
                samples, other_kind = samples[partnered], other_kind[partnered]
            distance = (np.abs(plain[None, :, 0] - samples[:, :1]) + 2 * unlike * other_kind
                        + unlike * (plain[None, :, 3] != samples[:, 3:4]))
            nearest = np.argsort(distance, axis=1, kind="stable")[:, : self.neighbours]
            # A partnered sample's plain cycles are its own program's and width's only.
            alike = ~np.take_along_axis(other_kind, nearest, axis=1) | ~partnered.any()
            around = [np.median(plain[n[a], 1]) for n, a in zip(nearest, alike)]
            out[k] = np.median(samples[:, 1] / np.asarray(around))
            weight[k] = len(samples)
        out[1:] = _non_decreasing(out[1:], weight[1:])
        return np.fmax.accumulate(out)  # no length below a plain cycle; one not timed: the shorter one's

    def costs(self) -> CostModel:
        """The start-up costs with ``measured`` set, for every row bucket whose
        lengths all have ``min_samples``, to :meth:`relative`; other buckets keep their parts."""
        if self._costs is not None:
            return self._costs
        start = self.start
        measured = np.array(
            np.broadcast_to(np.asarray(start.measured, np.float64), (len(self.batches), self.num_lengths))
        )
        counts = self.samples()
        for i, rows in enumerate(self.batches):
            if (counts[i] >= self.min_samples).all():
                measured[i] = self.relative(rows)
        measured = measured.reshape(np.shape(start.measured))
        self._costs = start.replace(measured=jnp.asarray(measured, jnp.float32))
        return self._costs

    def forced_costs(self, draft_length: int) -> CostModel:
        """Costs under which :func:`~specjax.drafting.auto` drafts ``draft_length`` tokens.

        Built once per length: they hold no timing (only the shapes and the start-up
        costs' forward time), so a forced step adds no host work of its own to the step
        it times (building them took several small device calls each time)."""
        k = int(draft_length)
        if not 0 <= k < self.num_lengths:
            raise ValueError(f"draft_length must lie in 0 .. {self.num_lengths - 1}, got {draft_length}.")
        if k not in self._forced:
            self._forced[k] = forcing(self.start, k)
        return self._forced[k]

    def report(self) -> dict:
        """What a server's metrics show: per row bucket (``rows``), the median
        ``seconds`` per cycle and ``samples`` by draft length (None: not
        timed), the ``relative`` cost by length that ``auto`` plans with
        now (timed where every length is, else the parts), and the ``refreshes``
        (:meth:`refreshes`)."""
        costs, seconds = self.costs(), self.seconds()
        k = self.num_lengths - 1
        return {
            "rows": list(self.batches),
            "seconds": [[None if np.isnan(x) else float(x) for x in row] for row in seconds],
            "samples": self.samples().tolist(),
            "relative": [[float(x) for x in np.asarray(costs.at_batch(b).cycle_costs(k))] for b in self.batches],
            "refreshes": self.refreshes().tolist(),
        }

    def describe(self) -> str:
        """One line per row bucket: samples and median milliseconds per cycle by draft length, and
        the cost in plain cycles auto plans with (timed where every length is, else the parts)."""
        seconds, counts, planned = self.seconds(), self.samples(), self.report()["relative"]
        return "\n".join(
            f"rows {b}: "
            + ", ".join(
                f"k={k}: " + ("-" if counts[i, k] == 0 else f"{1e3 * seconds[i, k]:.1f} ms x{counts[i, k]}")
                for k in range(self.num_lengths)
            )
            + "; plans with " + ", ".join(f"{x:.2f}" for x in planned[i]) + " plain cycles"
            for i, b in enumerate(self.batches)
        )


def _non_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest ``values [N]`` in least squares weighted by
    ``weights [N]`` (SciPy's isotonic regression; SciPy comes with JAX); NaN entries are left
    out and stay NaN."""
    out = np.array(values, np.float64)
    finite = np.isfinite(out)
    if finite.any():
        out[finite] = isotonic_regression(out[finite], weights=np.maximum(weights[finite], 1e-9)).x
    return out


def promised_tokens(policy: DraftingPolicy, states, live) -> Optional[np.ndarray]:
    """``[K + 1]`` what :meth:`LiveCosts.explore` weighs: the tokens a cycle of each draft length
    promises the ``live [S]`` slots of ``states`` (a slots engine's policy states), by
    :meth:`~specjax.drafting.Auto.promised`; None for another policy or no live slot. One
    program of fixed shapes: eager operations over the live slots alone compiled a program per
    slot count, 24 in a served round at eight clients."""
    live = np.asarray(live, bool)
    if not isinstance(policy, Auto) or not live.any():
        return None
    return np.asarray(_promised(policy, states, live))


@jax.jit
def _promised(policy: Auto, states, live):
    return policy.promised(states, live)


def step_draft_length(cycles, drafted_at, steps_asked: int) -> Optional[int]:
    """The draft length every cycle of a step drafted, or None when it cannot be told.

    ``cycles [S]`` and ``drafted_at [S, K]`` are the step's increments per
    slot (``SlotState.loop.stats``' counters after the step minus before).
    The policy plans one length for the batch, so the step's length is the
    largest any slot drafted; None when a slot's cycles drafted several
    lengths, when slots ran unequal numbers of cycles, or when a slot counted
    more cycles than the step may run (a forked slot's copied counts).
    """
    cycles, drafted_at = np.asarray(cycles), np.asarray(drafted_at)
    ran = cycles > 0
    if not ran.any():
        return None
    n = cycles[ran]
    if (n != n[0]).any() or n[0] > steps_asked:
        return None
    per_slot = drafted_at[ran]
    # drafted_at[j] counts cycles that drafted slot j: one length for all n cycles means
    # every count is n (drafted) or 0 (not).
    if ((per_slot != 0) & (per_slot != n[0])).any():
        return None
    return int((per_slot == n[0]).sum(axis=1).max())


def widths_read(widths: Sequence[int], longest_before: int, longest_after: int, draft_length: int) -> tuple[int, ...]:
    """The indices into ``widths`` (the key widths a step's attention may read,
    ascending; :meth:`specjax.engine.Engine.attention_widths`) that its cycles'
    verifications read, as the model picks them (the first width holding the
    batch's longest row and the ``draft_length + 1`` tokens verified; past the
    last, the last): the longest row held ``longest_before`` positions before the step and
    ``longest_after`` after it, so its last cycle began at ``longest_after - 1`` or less."""
    bounds = np.asarray(widths[:-1], np.int64)
    first = int(np.searchsorted(bounds, int(longest_before) + draft_length + 1))
    last = int(np.searchsorted(bounds, max(int(longest_after), int(longest_before) + 1) + draft_length))
    return tuple(range(first, last + 1))
