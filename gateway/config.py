"""One validated settings object, built before anything connects.

Sources, highest priority first: environment variables (`GATEWAY_` prefix, `__`
between levels, e.g. `GATEWAY_REDIS__TTL=12h`), the TOML file given with
`--config` (or named by `$GATEWAY_CONFIG`), then the defaults below. A bad value stops start-up with
`ConfigError`, whose message names the setting.
"""

from __future__ import annotations

import difflib
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema, models_json_schema
from pydantic_core import MultiHostUrl
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from gateway import client_properties, sizing
from gateway.errors import ConfigError
from gateway.member_urls import MemberUrl, check_member_url, masked, member_name

ENV_PREFIX = "GATEWAY_"
ENV_NESTED_DELIMITER = "__"  # GATEWAY_<SECTION>__<KEY>
CONFIG_ENV = "GATEWAY_CONFIG"  # the config file, when --config is not given

__all__ = ["ConfigError", "Settings", "env_name", "json_schema", "load", "load_settings"]

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)")
_DURATION = re.compile(rf"^\s*(?:{_DURATION_PART.pattern}\s*)+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> timedelta:
    """`"24h"`, `"500ms"`, `"1h30m"`, `"7d"`, a number of seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=value)
    if isinstance(value, str) and _DURATION.match(value):
        return sum(
            (timedelta(seconds=float(n) * _UNIT_SECONDS[unit])
             for n, unit in _DURATION_PART.findall(value)),
            timedelta(),
        )  # fmt: skip
    raise ValueError(f"expected a duration like '24h', '1h30m', '500ms' or '30s', got {value!r}")


def format_duration(value: timedelta) -> str | float:
    """The duration as `parse_duration` reads it back: `"1h30m"`, `"100ms"`, `"0s"`
    (a negative one as a number of seconds, which no unit spells)."""
    if value < timedelta(0):
        return value.total_seconds()
    micros = value // timedelta(microseconds=1)
    parts = []
    for unit, size in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000),
                       ("s", 1_000_000)):  # fmt: skip
        count, micros = divmod(micros, size)
        if count:
            parts.append(f"{count}{unit}")
    if micros:
        ms = f"{micros / 1000:.3f}".rstrip("0").rstrip(".")
        parts.append(f"{ms}ms")
    return "".join(parts) or "0s"


# Written out (`check-config`, JSON dumps) as `format_duration` spells it, so it loads back;
# in the JSON Schema (`config-schema`) as the text or number `parse_duration` reads.
Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str | float, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "pattern": _DURATION.pattern},
                {"type": "number", "description": "seconds"},
            ],
            "description": "a duration: '500ms', '30s', '1h30m', '7d', or a number of seconds",
        }
    ),
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KafkaSettings(_Section):
    bootstrap_servers: str = "127.0.0.1:9092"
    raw_topics: list[str] = Field(default=["raw"], min_length=1)
    clean_topic: str = "clean"
    failure_topic: str = "dedup-failures"
    quarantine_topic: str = "dedup-quarantine"
    dead_letter_topic: str = "dedup-dead-letter"
    group_id: str = "dedup-gateway"
    # Gateway processes on this host (`run --workers N` overrides): one per core
    # it may use; all join `group_id` under one supervisor (docs/operations.md).
    workers: int = Field(default=1, ge=1, le=256)
    # Most records fetched and voted on in one batch (one script call per member).
    max_batch_records: int = Field(default=2000, ge=1, le=100_000)
    # Longest a fetch waits at the broker for new records: the idle fetch rate
    # (Apache Kafka answers as soon as data arrives; a broker that holds a fetch
    # for its whole wait adds up to this much latency).
    fetch_max_wait: Duration = timedelta(milliseconds=100)
    # A member silent this long (e.g. killed) is dropped from the group and its
    # partitions move on; heartbeats go every third of it.
    session_timeout: Duration = timedelta(seconds=10)
    # Passed through to the clients; docs/operations.md, "Security".
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    # Idempotent producers (Kafka 0.11+): a retried produce request is written once.
    producer_idempotence: bool = True
    # The clean topic exactly once for `read_committed` readers (docs/guarantees.md):
    # each raw batch's copies and its raw offsets in one Kafka transaction, fenced by
    # the consumer group's generation (KIP-447, Kafka 2.5+). "auto": on where the
    # broker supports it, else at-least-once with a WARNING; "on": refuse to start
    # without it; "off": at-least-once (a crash may forward a batch again).
    exactly_once: Literal["auto", "on", "off"] = "auto"
    # How long the broker lets a transaction stay open before it aborts it: the most
    # a gateway killed mid-transaction holds `read_committed` readers back (with
    # `group_instance_id`, its restart aborts the transaction at once).
    transaction_timeout: Duration = Field(
        default=timedelta(seconds=10), ge=timedelta(seconds=1), le=timedelta(minutes=15)
    )
    # Static group membership (KIP-345): a name unique in the group and stable across
    # restarts (a pod name). A gateway restarted within `session_timeout` takes its
    # partitions back without a rebalance; `run --workers N` appends `-<worker>`.
    group_instance_id: str | None = Field(default=None, min_length=1, max_length=200)
    # The broker's limit on one produce request (`message.max.bytes`); a clean
    # copy that would outgrow it is quarantined as `too_large` instead.
    max_request_bytes: int = Field(default=1_048_576, ge=1024, le=2**31 - 1)
    # `[kafka.client]`: raw client properties (gateway/client_properties.py).
    client: dict[str, client_properties.ClientValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _usable_client_properties(self) -> KafkaSettings:
        client_properties.check(self.client, self.sasl_mechanism)
        return self

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port_list(cls, value: str) -> str:
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"expected host:port[,host:port...], got {value!r}")
        return value


class RedisSettings(_Section):
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
                f"and needs {sizing.TIMEOUT_MARGIN}x that for a loaded instance"
            )
        return timeout

    @field_validator("ping_interval")
    @classmethod
    def _ping_range(cls, every: timedelta) -> timedelta:
        if not timedelta(milliseconds=100) <= every <= timedelta(minutes=5):
            raise ValueError(f"must be between 100ms and 5m, got {every}")
        return every


class DedupSettings(_Section):
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

    @field_validator("id")
    @classmethod
    def _known_strategy(cls, spec: str) -> str:
        return id_spec(spec)


def id_spec(spec: str) -> str:
    """A valid `[dedup] id` / `[coalesce] key` spec, or ValueError naming the choices."""
    kind, _, arg = spec.partition(":")
    if (kind in ("key", "hash") and not arg) or (kind in ("header", "json") and arg.strip()):
        return spec
    raise ValueError(
        f"unknown id strategy {spec!r}; use 'header:NAME', 'key', 'json:dotted.path' or 'hash'"
    )


class CoalesceSettings(_Section):
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


class FailureSettings(_Section):
    # "retry": re-fetch the raw record and forward it again; "release": only delete the mark.
    mode: Literal["retry", "release"] = "retry"
    max_attempts: int = Field(default=16, ge=1, le=1000)
    backoff_initial: Duration = timedelta(seconds=1)
    backoff_max: Duration = timedelta(minutes=5)


class DelaySettings(_Section):
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


class LaneSettings(_Section):
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


class MetricsSettings(_Section):
    host: str = "0.0.0.0"
    port: int = Field(default=9108, ge=0, le=65535)


class LogSettings(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_format: bool = Field(default=False, alias="json")


# A topic config's value as Kafka takes it (a string); numbers and booleans are written
# as Kafka spells them ("2", "true").
TopicConfigValue = str | int | float | bool
TOPIC_ROLES = ("raw", "clean", "delay", "failure", "quarantine", "dead_letter")
_TOPIC_CONFIG_NAME = re.compile(r"^[a-z][a-z0-9]*(?:\.[a-z0-9]+)*$")


def topic_config_text(value: TopicConfigValue) -> str:
    """A topic config value as Kafka reads it: `2` -> "2", `true` -> "true"."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class TopicRoleSettings(_Section):
    """`[topics.<role>]`: how `dedup-gateway topics --create` creates that role's topics."""

    # Topic configs (Kafka's names), over `[topics] config`.
    config: dict[str, TopicConfigValue] = Field(default_factory=dict)

    @field_validator("config")
    @classmethod
    def _kafka_topic_configs(
        cls, config: dict[str, TopicConfigValue]
    ) -> dict[str, TopicConfigValue]:
        return check_topic_configs(config)


def check_topic_configs(config: dict[str, TopicConfigValue]) -> dict[str, TopicConfigValue]:
    for name, value in config.items():
        if not _TOPIC_CONFIG_NAME.match(name):
            raise ValueError(
                f"{name!r} is not a Kafka topic config name (like 'min.insync.replicas')"
            )
        if name == "cleanup.policy" and topic_config_text(value) != "delete":
            # The failure loop re-reads raw records by offset; a compacted-away one is
            # skipped as raw_record_gone (gateway/ops/topics.py, CLEANUP).
            raise ValueError(
                f"cleanup.policy must stay 'delete', got {value!r}: the failure loop "
                "re-reads records by offset, and compaction removes them"
            )
    return config


class TopicsSettings(TopicRoleSettings):
    """`[topics]`: the topic configs `dedup-gateway topics --create` creates topics with
    (gateway/ops/topics.py); a topic that exists is never changed. Its own `config`:
    every topic's, over the gateway's own (retention.ms, cleanup.policy)."""

    # Per role, over `config`: `[topics.clean] config = {"min.insync.replicas" = 2}`.
    raw: TopicRoleSettings = TopicRoleSettings()
    clean: TopicRoleSettings = TopicRoleSettings()
    delay: TopicRoleSettings = TopicRoleSettings()
    failure: TopicRoleSettings = TopicRoleSettings()
    quarantine: TopicRoleSettings = TopicRoleSettings()
    dead_letter: TopicRoleSettings = TopicRoleSettings()

    def configs_for(self, role: str) -> dict[str, str]:
        """The configs set on a topic of `role` ("dead-letter" or "dead_letter"), as text."""
        section: TopicRoleSettings = getattr(self, role.replace("-", "_"))
        merged = {**self.config, **section.config}
        return {name: topic_config_text(value) for name, value in merged.items()}


class TomlSettings(BaseSettings):
    """Settings read from the environment, then a TOML file, then defaults.

    The base of the gateway's `Settings` and the Spark job's `SinkSettings`:
    both programs read one file, each the sections it knows. Build with `load`.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        extra="forbid",
        populate_by_name=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _TOML_FILE.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


class Settings(TomlSettings):
    """Every setting of the gateway. Build it with `load_settings`."""

    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    dedup: DedupSettings = DedupSettings()
    failures: FailureSettings = FailureSettings()
    delay: DelaySettings = DelaySettings()
    coalesce: CoalesceSettings = CoalesceSettings()
    # Priority lanes; none given: one lane of `[kafka] raw_topics` (see `_lanes`).
    lanes: list[LaneSettings] = Field(default_factory=list)
    metrics: MetricsSettings = MetricsSettings()
    log: LogSettings = LogSettings()
    # How `dedup-gateway topics --create` creates the topics (not read by `run`).
    topics: TopicsSettings = TopicsSettings()
    # Read by the Spark job (spark_sink.config); the gateway ignores it.
    spark: dict[str, Any] = Field(default_factory=dict)

    @field_validator("delay")
    @classmethod
    def _delay_within_ttl(cls, delay: DelaySettings, info: ValidationInfo) -> DelaySettings:
        # A record that waits longer than its mark lives would let a copy through.
        redis = info.data.get("redis")
        if delay.enabled and redis is not None and delay.max_delay > redis.ttl:
            raise ValueError(
                f"delay.max_delay ({delay.max_delay}) is longer than redis.ttl ({redis.ttl}): "
                "lower delay.max_delay or raise redis.ttl"
            )
        if delay.deliver_at_header == delay.deliver_after_header:
            raise ValueError("delay.deliver_at_header and deliver_after_header must differ")
        return delay

    @model_validator(mode="after")
    def _lanes(self) -> Settings:
        """`[[lanes]]` name the raw topics (then `[kafka] raw_topics` is their union);
        without them `[kafka] raw_topics` is one lane, `default`."""
        if not self.lanes:
            self.lanes = [LaneSettings(name="default", raw_topics=list(self.kafka.raw_topics))]
            return self
        if "raw_topics" in self.kafka.model_fields_set:
            raise ValueError("give the raw topics in [[lanes]] or in kafka.raw_topics, not both")
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"lanes: every lane needs its own name, got {names}")
        topics = [t for lane in self.lanes for t in lane.raw_topics]
        if len(set(topics)) != len(topics):
            raise ValueError("lanes: a raw topic may belong to one lane only")
        if self.delay.enabled and any(lane.clean_topic for lane in self.lanes):
            # Delay tiers are named after the one clean topic they deliver to.
            raise ValueError("lanes.clean_topic cannot be used with delay.enabled")
        self.kafka.raw_topics = topics
        return self

    @model_validator(mode="after")
    def _coalesce_needs_delay(self) -> Settings:
        c = self.coalesce
        if not c.enabled:
            return self
        if not self.delay.enabled:
            raise ValueError("coalesce.enabled needs delay.enabled: records wait in the tiers")
        if c.mode == "trailing" and c.max_window < c.window:
            raise ValueError("coalesce.max_window must be at least coalesce.window")
        # A record waits until its window's end plus grace: the wait, and so the mark's
        # life ([redis] ttl >= delay.max_delay), must hold it.
        what = "coalesce.max_window" if c.mode == "trailing" else "coalesce.window"
        if c.longest + c.grace > self.delay.max_delay:
            raise ValueError(
                f"{what} + coalesce.grace ({c.longest} + {c.grace}) is longer than "
                f"delay.max_delay ({self.delay.max_delay}): lower them or raise delay.max_delay "
                "(and [redis] ttl)"
            )
        return self

    def clean_topic_of(self, raw_topic: str) -> str:
        """Where the clean copies of `raw_topic`'s records go (its lane's, or the one)."""
        for lane in self.lanes:
            if raw_topic in lane.raw_topics:
                return lane.clean_topic or self.kafka.clean_topic
        return self.kafka.clean_topic

    @property
    def quorum(self) -> int:
        """m = N//2 + 1: how many members make a majority."""
        return len(self.redis.nodes) // 2 + 1


# The TOML path for the settings being built; pydantic-settings reads sources
# from the class, so the path is handed over here for the duration of one load.
_TOML_FILE: ContextVar[Path | None] = ContextVar("toml_file", default=None)

S = TypeVar("S", bound=TomlSettings)


def config_path(path: Path | None) -> Path | None:
    """`path`, else `$GATEWAY_CONFIG` when set, else None (defaults and environment only)."""
    if path is None and os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    return path


def load(cls: type[S], path: Path | None = None, **overrides: Any) -> S:
    """Build and validate `cls` from `path` (or `$GATEWAY_CONFIG`), the environment and
    `overrides` (whole sections, highest priority). Raises ConfigError naming the setting
    (and the environment variable, when the value came from one)."""
    path = config_path(path)
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    token = _TOML_FILE.set(path)
    try:
        return cls(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, cls, overrides)) from None
    except SettingsError as exc:  # an environment variable that is not the JSON its field takes
        raise ConfigError(f"cannot read configuration: {_env_not_json(exc, cls)}") from None
    except ValueError as exc:  # malformed TOML
        raise ConfigError(f"cannot read configuration: {exc}") from None
    finally:
        _TOML_FILE.reset(token)


def load_settings(path: Path | None = None, **overrides: Any) -> Settings:
    """The gateway's settings (see `load`)."""
    return load(Settings, path, **overrides)


def env_name(*where: str) -> str:
    """The environment variable that overrides a setting: `env_name("kafka", "group_id")`
    is `GATEWAY_KAFKA__GROUP_ID`."""
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(part.upper() for part in where)


Loc = tuple[int | str, ...]


def _describe(
    exc: ValidationError, cls: type[BaseModel], overrides: Mapping[str, Any] | None = None
) -> str:
    """One phrase per problem, `; `-joined on one line: `invalid setting redis.nodes: needs an
    odd number of members ...`, `unknown key `bootstrap_server` in [kafka]; did you mean
    `bootstrap_servers`?`, each naming the environment variable the value came from."""
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        variable = _env_origin(loc, overrides or {})
        origin = f" (environment variable {variable})" if variable else ""
        if error["type"] == "extra_forbidden" and loc:
            lines.append(_unknown(cls, loc, error["input"], origin))
            continue
        where = ".".join(str(part) for part in loc)
        message = error["msg"].removeprefix("Value error, ")
        # A rule across sections has no one location; its message names the settings.
        lines.append(
            f"invalid setting {where}{origin}: {message}" if where else f"invalid: {message}"
        )
    return "; ".join(lines)


def _unknown(cls: type[BaseModel], loc: Loc, value: Any, origin: str) -> str:
    """`unknown key `bootstrap_server` in [kafka]; did you mean `bootstrap_servers`?`"""
    *parent, key = loc
    model = _model_at(cls, parent)
    known = [] if model is None else _keys(model)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if not parent:
        kind = "section" if isinstance(value, dict) else "top-level key"
        text = f"unknown {kind} [{key}]" if kind == "section" else f"unknown {kind} `{key}`"
        return text + origin + (f"; did you mean [{close[0]}]?" if close else "")
    return f"unknown key `{key}` in {_table(parent)}{origin}" + (
        f"; did you mean `{close[0]}`?" if close else ""
    )


def _table(parent: Sequence[int | str]) -> str:
    """How the TOML names a table: `[kafka]`, `[kafka.client]`, `[[lanes]] #2`."""
    names = [str(part) for part in parent if not isinstance(part, int)]
    items = [part for part in parent if isinstance(part, int)]
    if items:
        return f"[[{'.'.join(names)}]] #{items[-1] + 1}"
    return f"[{'.'.join(names)}]"


def _keys(model: type[BaseModel]) -> list[str]:
    """Every key a section takes: field names and their aliases."""
    return sorted(
        {name for name in model.model_fields}
        | {f.alias for f in model.model_fields.values() if f.alias}
    )


def _field_annotation(model: type[BaseModel], key: str) -> Any:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field.annotation
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The settings model an annotation holds: itself, or the item of a list or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _model_at(cls: type[BaseModel], path: Sequence[int | str]) -> type[BaseModel] | None:
    """The section model at `path` (list indices skipped), or None (a free-form table)."""
    model: type[BaseModel] | None = cls
    for part in path:
        if isinstance(part, int):
            continue
        if model is None:
            return None
        model = _model_in(_field_annotation(model, part))
    return model


def _holds(data: Any, path: Sequence[int | str]) -> bool:
    """Whether `path` (keys and list indices) leads somewhere in `data`."""
    for part in path:
        in_list = isinstance(part, int) and isinstance(data, list) and 0 <= part < len(data)
        if not (in_list or (isinstance(data, dict) and part in data)):
            return False
        data = data[part]
    return True


def _environment() -> dict[str, str]:
    """Lower-cased name -> name, for the variables with the prefix (matched without case,
    as pydantic-settings does)."""
    return {name.lower(): name for name in os.environ if name.upper().startswith(ENV_PREFIX)}


def _env_origin(loc: Loc, overrides: Mapping[str, Any]) -> str | None:
    """The environment variable the value at `loc` came from, or None (file or default).

    `GATEWAY_REDIS__TTL` for `redis.ttl`; for a deeper location, a variable holding JSON
    for a table or list above it (`GATEWAY_REDIS__NODES` for `redis.nodes.0`) when the
    JSON has that location. Overrides given to `load` win over the environment."""
    if _holds(overrides, loc):
        return None
    environment = _environment()
    for end in range(len(loc), 0, -1):
        head = loc[:end]
        if any(isinstance(part, int) for part in head):
            continue
        variable = environment.get(env_name(*(str(part) for part in head)).lower())
        if variable is None:
            continue
        if end == len(loc):
            return variable
        try:
            value = json.loads(os.environ[variable])
        except ValueError:
            return None
        return variable if _holds(value, loc[end:]) else None
    return None


def _takes_json(annotation: Any) -> bool:
    """Whether pydantic-settings reads this field's environment variable as JSON."""
    if _model_in(annotation) is not None:
        return True
    if get_origin(annotation) in (list, dict, set, tuple):
        return True
    return any(_takes_json(arg) for arg in get_args(annotation) if arg is not type(None))


def _env_not_json(exc: SettingsError, cls: type[BaseModel]) -> str:
    """Which variable is not the JSON its field takes (never its value: it may be secret)."""
    field = re.search(r'field "(\w+)"', str(exc))
    if field is None:
        return str(exc)
    prefix = env_name(field[1]).lower()
    culprits = []
    for lowered, variable in sorted(_environment().items()):
        if lowered != prefix and not lowered.startswith(prefix + ENV_NESTED_DELIMITER.lower()):
            continue
        path = lowered.removeprefix(ENV_PREFIX.lower()).split(ENV_NESTED_DELIMITER.lower())
        *parent, key = path
        model = _model_at(cls, parent)
        annotation = None if model is None else _field_annotation(model, key)
        if annotation is None or not _takes_json(annotation):
            continue
        try:
            json.loads(os.environ[variable])
        except ValueError as not_json:
            culprits.append(
                f"environment variable {variable} must be JSON for {'.'.join(path)} "
                f"(a list or table): {not_json}"
            )
    return "; ".join(culprits) or str(exc)


class _Schema(GenerateJsonSchema):
    """Defaults written as the file spells them (`"24h"`, not ISO 8601's `"P1D"`)."""

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, timedelta):
            return format_duration(dft)
        return super().encode_default(dft)


def json_schema(sections: Mapping[str, type[BaseModel]] | None = None) -> dict[str, Any]:
    """The JSON Schema of the settings file (`dedup-gateway config-schema`): the gateway's
    sections, with `sections` (e.g. the Spark job's `[spark]`) in place of the tables the
    gateway leaves to another program."""
    sections = dict(sections or {})
    models: list[type[BaseModel]] = [Settings, *sections.values()]
    refs, top = models_json_schema(
        [(model, "validation") for model in models], schema_generator=_Schema
    )
    definitions = top["$defs"]
    schema: dict[str, Any] = definitions.pop(Settings.__name__)
    for name, model in sections.items():
        schema["properties"][name] = {**refs[(model, "validation")], "default": {}}
    schema.pop("title", None)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "dedup-gateway settings",
        **schema,
        "description": (
            "The TOML file of `--config` (or $GATEWAY_CONFIG); every key can be overridden "
            f"by an environment variable {ENV_PREFIX}<SECTION>{ENV_NESTED_DELIMITER}<KEY> "
            "(docs/configuration.md)."
        ),
        "$defs": definitions,
    }


def effective(settings: BaseSettings) -> dict[str, Any]:
    """The settings as plain data, secrets masked (`check-config`, the start-up log)."""
    data: dict[str, Any] = settings.model_dump(mode="json", by_alias=True)
    if "kafka" in data:
        data["kafka"]["client"] = client_properties.masked(data["kafka"]["client"])
    if isinstance(settings, Settings):
        data["redis"]["nodes"] = [masked(n) for n in settings.redis.nodes]
        # The raw topics once (both would not load back): as `[kafka] raw_topics` when
        # the lanes are the one lane that stands for it, else as `[[lanes]]`.
        # Only the roles given a config: the others are the default, an empty table.
        data["topics"] = {
            role: table
            for role, table in data["topics"].items()
            if role == "config" or table["config"]
        }
        if settings.lanes == [LaneSettings(name="default", raw_topics=settings.kafka.raw_topics)]:
            del data["lanes"]
        else:
            del data["kafka"]["raw_topics"]
    return data
