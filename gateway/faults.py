"""Fault points for the crash tests and chaos runs: testing only, off unless asked for.

`DEDUP_GATEWAY_FAULT=<point>:<action>:<n>` makes the n-th arrival of this process at
`<point>` do `<action>` to the process itself:

- `kill`: SIGKILL (a crash at exactly that moment);
- `stop`: SIGSTOP (a stall: the process resumes only when sent SIGCONT, a zombie if
  its group moved on meanwhile).

Points: `raw-acked`, after the broker acknowledged a raw batch's copies and before
its offsets are committed (or, with `exactly_once`, sent in its transaction): the
window in which a crash replays a batch whose copies are written; `delay-acked`, the
same for a step of the delay loop (tier records moved on, tier offsets not committed);
`retry-acked`, after the broker acknowledged a retry's copy and before its command
counts as done (noted in Redis and, with `exactly_once`, its transaction committed).

Nothing reads the variable in production but this module, once at import; an unknown
point or action is refused at start-up.
"""

from __future__ import annotations

import os
import signal

ENV = "DEDUP_GATEWAY_FAULT"
POINTS = frozenset({"raw-acked", "delay-acked", "retry-acked"})
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def _parse(spec: str) -> tuple[str, signal.Signals, int] | None:
    if not spec:
        return None
    point, action, count = [*spec.split(":"), "", ""][:3]
    if point not in POINTS or action not in ACTIONS or not count.isdigit() or int(count) < 1:
        raise ValueError(
            f"{ENV}={spec!r}: expected <point>:<action>:<n> with point in {sorted(POINTS)}, "
            f"action in {sorted(ACTIONS)}, n >= 1"
        )
    return point, ACTIONS[action], int(count)


_FAULT = _parse(os.environ.get(ENV, ""))
_arrivals: dict[str, int] = {}


def reached(point: str) -> None:
    """This process is at `point`: act when a fault is set for this arrival."""
    if _FAULT is None or _FAULT[0] != point:
        return
    _arrivals[point] = _arrivals.get(point, 0) + 1
    if _arrivals[point] == _FAULT[2]:
        os.kill(os.getpid(), _FAULT[1])
