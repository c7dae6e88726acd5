"""How many draft-verify cycles the server's next step runs.

A step's fixed host cost (dispatch, reading its output back, detokenizing: 5 to 7 ms of
host time for the smollm2-eagle pair's 4-bit target on a 2-core CPU) comes with every
step, so one-cycle steps pay it every cycle. While a slot is free and no request waits,
a step runs the cycles that fit in an admission wait instead, timed from the server's
own steps, so that a request arriving meanwhile waits about that long. The cycles are the
nearest whole number, not the floor: with a floor, two programs whose cycles differ by 1% on
either side of ``admission_wait / n`` run ``n`` and ``n - 1`` cycles a step, and the second
pays the fixed host cost up to half as often again (on the real pair at one row, cycles of
31.7 and 33.5 ms ran 2.8 and 2.4 cycles a step with a 100 ms wait).

A cycle's time is the median of the row bucket's last ``window`` steps, not a running mean:
the steps a drafting policy forces to another length to time it (two in 32 with
``drafting.auto``; a three-draft step at eight rows takes twice a one-draft step's time)
and the one-cycle steps of a new request, which pay the fixed cost alone, are outliers. With
a mean halved at each step, one such step put the real pair's cycle at eight rows near 70 ms
instead of 60, so the next steps ran one cycle each and timed near 70 ms again: the server
with ``auto`` ran 22-38 one-cycle steps a round at 16 clients where fixed K=1's ran two cycles,
and its cycles there cost 68-69 ms against 60 in four-cycle steps.
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np

from specjax._src.foundation.checks import check_positive_int


class StepLength:
    """The cycles each step may run, from the last steps' seconds per cycle by row bucket (their median).

    Args:
      num_cycles: the most cycles a step runs (every step runs them all while
        each slot is taken or a request waits).
      admission_wait: seconds; while a slot is free and no request waits, a
        step runs the whole number of cycles nearest to fill it (at least 1).
        0: one cycle.
      window: the steps per row bucket whose median seconds per cycle is a cycle's time.
    """

    def __init__(self, num_cycles: int, admission_wait: float, window: int = 9):
        if not 0.0 <= float(admission_wait) < 3600.0:
            raise ValueError(f"admission_wait must be seconds in [0, 3600), got {admission_wait!r}.")
        self.num_cycles, self.admission_wait = int(num_cycles), float(admission_wait)
        self.window = check_positive_int("window", window)
        self._recent: dict[int, collections.deque] = {}  # seconds per cycle of the last steps, per row bucket

    def cycle_seconds(self, rows: int) -> Optional[float]:
        """The median seconds per cycle of the last ``window`` steps of ``rows`` rows (None: none timed)."""
        recent = self._recent.get(rows)
        return float(np.median(recent)) if recent else None

    def observe(self, rows: int, asked: int, ran: np.ndarray, seconds: float) -> None:
        """A step of ``rows`` rows, asked for ``asked`` cycles, took ``seconds``; ``ran [L]`` holds
        each live slot's cycles since the last step (a forked slot's copied counts exceed
        ``asked`` and are not a timing)."""
        counted = ran[(ran > 0) & (ran <= asked)]
        if counted.size:
            self._recent.setdefault(rows, collections.deque(maxlen=self.window)).append(seconds / int(counted.max()))

    def cycles(self, rows: int, free: bool, waiting: bool, fresh: bool = False) -> int:
        """The cycles the next step may run: all ``num_cycles`` while every slot is taken or a
        request waits; while a slot is free and nobody waits, as many as fit in
        ``admission_wait`` at this row bucket's timed cycles (the nearest whole number, at
        least 1), and one while a request has had no tokens yet (``fresh``), so that its
        first ones go out after one."""
        if waiting or not free:
            return self.num_cycles
        per_cycle = self.cycle_seconds(rows)
        if fresh or per_cycle is None or per_cycle <= 0.0:
            return 1
        return int(min(self.num_cycles, max(1, round(self.admission_wait / per_cycle))))
