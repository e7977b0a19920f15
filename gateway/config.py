"""One validated settings object, built before anything connects.

Sources, highest priority first: environment variables (`GATEWAY_` prefix, `__`
between levels, e.g. `GATEWAY_REDIS__TTL=12h`), the TOML file given with
`--config`, then the defaults below. A bad value stops start-up with
`ConfigError`, whose message names the setting.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RedisDsn,
    SecretStr,
    ValidationError,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

ENV_PREFIX = "GATEWAY_"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> timedelta:
    """`"24h"`, `"500ms"`, `"30s"`, `"7d"`, a number of seconds, or a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=value)
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return timedelta(seconds=float(match[1]) * _UNIT_SECONDS[match[2]])
    raise ValueError(f"expected a duration like '24h', '500ms' or '30s', got {value!r}")


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


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
    # Most records fetched and voted on in one batch (one script call per instance).
    max_batch_records: int = Field(default=2000, ge=1, le=100_000)
    # Longest a fetch waits at the broker for new records; bounds latency on
    # brokers that hold a fetch for its whole wait (Tansu does) and sets the
    # idle fetch rate elsewhere (Apache Kafka answers as soon as data arrives).
    fetch_max_wait: Duration = timedelta(milliseconds=100)
    # A member silent this long (e.g. killed) is dropped from the group and its
    # partitions move on; heartbeats go every third of it.
    session_timeout: Duration = timedelta(seconds=10)
    # Passed through to aiokafka; see the README's security section.
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    # Apache Kafka supports idempotent producers; the local test broker does not.
    producer_idempotence: bool = False

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port_list(cls, value: str) -> str:
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"expected host:port[,host:port...], got {value!r}")
        return value


class RedisSettings(_Section):
    nodes: list[RedisDsn] = Field(default_factory=lambda: [RedisDsn("redis://127.0.0.1:6379/0")])
    # The dedup window: how long a mark lives. Set atomically with the claim.
    ttl: Duration = timedelta(hours=24)
    key_prefix: str = Field(default="dd:", max_length=32)
    # Hash buckets per time slice that marks are spread over (gateway/keys.py):
    # aim for a few hundred marks per bucket at most, i.e. about
    # distinct ids per ttl / 2 / 300. Each live bucket costs about one Redis key.
    buckets: int = Field(default=16_384, ge=1, le=2**24)
    # Per-instance bound on one script call; a slower instance counts as no answer.
    timeout: Duration = timedelta(milliseconds=500)

    @field_validator("nodes")
    @classmethod
    def _odd_count(cls, nodes: list[RedisDsn]) -> list[RedisDsn]:
        if len(nodes) % 2 == 0:
            raise ValueError(f"needs an odd number of instances (1, 3, 5, ...), got {len(nodes)}")
        if len({(n.host, n.port, n.path) for n in nodes}) != len(nodes):
            raise ValueError("lists the same instance twice")
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
        if not timedelta(milliseconds=1) <= timeout <= timedelta(seconds=60):
            raise ValueError(f"must be between 1ms and 60s, got {timeout}")
        return timeout


class DedupSettings(_Section):
    # false: forward every record with an id, no Redis calls (the benchmark's ceiling).
    enabled: bool = True
    # Where the message id comes from: "header:NAME", "key", "json:dotted.path", "hash".
    id: str = "header:message-id"
    # What to do with a record no majority decides (instances down, split vote).
    on_no_quorum: Literal["block", "forward", "drop"] = "block"
    # Ids longer than this are bad input (quarantined), not silently truncated.
    max_id_bytes: int = Field(default=1024, ge=1, le=1_048_576)
    # Backoff while a partition is blocked on an undecided vote.
    retry_backoff_initial: Duration = timedelta(milliseconds=100)
    retry_backoff_max: Duration = timedelta(seconds=5)

    @field_validator("id")
    @classmethod
    def _known_strategy(cls, spec: str) -> str:
        kind, _, arg = spec.partition(":")
        if (kind in ("key", "hash") and not arg) or (kind in ("header", "json") and arg.strip()):
            return spec
        raise ValueError(
            f"unknown id strategy {spec!r}; use 'header:NAME', 'key', 'json:dotted.path' or 'hash'"
        )


class FailureSettings(_Section):
    # "retry": re-fetch the raw record and forward it again; "release": only delete the mark.
    mode: Literal["retry", "release"] = "retry"
    max_attempts: int = Field(default=16, ge=1, le=1000)
    backoff_initial: Duration = timedelta(seconds=1)
    backoff_max: Duration = timedelta(minutes=5)


class MetricsSettings(_Section):
    host: str = "0.0.0.0"
    port: int = Field(default=9108, ge=0, le=65535)


class LogSettings(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    json_format: bool = Field(default=False, alias="json")


class Settings(BaseSettings):
    """Every setting of the gateway. Build it with `load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", populate_by_name=True
    )

    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    dedup: DedupSettings = DedupSettings()
    failures: FailureSettings = FailureSettings()
    metrics: MetricsSettings = MetricsSettings()
    log: LogSettings = LogSettings()
    # Read by the Spark job (spark_sink.config); the gateway ignores it.
    spark: dict[str, Any] = Field(default_factory=dict)

    @property
    def quorum(self) -> int:
        """m = N//2 + 1: how many instances make a majority."""
        return len(self.redis.nodes) // 2 + 1

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _TOML_FILE.get("path")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


# The TOML path for the settings being built; pydantic-settings reads sources
# from the class, so the path is handed over here for the duration of one load.
_TOML_FILE: dict[str, Path] = {}


class ConfigError(ValueError):
    """Invalid configuration; the message names the setting."""


def load_settings(path: Path | None = None, **overrides: Any) -> Settings:
    """Build and validate the settings from `path`, the environment and `overrides`."""
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    _TOML_FILE.clear()
    if path is not None:
        _TOML_FILE["path"] = path
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except ValueError as exc:  # malformed TOML or env JSON
        raise ConfigError(f"cannot read configuration: {exc}") from None
    finally:
        _TOML_FILE.clear()


def _describe(exc: ValidationError) -> str:
    """One line per problem: `redis.nodes: needs an odd number of instances ...`."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"invalid setting {where}: {message}")
    return "; ".join(lines)


def redacted(url: RedisDsn) -> str:
    """`host:port/db` of a Redis URL, never its password: safe to log and label."""
    return f"{url.host}:{url.port or 6379}{url.path or ''}"
