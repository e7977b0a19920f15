"""One validated settings object, built before anything connects.

Sources, highest priority first: environment variables (`GATEWAY_` prefix, `__`
between levels, e.g. `GATEWAY_REDIS__TTL=12h`), the TOML file given with
`--config` (or named by `$GATEWAY_CONFIG`), then the defaults below. A bad value stops start-up with
`ConfigError`, whose message names the setting.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from gateway import client_properties
from gateway.errors import ConfigError
from gateway.masking import masked_tree
from gateway.member_urls import masked
from gateway.settings.describe import describe, env_not_json
from gateway.settings.kafka import (
    TOPIC_ROLES,
    KafkaSettings,
    TopicRoleSettings,
    TopicsSettings,
    check_topic_configs,
    topic_config_text,
)
from gateway.settings.sections import (
    CoalesceSettings,
    DedupSettings,
    DelaySettings,
    FailureSettings,
    LaneSettings,
    LogSettings,
    MetricsSettings,
    RedisSettings,
    id_spec,
)
from gateway.settings.spark import SparkSettings
from gateway.settings.values import (
    CONFIG_ENV,
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    Duration,
    env_name,
    format_duration,
    parse_duration,
)

__all__ = [
    "CONFIG_ENV", "ENV_NESTED_DELIMITER", "ENV_PREFIX", "TOPIC_ROLES", "CoalesceSettings",
    "ConfigError", "DedupSettings", "DelaySettings", "Duration", "FailureSettings",
    "KafkaSettings", "LaneSettings", "LogSettings", "MetricsSettings", "RedisSettings",
    "Settings", "SinkSettings", "SparkSettings", "TopicRoleSettings", "TopicsSettings",
    "check_topic_configs", "effective", "env_name", "format_duration", "id_spec",
    "json_schema", "load", "load_settings", "load_sink_settings", "parse_duration",
    "topic_config_text",
]  # fmt: skip


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

    @property
    def source_file(self) -> Path | None:
        """The TOML file these settings were read from (`load`), for hints that name it
        (`dedup-gateway topics --create --config FILE`)."""
        return self._source_file

    _source_file: Path | None = PrivateAttr(default=None)


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
    # Read by the Spark job (spark_sink/); the gateway only validates it.
    spark: SparkSettings = SparkSettings()

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
        settings = cls(**overrides)
        settings._source_file = path
        return settings
    except ValidationError as exc:
        raise ConfigError(describe(exc, cls, overrides)) from None
    except SettingsError as exc:  # an environment variable that is not the JSON its field takes
        raise ConfigError(f"cannot read configuration: {env_not_json(exc, cls)}") from None
    except ValueError as exc:  # malformed TOML
        raise ConfigError(f"cannot read configuration: {exc}") from None
    finally:
        _TOML_FILE.reset(token)


def load_settings(path: Path | None = None, **overrides: Any) -> Settings:
    """The gateway's settings (see `load`)."""
    return load(Settings, path, **overrides)


class SinkSettings(TomlSettings):
    """Every setting the Spark job reads (spark_sink/). Build it with `load_sink_settings`."""

    # The gateway's own sections ([redis], [dedup], ...) are in the same file.
    model_config = SettingsConfigDict(extra="ignore")

    kafka: KafkaSettings = KafkaSettings()
    spark: SparkSettings = SparkSettings()
    log: LogSettings = LogSettings()
    # Read only to know which of the gateway's paths write the clean topic outside a
    # transaction (`[spark] delivery_dedup = "auto"`).
    failures: FailureSettings = FailureSettings()
    delay: DelaySettings = DelaySettings()
    coalesce: CoalesceSettings = CoalesceSettings()


def load_sink_settings(path: Path | None = None, **overrides: Any) -> SinkSettings:
    """Build and validate the Spark job's settings from `path`, the environment and
    `overrides` (whole sections, e.g. `spark={"output_path": "/tmp/out"}`)."""
    return load(SinkSettings, path, **overrides)


class _Schema(GenerateJsonSchema):
    """Defaults written as the file spells them (`"24h"`, not ISO 8601's `"P1D"`)."""

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, timedelta):
            return format_duration(dft)
        return super().encode_default(dft)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the settings file (`dedup-gateway config-schema`): every
    section, `[spark]` too."""
    schema: dict[str, Any] = Settings.model_json_schema(schema_generator=_Schema)
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
    }


def effective(settings: BaseSettings) -> dict[str, Any]:
    """The settings as plain data, secrets masked (`check-config`, the start-up log)."""
    data: dict[str, Any] = settings.model_dump(mode="json", by_alias=True)
    if "kafka" in data:
        data["kafka"]["client"] = client_properties.masked(data["kafka"]["client"])
    if isinstance(data.get("spark"), dict):  # the Spark job's table (settings/spark.py)
        spark = data["spark"]
        if isinstance(spark.get("dedup_redis"), str):
            spark["dedup_redis"] = masked(spark["dedup_redis"])
        for table in ("conf", "handler_options"):  # secret names, URLs with passwords
            if table in spark:
                spark[table] = masked_tree(spark[table])
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
