"""The other sections: `[redis]`, `[dedup]`, `[coalesce]`, `[failures]`, `[delay]`,
`[[lanes]]`, `[metrics]`, `[log]`."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import MultiHostUrl

from gateway import sizing
from gateway.member_urls import MemberUrl, check_member_url, is_cluster, member_name
from gateway.settings.values import Duration, Section


class RedisSettings(Section):
    # Quorum members: redis[s]://host:port/db, or a Redis Cluster as
    # redis[s]+cluster://host:port[,host:port...] (gateway/quorum/members.py).
    nodes: list[MemberUrl] = Field(
        default_factory=lambda: [MultiHostUrl("redis://127.0.0.1:6379/0")]
    )
    # The dedup window: how long a mark lives. Set atomically with the claim.
    ttl: Duration = timedelta(hours=24)
    # No braces: a cluster member's keys put their hash tag after it.
    key_prefix: str = Field(default="dd:", max_length=32, pattern=r"^[^{}]*$")
    # Hash buckets of a member's first time slice (gateway/quorum/keys.py): later
    # slices open with the marks of the one before / 32, and every slice splits its
    # buckets as it fills past ~32 marks each (a lookup scans its bucket: ~300 per
    # bucket cost about twice the Redis CPU per new id), so this needs no sizing.
    buckets: int = Field(default=16_384, ge=1, le=2**24)
    # Per-member bound on one round trip (up to sizing.CHUNKS_PER_TRIP chunks of
    # sizing.CHUNK_DIGESTS digests); a slower member counts as no answer.
    timeout: Duration = timedelta(milliseconds=500)
    # How often every member is pinged (and its epoch read) in the background.
    ping_interval: Duration = timedelta(seconds=2)
    # Most marks waiting per member to be completed there (it missed the
    # vote); beyond it the oldest are dropped (counted).
    repair_backlog: int = Field(default=100_000, ge=0, le=10_000_000)
    # Hash-tag groups a Redis Cluster member's keys are split into (gateway/quorum/members.py):
    # a batch costs one call per group that has records, and the groups spread over
    # the cluster's masters. Changing it makes every cluster member look empty
    # (recovering), as a member that lost its data.
    cluster_groups: int = Field(default=64, ge=2, le=4096)
    # How claims run on a member: "lua" (the scripts, every Redis), "module" (the
    # native claim, a Redis module the operator loaded: gateway/quorum/native; a
    # member without it stops start-up), "auto" (the module where `MODULE LIST`
    # shows it at this gateway's version, else Lua; one log line per member).
    # Both give the same replies and write the same keys.
    claim: Literal["lua", "module", "auto"] = "auto"

    @model_validator(mode="after")
    def _module_on_standalone(self) -> RedisSettings:
        clusters = [member_name(n) for n in self.nodes if is_cluster(n)]
        if self.claim == "module" and clusters:
            raise ValueError(
                f'claim = "module" serves standalone members only; {", ".join(clusters)} '
                'is a Redis Cluster member (use "auto": Lua there, the module elsewhere)'
            )
        return self

    @field_validator("nodes")
    @classmethod
    def _odd_count(cls, nodes: list[MultiHostUrl]) -> list[MultiHostUrl]:
        if len(nodes) % 2 == 0:
            raise ValueError(f"needs an odd number of members (1, 3, 5, ...), got {len(nodes)}")
        for node in nodes:
            check_member_url(node)
        if len({member_name(n) for n in nodes}) != len(nodes):
            raise ValueError("lists the same member twice")
        return nodes

    @field_validator("ttl")
    @classmethod
    def _ttl_range(cls, ttl: timedelta) -> timedelta:
        if not timedelta(seconds=1) <= ttl <= timedelta(days=365):
            raise ValueError(f"must be between 1s and 365d, got {ttl}")
        return ttl

    @field_validator("timeout")
    @classmethod
    def _timeout_range(cls, timeout: timedelta) -> timedelta:
        least = timedelta(milliseconds=sizing.MIN_TIMEOUT_MS)
        if not least <= timeout <= timedelta(seconds=60):
            raise ValueError(
                f"must be between {sizing.MIN_TIMEOUT_MS}ms and 60s, got {timeout}: one round "
                f"trip carries up to {sizing.CHUNKS_PER_TRIP} chunks of "
                f"{sizing.CHUNK_DIGESTS} digests, about {sizing.TRIP_MS}ms of Redis work, "
                f"and needs {sizing.TIMEOUT_MARGIN}x that for a loaded member"
            )
        return timeout

    @field_validator("ping_interval")
    @classmethod
    def _ping_range(cls, every: timedelta) -> timedelta:
        if not timedelta(milliseconds=100) <= every <= timedelta(minutes=5):
            raise ValueError(f"must be between 100ms and 5m, got {every}")
        return every


class DedupSettings(Section):
    # false: forward every record with an id, no Redis calls (the benchmark's ceiling).
    enabled: bool = True
    # Where the message id comes from: "header:NAME", "key", "json:dotted.path", "hash".
    id: str = "header:message-id"
    # What to do with a record no majority decides (members down, split vote).
    on_no_quorum: Literal["block", "forward", "drop"] = "block"
    # Ids longer than this are bad input (quarantined), not silently truncated.
    max_id_bytes: int = Field(default=1024, ge=1, le=1_048_576)
    # Backoff while a partition is blocked on an undecided vote.
    retry_backoff_initial: Duration = timedelta(milliseconds=100)
    retry_backoff_max: Duration = timedelta(seconds=5)
    # A wrong `id` quarantines every record: when more than this share of the raw records
    # consumed over `quarantine_alarm_window` is quarantined (and at least
    # QUARANTINE_ALARM_MIN_RECORDS were consumed), /readyz says degraded and
    # dedup_gateway_quarantine_alarm is 1 (gateway/raw/quarantine.py). 1.0: never.
    quarantine_alarm_share: float = Field(default=0.5, gt=0, le=1)
    quarantine_alarm_window: Duration = timedelta(minutes=1)

    @field_validator("id")
    @classmethod
    def _known_strategy(cls, spec: str) -> str:
        return id_spec(spec)

    @field_validator("quarantine_alarm_window")
    @classmethod
    def _alarm_window(cls, window: timedelta) -> timedelta:
        if not timedelta(seconds=10) <= window <= timedelta(hours=1):
            raise ValueError(f"must be between 10s and 1h, got {window}")
        return window


# What a `json:` path may not hold: it is dotted field names, not JSONPath.
_NOT_IN_JSON_PATH = "[]$"


def id_spec(spec: str) -> str:
    """A valid `[dedup] id` / `[coalesce] key` spec, or ValueError naming the choices."""
    kind, _, arg = spec.partition(":")
    if kind == "json" and arg.strip():
        return json_path_spec(spec, arg)
    if (kind in ("key", "hash") and not arg) or (kind == "header" and arg.strip()):
        return spec
    raise ValueError(
        f"unknown id strategy {spec!r}; use 'header:NAME', 'key', 'json:dotted.path' or 'hash'"
    )


def json_path_spec(spec: str, path: str) -> str:
    """`spec` when `path` is field names joined by dots; else ValueError saying why: the
    extractor reads `items[0]` as a key of that name and `a.` as a key "", which no
    record has, so every record would be quarantined (missing_field)."""
    bad = sorted({c for c in path if c in _NOT_IN_JSON_PATH})
    if bad:
        raise ValueError(
            f"{spec!r}: a json: path is field names joined by dots, not JSONPath; "
            f"{' '.join(repr(c) for c in bad)} would be read as part of a field name and match "
            "nothing (array items cannot be addressed; nested objects can: 'json:order.id')"
        )
    if any(not part.strip() for part in path.split(".")):
        raise ValueError(
            f"{spec!r}: a json: path is field names joined by dots; an empty name "
            "(a leading, trailing or doubled dot) matches nothing"
        )
    return spec


class CoalesceSettings(Section):
    """Coalescing windows (gateway/delay/coalescer.py, docs/coalescing.md)."""

    enabled: bool = False
    # What names the entity whose versions merge: the `[dedup] id` syntax.
    key: str = "header:entity-id"
    # fixed: windows of `window` on the record timestamp; trailing: a window closes
    # `window` after its newest update, at most `max_window` after its first.
    mode: Literal["fixed", "trailing"] = "fixed"
    window: Duration = timedelta(seconds=2)
    max_window: Duration = timedelta(seconds=30)
    # How long after its end a window still takes updates stamped inside it (records
    # in flight: producer linger, broker, fetch): it closes at end + grace by the
    # gateway's clock. Later updates are counted as late (docs/coalescing.md, "Late updates").
    grace: Duration = timedelta(seconds=1)

    @field_validator("key")
    @classmethod
    def _known_strategy(cls, spec: str) -> str:
        return id_spec(spec)

    @field_validator("window", "max_window")
    @classmethod
    def _whole_ms(cls, value: timedelta) -> timedelta:
        if value < timedelta(milliseconds=1) or value % timedelta(milliseconds=1):
            raise ValueError(f"must be a positive whole number of milliseconds, got {value}")
        return value

    @field_validator("grace")
    @classmethod
    def _whole_ms_or_none(cls, value: timedelta) -> timedelta:
        if value < timedelta(0) or value % timedelta(milliseconds=1):
            raise ValueError(f"must be a whole number of milliseconds (0 or more), got {value}")
        return value

    @property
    def longest(self) -> timedelta:
        """The longest a window stays open (fixed: `window`; trailing: `max_window`)."""
        return self.max_window if self.mode == "trailing" else self.window


class FailureSettings(Section):
    # "retry": re-fetch the raw record and forward it again; "release": only delete the mark.
    mode: Literal["retry", "release"] = "retry"
    max_attempts: int = Field(default=16, ge=1, le=1000)
    backoff_initial: Duration = timedelta(seconds=1)
    backoff_max: Duration = timedelta(minutes=5)


class DelaySettings(Section):
    """Scheduled delivery (gateway/delay/loop.py, docs/delay.md)."""

    enabled: bool = False
    # The fixed delay of each tier topic `<clean_topic>.delay.<tier>`, smallest first;
    # every tier's topic must exist. The smallest also sets how far ahead of its
    # time the delay loop holds a record in memory (precision, not a wait).
    tiers: list[Duration] = Field(
        default_factory=lambda: [
            timedelta(seconds=s) for s in (1, 4, 16, 60, 240, 960, 3600, 14400, 57600)
        ],
        min_length=1,
        max_length=32,
    )
    # Longest delay accepted, from the raw record's timestamp; longer ones are
    # quarantined (`delay_too_long`). At most [redis] ttl: the mark must outlive the wait.
    max_delay: Duration = timedelta(hours=24)
    deliver_at_header: str = "deliver-at"  # epoch milliseconds
    deliver_after_header: str = "deliver-after"  # a duration: "90s", "15m"

    @field_validator("tiers")
    @classmethod
    def _increasing_whole_ms(cls, tiers: list[timedelta]) -> list[timedelta]:
        for tier in tiers:
            if tier < timedelta(milliseconds=10) or tier % timedelta(milliseconds=1):
                raise ValueError(f"each tier must be whole milliseconds, at least 10ms: {tier}")
        if any(b <= a for a, b in itertools.pairwise(tiers)):
            raise ValueError("tiers must be listed smallest first, each once")
        return tiers

    @field_validator("deliver_at_header", "deliver_after_header")
    @classmethod
    def _own_header(cls, name: str) -> str:
        if not name or name.startswith("dedup-"):
            raise ValueError(f"must be non-empty and not start with 'dedup-': {name!r}")
        return name


class LaneSettings(Section):
    """One priority lane (`[[lanes]]`, gateway/raw/lanes.py): raw topics that share a priority."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    raw_topics: list[str] = Field(min_length=1)
    # Higher first. While a lane's lag (records not yet read, all partitions of
    # its topics, group-wide) is above its `lag_threshold`, every lower lane is
    # paused.
    priority: int = 0
    lag_threshold: int = Field(default=1000, ge=0)
    # A paused lane is let through for one fetch after this long (then paused again).
    max_starve: Duration = timedelta(seconds=30)
    # Where this lane's clean records go (a Spark query per lane); default `[kafka] clean_topic`.
    clean_topic: str | None = None


class MetricsSettings(Section):
    host: str = "0.0.0.0"
    port: int = Field(default=9108, ge=0, le=65535)


class LogSettings(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_format: bool = Field(default=False, alias="json")
