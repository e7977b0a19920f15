"""SIGKILL the gateway process at random points mid-stream, restart it: no id is lost;
with `exactly_once` on, a `read_committed` reader sees every id once; off, duplicates
stay within the batch in flight at each kill."""

from __future__ import annotations

import asyncio
import random
import signal
from pathlib import Path

import pytest

from devtools.harness import (
    clean_ids,
    start_process,
    write_toml,
)
from devtools.topics import committed_offsets, wait_committed
from devtools.traffic import produce_traffic

KILLS = 4
BATCH = 500


@pytest.mark.parametrize("exactly_once", ["on", "off"])
async def test_sigkill_at_random_points_loses_nothing_and_bounds_duplicates(
    exactly_once, broker, stack, tmp_path: Path
):
    s = await stack(
        kafka={"max_batch_records": BATCH, "session_timeout": "2s", "exactly_once": exactly_once,
               "group_instance_id": "crashing"},
    )  # fmt: skip
    topics, settings = s.topics, s.settings
    traffic = await produce_traffic(broker, topics.raw, 40_000, duplicate_share=0.3, seed=5)
    total = sum(traffic.per_partition.values())
    config = write_toml(tmp_path / "gateway.toml", settings)
    rng = random.Random(99)
    kills = 0
    progress = 0
    while kills < KILLS:
        proc = start_process(config, tmp_path / "gateway.log")
        try:
            # Wait until this incarnation commits something, then kill at a random moment.
            deadline = asyncio.get_running_loop().time() + 60
            while (
                done := sum((await committed_offsets(broker, topics.group, topics.raw)).values())
            ) <= progress:
                assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
                assert asyncio.get_running_loop().time() < deadline, "no progress after restart"
                await asyncio.sleep(0.05)
            progress = done
            await asyncio.sleep(rng.uniform(0.0, 0.4))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        kills += 1
        if progress >= total:
            break
    assert progress < total, "the stream ended before the kills: make it longer"

    proc = start_process(config, tmp_path / "gateway.log")
    try:
        await wait_committed(broker, topics.group, topics.raw, traffic.per_partition, timeout_s=120)
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: drain, commit, exit 0
        assert proc.wait(timeout=30) == 0

    ids = await clean_ids(broker, topics.clean)
    assert set(ids) == traffic.unique_ids  # nothing lost
    extra = sum(ids.values()) - len(ids)
    if exactly_once == "on":
        assert extra == 0
    else:
        assert extra <= kills * BATCH  # only what was in flight at each kill
