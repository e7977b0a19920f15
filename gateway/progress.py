"""Progress of a long operator command (`rebuild`, `redrive`, `inspect`'s tier scan), on stderr.

On a terminal: one line redrawn in place (a bar when the total is known).
Otherwise (a log file, a CI job, a pipe): one JSON line every `every_s`, and a
last one when the work ends, e.g.
    {"progress": "redrive", "done": 1200, "total": 5000, "rate_per_s": 410.2,
     "eta_s": 9.3, "elapsed_s": 2.9}
`total` and `eta_s` are null when the total is not known up front; a `fraction`
(0..1) given instead of a total still gives an ETA. Standard output keeps the
command's report alone.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

EVERY_S = 10.0  # between JSON lines
REDRAW_S = 0.2  # between terminal redraws
BAR_WIDTH = 30


class Progress:
    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        stream: TextIO | None = None,
        every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty()
        self.every_s = every_s if every_s is not None else REDRAW_S if self.terminal else EVERY_S
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.fraction: float | None = None
        self._shown_at = self.started

    def advance(self, count: int = 1, fraction: float | None = None) -> None:
        """`count` more units done; `fraction`, when known, of the whole work."""
        self.done += count
        if fraction is not None:
            # Never backwards: an estimate from a cursor may dip.
            self.fraction = max(self.fraction or 0.0, min(fraction, 1.0))
        if self.clock() - self._shown_at >= self.every_s:
            self._show()

    def finish(self) -> None:
        """The last report (always written, so a short run still says what it did)."""
        if self.total is None and self.fraction is not None:
            self.fraction = 1.0
        self._show()
        if self.terminal:
            self.stream.write("\n")
        self.stream.flush()

    def state(self) -> dict[str, object]:
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.done / elapsed
        done_part = self.fraction
        if self.total:
            done_part = min(self.done / self.total, 1.0)
        eta = None
        if done_part is not None and done_part > 0:
            eta = round(elapsed * (1 - done_part) / done_part, 1)
        return {"progress": self.what, "done": self.done, "total": self.total,
                "rate_per_s": round(rate, 1), "eta_s": eta,
                "elapsed_s": round(elapsed, 1)}  # fmt: skip

    def _show(self) -> None:
        self._shown_at = self.clock()
        state = self.state()
        if not self.terminal:
            self.stream.write(json.dumps(state) + "\n")
            self.stream.flush()
            return
        part = self.done / self.total if self.total else self.fraction
        bar = ""
        if part is not None:
            filled = int(BAR_WIDTH * min(part, 1.0))
            bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {part * 100:3.0f}% "
        total = f"/{self.total}" if self.total is not None else ""
        eta = f", ETA {state['eta_s']:.0f}s" if state["eta_s"] is not None else ""
        self.stream.write(
            f"\r{self.what}: {bar}{self.done}{total} at {state['rate_per_s']}/s{eta}\x1b[K"
        )
        self.stream.flush()
