"""When things happened in a run: one clock, the faults as injected, and how the
checker names the fault around a moment ("during step 3 ...", "after step 5 ...")."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from devtools.chaos.schedule import Step


class Clock:
    """Seconds since the run started: every event of a run is stamped with it."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall0 = time.time()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def of_wall(self, wall: float) -> float:
        """A wall-clock time (e.g. from a gateway's log line) on this clock."""
        return wall - self.wall0


@dataclass
class StepRun:
    """A step as it ran: injected at `started`, restored at `ended` (None: never)."""

    step: Step
    started: float
    ended: float | None = None


def step_context(step_runs: Sequence[StepRun], at: float) -> str:
    """Which faults were active at `at`, or which one came last before it."""
    active = [r for r in step_runs if r.started <= at and (r.ended is None or at <= r.ended)]
    if active:
        return "during " + "; ".join(f"[{r.step}]" for r in active)
    before = [r for r in step_runs if r.started <= at]
    return f"after [{before[-1].step}]" if before else "before any fault"
