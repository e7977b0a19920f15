"""Coalescing windows against the real broker and redis-server: of 10 updates per key
spread over two partitions (and exact copies), each key's window emits its last
value once, after the window closes; with two gateways, with a Redis member down,
and across a SIGKILL of the gateway process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
from collections import defaultdict

from aiokafka import AIOKafkaProducer

from devtools.harness import (
    Topics,
    counter_value,
    make_settings,
    running,
    start_process,
    write_toml,
)
from devtools.topics import wait_committed
from gateway.config import Settings
from gateway.contract.tokens import mark_digest
from gateway.delay.coalescer import now_ms, version
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from tests.conftest import redis_urls
from tests.integration.test_delay import TIERS, create_all, poll, reading

KEYS, UPDATES, WINDOW_MS = 300, 10, 3000
COPIES = 0.2  # exact copies (same message id), dropped by dedup before coalescing


def coalesce_settings(
    broker: str, topics: Topics, nodes: list[str], window_ms: int = WINDOW_MS, **kafka
) -> Settings:
    return make_settings(
        broker, topics, nodes,
        kafka={"max_batch_records": 200, **kafka},
        delay={"enabled": True, "tiers": TIERS},
        coalesce={"enabled": True, "key": "header:entity-id", "window": f"{window_ms}ms"},
    )  # fmt: skip


async def quorum_of(nodes: list[str]) -> Quorum:
    settings = make_settings("127.0.0.1:1", Topics(lambda n: n), nodes)
    return Quorum(settings.redis, Metrics())


async def test_window_state_keeps_the_newest_version_and_counts_updates(redis_servers):
    nodes = redis_urls(redis_servers(1))
    quorum = await quorum_of(nodes)
    try:
        kd = mark_digest(b"e-1")
        stamps = [3100, 5900, 4000, 5900]
        versions = [version(t, "raw", 0, n) for n, t in enumerate(stamps)]
        (fixed,) = await quorum.coalesce_update([kd] * 4, stamps, versions, "fixed", 3000, 9000)
        assert fixed == [(3000, True), (3000, False), (3000, False), (3000, False)]
        # Replaying the newest changes nothing; an update stamped in the next window opens it.
        await quorum.coalesce_update([kd], [5900], [versions[3]], "fixed", 3000, 9000)
        (nxt,) = await quorum.coalesce_update([kd], [6000], [version(6000, "raw", 1, 0)],
                                              "fixed", 3000, 9000)  # fmt: skip
        assert nxt == [(6000, True)]
        (held,) = await quorum.coalesce_close([kd, kd, mark_digest(b"none")], [3000, 6000, 0])
        assert held == [(versions[3], 4, 5900), (version(6000, "raw", 1, 0), 1, 6000), ("", 0, 0)]

        kt = mark_digest(b"e-2")  # trailing: open until 3000 after the newest, 9000 at most
        trail = [0, 2500, 5400, 8300, 8999, 9000, 20_000]  # each within 3000 of the last
        got = []
        for n, t in enumerate(trail):
            (r,) = await quorum.coalesce_update([kt], [t], [version(t, "raw", 0, n)],
                                                "trailing", 3000, 9000)  # fmt: skip
            got.append(r[0][0])
        assert got == [0, 0, 0, 0, 0, 9000, 20_000]  # 9000: max_window; 20000: a gap

        # A digest holding a zero byte names the same window state in both scripts.
        zero = next(d for i in range(10_000) if b"\0" in (d := mark_digest(b"z%d" % i)))
        for mode in ("fixed", "trailing"):
            await quorum.coalesce_update([zero], [70_000], [version(70_000, "r", 0, 0)],
                                         mode, 3000, 9000)  # fmt: skip
        (held,) = await quorum.coalesce_close([zero, zero], [69_000, 70_000])
        assert [n for _, n, _ in held] == [1, 1]
    finally:
        await quorum.close()


async def produce_updates(
    broker: str, topic: str, seed: int, window_ms: int = WINDOW_MS,
    stamps: dict[str, list[int]] | None = None,
) -> tuple[dict[str, bytes], int]:  # fmt: skip
    """KEYS x UPDATES versions stamped inside the next window (the same for all), on
    both partitions in random order, plus exact copies; the last value of each key,
    and when the window closes. `stamps` gets each key's timestamps."""
    rng = random.Random(seed)
    start = (now_ms() // window_ms + 1) * window_ms
    records = []
    last: dict[str, bytes] = {}
    stamps = {} if stamps is None else stamps
    for k in range(KEYS):
        for u in range(UPDATES):
            value = json.dumps({"key": k, "update": u}).encode()
            ts = start + u * (window_ms - 200) // UPDATES + rng.randrange(50)
            headers = [("message-id", f"e{k}-u{u}".encode()), ("entity-id", f"e{k}".encode())]
            records.append((ts, value, headers))
            last[f"e{k}"] = value
            stamps.setdefault(f"e{k}", []).append(ts)
    records += rng.sample(records, int(len(records) * COPIES))
    rng.shuffle(records)
    producer = AIOKafkaProducer(bootstrap_servers=broker)
    await producer.start()
    try:
        sent = [
            await producer.send(topic, value, partition=n % 2, timestamp_ms=ts, headers=headers)
            for n, (ts, value, headers) in enumerate(records)
        ]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()
    return last, start + window_ms


def check_emitted(seen, last: dict[str, bytes], close_ms: int) -> None:
    """Each key once (one token: a replayed move is the same record), its last value,
    not before its window closed and within 2 s of it."""
    by_key: dict[str, list] = defaultdict(list)
    for rec, read_ms in seen.records:
        headers = dict(rec.headers)
        by_key[json.loads(rec.value)["key"]].append((rec, headers, read_ms))
    assert sorted(by_key) == list(range(KEYS)), "every key's window emitted"
    for key, emitted in by_key.items():
        assert len({h["dedup-token"] for _, h, _ in emitted}) == 1, f"e{key} emitted twice"
        rec, headers, read_ms = emitted[0]
        assert rec.value == last[f"e{key}"], f"e{key}: not its last value"
        assert headers["dedup-window"] == f"{close_ms - WINDOW_MS}/{close_ms}".encode()
        assert int(headers["dedup-coalesced"]) >= UPDATES  # replays may count twice
        assert close_ms <= read_ms <= close_ms + 2000, f"e{key} read {read_ms - close_ms} ms"


async def test_two_gateways_emit_each_keys_last_value_once_after_its_window(
    broker, redis_servers, names
):
    topics = Topics(names)
    settings = coalesce_settings(broker, topics, redis_urls(redis_servers(3)))
    await create_all(broker, topics, settings, raw_partitions=2)
    async with contextlib.AsyncExitStack() as stack:
        seen = await stack.enter_async_context(reading(broker, topics.clean))
        one = await stack.enter_async_context(running(settings))
        two = await stack.enter_async_context(running(settings))
        await poll(lambda: bool(one.partitions() and two.partitions()), 30, "both assigned")
        last, close_ms = await produce_updates(broker, topics.raw, seed=1)
        await poll(lambda: len(seen.records) >= KEYS, (close_ms - now_ms()) / 1000 + 10, "all")
        await asyncio.sleep(0.5)  # a second emission of any key would show by now
    check_emitted(seen, last, close_ms)
    merged = sum(counter_value(g.metrics.coalesce_merged) for g in (one, two))
    assert merged == KEYS * (UPDATES - 1)  # every other version dropped at its close


async def test_with_one_redis_member_down_each_key_still_emits_its_last_value_once(
    broker, redis_servers, names
):
    topics = Topics(names)
    servers = redis_servers(3)
    settings = coalesce_settings(broker, topics, redis_urls(servers))
    await create_all(broker, topics, settings, raw_partitions=2)
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        servers[2].kill()
        last, close_ms = await produce_updates(broker, topics.raw, seed=2)
        await poll(lambda: len(seen.records) >= KEYS, (close_ms - now_ms()) / 1000 + 10, "all")
        await asyncio.sleep(0.5)
    check_emitted(seen, last, close_ms)


async def test_a_sigkill_mid_window_loses_no_key_and_emits_none_twice(
    broker, redis_servers, names, tmp_path
):
    topics = Topics(names)
    # A window long enough for the restarted gateway to take every update before it
    # closes (an update taken after its window closed is emitted again: see README).
    settings = coalesce_settings(
        broker, topics, redis_urls(redis_servers(3)), window_ms=10_000, session_timeout="2s"
    )
    await create_all(broker, topics, settings, raw_partitions=2)
    config = write_toml(tmp_path / "gateway.toml", settings)
    log = tmp_path / "gateway.log"
    proc = start_process(config, log)
    try:
        async with reading(broker, topics.clean) as seen:
            joined = "delay tier partitions assigned"
            await poll(lambda: joined in log.read_text(), 60, "the gateway joined", proc)
            last, close_ms = await produce_updates(broker, topics.raw, seed=3, window_ms=10_000)
            await wait_committed(broker, topics.group, topics.raw, {0: 1, 1: 1}, timeout_s=30)
            proc.send_signal(signal.SIGKILL)  # mid-window: updates taken, records waiting
            proc.wait()
            assert now_ms() < close_ms, "the kill came after the window closed"
            proc = start_process(config, log)
            await poll(lambda: len(seen.records) >= KEYS, (close_ms - now_ms()) / 1000 + 30,
                       "every key", proc)  # fmt: skip
            await asyncio.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    # The restart rejoins after the killed member's session: late by that, never early.
    by_key: dict[int, set[bytes]] = defaultdict(set)
    for rec, read_ms in seen.records:
        assert read_ms >= close_ms, "emitted before its window closed"
        assert rec.value == last[f"e{json.loads(rec.value)['key']}"]
        by_key[json.loads(rec.value)["key"]].add(dict(rec.headers)["dedup-token"])
    assert sorted(by_key) == list(range(KEYS))
    assert all(len(tokens) == 1 for tokens in by_key.values()), "a key emitted twice"


async def test_trailing_windows_close_a_window_after_each_keys_newest_update(
    broker, redis_servers, names
):
    topics = Topics(names)
    settings = make_settings(
        broker, topics, redis_urls(redis_servers(3)),
        kafka={"max_batch_records": 200},
        delay={"enabled": True, "tiers": TIERS},
        coalesce={"enabled": True, "key": "header:entity-id", "mode": "trailing",
                  "window": f"{WINDOW_MS}ms", "max_window": "30s"},
    )  # fmt: skip
    await create_all(broker, topics, settings, raw_partitions=2)
    stamps: dict[str, list[int]] = {}
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        # Each key's updates span 2.8 s, less than the window: one window per key.
        last, _ = await produce_updates(broker, topics.raw, seed=4, stamps=stamps)
        latest = max(max(ts) for ts in stamps.values()) + WINDOW_MS
        await poll(lambda: len(seen.records) >= KEYS, (latest - now_ms()) / 1000 + 10, "all")
        await asyncio.sleep(0.5)
    by_key: dict[str, list] = defaultdict(list)
    for rec, read_ms in seen.records:
        by_key[f"e{json.loads(rec.value)['key']}"].append((rec, read_ms))
    assert sorted(by_key) == sorted(last)
    for key, emitted in by_key.items():
        assert len(emitted) == 1, f"{key} emitted {len(emitted)} times"
        ((rec, read_ms),) = emitted
        assert rec.value == last[key]
        start, end = map(int, dict(rec.headers)["dedup-window"].split(b"/"))
        close = max(stamps[key]) + WINDOW_MS  # a window after the newest update
        assert start in stamps[key] and end == close
        assert close <= read_ms <= close + 2000, f"{key} read {read_ms - close} ms after"
