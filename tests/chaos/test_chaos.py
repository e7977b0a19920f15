"""Seeded random fault schedules against real processes: the guarantees hold.

Each test runs one schedule (devtools/chaos): its own Tansu broker, three
redis-server processes and 2-3 gateway processes in one group, traffic with
duplicates and hostile records, and every fault class at least once (gateway
SIGKILL and SIGSTOP, one Redis member killed, hung and restarted empty, the
broker SIGSTOPped past the raw-fetch deadline, duplicated, stale, reordered and
garbage failure commands). A consumer plays the Spark job's side. The checker's
rules are listed in devtools/chaos/__init__.py.

The CI seeds stay within the documented guarantees (profile `guaranteed`: Redis
faults hit one member only). `make chaos` runs many more seeds, some beyond them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.chaos import make_schedule, run_schedule
from devtools.chaos.schedule import Mode

# Record kinds that break a guarantee and that no change in flight fixes yet: kept
# in the long run (`make chaos`), left out here. See the README's chaos section.
# Record kinds left out of the CI schedules while a known bug is open (none now:
# lone-surrogate JSON ids and forged dedup-source headers on quarantine copies
# were found here and fixed).
NOT_YET_FIXED: tuple[str, ...] = ()
SECONDS = 40.0  # of faults; a passing run took 40-80 s here, a failing one up to 5 min


async def _run(
    seed: int, seconds: float | None, tmp_path: Path, mode: Mode, session_timeout_s: float
) -> None:
    schedule = make_schedule(
        seed, seconds or SECONDS, "guaranteed", mode, NOT_YET_FIXED, session_timeout_s, False
    )
    result = await run_schedule(schedule, tmp_path / "chaos")
    print(result.summary())
    assert result.passed, result.report()


@pytest.mark.chaos_schedule
@pytest.mark.timeout(420)
async def test_retry_mode_under_seeded_faults_loses_nothing_and_repeats_only_the_crash_window(
    tmp_path: Path, chaos_seed: int | None, chaos_seconds: float | None
) -> None:
    # A long session: the raw group outlives the broker's stop, while retries that
    # come due during it meet the raw-fetch deadline (rule command-invalid).
    await _run(chaos_seed or 1, chaos_seconds, tmp_path, "retry", session_timeout_s=20.0)


@pytest.mark.chaos_schedule
@pytest.mark.timeout(420)
async def test_release_mode_under_seeded_faults_loses_nothing_and_processes_no_id_twice(
    tmp_path: Path, chaos_seed: int | None, chaos_seconds: float | None
) -> None:
    await _run(chaos_seed or 8, chaos_seconds, tmp_path, "release", session_timeout_s=2.0)
