"""`check-config --connect`, the records: what share of each raw topic's newest records
`[dedup] id` extracts an id from (the rest would be quarantined), and why not.

An id that matches nothing (`header:message-id` on records that carry it in the JSON
body) quarantines every record while the gateway looks healthy; a few records read
before it runs say so. Up to `SAMPLE_RECORDS` of the newest records of each raw topic
are read, spread over its partitions, without a group (nothing is committed, no
running gateway is rebalanced), and judged by the gateway's own extractor.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from gateway.config import Settings
from gateway.errors import BadRecord
from gateway.kafka.clients import build_consumer
from gateway.ops.findings import Finding, error, ok, warn
from gateway.rules.ids import build_extractor, unframed

SAMPLE_RECORDS = 20  # per raw topic
FETCH_MS = 200
SHOWN = 6  # header names and JSON fields named in a hint


async def id_findings(settings: Settings, timeout_s: float) -> list[Finding]:
    """One finding per raw topic with records: the share of its sampled records that
    have an id (a missing topic is the topic check's finding; an empty one has none)."""
    consumer = build_consumer(settings.kafka, None)
    try:
        await consumer.start()
        found = [
            await _topic_finding(settings, consumer, topic, timeout_s)
            for topic in settings.kafka.raw_topics
        ]
        return [finding for finding in found if finding is not None]
    except (KafkaError, OSError) as exc:
        return [warn("dedup.id", f"could not sample the raw topics: {exc!r}")]
    finally:
        await consumer.stop()


async def _topic_finding(
    settings: Settings, consumer: AIOKafkaConsumer, topic: str, timeout_s: float
) -> Finding | None:
    where, spec = f"topic {topic}", settings.dedup.id
    try:
        records = await sample(consumer, topic, SAMPLE_RECORDS, timeout_s)
    except UnicodeDecodeError as exc:  # a header name that is not UTF-8 (quarantined: bad_header)
        return warn(where, f"[dedup] id {spec!r}: the sampled records cannot be read ({exc})")
    if not records:  # missing (the topic check says so), or nothing to judge yet
        return None
    dedup = settings.dedup
    extract = build_extractor(spec, dedup.max_id_bytes, settings.kafka.max_request_bytes)
    reasons: Counter[str] = Counter()
    details: dict[str, str] = {}
    for rec in records:
        try:
            extract(rec)
        except BadRecord as exc:
            reasons[exc.reason] += 1
            details.setdefault(exc.reason, exc.detail)
    bad, total = sum(reasons.values()), len(records)
    said = (
        f"[dedup] id = {spec!r} extracts an id from {total - bad} of {total} sampled "
        f"records ({(total - bad) / total:.0%})"
    )
    if not bad:
        return ok(where, said)
    why = ", ".join(f"{reason} {n} ({details[reason]})" for reason, n in reasons.most_common())
    said += f"; the rest would be quarantined: {why}{_hint(records)}"
    if bad / total > dedup.quarantine_alarm_share:
        return error(
            where,
            f"{said}; check [dedup] id: the gateway would quarantine them and report "
            "/readyz degraded (docs/runbooks.md, DedupGatewayQuarantineShare)",
        )
    return warn(where, said)


def _hint(records: Iterable[ConsumerRecord[bytes, bytes]]) -> str:
    """What the records carry that an id could be: their header names, the top-level
    fields of JSON object values."""
    headers: dict[str, None] = {}
    fields: dict[str, None] = {}
    keyed = False
    for rec in records:
        keyed |= rec.key is not None
        headers.update(dict.fromkeys(name for name, _ in rec.headers))
        try:
            value = json.loads(unframed(rec.value)) if rec.value is not None else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(value, dict):
            fields.update(dict.fromkeys(map(str, value)))
    carry = [
        f"headers {', '.join(list(headers)[:SHOWN])}" if headers else "no headers",
        f"JSON values with fields {', '.join(list(fields)[:SHOWN])}" if fields else "",
        "keys" if keyed else "no keys",
    ]
    return f"; the records carry {'; '.join(c for c in carry if c)}"


async def sample(
    consumer: AIOKafkaConsumer, topic: str, wanted: int, timeout_s: float
) -> list[ConsumerRecord[bytes, bytes]] | None:
    """Up to `wanted` of the newest records of `topic` (about as many per partition),
    in partition and offset order; None when the topic does not exist. The consumer
    is assigned the topic's partitions (no group)."""
    cluster = await consumer._client.fetch_all_metadata()  # never auto-creates a topic
    partitions = cluster.partitions_for_topic(topic)
    if not partitions:
        return None
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    begin = await consumer.beginning_offsets(tps)
    end = await consumer.end_offsets(tps)
    quota = math.ceil(wanted / len(tps))
    pending: dict[TopicPartition, int] = {}
    for tp in tps:
        if end[tp] > begin[tp]:
            consumer.seek(tp, max(begin[tp], end[tp] - quota))
            pending[tp] = end[tp]
    found: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {tp: [] for tp in pending}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        fetched = await consumer.getmany(*pending, timeout_ms=FETCH_MS)
        for tp, records in fetched.items():
            found[tp] += [r for r in records if r.offset < end[tp]]
        for tp in list(pending):
            if await consumer.position(tp) >= pending[tp]:
                del pending[tp]
                consumer.pause(tp)
        await asyncio.sleep(0)
    return [r for tp in tps for r in found.get(tp, [])]
