"""An id that matches nothing does not look healthy: `[dedup] id = "header:message-id"`
(the default) on records that carry their id in the JSON body. Every record is
quarantined (none lost); /readyz says degraded with one summary line; the per-record
warnings are rate-limited with a count; `check-config --connect` says what share the
id extracts and why not."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp

from devtools.harness import (
    Topics,
    clean_ids,
    counter_value,
    eventually,
    make_settings,
    produce,
    redis_urls,
    running,
    write_toml,
)
from devtools.topics import read_topic, wait_committed
from gateway import cli
from gateway.raw import quarantine

RECORDS = 120
JSON_BODIED = [
    (b"k", json.dumps({"id": f"o-{i}", "amount": i}).encode(), [("trace", b"t")])
    for i in range(RECORDS)
]


async def test_a_wrong_id_turns_readyz_degraded_rate_limits_warnings_and_loses_nothing(
    broker, stack, caplog, monkeypatch
):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(quarantine, "LOG_EVERY_S", 1.0)  # the counted lines within the test
    s = await stack(members=1, raw_partitions=1)
    topics, settings = s.topics, s.settings
    await produce(broker, topics.raw, JSON_BODIED)
    assert settings.dedup.id == "header:message-id"  # the example's, left as it is
    raw = re.escape(topics.raw)
    one = re.compile(rf"^quarantined {raw}/0/\d+: missing_header: no header 'message-id'$")
    more = re.compile(rf"^\.\.\. and (\d+) more quarantined as missing_header in 1s \({raw}/0/")

    def accounted() -> int:
        """Records the warnings name: one line each, or counted in an `and K more`."""
        lines = [r.getMessage() for r in caplog.records]
        counted = sum(int(m[1]) for line in lines if (m := more.match(line)))
        return sum(bool(one.match(line)) for line in lines) + counted

    async with running(settings) as gateway, aiohttp.ClientSession() as http:
        await wait_committed(broker, topics.group, topics.raw, {0: RECORDS})
        assert counter_value(gateway.metrics.quarantined, "missing_header") == RECORDS
        for _ in range(50):  # the share is judged once a second
            async with http.get(f"http://127.0.0.1:{gateway.health.port}/readyz") as response:
                status, body = response.status, await response.text()
            if not body.startswith("ready"):
                break
            await asyncio.sleep(0.2)
        assert status == 200
        assert body == (
            f"degraded: quarantined 100% of raw records over the last 1m ({RECORDS} of "
            f"{RECORDS}: missing_header {RECORDS} (no header 'message-id')); "
            "check [dedup] id = 'header:message-id'\n"
        )
        await eventually(lambda: accounted() == RECORDS, 10, "every record counted in the log")
        assert gateway.metrics.quarantine_alarm._value.get() == 1
        assert gateway.metrics.quarantine_share._value.get() == 1.0
        assert gateway.metrics.ready._value.get() == 1  # it works: degraded, not unready
    summaries = [r for r in caplog.records if "quarantine_alarm_share" in r.getMessage()]
    assert len(summaries) == 1, [r.getMessage() for r in summaries]
    assert summaries[0].levelno == logging.WARNING
    assert "check [dedup] id = 'header:message-id' first" in summaries[0].getMessage()
    per_record = [r for r in caplog.records if one.match(r.getMessage())]
    assert len(per_record) <= RECORDS // 4, f"{len(per_record)} per-record warnings"
    assert any(more.match(r.getMessage()) for r in caplog.records)
    # None lost: every record is on the quarantine topic, nothing forwarded.
    kept = await read_topic(broker, topics.quarantine)
    assert sorted(r.value for r in kept) == sorted(v for _, v, _ in JSON_BODIED)
    assert not await clean_ids(broker, topics.clean)


def test_check_config_connect_says_what_share_the_id_extracts_and_why(
    broker, redis_servers, names, tmp_path, capsys
):
    topics = Topics(names)

    async def topic_of_json_bodied_records() -> None:
        await topics.create(broker, raw_partitions=2)
        await produce(broker, topics.raw, JSON_BODIED[:30], partition=0)
        await produce(broker, topics.raw, JSON_BODIED[30:40], partition=1)

    asyncio.run(topic_of_json_bodied_records())  # (the command runs its own event loop)
    settings = make_settings(broker, topics, redis_urls(redis_servers(1)))
    config = write_toml(tmp_path / "g.toml", settings)
    assert cli.main(["check-config", "--config", str(config), "--connect"]) == 3
    out = capsys.readouterr().out
    assert (
        f"ERROR topic {topics.raw}: [dedup] id = 'header:message-id' extracts an id from "
        "0 of 20 sampled records (0%); the rest would be quarantined: missing_header 20 "
        "(no header 'message-id'); the records carry headers trace; JSON values with "
        "fields id, amount; keys; check [dedup] id" in out
    ), out
    # The id the records do carry: all of them.
    settings = make_settings(broker, topics, redis_urls(redis_servers(1)), dedup={"id": "json:id"})
    config = write_toml(tmp_path / "g2.toml", settings)
    cli.main(["check-config", "--config", str(config), "--connect"])
    out = capsys.readouterr().out
    assert (
        f"OK    topic {topics.raw}: [dedup] id = 'json:id' extracts an id from 20 of 20 "
        "sampled records (100%)" in out
    ), out
