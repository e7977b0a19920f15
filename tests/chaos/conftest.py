"""The chaos tests start their own broker, Redis instances and gateways (never the
session broker: they SIGSTOP theirs). CHAOS_SEED and CHAOS_SECONDS rerun them with
another seed or a longer schedule; the failure report prints the seed, the
schedule and the command that reruns it on its own."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def chaos_seed() -> int | None:
    """CHAOS_SEED when set: replaces each test's fixed seed."""
    seed = os.environ.get("CHAOS_SEED")
    return int(seed) if seed else None


@pytest.fixture
def chaos_seconds() -> float | None:
    """CHAOS_SECONDS when set: how long each schedule's faults should last."""
    seconds = os.environ.get("CHAOS_SECONDS")
    return float(seconds) if seconds else None
