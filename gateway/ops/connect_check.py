"""`dedup-gateway check-config --connect`: reach everything the settings name.

Per Redis member: connect and authenticate; whether the member's user may run
every command the gateway's scripts call (asked with `redis.acl_check_cmd`
inside a script: nothing is written) plus the calls the client makes around
them; for a `redis+cluster://` member, that every hash slot is served, and the
checks above on every master; `maxmemory-policy` (anything but `noeviction`
evicts marks: copies would pass). Per broker: it answers; every topic of
`dedup-gateway topics` exists, clean topics have at least as many partitions as
their raw topics, delay tiers keep records longer than their delay, no raw
topic is compacted; no tier topic is left over from an earlier configuration
(a tier removed, the clean topic renamed: drained, then to delete; `[delay]`
off while a tier holds records: stranded); the consumer groups can be
described (so the user may use them). It never joins a group: that would rebalance running gateways.

One `Finding` per check, worst first in the exit code (`exit_code`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import redis.asyncio as aioredis
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from pydantic_core import MultiHostUrl
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from gateway.config import Settings
from gateway.delay.leftovers import read_clean_topics, tier_of, unnamed_tiers
from gateway.errors import BrokerUnreachable
from gateway.kafka.transactions import transactions_unsupported
from gateway.member_urls import member_name
from gateway.ops.broker import reaching_broker
from gateway.ops.topics import TopicSpec, admin_client, existing_topics, needed_topics
from gateway.quorum import scripts
from gateway.quorum.identity import describe, run_id_of, shared
from gateway.quorum.members import client_for, node_client_for
from gateway.quorum.scripts import EXPIRY_SLACK_MS

CHECK_TIMEOUT_S = 5.0
SLOTS = 16384


class Severity(IntEnum):
    """A finding's weight; the command's exit code is the worst one's `code`."""

    OK = 0
    WARN = 1  # it runs, but a setting should change
    ERROR = 3  # the gateway would not start, or not keep its guarantees

    @property
    def code(self) -> int:
        return int(self)


@dataclass(frozen=True)
class Finding:
    severity: Severity
    where: str  # "redis 127.0.0.1:6379/0", "kafka", "topic clean"
    message: str

    def line(self) -> str:
        return f"{self.severity.name:<5} {self.where}: {self.message}"


def ok(where: str, message: str) -> Finding:
    return Finding(Severity.OK, where, message)


def warn(where: str, message: str) -> Finding:
    return Finding(Severity.WARN, where, message)


def error(where: str, message: str) -> Finding:
    return Finding(Severity.ERROR, where, message)


def exit_code(findings: list[Finding]) -> int:
    """0: all reached and fit; 1: warnings only; 3: at least one error."""
    return max((f.severity.code for f in findings), default=0)


def script_commands() -> list[tuple[str, ...]]:
    """Every command (with subcommand) the gateway's scripts call, each once."""
    text = "\n".join(getattr(scripts, name.upper()) for name in scripts.NAMES)
    found = re.findall(r"redis\.p?call\('([A-Za-z]+)'(?:, '([A-Za-z]+)')?", text)
    return sorted({(cmd.upper(), sub.upper()) if sub else (cmd.upper(),) for cmd, sub in found})


# Called by the client itself, around the scripts (redis-py: HELLO on connect,
# SCRIPT LOAD on NOSCRIPT; the quorum: PING).
CLIENT_COMMANDS: list[tuple[str, ...]] = [("EVALSHA",), ("SCRIPT", "LOAD"), ("PING",)]
# What a cluster client adds (docs/redis-cluster.md).
CLUSTER_COMMANDS: list[tuple[str, ...]] = [
    ("CLUSTER", "SLOTS"),
    ("CLUSTER", "SHARDS"),
    ("CLUSTER", "NODES"),
    ("READONLY",),
    ("ASKING",),
]

# ARGV: a key under the prefix, then per command its word count and words; returns
# the commands the user may not run (with that key where they take one).
PERMISSION_PROBE = """#!lua flags=no-writes
local key, denied, i = ARGV[1], {}, 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local words = {}
  for j = 1, n do words[j] = ARGV[i + j] end
  local args = {unpack(words)}
  args[#args + 1] = key
  if not redis.acl_check_cmd(unpack(args)) then denied[#denied + 1] = table.concat(words, '|') end
  i = i + n + 1
end
return denied
"""


async def check(settings: Settings, timeout_s: float = CHECK_TIMEOUT_S) -> list[Finding]:
    """Every finding, Redis members first, then the broker."""
    run_ids: dict[str, str | None] = {}
    members = await asyncio.gather(
        *(_check_member(url, settings, timeout_s, run_ids) for url in settings.redis.nodes)
    )
    findings = [f for found in members for f in found]
    in_config_order = {name: run_ids.get(name) for name in map(member_name, settings.redis.nodes)}
    for names in shared(in_config_order):  # the members answer in any order
        findings.append(error("redis", describe([names]).removeprefix("redis.nodes: ")))
    reached = sum(1 for found in members if all(f.severity < Severity.ERROR for f in found))
    if reached < settings.quorum:
        findings.append(
            error(
                "redis",
                f"{reached} of {len(members)} members fully usable, a majority needs "
                f"{settings.quorum}: the gateway would wait unready",
            )
        )
    findings += await _check_kafka(settings, timeout_s)
    return findings


async def _check_member(
    url: MultiHostUrl, settings: Settings, timeout_s: float, run_ids: dict[str, str | None]
) -> list[Finding]:
    """The member's findings; its run_id into `run_ids` (a standalone member's)."""
    where = f"redis {member_name(url)}"
    client = client_for(url, timeout_s)
    try:
        found = await asyncio.wait_for(
            _member_findings(client, url, settings, where), timeout_s * 3
        )
        if not isinstance(client, RedisCluster) and all(f.severity < Severity.ERROR for f in found):
            with contextlib.suppress(RedisError, OSError):
                run_ids[member_name(url)] = run_id_of(await client.info("server"))
        return found
    except TimeoutError:
        return [error(where, f"no answer within {timeout_s * 3:.0f}s")]
    finally:
        await client.aclose()


async def _member_findings(
    client: aioredis.Redis | RedisCluster, url: MultiHostUrl, settings: Settings, where: str
) -> list[Finding]:
    try:
        await client.ping()
    except AuthenticationError as exc:
        return [
            error(where, f"credentials refused ({exc}); check the user and password in the URL")
        ]
    except NoPermissionError:
        return [error(where, "the user may not run PING")]
    except (RedisError, OSError) as exc:
        return [error(where, f"cannot reach it: {exc}")]
    commands = script_commands() + CLIENT_COMMANDS
    if not isinstance(client, RedisCluster):
        return [
            ok(where, "reached, authenticated"),
            *await _node_findings(client, where, settings.redis.key_prefix, commands),
            *await _ttl_findings(client, where, settings),
        ]
    findings = [ok(where, "reached, authenticated")]
    served = client.nodes_manager.slots_cache
    unserved = SLOTS - sum(1 for slot in range(SLOTS) if served.get(slot))
    if unserved:
        findings.append(error(where, f"{unserved} of {SLOTS} hash slots are served by no node"))
    else:
        findings.append(ok(where, f"all {SLOTS} hash slots served"))
    timeout_s = settings.redis.timeout.total_seconds()
    for node in client.get_primaries():
        async with node_client_for(url, node.host, int(node.port), max(timeout_s, 1.0)) as conn:
            findings += await _node_findings(
                conn,
                f"{where} node {node.name}",
                settings.redis.key_prefix,
                commands + CLUSTER_COMMANDS,
            )
    return findings


async def _node_findings(
    client: Any, where: str, prefix: str, commands: list[tuple[str, ...]]
) -> list[Finding]:
    findings = []
    argv: list[str] = [f"{prefix}check-config"]
    for words in commands:
        argv += [str(len(words)), *words]
    try:
        denied = await client.eval(PERMISSION_PROBE, 0, *argv)
    except NoPermissionError:
        findings.append(
            error(
                where,
                "the user may not run EVAL, so its command rights cannot be "
                "read; the gateway needs EVALSHA and SCRIPT LOAD",
            )
        )
    except RedisError as exc:
        findings.append(error(where, f"permission probe failed: {exc}"))
    else:
        names = [d.decode() if isinstance(d, bytes) else str(d) for d in denied]
        if names:
            findings.append(
                error(
                    where,
                    f"the user may not run {', '.join(names)} on keys "
                    f"'{prefix}*' (docs/operations.md, Security)",
                )
            )
        else:
            findings.append(
                ok(
                    where,
                    f"the user may run the {len(commands)} commands the gateway "
                    f"uses on keys '{prefix}*'",
                )
            )
    findings.append(await _memory_policy(client, where))
    return findings


async def _ttl_findings(client: Any, where: str, settings: Settings) -> list[Finding]:
    """A WARN when `[redis] ttl` is lower than the one the member's current slice was
    claimed under (its `expires:<slice>` less its end: gateway/quorum/keys.py)."""
    meta = f"{settings.redis.key_prefix}slice"
    try:
        slice_id, ends = await client.hmget(meta, "id", "ends")
        expires = await client.hget(meta, f"expires:{int(slice_id)}") if slice_id else None
    except (RedisError, ValueError):
        return []
    if not ends or not expires:
        return []
    before_ms = int(expires) - int(ends)
    now_ms = int(settings.redis.ttl.total_seconds() * 1000)
    if before_ms <= now_ms + EXPIRY_SLACK_MS:
        return []
    return [
        warn(
            where,
            f"[redis] ttl is {now_ms / 1000:g}s, lower than the {before_ms / 1000:g}s the "
            "member's marks were claimed under: those keep their life, but an id first "
            f"seen from now on is remembered {now_ms / 1000:g}s only, so a copy arriving "
            "later than that is forwarded again (docs/operations.md, Changing the "
            "configuration safely)",
        )
    ]


async def _memory_policy(client: Any, where: str) -> Finding:
    try:
        memory = await client.info("memory")
    except NoPermissionError:
        return warn(
            where, "cannot read maxmemory-policy (the user may not run INFO); it must be noeviction"
        )
    except RedisError as exc:
        return warn(where, f"cannot read maxmemory-policy: {exc}")
    policy = memory.get("maxmemory_policy")
    if policy != "noeviction":
        return error(
            where, f"maxmemory-policy is {policy}: evicted marks let copies through; set noeviction"
        )
    if not memory.get("maxmemory"):
        return warn(
            where,
            "maxmemory-policy noeviction, but no maxmemory: Redis may grow until the host runs out",
        )
    return ok(
        where,
        f"maxmemory-policy noeviction, maxmemory "
        f"{memory.get('maxmemory_human', memory['maxmemory'])}",
    )


async def _check_kafka(settings: Settings, timeout_s: float) -> list[Finding]:
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
        return [
            ok(where, "reached"),
            *await asyncio.wait_for(_broker_findings(admin, settings), timeout_s * 3),
        ]
    except (TimeoutError, KafkaError) as exc:
        return [error(where, f"the broker stopped answering: {exc!r}")]
    finally:
        await admin.close()


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
    findings = []
    for spec in specs:
        if spec.name not in existing:
            findings.append(
                error(
                    f"topic {spec.name}",
                    f"missing ({spec.role}); create it: dedup-gateway topics --create",
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
    present = sum(1 for s in specs if s.name in existing)
    findings.append(ok("kafka", f"{present} of {len(specs)} topics exist"))
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
                state_text = state or "unknown"
                findings.append(ok(f"group {name}", f"usable (state {state_text})"))
    return findings
