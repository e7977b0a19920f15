"""The one backoff rule of the gateway: doubling with jitter, bounded."""

from __future__ import annotations

import random


def backoff_delay(initial_s: float, maximum_s: float, attempt: int, jitter: float = 0.2) -> float:
    """Delay before try `attempt` (1-based): initial * 2^(attempt-1), capped at maximum,
    then spread by +-`jitter` (a share of the delay), never above maximum."""
    base = min(initial_s * 2 ** max(attempt - 1, 0), maximum_s)
    return float(min(base * (1 + random.uniform(-jitter, jitter)), maximum_s))
