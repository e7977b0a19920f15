"""`check-config --connect`, the broker: it answers; `[kafka] exactly_once` fits it;
every topic of `dedup-gateway topics` exists, clean topics have at least as many
partitions as their raw topics, delay tiers keep records longer than their delay, no
raw topic is compacted; no tier topic is left over from an earlier configuration;
the consumer groups can be described (so the user may use them); the share of each
raw topic's newest records `[dedup] id` extracts an id from (gateway/ops/check_ids.py).
It never joins a group: that would rebalance running gateways."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from gateway.config import Settings
from gateway.delay.leftovers import read_clean_topics, tier_of, unnamed_tiers
from gateway.errors import BrokerUnreachable
from gateway.kafka.admin import admin_client, reaching_broker, transactions_unsupported
from gateway.ops.check_ids import id_findings
from gateway.ops.findings import Finding, error, ok, warn
from gateway.ops.topics import TopicSpec, existing_topics, needed_topics
from gateway.rules.missing_topics import create_hint, did_you_mean


async def kafka_findings(settings: Settings, timeout_s: float) -> list[Finding]:
    kafka = settings.kafka
    where = f"kafka {kafka.bootstrap_servers}"
    admin = admin_client(kafka)
    try:
        async with reaching_broker(kafka):
            await asyncio.wait_for(admin.start(), timeout_s)
    except BrokerUnreachable as exc:
        await admin.close()
        return [
            error(where, f"cannot connect to the broker ([kafka] bootstrap_servers): {exc.reason}")
        ]
    except (TimeoutError, KafkaError, OSError) as exc:
        await admin.close()
        return [error(where, f"cannot reach the broker: {exc!r}")]
    try:
        findings = [
            ok(where, "reached"),
            *await asyncio.wait_for(_broker_findings(admin, settings), timeout_s * 3),
        ]
    except (TimeoutError, KafkaError) as exc:
        return [error(where, f"the broker stopped answering: {exc!r}")]
    finally:
        await admin.close()
    try:  # what share of the records the configured id matches
        findings += await asyncio.wait_for(id_findings(settings, timeout_s), timeout_s * 3)
    except TimeoutError:
        findings.append(warn("dedup.id", "sampling the raw topics' records timed out"))
    return findings


async def _broker_findings(admin: AIOKafkaAdminClient, settings: Settings) -> list[Finding]:
    findings = [await _exactly_once_finding(admin, settings)]
    findings += await topic_findings(admin, settings)
    findings += await _leftover_findings(admin, settings)
    findings += await _group_findings(admin, settings)
    return findings


async def _exactly_once_finding(admin: AIOKafkaAdminClient, settings: Settings) -> Finding:
    """Whether `[kafka] exactly_once` will be on with this broker."""
    mode, where = settings.kafka.exactly_once, "kafka.exactly_once"
    if mode == "off":
        return ok(where, "off: at-least-once output (a crash may forward a batch again)")
    why = await transactions_unsupported(admin._client)
    if why is None:
        return ok(where, f"{mode}: the broker supports transactions; exactly-once output")
    if mode == "on":
        return error(where, f'"on", but {why}: the gateway would not start')
    return warn(where, f"auto: {why}; the gateway runs at-least-once")


async def topic_findings(admin: AIOKafkaAdminClient, settings: Settings) -> list[Finding]:
    """Every topic the settings need: there, partitioned, retained and configured as
    they should be (`[topics]`), and a summary line."""
    specs = needed_topics(settings)
    existing = await existing_topics(admin, [s.name for s in specs])
    listed = await admin.list_topics() if len(existing) < len(specs) else []
    findings = []
    for spec in specs:
        if spec.name not in existing:
            findings.append(
                error(
                    f"topic {spec.name}",
                    f"missing ({spec.role}){did_you_mean(spec.name, listed)}; "
                    + create_hint(settings.source_file),
                )
            )
    for lane in settings.lanes:
        clean = lane.clean_topic or settings.kafka.clean_topic
        for raw in lane.raw_topics:
            if raw in existing and clean in existing and existing[clean] < existing[raw]:
                findings.append(
                    warn(
                        f"topic {clean}",
                        f"{existing[clean]} partitions, fewer than raw topic "
                        f"{raw}'s {existing[raw]}: records of several raw "
                        "partitions share one clean partition",
                    )
                )
    configs = await _topic_configs(admin, [s.name for s in specs if s.name in existing])
    largest_tier_ms = max(settings.delay.tiers).total_seconds() * 1000
    failures = settings.failures
    retrying_ms = failures.max_attempts * failures.backoff_max.total_seconds() * 1000
    for spec in specs:
        config = configs.get(spec.name, {})
        retention = int(config.get("retention.ms") or -1)
        if spec.role == "delay" and 0 <= retention < largest_tier_ms:
            findings.append(
                warn(
                    f"topic {spec.name}",
                    f"retention.ms {retention} is shorter than the largest tier: "
                    "a waiting record may be deleted",
                )
            )
        if spec.role == "raw" and 0 <= retention < retrying_ms:
            findings.append(
                warn(
                    f"topic {spec.name}",
                    f"retention.ms {retention} is shorter than the failure retries can take "
                    "(failures.max_attempts x backoff_max): a retried record may be gone",
                )
            )
        if spec.role == "raw" and "compact" in config.get("cleanup.policy", ""):
            findings.append(
                warn(
                    f"topic {spec.name}",
                    "compacted: a failed record compacted away cannot be retried (raw_record_gone)",
                )
            )
    findings += _configured_findings(specs, configs)
    findings += await _durability_findings(admin, specs, existing, configs)
    present = sum(1 for s in specs if s.name in existing)
    summary = error if present < len(specs) else ok
    findings.append(summary("kafka", f"{present} of {len(specs)} topics exist"))
    return findings


def _configured_findings(
    specs: list[TopicSpec], configs: dict[str, dict[str, str]]
) -> list[Finding]:
    """A topic config `[topics]` asks for that the topic does not have: `topics --create`
    never changes a topic that exists (it may predate the setting)."""
    findings = []
    for spec in specs:
        have = configs.get(spec.name)
        if not have:  # missing, or the broker did not say
            continue
        for name, want in spec.config.items():
            if have.get(name) != want:
                findings.append(
                    warn(
                        f"topic {spec.name}",
                        f"{name} is {have.get(name, 'not set')}, [topics] asks for {want}; "
                        "topics --create does not change an existing topic: "
                        f"kafka-configs.sh --alter --entity-type topics --entity-name "
                        f"{spec.name} --add-config {name}={want}",
                    )
                )
    return findings


# What a lost broker must not take with it: the copies and commands only these topics hold.
DURABLE_ROLES = frozenset({"clean", "delay", "failure", "dead_letter"})


async def _durability_findings(
    admin: AIOKafkaAdminClient,
    specs: list[TopicSpec],
    existing: dict[str, int],
    configs: dict[str, dict[str, str]],
) -> list[Finding]:
    """On a cluster of 3 brokers or more: a topic of `DURABLE_ROLES` with one replica, or
    `min.insync.replicas` 1, loses acknowledged writes with one broker."""
    if len((await admin.describe_cluster())["brokers"]) < 3:
        return []
    names = [s.name for s in specs if s.role in DURABLE_ROLES and s.name in existing]
    if not names:
        return []
    replicas = {
        d["topic"]: min(len(p["replicas"]) for p in d["partitions"])
        for d in await admin.describe_topics(names)
        if d["error_code"] == 0 and d["partitions"]
    }
    findings = []
    for name in names:
        if replicas.get(name, 3) < 2:
            findings.append(
                warn(
                    f"topic {name}",
                    "1 replica on a cluster of 3+ brokers: a write is lost with its broker; "
                    "recreate it with 3 (topics --create does) or add replicas "
                    "(kafka-reassign-partitions.sh)",
                )
            )
        elif configs.get(name, {}).get("min.insync.replicas") == "1":
            findings.append(
                warn(
                    f"topic {name}",
                    "min.insync.replicas 1: a write acknowledged by one broker is lost with "
                    "it; kafka-configs.sh --alter --entity-type topics --entity-name "
                    f"{name} --add-config min.insync.replicas=2",
                )
            )
    return findings


async def _leftover_findings(admin: AIOKafkaAdminClient, settings: Settings) -> list[Finding]:
    """Tier topics the settings no longer name (gateway/delay/leftovers.py): drained by
    the delay loop, then to delete; with `[delay]` off, stranded."""
    clean = settings.kafka.clean_topic
    runbook = "docs/operations.md, Changing the configuration safely"
    listed = set(await admin.list_topics())
    try:  # the tiers of a renamed clean topic: the delay group read them
        read = await admin.list_consumer_group_offsets(f"{settings.kafka.group_id}.delay")
    except KafkaError:
        read = {}
    others = read_clean_topics(settings, {tp.topic for tp in read})
    if not settings.delay.enabled:
        stranded = sorted(
            t for t in listed if (tier := tier_of(t)) and (tier[0] == clean or tier[0] in others)
        )
        return [
            warn(
                f"topic {topic}",
                "a delay tier, but [delay] is off: records waiting in it are never delivered "
                f"and their ids stay claimed; keep [delay] on until it is empty ({runbook})",
            )
            for topic in stranded
        ]
    leftover = set(unnamed_tiers(settings, listed))
    leftover |= {t for t in listed if (tier := tier_of(t)) is not None and tier[0] in others}
    return [
        warn(
            f"topic {topic}",
            "a delay tier that [delay] tiers no longer names: the gateway reads it until it "
            f"is empty, delivering to {clean}; delete it once its "
            f'dedup_delay_backlog_records{{tier="{topic}"}} is 0 ({runbook})',
        )
        for topic in sorted(leftover)
    ]


async def _topic_configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    """Every config of each topic (name -> value); {} where the broker does not say."""
    if not names:
        return {}
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
        )
    except KafkaError:
        return {}
    out: dict[str, dict[str, str]] = {}
    for response in responses:
        for code, _msg, _type, name, entries in response.resources:
            if code == 0:
                out[name] = {entry[0]: entry[1] for entry in entries if entry[1] is not None}
    return out


GROUP_COORDINATOR_WAIT_S = 10.0
# COORDINATOR_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR: ask again.
COORDINATOR_MOVING = frozenset({14, 15, 16})


async def _described(admin: AIOKafkaAdminClient, group: str) -> list[Any]:
    """DescribeGroups of `group`, asked again while the broker answers a retriable
    error: a broker no group ever used creates its offsets topic on the first
    question, and answers "coordinator not available" until it exists."""
    deadline = time.monotonic() + GROUP_COORDINATOR_WAIT_S
    while True:
        try:
            described: list[Any] = await admin.describe_consumer_groups([group])
        except KafkaError as exc:
            if not exc.retriable or time.monotonic() > deadline:
                raise
        else:
            codes = {entry[0] for response in described for entry in response.groups}
            if not codes & COORDINATOR_MOVING or time.monotonic() > deadline:
                return described
        await asyncio.sleep(0.2)


def _group_state(state: str) -> str:
    """The broker says Dead for a group it holds nothing for (never joined, or its
    offsets expired) and Empty for one with offsets but no member now."""
    if state in ("Dead", ""):
        return "no members yet"
    if state == "Empty":
        return "no members now; committed offsets kept"
    return f"state {state}"


async def _group_findings(admin: AIOKafkaAdminClient, settings: Settings) -> list[Finding]:
    group = settings.kafka.group_id
    groups = [group, f"{group}.failures"] + ([f"{group}.delay"] if settings.delay.enabled else [])
    findings = []
    # One group per request: a few requests, and answers a broker cannot mix up.
    responses = [r for g in groups for r in await _described(admin, g)]
    for response in responses:
        for code, name, state, *_ in response.groups:
            if code:
                findings.append(
                    error(
                        f"group {name}",
                        f"cannot be used (Kafka error code {code}); check the user's ACLs on it",
                    )
                )
            else:
                findings.append(ok(f"group {name}", f"usable ({_group_state(state)})"))
    return findings
