"""`check-config --connect`, per Redis member: connect and authenticate; whether the
member's user may run every command the gateway's scripts call (asked with
`redis.acl_check_cmd` inside a script: nothing is written) plus the calls the client
makes around them; for a `redis+cluster://` member, that every hash slot is served,
and the checks above on every master; `maxmemory-policy`; a `[redis] ttl` lowered
since the member's marks were claimed."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import redis.asyncio as aioredis
from pydantic_core import MultiHostUrl
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from gateway.config import Settings
from gateway.member_urls import member_name
from gateway.ops.findings import Finding, Severity, error, ok, warn
from gateway.quorum import scripts
from gateway.quorum.identity import run_id_of
from gateway.quorum.members import client_for, node_client_for
from gateway.quorum.scripts import EXPIRY_SLACK_MS

SLOTS = 16384


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


async def member_findings(
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
