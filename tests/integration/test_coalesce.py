"""Coalescing windows against the real broker and redis-server: of 10 updates per key
spread over two partitions (and exact copies), each key's window emits its last
value once, after the window closes (its end + grace); with two gateways, with a
Redis member down, and across a SIGKILL of the gateway process. Updates stamped in
a window's last milliseconds that arrive within grace are merged (with and without a
SIGKILL); later ones are counted late; a record stamped hours ahead is windowed by
the gateway's clock; a close whose window state is gone, or one bad record among
co-due ones, goes to quarantine alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
from collections import defaultdict
from datetime import timedelta

import redis.asyncio
from aiokafka import AIOKafkaProducer

from devtools.harness import (
    Topics,
    counter_value,
    make_settings,
    redis_urls,
    running,
    start_process,
    write_toml,
)
from devtools.topics import read_topic, wait_committed
from gateway.config import Settings
from gateway.contract.tokens import mark_digest
from gateway.delay.coalescer import now_ms
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.tiers import tier_topics
from gateway.rules.windows import version
from tests.integration.test_delay import TIERS, poll, reading

KEYS, UPDATES, WINDOW_MS = 300, 10, 3000
COPIES = 0.2  # exact copies (same message id), dropped by dedup before coalescing
GRACE_MS = Settings().coalesce.grace // timedelta(milliseconds=1)  # the default
STRAGGLER_GRACE_MS = 3000


def coalesce_sections(
    window_ms: int = WINDOW_MS, grace_ms: int = GRACE_MS, delay: dict | None = None, **kafka
) -> dict[str, dict]:
    """The `make_settings` overrides of these tests: fixed windows keyed by entity-id."""
    return {
        "kafka": {"max_batch_records": 200, **kafka},
        "delay": {"enabled": True, "tiers": TIERS, **(delay or {})},
        "coalesce": {"enabled": True, "key": "header:entity-id", "window": f"{window_ms}ms",
                     "grace": f"{grace_ms}ms"},
    }  # fmt: skip


def coalesce_settings(broker: str, topics: Topics, nodes: list[str], **options) -> Settings:
    return make_settings(broker, topics, nodes, **coalesce_sections(**options))


async def quorum_of(nodes: list[str]) -> Quorum:
    """A quorum whose calls may take 5 s: these tests check what the scripts answer,
    not timing, and a first call (connection, script load) can outlast the harness's
    300 ms on a loaded machine."""
    settings = make_settings("127.0.0.1:1", Topics(lambda n: n), nodes)
    redis = settings.redis.model_copy(update={"timeout": timedelta(seconds=5)})
    return Quorum(redis, Metrics())


async def test_window_state_keeps_the_newest_version_and_counts_updates(redis_servers):
    nodes = redis_urls(redis_servers(1))
    quorum = await quorum_of(nodes)
    try:
        kd = mark_digest(b"e-1")
        stamps = [3100, 5900, 4000, 5900]
        versions = [version(t, "raw", 0, n) for n, t in enumerate(stamps)]
        (fixed,) = await quorum.windows.coalesce_update(
            [kd] * 4, stamps, versions, "fixed", 3000, 9000
        )
        # (start, opened, the window's newest timestamp before the update)
        assert fixed == [(3000, True, 0), (3000, False, 3100), (3000, False, 5900),
                         (3000, False, 5900)]  # fmt: skip
        # Replaying the newest changes nothing; an update stamped in the next window opens it.
        await quorum.windows.coalesce_update([kd], [5900], [versions[3]], "fixed", 3000, 9000)
        (nxt,) = await quorum.windows.coalesce_update([kd], [6000], [version(6000, "raw", 1, 0)],
                                              "fixed", 3000, 9000)  # fmt: skip
        assert nxt == [(6000, True, 0)]
        (held,) = await quorum.windows.coalesce_close(
            [kd, kd, mark_digest(b"none")], [3000, 6000, 0]
        )
        assert held == [(versions[3], 4, 5900), (version(6000, "raw", 1, 0), 1, 6000), ("", 0, 0)]

        kt = mark_digest(b"e-2")  # trailing: open until 3000 after the newest, 9000 at most
        trail = [0, 2500, 5400, 8300, 8999, 9000, 20_000]  # each within 3000 of the last
        got = []
        for n, t in enumerate(trail):
            (r,) = await quorum.windows.coalesce_update([kt], [t], [version(t, "raw", 0, n)],
                                                "trailing", 3000, 9000)  # fmt: skip
            got.append(r[0][0])
        assert got == [0, 0, 0, 0, 0, 9000, 20_000]  # 9000: max_window; 20000: a gap

        # A digest holding a zero byte names the same window state in both scripts.
        zero = next(d for i in range(10_000) if b"\0" in (d := mark_digest(b"z%d" % i)))
        for mode in ("fixed", "trailing"):
            await quorum.windows.coalesce_update([zero], [70_000], [version(70_000, "r", 0, 0)],
                                         mode, 3000, 9000)  # fmt: skip
        (held,) = await quorum.windows.coalesce_close([zero, zero], [69_000, 70_000])
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


def check_emitted(seen, last: dict[str, bytes], close_ms: int, grace_ms: int = GRACE_MS) -> None:
    """Each key once (one token: a replayed move is the same record), its last value,
    not before its window closed (end + grace) and within 2 s of that."""
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
        closed = close_ms + grace_ms
        assert closed <= read_ms <= closed + 2000, f"e{key} read {read_ms - closed} ms"


async def test_two_gateways_emit_each_keys_last_value_once_after_its_window(broker, stack):
    s = await stack(raw_partitions=2, tier_partitions=2, **coalesce_sections())
    topics, settings = s.topics, s.settings
    async with contextlib.AsyncExitStack() as contexts:
        seen = await contexts.enter_async_context(reading(broker, topics.clean))
        one = await contexts.enter_async_context(running(settings))
        two = await contexts.enter_async_context(running(settings))
        await poll(lambda: bool(one.partitions() and two.partitions()), 30, "both assigned")
        last, close_ms = await produce_updates(broker, topics.raw, seed=1)
        await poll(lambda: len(seen.records) >= KEYS, (close_ms - now_ms()) / 1000 + 10, "all")
        await asyncio.sleep(0.5)  # a second emission of any key would show by now
    check_emitted(seen, last, close_ms)
    merged = sum(counter_value(g.metrics.coalesce_merged) for g in (one, two))
    assert merged == KEYS * (UPDATES - 1)  # every other version dropped at its close


async def test_with_one_redis_member_down_each_key_still_emits_its_last_value_once(broker, stack):
    # Every update must be taken before its window closes (the premise of "once"); with
    # a member's calls failing, a loaded machine can take the 3,600 records for longer
    # than the default grace: the stragglers' grace leaves it room.
    sections = coalesce_sections(grace_ms=STRAGGLER_GRACE_MS)
    s = await stack(raw_partitions=2, tier_partitions=2, **sections)
    topics, servers, settings = s.topics, s.servers, s.settings
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        servers[2].kill()
        last, close_ms = await produce_updates(broker, topics.raw, seed=2)
        await poll(lambda: len(seen.records) >= KEYS, (close_ms - now_ms()) / 1000 + 10, "all")
        await asyncio.sleep(0.5)
        assert counter_value(gateway.metrics.coalesce_late) == 0, "an update came after grace"
    check_emitted(seen, last, close_ms, grace_ms=STRAGGLER_GRACE_MS)


async def test_a_sigkill_mid_window_loses_no_key_and_emits_none_twice(broker, stack, tmp_path):
    # A window long enough for the restarted gateway to take every update before it
    # closes (an update taken after its window closed is emitted again: see README).
    sections = coalesce_sections(window_ms=10_000, session_timeout="2s")
    s = await stack(raw_partitions=2, tier_partitions=2, **sections)
    topics, settings = s.topics, s.settings
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


async def test_trailing_windows_close_a_window_after_each_keys_newest_update(broker, stack):
    s = await stack(
        raw_partitions=2, tier_partitions=2,
        kafka={"max_batch_records": 200},
        delay={"enabled": True, "tiers": TIERS},
        coalesce={"enabled": True, "key": "header:entity-id", "mode": "trailing",
                  "window": f"{WINDOW_MS}ms", "max_window": "30s"},
    )  # fmt: skip
    topics, settings = s.topics, s.settings
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
        closed = close + GRACE_MS
        assert closed <= read_ms <= closed + 2000, f"{key} read {read_ms - closed} ms after"


# -- Grace: updates in flight at a window's end -----------------------------------

ENTITIES = 40
EARLY = 4  # versions per entity stamped well inside the window, taken before its end
# The stragglers' tests: room for a loaded machine to take them (the default grace is
# what the benchmark's coalesce-close runs measure).


def window_ending_after(window_ms: int, lead_ms: int) -> tuple[int, int]:
    """(start, end) of the first fixed window that starts at least `lead_ms` from now."""
    start = -(-(now_ms() + lead_ms) // window_ms) * window_ms
    return start, start + window_ms


async def send(broker: str, topic: str, records: list[tuple[int, bytes, list, int]]) -> None:
    """(timestamp ms, value, headers, partition) each, stamped with that timestamp."""
    producer = AIOKafkaProducer(bootstrap_servers=broker)
    await producer.start()
    try:
        sent = [await producer.send(topic, value, partition=p, timestamp_ms=ts, headers=h)
                for ts, value, h, p in records]  # fmt: skip
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


def update(entity: int, n: int, ts: int, tag: str = "") -> tuple[int, bytes, list, int]:
    value = json.dumps({"key": entity, "update": n}).encode()
    headers = [("message-id", f"{tag}e{entity}-u{n}".encode()),
               ("entity-id", f"{tag}e{entity}".encode())]  # fmt: skip
    return ts, value, headers, (entity + n) % 2


def early_updates(start: int, window_ms: int) -> list[tuple[int, bytes, list, int]]:
    return [update(e, n, start + n * window_ms // (EARLY + 1) + e % 7)
            for e in range(ENTITIES) for n in range(EARLY)]  # fmt: skip


def stragglers(end: int) -> list[tuple[int, bytes, list, int]]:
    """Per entity: one version in the window's last 3 ms, one in the next window's first."""
    return [
        r
        for e in range(ENTITIES)
        for r in (update(e, EARLY, end - 1 - e % 3), update(e, EARLY + 1, end + e % 3))
    ]


def by_window(seen) -> dict[tuple[int, int], list]:
    """(entity, window start) -> its clean records, in the order read."""
    out: dict[tuple[int, int], list] = defaultdict(list)
    for rec, _ in seen.records:
        start = int(dict(rec.headers)["dedup-window"].split(b"/")[0])
        out[(json.loads(rec.value)["key"], start)].append(rec)
    return out


def per_partition(records: list[tuple[int, bytes, list, int]]) -> dict[int, int]:
    """How many of `records` go to each raw partition (the offsets to wait for)."""
    return {p: sum(r[3] == p for r in records) for p in (0, 1)}


def check_one_per_window(seen, start: int, end: int, replays: bool = False) -> None:
    """Each entity's window once, under one token, with its newest version: the last
    straggler for the window that ended at `end`, the first of the next for the next.
    With `replays`, a repeat of the same record (same token) after a kill is allowed."""
    windows = by_window(seen)
    assert sorted(windows) == sorted((e, s) for e in range(ENTITIES) for s in (start, end)), (
        "every entity's two windows emitted"
    )
    for (entity, s), emitted in windows.items():
        tokens = {dict(r.headers)["dedup-token"] for r in emitted}
        assert len(tokens) == 1, f"e{entity} window {s} emitted under {len(tokens)} tokens"
        assert replays or len(emitted) == 1, f"e{entity} window {s} emitted {len(emitted)} times"
        newest = EARLY if s == start else EARLY + 1
        assert {json.loads(r.value)["update"] for r in emitted} == {newest}, f"e{entity} {s}"


async def test_updates_stamped_in_a_windows_last_milliseconds_arriving_within_grace_are_merged(
    broker, stack
):
    sections = coalesce_sections(window_ms=2000, grace_ms=STRAGGLER_GRACE_MS)
    s = await stack(raw_partitions=2, tier_partitions=2, **sections)
    topics, settings = s.topics, s.settings
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        start, end = window_ending_after(2000, 500)
        await send(broker, topics.raw, early_updates(start, 2000))
        m = gateway.metrics
        await poll(lambda: counter_value(m.coalesce_updates) >= ENTITIES * EARLY, 30, "taken")
        assert now_ms() < end, "the early versions were taken after the window's end"
        # In flight at the end: stamped in its last milliseconds (and the next window's
        # first), taken after the end but within grace.
        await poll(lambda: now_ms() >= end + 100, 30, "the window's end")
        await send(broker, topics.raw, stragglers(end))
        taken = ENTITIES * (EARLY + 2)
        await poll(lambda: counter_value(m.coalesce_updates) >= taken, 30, "stragglers taken")
        assert now_ms() < end + STRAGGLER_GRACE_MS, "the stragglers were taken after grace"
        decided = lambda: counter_value(m.coalesce_merged) + counter_value(m.coalesce_emitted)  # noqa: E731
        await poll(lambda: decided() >= taken, (end - now_ms()) / 1000 + 30, "every close")
        await poll(lambda: len(seen.records) >= counter_value(m.coalesce_emitted), 10, "read")
    check_one_per_window(seen, start, end)
    assert counter_value(m.coalesce_late) == 0


async def test_a_sigkill_while_windows_wait_still_merges_updates_arriving_within_grace(
    broker, stack, tmp_path
):
    sections = coalesce_sections(window_ms=2000, grace_ms=STRAGGLER_GRACE_MS, session_timeout="2s")
    s = await stack(raw_partitions=2, tier_partitions=2, **sections)
    topics, settings = s.topics, s.settings
    config = write_toml(tmp_path / "gateway.toml", settings)
    log = tmp_path / "gateway.log"
    joined = "delay tier partitions assigned"
    proc = start_process(config, log)
    try:
        async with reading(broker, topics.clean) as seen:
            await poll(lambda: joined in log.read_text(), 60, "the gateway joined", proc)
            # A window far enough ahead that the restarted gateway joins before it ends.
            start, end = window_ending_after(2000, 20_000)
            early, late = early_updates(start, 2000), stragglers(end)
            await send(broker, topics.raw, early)
            await wait_committed(broker, topics.group, topics.raw, per_partition(early))
            proc.send_signal(signal.SIGKILL)  # the early versions wait in the tiers
            proc.wait()
            proc = start_process(config, log)
            await poll(lambda: log.read_text().count(joined) >= 2, 60, "rejoined", proc)
            assert now_ms() < end, "the restart took longer than the lead"
            await poll(lambda: now_ms() >= end + 100, 30, "the window's end", proc)
            await send(broker, topics.raw, late)
            await wait_committed(broker, topics.group, topics.raw, per_partition(early + late))
            assert now_ms() < end + STRAGGLER_GRACE_MS, "the stragglers were taken after grace"
            # The first window closes before the next: once both are out, every record
            # of the first was decided.
            await poll(lambda: len(by_window(seen)) >= 2 * ENTITIES, 30, "both windows", proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
    # A tier move replayed after the kill repeats its record (same token): one emission.
    check_one_per_window(seen, start, end, replays=True)


async def test_an_update_taken_after_its_window_closed_is_counted_late_and_sent_after_it(
    broker, stack
):
    s = await stack(raw_partitions=2, tier_partitions=2, **coalesce_sections(window_ms=2000))
    topics, settings = s.topics, s.settings
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        start, end = window_ending_after(2000, 500)
        await send(broker, topics.raw, early_updates(start, 2000))
        await poll(lambda: len(seen.records) >= ENTITIES, (end - now_ms()) / 1000 + 30, "closed")
        # Newer than every version sent, stamped in the window, taken after its close.
        await send(broker, topics.raw, [update(e, EARLY, end - 1) for e in range(ENTITIES)])
        await poll(lambda: len(seen.records) >= 2 * ENTITIES, 30, "the late versions sent")
        taken_after = now_ms()
    m = gateway.metrics
    assert counter_value(m.coalesce_late) == ENTITIES
    (family,) = m.coalesce_update_lateness.collect()
    got = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples if "_bucket" not in s.name}
    assert got["count"] == ENTITIES
    assert 0 < got["sum"] <= ENTITIES * (taken_after - end - GRACE_MS) / 1000
    for (entity, s), emitted in by_window(seen).items():
        assert s == start
        # the close's newest, then the late one on its own (the README's rule)
        assert [json.loads(r.value)["update"] for r in emitted] == [EARLY - 1, EARLY], entity


async def test_a_record_stamped_hours_ahead_is_windowed_by_the_gateways_clock_and_sent_once(
    broker, stack
):
    sections = coalesce_sections(window_ms=2000, grace_ms=1000, delay={"max_delay": "10s"})
    s = await stack(raw_partitions=2, tier_partitions=2, **sections)
    topics, settings = s.topics, s.settings
    # Marks and window state live no longer than the longest wait allowed (the tightest
    # setting start-up accepts): a wait stretched by a producer's clock would outlive them.
    settings.redis.ttl = timedelta(seconds=10)
    ahead = now_ms() + 3 * 3_600_000
    records = [update(e, n, ahead + n) for e in range(ENTITIES) for n in range(3)]
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        sent_ms = now_ms()
        await send(broker, topics.raw, records)
        await poll(lambda: len(seen.records) >= ENTITIES, 10, "windowed by the gateway's clock")
        # A resend of every record while its mark lives: a duplicate, never sent again.
        await send(broker, topics.raw, records)
        m = gateway.metrics
        await poll(lambda: m.duplicates_total() >= len(records), 10, "the resends judged")
        decided = lambda: counter_value(m.coalesce_merged) + counter_value(m.coalesce_emitted)  # noqa: E731
        await poll(lambda: decided() >= len(records), 10, "every close")
        await poll(lambda: len(seen.records) >= counter_value(m.coalesce_emitted), 10, "read")
        done_ms = now_ms()
    windows = by_window(seen)
    assert sorted(e for e, _ in windows) == list(range(ENTITIES))
    for (entity, s), emitted in windows.items():
        assert len(emitted) == 1, f"e{entity} sent {len(emitted)} times"
        assert json.loads(emitted[0].value)["update"] == 2  # the newest by its own timestamp
        assert sent_ms - 2000 <= s <= done_ms, "not the window of the gateway's clock"
    assert counter_value(m.coalesce_emitted) == ENTITIES


async def test_a_close_that_finds_its_window_state_gone_is_quarantined_not_sent(broker, stack):
    s = await stack(raw_partitions=2, tier_partitions=2, **coalesce_sections(window_ms=2000))
    topics, servers, settings = s.topics, s.servers, s.settings
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        start, end = window_ending_after(2000, 1000)
        early = early_updates(start, 2000)
        await send(broker, topics.raw, early)
        m = gateway.metrics
        await poll(lambda: counter_value(m.coalesce_updates) >= len(early), 30, "taken")
        assert now_ms() < end + GRACE_MS, "taken after the close"
        # The window state expires before the close (as after an outage longer than ttl).
        gone = 0
        for server in servers:
            client = redis.asyncio.Redis(port=server.port)
            keys = [k async for k in client.scan_iter(match=b"dd:cs:*")]
            gone += await client.delete(*keys)
            await client.aclose()
        assert gone == 3 * ENTITIES
        lost = lambda: counter_value(m.quarantined, "window_expired")  # noqa: E731
        await poll(lambda: lost() >= len(early), (end - now_ms()) / 1000 + 30, "quarantined")
        quarantined = await read_topic(broker, topics.quarantine, min_records=len(early))
    assert seen.records == [], "a version sent without knowing whether it is the newest"
    assert counter_value(m.coalesce_emitted) == 0
    reasons = {dict(r.headers)["dedup-error"].split(b":")[0] for r in quarantined}
    assert reasons == {b"window_expired"}
    assert sorted(r.value for r in quarantined) == sorted(v for _, v, _, _ in early)


async def test_one_bad_record_among_co_due_closes_goes_to_quarantine_alone(broker, stack):
    s = await stack(raw_partitions=2, tier_partitions=2, **coalesce_sections(window_ms=2000))
    topics, settings = s.topics, s.settings
    async with reading(broker, topics.clean) as seen, running(settings) as gateway:
        await poll(lambda: bool(gateway.partitions()), 30, "assigned")
        start, end = window_ending_after(2000, 500)
        early = early_updates(start, 2000)
        await send(broker, topics.raw, early)
        # A tier record due with the window's records, whose window header no gateway wrote.
        due = str(end + GRACE_MS).encode()
        forged = [(now_ms(), b"forged", [("dedup-deliver-at", due),
                   ("dedup-tier-at", str(now_ms()).encode()), ("dedup-window", b"soon"),
                   ("dedup-source", b"raw/0/0"), ("entity-id", b"e0")], 0)]  # fmt: skip
        await send(broker, tier_topics(settings)[0], forged)
        m = gateway.metrics
        bad = lambda: counter_value(m.quarantined, "bad_tier_record")  # noqa: E731
        await poll(lambda: bad() >= 1, (end - now_ms()) / 1000 + 30, "the forged one quarantined")
        await poll(lambda: len(seen.records) >= ENTITIES, 30, "every window emitted")
        (quarantined,) = await read_topic(broker, topics.quarantine, min_records=1)
    assert quarantined.value == b"forged"
    assert dict(quarantined.headers)["dedup-error"].startswith(b"bad_tier_record")
    assert {json.loads(r.value)["update"] for r, _ in seen.records} == {EARLY - 1}
    assert sorted(json.loads(r.value)["key"] for r, _ in seen.records) == list(range(ENTITIES))
