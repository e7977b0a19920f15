"""The raw traffic of a chaos run, and the ledger of what the broker acknowledged.

`RecordMaker` is the seeded traffic (pure but for the clock that delay runs
stamp records and due times with: `now_ms`): new ids, copies of earlier ids on
any partition (producer resends), and a share of hostile records, each with
what a correct gateway does with it (`expect`): forward its id (`usable`),
quarantine it with a reason code (`quarantine`), or either of the two where the
README leaves the choice open (`either`: e.g. a record too large to forward).
`Traffic` produces them and notes each record's offset from the broker's
acknowledgement: the checker's ledger. The ledger is read from acknowledgements,
not from the raw topic, because a record with a non-UTF-8 header name makes
aiokafka's reader fail on the whole partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from hashlib import blake2b
from typing import Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

from devtools.chaos.schedule import (
    DELAY_HOSTILE,
    ENTITIES,
    ENTITY_HEADER,
    GRACE_MS,
    HEADER_HOSTILE,
    JSON_HOSTILE,
    MAX_DELAY_S,
    WINDOW_MS,
    RunConfig,
)
from devtools.chaos.timeline import Clock

BIG_VALUE = 1_048_576  # a raw value of the broker's default request limit
RESEND_EVERY_S = 1.0  # release mode: the producer sends a released id again
# For 2 minutes: a command can wait that long behind the schedule's own faults (seed 9508:
# two gateway stops of 23 s and 22 s back to back on the command partition's owner,
# with a 20 s session, applied the releases 47 s after they were sent).
MAX_RESENDS = 120
MAX_REQUEST_BYTES = 8 * 1024 * 1024  # of the test's own clients: hostile records are big

Expect = Literal["usable", "quarantine", "either"]


class RawHeaderName(str):
    """A header name whose wire bytes are not UTF-8 (aiokafka's pure-Python batch
    builder writes `name.encode("utf-8")`, which this returns as given)."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawHeaderName:
        name = super().__new__(cls, raw.decode("latin-1"))
        name.raw = raw
        return name

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


@dataclass(frozen=True)
class Planned:
    """A raw record to produce, and what a correct gateway does with it."""

    kind: str
    partition: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    expect: Expect
    message_id: bytes | None  # the id a gateway must extract, when known
    reason: str | None = None  # the quarantine reason code, when expect = quarantine
    raw_header_name: bool = False  # needs the pure-Python batch builder
    # Delay runs: the producer's timestamp (else the producer's clock), the due time
    # asked for, the coalescing key, when it may reach the clean topic at the latest
    # due or window close (epoch ms), and the topic when it is not the raw topic.
    timestamp_ms: int | None = None
    due_ms: int | None = None
    entity: bytes | None = None
    release_ms: int = 0
    topic: str | None = None


@dataclass(frozen=True)
class RawEntry:
    """A raw record as produced and acknowledged: the ledger the checker trusts."""

    partition: int
    offset: int
    kind: str
    expect: Expect
    message_id: bytes | None
    reason: str | None
    at: float
    value_digest: bytes | None
    topic: str | None = None  # None: the raw topic; else a delay tier's (hostile records)
    timestamp_ms: int | None = None  # as produced, when the harness set it (delay runs)
    due_ms: int | None = None  # asked for with deliver-at / deliver-after
    entity: bytes | None = None  # the coalescing key

    @property
    def where(self) -> str:
        if self.topic is not None:
            return f"tier {self.topic}/{self.partition}/{self.offset}"
        return f"raw {self.partition}/{self.offset}"


def digest_of(value: bytes | None) -> bytes | None:
    """What the checker compares a clean record's value by."""
    return None if value is None else blake2b(value, digest_size=8).digest()


class RecordMaker:
    """The seeded raw traffic: new ids, copies of earlier ids on any partition, and
    a share of hostile records."""

    def __init__(self, config: RunConfig, now_ms: Callable[[], int] | None = None) -> None:
        self.config = config
        self.rng = random.Random(f"{config.seed}:traffic")
        self.n = 0
        self.issued: list[bytes] = []
        kinds: tuple[str, ...] = JSON_HOSTILE if config.json_ids else HEADER_HOSTILE
        if config.delay:
            kinds += DELAY_HOSTILE
        self.hostile_kinds = [k for k in kinds if k not in config.excluded]
        self.now_ms = now_ms or (lambda: int(time.time() * 1000))

    def next(self) -> Planned:
        rng = self.rng
        roll = rng.random()
        if self.hostile_kinds and roll < self.config.hostile_share:
            return self.hostile(rng.choice(self.hostile_kinds))
        if self.issued and roll < self.config.hostile_share + self.config.duplicate_share:
            # Delay runs lower the ttl to 75 s: copies stay well inside it.
            recent = self.issued[-1500:] if self.config.delay else self.issued[-5000:]
            return self._good("copy", rng.choice(recent))
        return self._good("new", self._new_id())

    def resend(self, message_id: bytes) -> Planned:
        """Another copy of `message_id` (release mode: the producer sends it again)."""
        return self._good("resend", message_id, remember=False)

    def _new_id(self) -> bytes:
        self.n += 1
        if self.rng.random() < 0.03:
            return f"s{self.config.seed}-ü-{self.n}-✓".encode()
        return f"s{self.config.seed}-{self.n}".encode()

    def _partition(self) -> int:
        return self.rng.randrange(self.config.raw_partitions)

    def _key(self) -> bytes:
        return f"k-{self.rng.randrange(200)}".encode()

    def _order(self, message_id: str | int, **extra: Any) -> bytes:
        order = {
            "id": message_id,
            "customer": f"c-{self.rng.randrange(500)}",
            "amount": round(self.rng.uniform(1, 500), 2),
            **extra,
        }
        return json.dumps({"order": order}).encode()

    def old_copy(self, message_id: bytes) -> Planned:
        """A copy of `message_id` sent after the ttl was lowered, its mark claimed before."""
        return self._good("old-copy", message_id, remember=False)

    def _good(self, kind: str, message_id: bytes, remember: bool = True) -> Planned:
        if remember and kind == "new":
            self.issued.append(message_id)
        if self.config.json_ids:
            value = self._order(message_id.decode())
            rec = Planned(kind, self._partition(), self._key(), value, [], "usable", message_id)
        else:
            value = self._order(message_id.decode("utf-8", "backslashreplace"))
            headers = [("message-id", message_id)]
            rec = Planned(
                kind, self._partition(), self._key(), value, headers, "usable", message_id
            )
        if not self.config.delay:
            return rec
        # New records share a few keys (their versions merge); the copies of an id have a
        # key of their own, so whichever copy claims the id, the others name no version.
        if kind == "new":
            entity = f"e-{self.rng.randrange(ENTITIES)}".encode()
        else:
            entity = f"{kind[0]}-".encode() + message_id
        return self._in_delay_run(rec, entity, new=kind == "new")

    def _in_delay_run(self, rec: Planned, entity: bytes | None, new: bool) -> Planned:
        """Delay runs: the coalescing key, and for a share of new records a producer
        clock hours off and a delay asked for; what the gateway must do with it."""
        rng, config = self.rng, self.config
        now = self.now_ms()
        headers = list(rec.headers) + ([(ENTITY_HEADER, entity)] if entity is not None else [])
        skew = 0
        if new and rng.random() < config.skew_share:
            skew = rng.choice((-1, 1)) * rng.randrange(3_600_000, 5 * 3_600_000)
        ts, due = now + skew, None
        expect, reason, message_id, kind = rec.expect, rec.reason, rec.message_id, rec.kind
        if new and rng.random() < config.delayed_share:
            wait = rng.randrange(500, 25_000)
            if rng.random() < 0.5:
                due = now + wait
                headers.append(("deliver-at", str(due).encode()))
            else:
                due = ts + wait
                headers.append(("deliver-after", f"{wait}ms".encode()))
            kind = "delayed"
            if due - ts > MAX_DELAY_S * 1000 or due - now > MAX_DELAY_S * 1000:
                expect, reason, message_id = "quarantine", "delay_too_long", None
        if skew:
            kind = f"{kind}-skewed"
        # A window whose close could be further than max_delay away is the gateway's now.
        if skew > MAX_DELAY_S * 1000 - WINDOW_MS - GRACE_MS:
            close = now + WINDOW_MS + GRACE_MS
        else:
            close = ts - ts % WINDOW_MS + WINDOW_MS + GRACE_MS
        return replace(
            rec, kind=kind, headers=headers, expect=expect, reason=reason,
            message_id=message_id, timestamp_ms=ts, due_ms=due, entity=entity,
            release_ms=0 if expect == "quarantine" else max(close, due or 0),
        )  # fmt: skip

    def hostile(self, kind: str) -> Planned:
        """One hostile record of `kind` (see HEADER_HOSTILE / JSON_HOSTILE / DELAY_HOSTILE)."""
        if kind in DELAY_HOSTILE:
            return self._hostile_delay(kind)
        rec = self._hostile_json(kind) if self.config.json_ids else self._hostile_header(kind)
        if not self.config.delay:
            return rec
        self.n += 1
        return self._in_delay_run(rec, f"h-{self.n}".encode(), new=False)

    def _hostile_delay(self, kind: str) -> Planned:
        """A record with a usable id whose delay or coalescing headers are bad."""
        message_id = self._new_id()
        rec = self._good(kind, message_id, remember=False)
        headers, reason = list(rec.headers), None
        if kind == "bad-deliver-at":
            headers, reason = [*headers, ("deliver-at", b"\xff\xfe-soon")], "bad_deliver_at"
        elif kind == "bad-deliver-after":
            headers, reason = [*headers, ("deliver-after", b"soon\xc3")], "bad_deliver_after"
        elif kind == "conflicting-delay":
            due = str(self.now_ms() + 1000).encode()
            headers, reason = (
                [*headers, ("deliver-at", due), ("deliver-after", b"1s")],
                ("conflicting_delay"),
            )
        elif kind == "delay-too-long":
            headers, reason = [*headers, ("deliver-after", b"2h")], "delay_too_long"
        elif kind == "no-coalesce-key":
            # Quarantined while coalescing is on, forwarded once the change switched it off.
            headers = [(k, v) for k, v in headers if k != ENTITY_HEADER]
            return replace(rec, headers=headers, expect="either", entity=None)
        else:
            raise ValueError(f"unknown hostile record kind {kind!r}")
        return replace(rec, headers=headers, expect="quarantine", reason=reason, message_id=None)

    def tier_hostile(self, topic: str, partitions: int) -> Planned:
        """A record on a delay tier that no gateway wrote: quarantined (`bad_tier_record`;
        well-formed but due years ahead, `delay_too_long`)."""
        rng, now = self.rng, str(self.now_ms()).encode()
        kind = rng.choice(("name", "values", "no-tier-at", "value", "digits", "far"))
        reason = "delay_too_long" if kind == "far" else "bad_tier_record"
        value = self._order("tier-hostile")
        headers: list[tuple[str, bytes]] = [("dedup-id", b"forged"), ("dedup-token", b"1")]
        if kind == "name":  # otherwise a tier record as a gateway writes it
            headers += [(RawHeaderName(b"\xff\xfe-name"), b"v"),
                        ("dedup-deliver-at", now), ("dedup-tier-at", now)]  # fmt: skip
        elif kind == "values":
            headers += [("dedup-deliver-at", b"\xff\xfe"), ("dedup-tier-at", b"soon")]
        elif kind == "no-tier-at":
            headers += [("dedup-deliver-at", now)]
        elif kind == "value":
            value, headers = b"\xff\xfe\x00 not a record", []
        elif kind == "far":
            years = str(self.now_ms() + 10 * 365 * 86_400_000).encode()
            headers += [("dedup-deliver-at", years), ("dedup-tier-at", now)]
        else:
            headers += [("dedup-deliver-at", b"9" * 20), ("dedup-tier-at", now)]
        return Planned(
            f"tier-{kind}", rng.randrange(partitions), self._key(), value, headers,
            "quarantine", None, reason, raw_header_name=kind == "name", topic=topic,
        )  # fmt: skip

    def _quarantined(
        self, kind: str, reason: str, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> Planned:
        return Planned(
            kind, self._partition(), self._key(), value, headers, "quarantine", None, reason
        )

    def _hostile_header(self, kind: str) -> Planned:
        value = self._order("hostile")
        if kind == "missing-id":
            return self._quarantined(kind, "missing_header", value, [("other", b"x")])
        if kind == "missing-id-forged-source":
            forged = [("dedup-source", b"forged/9/9"), ("dedup-error", b"forged")]
            return self._quarantined(kind, "missing_header", value, forged)
        if kind == "empty-id":
            return self._quarantined(kind, "empty_id", value, [("message-id", b"")])
        if kind == "huge-id":
            huge = b"h" * (self.config.max_id_bytes + 1 + self.rng.randrange(4000))
            return self._quarantined(kind, "oversize_id", value, [("message-id", huge)])
        message_id = self._new_id()
        if kind == "non-utf8-id":
            message_id = b"\xff\xfe-" + message_id + b"-\xc3"
        self.issued.append(message_id)
        part, key = self._partition(), self._key()
        if kind == "non-utf8-id":
            return Planned(
                kind, part, key, value, [("message-id", message_id)], "usable", message_id
            )
        if kind == "duplicate-id-headers":
            headers = [("message-id", message_id), ("message-id", message_id + b"-second")]
            return Planned(kind, part, key, value, headers, "either", message_id)
        if kind == "forged-dedup-headers":
            return Planned(
                kind, part, key, value, [*_FORGED, ("message-id", message_id)], "usable", message_id
            )
        if kind == "non-utf8-header-name":
            headers = [(RawHeaderName(b"\xff\xfe-name"), b"v"), ("message-id", message_id)]
            return Planned(
                kind, part, key, value, headers, "either", message_id, raw_header_name=True
            )
        if kind == "oversize-record":
            return Planned(
                kind,
                part,
                key,
                b"x" * BIG_VALUE,
                [("message-id", message_id)],
                "either",
                message_id,
            )
        if kind == "tombstone":
            return Planned(
                kind, part, None, None, [("message-id", message_id)], "usable", message_id
            )
        raise ValueError(f"unknown hostile record kind {kind!r}")

    def _hostile_json(self, kind: str) -> Planned:
        if kind == "not-json":
            return self._quarantined(kind, "not_json", b"not json {", [])
        if kind == "nesting-bomb":
            depth = 100_000 + self.rng.randrange(100_000)
            bomb = b'{"order": {"id": ' + b"[" * depth + b"]" * depth + b"}}"
            return self._quarantined(kind, "not_json", bomb, [])
        if kind == "missing-field":
            return self._quarantined(kind, "missing_field", b'{"order": {"no_id": 1}}', [])
        if kind == "empty-id":
            return self._quarantined(kind, "empty_id", self._order(""), [])
        if kind == "huge-id":
            huge = "h" * (self.config.max_id_bytes + 1 + self.rng.randrange(4000))
            return self._quarantined(kind, "oversize_id", self._order(huge), [])
        if kind == "non-utf8-value":
            return self._quarantined(kind, "not_json", b'{"order": {"id": "\xff\xfe"}}', [])
        part, key = self._partition(), self._key()
        if kind == "lone-surrogate-id":
            # JSON text that decodes to a string no UTF-8 encoder accepts.
            self.n += 1
            value = b'{"order": {"id": "\\udcff-' + str(self.n).encode() + b'"}}'
            return Planned(kind, part, key, value, [], "either", None)
        if kind == "numeric-id":
            self.n += 1
            number = 10**12 + self.n
            self.issued.append(str(number).encode())
            return Planned(kind, part, key, self._order(number), [], "usable", str(number).encode())
        message_id = self._new_id()
        self.issued.append(message_id)
        if kind == "forged-dedup-headers":
            return Planned(
                kind,
                part,
                key,
                self._order(message_id.decode()),
                list(_FORGED),
                "usable",
                message_id,
            )
        if kind == "non-utf8-header-name":
            headers: list[tuple[str, bytes]] = [(RawHeaderName(b"\xff\xfe-name"), b"v")]
            return Planned(
                kind,
                part,
                key,
                self._order(message_id.decode()),
                headers,
                "either",
                message_id,
                raw_header_name=True,
            )
        if kind == "oversize-record":
            value = self._order(message_id.decode(), pad="x" * BIG_VALUE)
            return Planned(kind, part, key, value, [], "either", message_id)
        raise ValueError(f"unknown hostile record kind {kind!r}")


_FORGED = [
    ("dedup-id", b"forged"),
    ("dedup-token", b"123"),
    ("dedup-source", b"forged/0/0"),
    ("dedup-attempt", b"7"),
]


class Traffic:
    """Produces the seeded raw traffic and keeps the ledger of what was acknowledged."""

    def __init__(self, config: RunConfig, bootstrap: str, topic: str, clock: Clock) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.topic = topic
        self.clock = clock
        self.maker = RecordMaker(config)
        self.entries: list[RawEntry] = []
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            linger_ms=0,
            max_batch_size=256 * 1024,
            max_request_size=MAX_REQUEST_BYTES,
            acks="all",
            # A batch the broker wrote but could not acknowledge (killed: broker-restart)
            # is sent again; idempotence keeps the log to one copy, the one the ledger has.
            enable_idempotence=True,
            request_timeout_ms=60_000,
        )
        self.resends: dict[bytes, tuple[float, int]] = {}  # id -> (next at, resends so far)
        self.last_release_ms = 0  # delay runs: when the last record may reach the clean topic

    async def start(self) -> None:
        await self.producer.start()

    async def stop(self) -> None:
        await self.producer.stop()

    def ends(self) -> dict[int, int]:
        """Next offset per raw partition, by the ledger."""
        ends = dict.fromkeys(range(self.config.raw_partitions), 0)
        for entry in self.entries:
            if entry.topic is None:
                ends[entry.partition] = max(ends[entry.partition], entry.offset + 1)
        return ends

    async def run(self, stop: asyncio.Event) -> None:
        """Produce at `rate` records per second until `stop`."""
        tick = 0.05
        owed = 0.0
        while not stop.is_set():
            owed += self.config.rate * tick
            count, owed = int(owed), owed - int(owed)
            await self.send([self.maker.next() for _ in range(count)])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)  # the pace, not a synchronisation

    async def burst(self, size: int) -> None:
        if self.maker.hostile_kinds:
            rng = self.maker.rng
            await self.send(
                [self.maker.hostile(rng.choice(self.maker.hostile_kinds)) for _ in range(size)]
            )

    async def tier_burst(self, size: int, tiers: Sequence[str], partitions: int) -> None:
        """`size` records no gateway wrote, on the delay tier topics `tiers`."""
        rng = self.maker.rng
        await self.send([self.maker.tier_hostile(rng.choice(tiers), partitions)
                         for _ in range(size)])  # fmt: skip

    async def old_copies(self, ids: Sequence[bytes]) -> None:
        await self.send([self.maker.old_copy(i) for i in ids])

    def released(self, message_id: bytes) -> None:
        """Release mode: the consumer released `message_id`; send it again until processed."""
        self.resends.setdefault(message_id, (self.clock.now() + RESEND_EVERY_S / 2, 0))

    def resends_pending(self) -> bool:
        return any(n < MAX_RESENDS for _, n in self.resends.values())

    async def resend_due(self, done: Callable[[bytes], bool]) -> None:
        """Send one more copy of each released id that is not processed yet and is due."""
        now = self.clock.now()
        due = []
        for message_id, (at, n) in list(self.resends.items()):
            if done(message_id) or n >= MAX_RESENDS:
                self.resends[message_id] = (at, MAX_RESENDS)
            elif at <= now:
                self.resends[message_id] = (now + RESEND_EVERY_S, n + 1)
                due.append(self.maker.resend(message_id))
        await self.send(due)

    async def send(self, planned: Sequence[Planned]) -> None:
        """Produce `planned`, wait for the acknowledgements, note each record's offset."""
        if not planned:
            return
        at = self.clock.now()
        plain: dict[tuple[str | None, int], list[Planned]] = defaultdict(list)
        shipped: list[tuple[asyncio.Future[Any], list[Planned]]] = []
        for rec in planned:
            self.last_release_ms = max(self.last_release_ms, rec.release_ms)
            if rec.raw_header_name or (rec.value is not None and len(rec.value) > 100_000):
                shipped.append((await self._ship([rec]), [rec]))  # a batch of its own
            else:
                plain[(rec.topic, rec.partition)].append(rec)
        for recs in plain.values():
            batch: list[Planned] = []
            for rec in recs:
                batch.append(rec)
                if len(batch) == 200:
                    shipped.append((await self._ship(batch), batch))
                    batch = []
            if batch:
                shipped.append((await self._ship(batch), batch))
        for future, recs in shipped:
            meta = await future
            for i, rec in enumerate(recs):
                self.entries.append(
                    RawEntry(
                        rec.partition,
                        meta.offset + i,
                        rec.kind,
                        rec.expect,
                        rec.message_id,
                        rec.reason,
                        at,
                        digest_of(rec.value),
                        rec.topic,
                        rec.timestamp_ms,
                        rec.due_ms,
                        rec.entity,
                    )
                )

    async def _ship(self, recs: list[Planned]) -> asyncio.Future[Any]:
        batch = self.producer.create_batch()
        if any(r.raw_header_name for r in recs):
            # Private aiokafka API, on purpose: the C builder refuses non-UTF-8 names.
            builder = _DefaultRecordBatchBuilderPy(2, 0, 0, -1, -1, 0, MAX_REQUEST_BYTES)
            batch._builder = builder
            # aiokafka hands an idempotent batch its producer state only for the C builder.
            batch._set_producer_state = builder.set_producer_state
        for rec in recs:
            appended = batch.append(
                key=rec.key, value=rec.value, timestamp=rec.timestamp_ms, headers=rec.headers
            )
            if appended is None:
                raise RuntimeError("a planned batch did not fit its builder")
        future: asyncio.Future[Any] = await self.producer.send_batch(
            batch, recs[0].topic or self.topic, partition=recs[0].partition
        )
        return future
