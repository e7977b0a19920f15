"""The start-up report's rate: at once, then at doubling intervals, capped."""

from __future__ import annotations

import itertools

from gateway.waits import FallingReport


def test_reports_fall_from_every_two_seconds_to_once_a_minute():
    now = [0.0]
    report = FallingReport(1.0, 60.0, clock=lambda: now[0])
    reported_at = []
    for second in range(600):  # one attempt a second for ten minutes
        now[0] = float(second)
        if report.due():
            reported_at.append(second)
    assert reported_at[:7] == [0, 2, 6, 14, 30, 62, 122]
    gaps = [b - a for a, b in itertools.pairwise(reported_at)]
    assert max(gaps) == 60 and gaps[-1] == 60
    assert len(reported_at) == 14  # 0 ... 122, then 182 ... 542: not 600
