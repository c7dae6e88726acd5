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
"""

from __future__ import annotations

import numpy as np


class StepLength:
    """The cycles each step may run, from the last steps' seconds per cycle by row bucket.

    Args:
      num_cycles: the most cycles a step runs (every step runs them all while
        each slot is taken or a request waits).
      admission_wait: seconds; while a slot is free and no request waits, a
        step runs the whole number of cycles nearest to fill it (at least 1).
        0: one cycle.
    """

    def __init__(self, num_cycles: int, admission_wait: float):
        if not 0.0 <= float(admission_wait) < 3600.0:
            raise ValueError(f"admission_wait must be seconds in [0, 3600), got {admission_wait!r}.")
        self.num_cycles, self.admission_wait = int(num_cycles), float(admission_wait)
        self.cycle_seconds: dict[int, float] = {}  # a running mean per row bucket

    def observe(self, rows: int, asked: int, ran: np.ndarray, seconds: float) -> None:
        """A step of ``rows`` rows, asked for ``asked`` cycles, took ``seconds``; ``ran [L]`` holds
        each live slot's cycles since the last step (a forked slot's copied counts exceed
        ``asked`` and are not a timing)."""
        counted = ran[(ran > 0) & (ran <= asked)]
        if counted.size:
            per_cycle = seconds / int(counted.max())
            before = self.cycle_seconds.get(rows)
            self.cycle_seconds[rows] = per_cycle if before is None else 0.5 * (before + per_cycle)

    def cycles(self, rows: int, free: bool, waiting: bool, fresh: bool = False) -> int:
        """The cycles the next step may run: all ``num_cycles`` while every slot is taken or a
        request waits; while a slot is free and nobody waits, as many as fit in
        ``admission_wait`` at this row bucket's timed cycles (the nearest whole number, at
        least 1), and one while a request has had no tokens yet (``fresh``), so that its
        first ones go out after one."""
        if waiting or not free:
            return self.num_cycles
        per_cycle = self.cycle_seconds.get(rows)
        if fresh or per_cycle is None or per_cycle <= 0.0:
            return 1
        return int(min(self.num_cycles, max(1, round(self.admission_wait / per_cycle))))
