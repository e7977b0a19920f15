"""`[kafka]` and `[topics]`: the broker, the topics the gateway reads and writes, and
how `dedup-gateway topics --create` creates them."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from gateway import client_properties
from gateway.settings.values import Duration, Section


class KafkaSettings(Section):
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
    # How long SIGTERM's drain (finish, commit, leave the group) may take: past it the
    # gateway leaves what is in flight, uncommitted (read again at the next start, as
    # after a crash), and exits 1. Keep it under the platform's own grace period
    # (Kubernetes' terminationGracePeriodSeconds) less 10 s.
    drain_timeout: Duration = Field(
        default=timedelta(seconds=30), ge=timedelta(seconds=1), le=timedelta(minutes=10)
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


class TopicRoleSettings(Section):
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
