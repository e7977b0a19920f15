"""The Spark job's side of the contract, played fast enough for a chaos loop.

A real Spark session costs ~10 s to start and a micro-batch a second or more on
this machine, so the chaos run uses this stand-in instead: it reads the clean
topic as the Spark job does (every partition, exact replay), drops a delivery
whose `dedup-token` it already processed (the same source record and attempt:
a crash-window duplicate), "processes" the rest (the seed says which ids fail
once or always) and sends the failure command the job sends for each failure
(gateway/contract/commands.py), with seeded chaos on top: some commands twice, some held
back behind later ones, some earlier commands again once they are stale, and
garbage on demand. It also reads the dead-letter topic.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b
from typing import Literal

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

from devtools.chaos.schedule import RunConfig
from devtools.chaos.timeline import Clock
from devtools.chaos.traffic import MAX_REQUEST_BYTES, RawHeaderName, digest_of
from devtools.harness import Topics
from gateway.contract.records import (
    H_ATTEMPT,
    H_DELIVER_AT,
    H_ID,
    H_REASONS,
    H_SOURCE,
    H_TOKEN,
    H_WINDOW,
    parse_source_ref,
)

Outcome = Literal["ok", "failed", "repeat"]
Fate = Literal["ok", "once", "always"]


@dataclass(frozen=True)
class Delivery:
    """One clean record as the consumer saw it, and what it did with it."""

    message_id: bytes
    token: str
    attempt: int
    source: tuple[int, int]  # raw partition, offset
    clean: tuple[int, int]  # clean partition, offset
    outcome: Outcome
    at: float
    value_digest: bytes | None
    read_ms: int = 0  # wall clock when read: never before the record was written
    deliver_at: int | None = None  # its dedup-deliver-at
    window: tuple[int, int] | None = None  # its dedup-window: start, end (epoch ms)


@dataclass(frozen=True)
class DeadLetter:
    message_id: bytes
    attempt: int
    source: tuple[int, int] | None
    at: float


def fate(seed: int, message_id: bytes, config: RunConfig) -> Fate:
    """Whether processing `message_id` succeeds, fails its first delivery, or always fails."""
    digest = blake2b(f"{seed}:fate:".encode() + message_id, digest_size=8).digest()
    u = int.from_bytes(digest, "big") / 2**64
    always = config.fail_always_share if config.mode == "retry" else 0.0
    if u < always:
        return "always"
    if u < always + config.fail_once_share:
        return "once"
    return "ok"


def readable(message_id: bytes) -> str:
    return message_id.decode("utf-8", "backslashreplace")


def source_of(ref: bytes) -> tuple[str, int, int]:
    """A `dedup-source` header's topic, partition, offset; ValueError if it is not one."""
    return parse_source_ref(ref.decode())


def command_value(headers: dict[str, bytes], reason: str) -> bytes:
    """The failure command the Spark job sends for a clean record (gateway/contract/commands.py):
    `id_b64` carries the exact id bytes, so ids that are not UTF-8 survive."""
    topic, partition, offset = source_of(headers[H_SOURCE])
    body = {
        "id": readable(headers[H_ID]),
        "id_b64": base64.b64encode(headers[H_ID]).decode(),
        "token": headers[H_TOKEN].decode(),
        "reason": reason,
        "source": {"topic": topic, "partition": partition, "offset": offset},
        "attempt": int(headers.get(H_ATTEMPT, b"1")),
        "reasons": json.loads(headers.get(H_REASONS, b"[]")),
    }
    return json.dumps(body).encode()


class SparkStandIn:
    """The consumer of the clean and dead-letter topics (see the module docstring).

    `on_release` is told each id it released (release mode), so the producer
    can send that id again, as the README asks of producers in that mode.
    """

    def __init__(
        self,
        config: RunConfig,
        bootstrap: str,
        topics: Topics,
        clock: Clock,
        on_release: Callable[[bytes], None],
    ) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.topics = topics
        self.clock = clock
        self.on_release = on_release
        self.rng = random.Random(f"{config.seed}:commands")
        self.deliveries: list[Delivery] = []
        self.dead: list[DeadLetter] = []
        self.tokens: set[str] = set()
        self.succeeded: set[bytes] = set()
        self.dead_ids: set[bytes] = set()
        self.failures: Counter[bytes] = Counter()
        self.last_command: dict[bytes, bytes] = {}
        self.held: list[tuple[bytes, bytes]] = []
        self.commands: Counter[str] = Counter()
        self.command_ends: dict[int, int] = {}
        self.sent: dict[str, bytes] = {}  # failure-topic ref -> id, of the commands a job sends
        self.hostile: list[str] = []  # failure-topic refs of commands with hostile headers
        self.problems: list[tuple[str, str]] = []  # (rule, message) found while reading
        self.caught_up = False
        self.last_activity = 0.0
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # As the Spark job reads: an aborted transaction's copies are never seen.
            isolation_level="read_committed",
            fetch_max_wait_ms=100,
            max_partition_fetch_bytes=16 * 1024 * 1024,
            request_timeout_ms=60_000,
        )
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            linger_ms=0,
            max_request_size=MAX_REQUEST_BYTES,
            request_timeout_ms=60_000,
        )
        self.tps: list[TopicPartition] = []

    def resolved(self, message_id: bytes) -> bool:
        return message_id in self.succeeded or message_id in self.dead_ids

    async def start(self) -> None:
        await self.producer.start()
        await self.consumer.start()
        self.tps = [
            TopicPartition(self.topics.clean, p) for p in range(self.config.clean_partitions)
        ]
        self.tps.append(TopicPartition(self.topics.dead, 0))
        self.consumer.assign(self.tps)
        await self.consumer.seek_to_beginning(*self.tps)

    async def stop(self) -> None:
        await self.consumer.stop()
        await self.producer.stop()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                batch = await self.consumer.getmany(timeout_ms=200, max_records=2000)
            except (UnicodeDecodeError, ValueError) as exc:
                self.problems.append(
                    (
                        "unreadable",
                        f"the clean or dead-letter topic cannot be "
                        f"read: {type(exc).__name__}: {exc}",
                    )
                )
                return
            out: list[tuple[bytes, bytes]] = []
            for tp, records in batch.items():
                for rec in records:
                    if tp.topic == self.topics.dead:
                        self._dead_letter(rec)
                    else:
                        out += self._process(rec)
                self.last_activity = self.clock.now()
            if out or (self.held and self.clock.now() - self.last_activity > 1.0):
                out += self.held
                self.held = []
                await self._send(out)
            self.caught_up = await self._at_end()

    async def _at_end(self) -> bool:
        for tp in self.tps:
            high = self.consumer.highwater(tp)
            if high is None or await self.consumer.position(tp) < high:
                return False
        return not self.held

    def _dead_letter(self, rec: ConsumerRecord[bytes, bytes]) -> None:
        headers = dict(rec.headers)
        message_id = headers.get(H_ID, b"")
        source = None
        with contextlib.suppress(KeyError, ValueError):
            _, partition, offset = source_of(headers[H_SOURCE])
            source = (partition, offset)
        self.dead.append(
            DeadLetter(message_id, int(headers.get(H_ATTEMPT, b"0")), source, self.clock.now())
        )
        self.dead_ids.add(message_id)

    def _process(self, rec: ConsumerRecord[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        """What the Spark job does with one clean record; the commands it sends."""
        counts = Counter(k for k, _ in rec.headers)
        where = f"clean {rec.partition}/{rec.offset}"
        if any(counts[h] != 1 for h in (H_ID, H_TOKEN, H_SOURCE)):
            self.problems.append(
                (
                    "contract",
                    f"{where} carries "
                    f"{[(h, counts[h]) for h in (H_ID, H_TOKEN, H_SOURCE)]} "
                    f"dedup headers; each must appear once",
                )
            )
        headers = {k: v for k, v in reversed(rec.headers)}  # the first of each name
        try:
            message_id, token = headers[H_ID], headers[H_TOKEN].decode()
            _, partition, offset = source_of(headers[H_SOURCE])
            attempt = int(headers.get(H_ATTEMPT, b"1"))
        except (KeyError, ValueError) as exc:
            self.problems.append(("contract", f"{where}: unusable dedup headers ({exc})"))
            return []
        deliver_at, window = None, None
        with contextlib.suppress(KeyError, ValueError):
            deliver_at = int(headers[H_DELIVER_AT])
        with contextlib.suppress(KeyError, ValueError):
            start, end = headers[H_WINDOW].split(b"/")
            window = (int(start), int(end))
        outcome: Outcome
        commands: list[tuple[bytes, bytes]] = []
        if token in self.tokens:
            outcome = "repeat"
        else:
            self.tokens.add(token)
            kind = fate(self.config.seed, message_id, self.config)
            if kind == "always" or (kind == "once" and self.failures[message_id] == 0):
                outcome = "failed"
                self.failures[message_id] += 1
                value = command_value(headers, f"chaos failure {self.failures[message_id]}")
                commands += self._with_chaos(message_id, value)
                if self.config.mode == "release":
                    self.on_release(message_id)
            else:
                outcome = "ok"
                self.succeeded.add(message_id)
                earlier = self.last_command.get(message_id)
                if earlier is not None and self.rng.random() < self.config.command_stale_share:
                    self.commands["stale"] += 1  # the failed delivery's command, again: stale
                    commands.append((message_id, earlier))
        self.deliveries.append(
            Delivery(
                message_id,
                token,
                attempt,
                (partition, offset),
                (rec.partition, rec.offset),
                outcome,
                self.clock.now(),
                digest_of(rec.value),
                int(time.time() * 1000),
                deliver_at,
                window,
            )
        )
        return commands

    def _with_chaos(self, message_id: bytes, value: bytes) -> list[tuple[bytes, bytes]]:
        rng, config = self.rng, self.config
        out = [(message_id, value)]
        self.commands["sent"] += 1
        if rng.random() < config.command_duplicate_share:
            self.commands["duplicated"] += 1
            out.append((message_id, value))
        earlier = self.last_command.get(message_id)
        if earlier is not None and rng.random() < config.command_stale_share:
            self.commands["stale"] += 1  # an earlier attempt's command, after the new one
            out.append((message_id, earlier))
        self.last_command[message_id] = value
        if rng.random() < config.command_reorder_share:
            self.commands["reordered"] += 1  # held back: sent after later commands
            self.held += out
            return []
        return out

    async def garbage(self, size: int) -> None:
        """`size` commands the gateway must count and skip, or find stale."""
        rng = self.rng
        raw_topic = self.topics.raw
        known = sorted(self.succeeded)
        out: list[tuple[bytes, bytes]] = []
        for _ in range(size):
            token = str(rng.randrange(10**17, 2**63))
            source = {
                "topic": raw_topic,
                "partition": rng.randrange(self.config.raw_partitions),
                "offset": rng.randrange(50),
            }
            choices: list[bytes] = [
                b"not json {",
                b"[1, 2, 3]",
                b"[" * 50_000 + b"]" * 50_000,
                json.dumps({"id": "x", "token": token}).encode(),
                json.dumps({"id": "x", "token": "abc", "source": source}).encode(),
                json.dumps(
                    {"id": "x", "token": token, "source": {**source, "offset": -5}}
                ).encode(),
                json.dumps(
                    {"id": f"never-{rng.randrange(10**6)}", "token": token, "source": source}
                ).encode(),
                json.dumps(
                    {"id": "gone", "token": token, "source": {**source, "offset": 10**9}}
                ).encode(),
                b'{"id": "\xff", "token": "1"}',
            ]
            if known:  # a live id with a forged token: the mark never holds it
                live = rng.choice(known)
                choices.append(
                    json.dumps(
                        {
                            "id": readable(live),
                            "id_b64": base64.b64encode(live).decode(),
                            "token": token,
                            "source": source,
                        }
                    ).encode()
                )
            out.append((b"garbage", rng.choice(choices)))
        self.commands["garbage"] += len(out)
        await self._send(out, garbage=True)

    async def hostile_commands(self, size: int) -> None:
        """`size` garbage commands with a header name that is not UTF-8 (each in a batch
        of its own) or header values that are garbage: each skipped as invalid."""
        for n in range(size):
            named = n % 2 == 0
            name = RawHeaderName(b"\xff\xfe-name") if named else "dedup-id"
            headers = [(name, b"\xff\x00"), ("dedup-source", b"\xc3(/x/-1")]
            batch = self.producer.create_batch()
            if named:  # the C builder refuses such names (see traffic._ship)
                batch._builder = _DefaultRecordBatchBuilderPy(2, 0, 0, -1, -1, 0, MAX_REQUEST_BYTES)
            body = b'{"id": "x", "token": "' + str(self.rng.randrange(10**17)).encode() + b'"}'
            batch.append(key=b"hostile", value=body, timestamp=None, headers=headers)
            partition = self.rng.randrange(2)
            meta = await (
                await self.producer.send_batch(batch, self.topics.failures, partition=partition)
            )
            end = max(self.command_ends.get(meta.partition, 0), meta.offset + 1)
            self.command_ends[meta.partition] = end
            self.hostile.append(f"{self.topics.failures}/{meta.partition}/{meta.offset}")
        self.commands["hostile"] += size
        self.last_activity = self.clock.now()

    async def _send(self, commands: list[tuple[bytes, bytes]], garbage: bool = False) -> None:
        futures = [
            await self.producer.send(self.topics.failures, value, key=key)
            for key, value in commands
        ]
        for (key, _), future in zip(commands, futures, strict=True):
            meta = await future
            end = max(self.command_ends.get(meta.partition, 0), meta.offset + 1)
            self.command_ends[meta.partition] = end
            if not garbage:
                self.sent[f"{self.topics.failures}/{meta.partition}/{meta.offset}"] = key
        if commands:
            self.last_activity = self.clock.now()
