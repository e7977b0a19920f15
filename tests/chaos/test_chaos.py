"""Seeded random fault schedules against real processes: the guarantees hold.

Each test runs one schedule (devtools/chaos): its own Apache Kafka broker, three
redis-server processes and 2-3 gateway processes in one group, traffic with
duplicates and hostile records, and every fault class at least once (gateway
SIGKILL and SIGSTOP, one Redis member killed, hung and restarted empty, the
broker SIGSTOPped past the raw-fetch deadline, duplicated, stale, reordered and
garbage failure commands). A consumer plays the Spark job's side. The checker's
rules are listed in devtools/chaos/__init__.py.

The third runs a delay run (devtools/chaos/schedule.py, `RunConfig.delay`): [delay]
tiers and [coalesce] windows on, delayed and windowed records and producer clocks
skewed by hours, hostile records on the raw topic, the failure topic and every
tier, and a rolling restart into changed settings (a tier removed, coalescing off,
ttl lowered), with only the cheap faults around them.

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


# The delay run's CI schedule: what it is about, not the slow faults the others cover.
DELAY_RUN_LEAVES_OUT = (
    "broker-stop", "gateway-stop", "redis-kill", "redis-stop", "member-handover",
)  # fmt: skip


async def _run(
    seed: int, seconds: float | None, tmp_path: Path, mode: Mode, session_timeout_s: float,
    delay: bool = False,
) -> None:  # fmt: skip
    excluded = NOT_YET_FIXED + (DELAY_RUN_LEAVES_OUT if delay else ())
    schedule = make_schedule(
        seed, seconds or SECONDS, "guaranteed", mode, excluded, session_timeout_s, False, delay
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


@pytest.mark.chaos_schedule
@pytest.mark.timeout(420)
async def test_delay_run_with_hostile_tier_and_command_headers_and_a_config_change_holds(
    tmp_path: Path, chaos_seed: int | None, chaos_seconds: float | None
) -> None:
    # Delivered once and never early, each window's newest version on the clean topic,
    # the removed tier drained, copies older than the lowered ttl still duplicates.
    await _run(chaos_seed or 4, chaos_seconds or 20.0, tmp_path, "retry", 2.0, delay=True)
