"""`dedup-gateway topics`: the topics a config needs, and creating the missing ones.

The gateway creates no topic itself (start-up waits, unready, naming a missing one), so a
new deployment starts from this table: every topic the settings name, who
writes and who reads it, and the partitions, retention and cleanup policy to
create it with. `--create` creates the missing ones through the admin API
(CreateTopics), with the topic configs of `[topics]` (`config` for every topic,
`[topics.<role>] config` for one role's); topics that exist are left as they are,
whatever they hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from gateway.config import Settings, format_duration
from gateway.rules.tiers import tier_topic

logger = logging.getLogger(__name__)

# Long enough for a weekend outage of whatever reads a topic, and for the failure
# loop to re-fetch a raw record whose processing failed (gateway/kafka/read_back.py).
RETENTION = timedelta(days=7)
DEFAULT_PARTITIONS = 6
# Records are deleted by age, never compacted: the failure loop re-reads raw records
# by offset, and a compacted-away one is skipped as `raw_record_gone`.
CLEANUP = "delete"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    role: str  # raw, clean, failure, quarantine, dead-letter, delay
    partitions: int
    retention: timedelta
    writers: str
    readers: str
    cleanup: str = CLEANUP
    # `[topics] config` and `[topics.<role>] config`, over the two above.
    config: dict[str, str] = field(default_factory=dict)

    def configs(self) -> dict[str, str]:
        """Topic configs to create it with: retention and cleanup, then the configured."""
        retention_ms = self.retention // timedelta(milliseconds=1)
        return {"retention.ms": str(retention_ms), "cleanup.policy": self.cleanup, **self.config}


def needed_topics(settings: Settings, partitions: int = DEFAULT_PARTITIONS) -> list[TopicSpec]:
    """Every topic `settings` names, each once, in the order records flow.

    `partitions` is the count for the raw topics and everything sized like them:
    the clean topics (a keyless record keeps its raw partition number) and the
    delay tiers (their partitions are shared by the gateways); the failure,
    quarantine and dead-letter topics carry few records and get fewer.
    """
    kafka = settings.kafka
    gateways = f"dedup-gateway (group {kafka.group_id})"
    specs: list[TopicSpec] = []
    for lane in settings.lanes:
        for raw in lane.raw_topics:
            specs.append(TopicSpec(raw, "raw", partitions, RETENTION, "your producers", gateways))
    clean_topics = dict.fromkeys([lane.clean_topic or kafka.clean_topic for lane in settings.lanes])
    for clean in clean_topics:
        specs.append(
            TopicSpec(
                clean,
                "clean",
                partitions,
                RETENTION,
                "dedup-gateway",
                "the Spark job (spark_sink), your consumers",
            )
        )
    if settings.delay.enabled:
        largest = max(settings.delay.tiers)
        for tier in settings.delay.tiers:
            # A record waits in a tier up to its delay; an outage adds to that.
            retention = max(RETENTION, largest + timedelta(days=1))
            specs.append(
                TopicSpec(
                    tier_topic(kafka.clean_topic, tier),
                    "delay",
                    partitions,
                    retention,
                    "dedup-gateway",
                    f"dedup-gateway (group {kafka.group_id}.delay)",
                )
            )
    small = max(1, min(partitions, 3))
    specs += [
        TopicSpec(
            kafka.failure_topic,
            "failure",
            small,
            RETENTION,
            "the Spark job (spark_sink)",
            f"dedup-gateway (group {kafka.group_id}.failures)",
        ),
        TopicSpec(
            kafka.quarantine_topic,
            "quarantine",
            small,
            RETENTION,
            "dedup-gateway",
            "operators (bad input to fix at its producer)",
        ),
        TopicSpec(
            kafka.dead_letter_topic,
            "dead-letter",
            small,
            RETENTION,
            "dedup-gateway",
            f"dedup-gateway redrive (group {kafka.group_id}.redrive)",
        ),
    ]
    seen: set[str] = set()
    unique = []
    for spec in specs:  # a name may be given twice (e.g. quarantine = dead letter)
        if spec.name not in seen:
            seen.add(spec.name)
            unique.append(replace(spec, config=settings.topics.configs_for(spec.role)))
    return unique


def render(specs: list[TopicSpec], existing: dict[str, int] | None) -> str:
    """The table; with `existing` (name -> partitions), a column saying what the broker has."""
    header = ["topic", "role", "partitions", "retention", "cleanup", "written by", "read by"]
    configured = any(spec.config for spec in specs)
    if configured:
        header.append("configs")
    if existing is not None:
        header.append("on the broker")
    rows = []
    for spec in specs:
        row = [
            spec.name,
            spec.role,
            str(spec.partitions),
            str(format_duration(spec.retention)),
            spec.cleanup,
            spec.writers,
            spec.readers,
        ]
        if configured:
            row.append(",".join(f"{k}={v}" for k, v in spec.config.items()) or "-")
        if existing is not None:
            have = existing.get(spec.name)
            row.append("MISSING" if have is None else f"exists, {have} partitions")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )


def as_json(specs: list[TopicSpec], existing: dict[str, int] | None) -> list[dict[str, object]]:
    out = []
    for spec in specs:
        row: dict[str, object] = asdict(spec)
        row["retention"] = format_duration(spec.retention)
        if existing is not None:
            row["exists"] = spec.name in existing
            row["broker_partitions"] = existing.get(spec.name)
        out.append(row)
    return out


async def existing_topics(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int]:
    """Partition counts of those of `names` the broker has. Listing first: a metadata
    request that names a topic may create it on a broker with auto-creation on."""
    listed = set(await admin.list_topics())
    present = [name for name in names if name in listed]
    if not present:
        return {}
    described = await admin.describe_topics(present)
    return {d["topic"]: len(d["partitions"]) for d in described if d["error_code"] == 0}


def durable(configs: dict[str, str], replication: int) -> dict[str, str]:
    """`configs`, and with 3 replicas or more `min.insync.replicas` 2 unless `[topics]`
    sets it: an acknowledged write is then on two brokers (the broker's default, 1,
    loses it with the one broker that had it)."""
    if replication >= 3:
        return {"min.insync.replicas": "2", **configs}
    return configs


@dataclass
class Created:
    name: str
    error: str | None  # None: created (or, dry run, would be)


async def create_missing(
    admin: AIOKafkaAdminClient,
    specs: list[TopicSpec],
    existing: dict[str, int],
    replication: int,
    dry_run: bool,
) -> list[Created]:
    """Create the topics of `specs` not in `existing`, one request for all."""
    missing = [spec for spec in specs if spec.name not in existing]
    if dry_run or not missing:
        return [Created(spec.name, None) for spec in missing]
    new = [
        NewTopic(s.name, s.partitions, replication, topic_configs=durable(s.configs(), replication))
        for s in missing
    ]
    try:
        response = await admin.create_topics(new)
    except KafkaError as exc:
        return [Created(spec.name, repr(exc)) for spec in missing]
    results = []
    for topic, code, *rest in response.topic_errors:
        message = rest[0] if rest else None
        # 36: TOPIC_ALREADY_EXISTS (created meanwhile, e.g. by another run): fine.
        error = None if code in (0, 36) else f"error {code}: {message or ''}".strip()
        results.append(Created(topic, error))
    await _until_listed(admin, [r.name for r in results if r.error is None])
    return results


VISIBLE_WITHIN_S = 10.0


async def _until_listed(admin: AIOKafkaAdminClient, names: list[str]) -> None:
    """Return once the broker lists `names` (bounded): CreateTopics answers when the
    controller has them, and a `check-config --connect` or `run` right after would
    otherwise find them missing for a moment."""
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while names and time.monotonic() < deadline:
        listed = set(await admin.list_topics())
        if all(name in listed for name in names):
            return
        await asyncio.sleep(0.05)
