"""The Spark job's settings: the `[kafka]` and `[spark]` sections of the gateway's TOML file.

Same sources and priorities as `gateway.config`: environment variables
(`GATEWAY_` prefix, `__` between levels, e.g. `GATEWAY_SPARK__MAX_RECORDS_PER_BATCH=500`),
then the TOML file, then the defaults below. The gateway's other sections
(`[redis]`, `[dedup]`, ...) are ignored here, so both programs read one file.
A bad value raises `gateway.config.ConfigError` naming the setting.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from gateway.config import ENV_PREFIX, ConfigError, Duration, KafkaSettings, _describe

DEFAULT_HANDLER = "spark_sink.handlers:orders"


class SparkSettings(BaseModel):
    """The `[spark]` table."""

    model_config = ConfigDict(extra="forbid")

    # Offsets, state (the dedup-id window) and release-command markers live here.
    # Keep it on a local or shared POSIX path: the release markers are plain files.
    checkpoint_dir: Path = Path("var/spark/checkpoint")
    # Successful records land in `<output_path>/batch_id=<n>/` (Parquet). Any Hadoop
    # URI Spark can write works (file:, hdfs:, s3a: with its connector on the classpath).
    output_path: str = "var/spark/output"
    # "module:function" called once per micro-batch; see spark_sink.handlers.
    handler: str = DEFAULT_HANDLER
    # When set, `handler` names a factory called with these keyword arguments.
    handler_options: dict[str, Any] = Field(default_factory=dict)
    # Upper bound on records read per micro-batch, spread over partitions
    # (Spark's maxOffsetsPerTrigger).
    max_records_per_batch: int = Field(default=10_000, ge=1, le=10_000_000)
    trigger_interval: Duration = timedelta(seconds=1)
    # How long a (dedup-id, attempt) is remembered to drop the gateway's crash-window
    # duplicates; measured in processing time (micro-batch start), not record time.
    dedup_watermark: Duration = timedelta(minutes=10)
    # "auto": Spark's own Kafka connector when its classes are on the classpath,
    # else the Python source in spark_sink.kafka_source.
    source: Literal["auto", "native", "python"] = "auto"
    starting_offsets: Literal["earliest", "latest"] = "earliest"
    # None leaves the master to spark-submit (or Spark's default, local[*]).
    master: str | None = None
    app_name: str = "dedup-spark-sink"
    # Extra Spark configuration, e.g. {"spark.sql.shuffle.partitions" = "4"}.
    conf: dict[str, str] = Field(default_factory=dict)

    @field_validator("handler")
    @classmethod
    def _module_colon_name(cls, spec: str) -> str:
        module, _, name = spec.partition(":")
        if not module.strip() or not name.strip():
            raise ValueError(f"expected 'module:function', got {spec!r}")
        return spec

    @field_validator("trigger_interval", "dedup_watermark")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError(f"must be positive, got {value}")
        return value


class SinkSettings(BaseSettings):
    """Every setting the Spark job reads. Build it with `load_sink_settings`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="ignore"
    )

    kafka: KafkaSettings = KafkaSettings()
    spark: SparkSettings = SparkSettings()

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


# Handed to settings_customise_sources for the duration of one load (as in gateway.config).
_TOML_FILE: dict[str, Path] = {}


def load_sink_settings(path: Path | None = None, **overrides: Any) -> SinkSettings:
    """Build and validate the settings from `path`, the environment and `overrides`.

    `overrides` are whole sections, e.g. `spark={"output_path": "/tmp/out"}`.
    """
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    _TOML_FILE.clear()
    if path is not None:
        _TOML_FILE["path"] = path
    try:
        return SinkSettings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except ValueError as exc:  # malformed TOML or env JSON
        raise ConfigError(f"cannot read configuration: {exc}") from None
    finally:
        _TOML_FILE.clear()


def kafka_client_config(kafka: KafkaSettings) -> dict[str, str]:
    """librdkafka (confluent-kafka) connection and security options from `[kafka]`."""
    config = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "security.protocol": kafka.security_protocol.lower(),
    }
    if kafka.sasl_mechanism:
        config["sasl.mechanism"] = kafka.sasl_mechanism
    if kafka.sasl_username is not None:
        config["sasl.username"] = kafka.sasl_username
    if kafka.sasl_password is not None:
        config["sasl.password"] = kafka.sasl_password.get_secret_value()
    for key, path in (
        ("ssl.ca.location", kafka.ssl_cafile),
        ("ssl.certificate.location", kafka.ssl_certfile),
        ("ssl.key.location", kafka.ssl_keyfile),
    ):
        if path is not None:
            config[key] = str(path)
    return config
