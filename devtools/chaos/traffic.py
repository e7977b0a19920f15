"""The raw traffic of a chaos run, and the ledger of what the broker acknowledged.

`RecordMaker` is the seeded traffic (pure): new ids, copies of earlier ids on
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
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

from devtools.chaos.schedule import HEADER_HOSTILE, JSON_HOSTILE, RunConfig
from devtools.chaos.timeline import Clock

BIG_VALUE = 1_048_576  # a raw value of the broker's default request limit
RESEND_EVERY_S = 1.0  # release mode: the producer sends a released id again
MAX_RESENDS = 40
MAX_REQUEST_BYTES = 8 * 1024 * 1024  # of the test's own clients: hostile records are big

Expect = Literal["usable", "quarantine", "either"]


class _RawHeaderName(str):
    """A header name whose wire bytes are not UTF-8 (aiokafka's pure-Python batch
    builder writes `name.encode("utf-8")`, which this returns as given)."""

    raw: bytes

    def __new__(cls, raw: bytes) -> _RawHeaderName:
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

    @property
    def where(self) -> str:
        return f"raw {self.partition}/{self.offset}"


def digest_of(value: bytes | None) -> bytes | None:
    """What the checker compares a clean record's value by."""
    return None if value is None else blake2b(value, digest_size=8).digest()


class RecordMaker:
    """The seeded raw traffic: new ids, copies of earlier ids on any partition, and
    a share of hostile records."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.rng = random.Random(f"{config.seed}:traffic")
        self.n = 0
        self.issued: list[bytes] = []
        kinds = JSON_HOSTILE if config.json_ids else HEADER_HOSTILE
        self.hostile_kinds = [k for k in kinds if k not in config.excluded]

    def next(self) -> Planned:
        rng = self.rng
        roll = rng.random()
        if self.hostile_kinds and roll < self.config.hostile_share:
            return self.hostile(rng.choice(self.hostile_kinds))
        if self.issued and roll < self.config.hostile_share + self.config.duplicate_share:
            return self._good("copy", rng.choice(self.issued[-5000:]))
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

    def _good(self, kind: str, message_id: bytes, remember: bool = True) -> Planned:
        if remember and kind == "new":
            self.issued.append(message_id)
        if self.config.json_ids:
            value = self._order(message_id.decode())
            return Planned(kind, self._partition(), self._key(), value, [], "usable", message_id)
        value = self._order(message_id.decode("utf-8", "backslashreplace"))
        headers = [("message-id", message_id)]
        return Planned(kind, self._partition(), self._key(), value, headers, "usable", message_id)

    def hostile(self, kind: str) -> Planned:
        """One hostile record of `kind` (see HEADER_HOSTILE / JSON_HOSTILE)."""
        if self.config.json_ids:
            return self._hostile_json(kind)
        return self._hostile_header(kind)

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
            headers = [(_RawHeaderName(b"\xff\xfe-name"), b"v"), ("message-id", message_id)]
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
            headers: list[tuple[str, bytes]] = [(_RawHeaderName(b"\xff\xfe-name"), b"v")]
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
            request_timeout_ms=60_000,
        )
        self.resends: dict[bytes, tuple[float, int]] = {}  # id -> (next at, resends so far)

    async def start(self) -> None:
        await self.producer.start()

    async def stop(self) -> None:
        await self.producer.stop()

    def ends(self) -> dict[int, int]:
        """Next offset per raw partition, by the ledger."""
        ends = dict.fromkeys(range(self.config.raw_partitions), 0)
        for entry in self.entries:
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
        plain: dict[int, list[Planned]] = defaultdict(list)
        shipped: list[tuple[asyncio.Future[Any], list[Planned]]] = []
        for rec in planned:
            if rec.raw_header_name or (rec.value is not None and len(rec.value) > 100_000):
                shipped.append((await self._ship([rec]), [rec]))  # a batch of its own
            else:
                plain[rec.partition].append(rec)
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
                    )
                )

    async def _ship(self, recs: list[Planned]) -> asyncio.Future[Any]:
        batch = self.producer.create_batch()
        if any(r.raw_header_name for r in recs):
            # Private aiokafka API, on purpose: the C builder refuses non-UTF-8 names.
            batch._builder = _DefaultRecordBatchBuilderPy(2, 0, 0, -1, -1, 0, MAX_REQUEST_BYTES)
        for rec in recs:
            appended = batch.append(
                key=rec.key, value=rec.value, timestamp=None, headers=rec.headers
            )
            if appended is None:
                raise RuntimeError("a planned batch did not fit its builder")
        future: asyncio.Future[Any] = await self.producer.send_batch(
            batch, self.topic, partition=recs[0].partition
        )
        return future
