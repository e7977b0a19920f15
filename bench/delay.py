"""Scheduled delivery against the forwarder, in one run on one local stack.

`measure(stack, records)` fills raw topics whose records all ask for a delay
(20% duplicates) and times, one after another:
- `forwarder`: dedup and delay off (the headers ride along unread): the ceiling;
- `gateway-3`: dedup on, delay off: the product without scheduled delivery;
- `delay-intake`: dedup and delay on, every record due in an hour: claimed and
  written to a delay tier instead of the clean topic;
- `delay-release`: dedup and delay on, every record due at the same instant D,
  set far enough ahead that all of them wait in a tier first: from D until the
  broker acknowledged the last clean copy (the delay loop's moving rate, in a
  burst, through its memory bound);
- `coalesce-intake`: as delay-intake with `[coalesce]` on too (key: the order's
  customer, 500 of them; a window of an hour): claimed, written into its
  window's state on three instances, and written to a delay tier.
Rates are records/s; ratios are against the forwarder of the same run.

And `coalesce-close`, once with `[coalesce] grace` 0 and once with its default:
entities updated about every 100 ms (each at its own phase) for a few seconds, each
record stamped as it is sent (windows of 1 s): windows emitted per window closed (1.0: each window
reached the clean topic once), and the updates counted late (taken after their
window's end + grace) with their mean lateness. With grace 0 the late share
times the window estimates the mean intake latency (producer to window update).

`python -m bench.delay [--records N]` prints them (and JSON with --json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import uvloop
from aiokafka import AIOKafkaProducer
from prometheus_client import Histogram

from bench.measure import FETCH_MAX_WAIT, delete_topics, flush
from devtools.harness import running, until
from devtools.localstack import LocalStack, default_state_dir
from devtools.topics import create_topics
from devtools.traffic import order_value
from gateway.config import Settings, load_settings
from gateway.delay.coalescer import now_ms
from gateway.logs import configure
from gateway.metrics import total
from gateway.rules.tiers import tier_topics
from gateway.service.app import Gateway

PARTITIONS = 4
DUPLICATES = 0.2
HOUR_MS = 3_600_000
# coalesce-close: without grace, and with the default
CLOSE_GRACES = (0, Settings().coalesce.grace // timedelta(milliseconds=1))


@dataclass
class DelayRates:
    records: int
    unique: int
    forwarder: float
    gateway: float
    intake: float
    release: float
    release_correct: bool  # every id came out once, none before D
    coalesce: float = 0.0  # coalesce-intake: [coalesce] on too (bench/delay.py docstring)
    closes: list[CloseRun] = field(default_factory=list)  # coalesce-close, per grace

    @property
    def ratios(self) -> dict[str, float]:
        return {
            "gateway-3 / forwarder": self.gateway / self.forwarder,
            "delay-intake / forwarder": self.intake / self.forwarder,
            "delay-release / forwarder": self.release / self.forwarder,
            "coalesce-intake / forwarder": self.coalesce / self.forwarder,
        }


@dataclass
class CloseRun:
    """One coalesce-close run (module docstring)."""

    grace_s: float
    updates: int  # records produced, each a new version of its entity
    windows: int  # (entity, window) pairs that took an update: the windows closed
    emitted: int  # windows' records on the clean topic
    late: int  # updates taken after their window's end + grace
    late_mean_s: float

    @property
    def emitted_per_window(self) -> float:
        return self.emitted / self.windows


async def fill(bootstrap: str, topic: str, records: int, due_ms: int, seed: int) -> int:
    """`records` raw records, all `deliver-at: due_ms`; returns the distinct ids."""
    rng = random.Random(seed)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_batch_size=1_000_000)
    await producer.start()
    issued: list[str] = []
    try:
        batches = [producer.create_batch() for _ in range(PARTITIONS)]
        futures = []
        for n in range(records):
            if issued and rng.random() < DUPLICATES:
                message_id = rng.choice(issued)
            else:
                message_id = f"d-{n}"
                issued.append(message_id)
            headers = [("message-id", message_id.encode()), ("deliver-at", str(due_ms).encode())]
            value = order_value(message_id, rng, 200)
            partition = rng.randrange(PARTITIONS)
            args = {"key": None, "value": value, "timestamp": None, "headers": headers}
            if batches[partition].append(**args) is None:
                futures.append(
                    await producer.send_batch(batches[partition], topic, partition=partition)
                )
                batches[partition] = producer.create_batch()
                batches[partition].append(**args)
        for partition, batch in enumerate(batches):
            futures.append(await producer.send_batch(batch, topic, partition=partition))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return len(issued)


def settings_for(
    stack: LocalStack, raw: str, clean: str, *, dedup: bool, delay: bool, coalesce: bool = False,
    window: str = "1h", grace: str = "1s",
) -> Settings:  # fmt: skip
    return load_settings(
        kafka={"bootstrap_servers": stack.bootstrap, "raw_topics": [raw], "clean_topic": clean,
               "group_id": f"bench-{clean}", "quarantine_topic": f"{clean}-quarantine",
               "failure_topic": "bench-failures", "dead_letter_topic": "bench-dead-letter",
               "fetch_max_wait": FETCH_MAX_WAIT},
        redis={"nodes": stack.redis_urls[:3]},
        dedup={"enabled": dedup},
        delay={"enabled": delay},
        # 500 customers (`order_value`), a window of an hour: every record waits.
        coalesce={"enabled": coalesce, "key": "json:customer", "window": window, "grace": grace},
        metrics={"host": "127.0.0.1", "port": 0},
        log={"level": "ERROR"},
    )  # fmt: skip


async def _topics_for(stack: LocalStack, settings: Settings) -> list[str]:
    clean = settings.kafka.clean_topic
    names = {clean: PARTITIONS, f"{clean}-quarantine": 1}
    names |= dict.fromkeys(tier_topics(settings), PARTITIONS)
    await create_topics(stack.bootstrap, names)
    return list(names)


async def _intake_rate(stack: LocalStack, settings: Settings, records: int) -> float:
    """Records/s from the first fetched batch until every raw record was handled."""
    topics = await _topics_for(stack, settings)
    await flush(stack.redis_urls[:3])
    gateway = Gateway(settings)
    async with running(gateway):
        await until(gateway, lambda: gateway.metrics.consumed() > 0)
        started = time.perf_counter()
        await until(gateway, lambda: gateway.metrics.handled() >= records)
        seconds = time.perf_counter() - started
    await delete_topics(stack.bootstrap, topics)
    return records / seconds


async def _release_rate(stack: LocalStack, records: int, intake_s: float) -> tuple[float, bool]:
    """All records due at one instant D: records/s from D to the last clean acknowledgement."""
    raw = "delay-release-raw"
    await create_topics(stack.bootstrap, {raw: PARTITIONS})
    settings = settings_for(stack, raw, "delay-release-clean", dedup=True, delay=True)
    topics = await _topics_for(stack, settings)
    await flush(stack.redis_urls[:3])
    gateway = Gateway(settings)
    lateness = gateway.metrics.delay_lateness
    async with running(gateway):
        await until(gateway, lambda: bool(gateway.partitions()))
        # Far enough ahead that filling and routing happen before D.
        due = now_ms() + int(3 * intake_s * 1000) + 5_000
        unique = await fill(stack.bootstrap, raw, records, due, seed=3)
        await until(gateway, lambda: gateway.metrics.handled() >= records)
        routed_before_due = now_ms() < due  # else some went straight to the clean topic
        await until(gateway, lambda: _count(lateness) >= unique, timeout_s=300)
        seconds = (now_ms() - due) / 1000
    await delete_topics(stack.bootstrap, [raw, *topics])
    return unique / seconds, routed_before_due and gateway.metrics.forwarded_total() == unique


def _count(histogram: Histogram, suffix: str = "_count") -> float:
    (family,) = histogram.collect()
    return float(next(s.value for s in family.samples if s.name.endswith(suffix)))


CLOSE_WINDOW_MS = 1000
CLOSE_PERIOD_MS = 100  # each entity's next version about this much later
CLOSE_SECONDS = 4


async def _close_run(stack: LocalStack, entities: int, grace_ms: int) -> CloseRun:
    """coalesce-close (module docstring) with `[coalesce] grace` of `grace_ms`."""
    raw, clean = f"coalesce-close-raw-{grace_ms}", f"coalesce-close-clean-{grace_ms}"
    await create_topics(stack.bootstrap, {raw: PARTITIONS})
    settings = settings_for(
        stack, raw, clean, dedup=True, delay=True, coalesce=True,
        window=f"{CLOSE_WINDOW_MS}ms", grace=f"{grace_ms}ms",
    )  # fmt: skip
    topics = await _topics_for(stack, settings)
    await flush(stack.redis_urls[:3])
    gateway = Gateway(settings)
    m = gateway.metrics
    windows: set[tuple[int, int]] = set()
    rng = random.Random(grace_ms)
    updates = 0
    producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
    async with running(gateway):
        await until(gateway, lambda: bool(gateway.partitions()))
        await producer.start()
        try:
            # Each entity at its own phase, its next version about a period later (0.5 to
            # 1.5 of it), so that some land in each window's last milliseconds.
            due = {e: rng.uniform(0, CLOSE_PERIOD_MS) for e in range(entities)}
            begin = now_ms()
            while (elapsed := now_ms() - begin) < CLOSE_SECONDS * 1000:
                sent = []
                for entity in [e for e, at in due.items() if at <= elapsed]:
                    ts = now_ms()  # stamped as sent, like a producer's own clock
                    windows.add((entity, ts // CLOSE_WINDOW_MS))
                    value = json.dumps({"customer": entity, "update": updates}).encode()
                    headers = [("message-id", f"{entity}-{updates}".encode())]
                    sent.append(await producer.send(raw, value, partition=entity % PARTITIONS,
                                                    timestamp_ms=ts, headers=headers))  # fmt: skip
                    updates += 1
                    due[entity] += rng.uniform(0.5, 1.5) * CLOSE_PERIOD_MS
                await asyncio.gather(*sent)
                await asyncio.sleep(0.005)  # the workload's pace: the next sends in 5 ms
        finally:
            await producer.stop()
        # Every waiting record decided: merged into a newer version, or emitted.
        await until(
            gateway,
            lambda: total(m.coalesce_merged) + total(m.coalesce_emitted) >= updates,
            timeout_s=120,
        )
    late = int(total(m.coalesce_late))
    lateness = _count(m.coalesce_update_lateness, "_sum")
    await delete_topics(stack.bootstrap, [raw, *topics])
    return CloseRun(grace_ms / 1000, updates, len(windows), int(total(m.coalesce_emitted)), late,
                    lateness / late if late else 0.0)  # fmt: skip


async def measure(stack: LocalStack, records: int = 20_000) -> DelayRates:
    """The four runs above on `stack` (three Redis instances at least)."""
    raw = "delay-intake-raw"
    await create_topics(stack.bootstrap, {raw: PARTITIONS, "bench-failures": 1,
                                          "bench-dead-letter": 1})  # fmt: skip
    unique = await fill(stack.bootstrap, raw, records, now_ms() + HOUR_MS, seed=2)
    rates = {}
    for name, dedup, delay, coalesce in (
        ("forwarder", False, False, False), ("gateway", True, False, False),
        ("intake", True, True, False), ("coalesce", True, True, True),
    ):  # fmt: skip
        settings = settings_for(
            stack, raw, f"delay-{name}-clean", dedup=dedup, delay=delay, coalesce=coalesce
        )
        rates[name] = await _intake_rate(stack, settings, records)
    release, correct = await _release_rate(stack, records, records / rates["intake"])
    await delete_topics(stack.bootstrap, [raw])
    closes = [await _close_run(stack, max(10, records // 100), grace) for grace in CLOSE_GRACES]
    return DelayRates(records, unique, rates["forwarder"], rates["gateway"], rates["intake"],
                      release, correct, rates["coalesce"], closes)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.delay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--json", action="store_true", help="print the rates as JSON")
    args = parser.parse_args(argv)
    configure(load_settings(log={"level": "ERROR"}).log)

    async def run() -> DelayRates:
        with LocalStack(default_state_dir() / "bench-delay", redis_count=3) as stack:
            return await measure(stack, args.records)

    rates = uvloop.run(run())
    if args.json:
        print(json.dumps({**asdict(rates), "ratios": rates.ratios}))
        return 0
    print(f"{rates.records:,} records ({rates.unique:,} ids), records/s:")
    for name in ("forwarder", "gateway", "intake", "release", "coalesce"):
        print(f"  {name:<10} {getattr(rates, name):>10,.0f}")
    for name, ratio in rates.ratios.items():
        print(f"  {name:<28} {ratio:.2f}")
    print(f"  release correct (every id once, routing before D): {rates.release_correct}")
    for close in rates.closes:
        print(
            f"  coalesce-close grace {close.grace_s:g}s: {close.updates:,} updates, "
            f"{close.windows:,} windows closed, {close.emitted:,} emitted "
            f"({close.emitted_per_window:.3f} per window), {close.late:,} late "
            f"(mean {close.late_mean_s * 1000:.0f} ms after the close)"
        )
    return 0 if rates.release_correct else 1


if __name__ == "__main__":
    raise SystemExit(main())
