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

One `Finding` per check, worst first in the exit code (`exit_code`,
gateway/ops/findings.py). The checks live by what they reach: the Redis members
(gateway/ops/check_redis.py) and the broker (gateway/ops/check_kafka.py).
"""

from __future__ import annotations

import asyncio

from gateway.config import Settings
from gateway.member_urls import member_name
from gateway.ops.check_kafka import kafka_findings
from gateway.ops.check_redis import member_findings
from gateway.ops.findings import Finding, Severity, error, exit_code
from gateway.quorum.identity import describe, shared

__all__ = ["CHECK_TIMEOUT_S", "Finding", "Severity", "check", "exit_code"]

CHECK_TIMEOUT_S = 5.0


async def check(settings: Settings, timeout_s: float = CHECK_TIMEOUT_S) -> list[Finding]:
    """Every finding, Redis members first, then the broker."""
    run_ids: dict[str, str | None] = {}
    members = await asyncio.gather(
        *(member_findings(url, settings, timeout_s, run_ids) for url in settings.redis.nodes)
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
    findings += await kafka_findings(settings, timeout_s)
    return findings
