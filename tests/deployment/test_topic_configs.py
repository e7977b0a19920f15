"""`[topics]` topic configs: `dedup-gateway topics --create` creates every topic with
them (per role over the section's), read back from a real Apache Kafka broker with
DescribeConfigs, and `check-config --connect` names a topic that lacks one.

The tests are synchronous: the CLI runs its own event loop (uvloop.run), as it does
from a shell; the admin calls around it run in asyncio.run."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from gateway.cli import main
from gateway.config import TOPIC_ROLES, ConfigError, load_settings
from gateway.kafka.admin import admin_client
from gateway.ops import check_kafka
from gateway.ops.findings import Finding
from gateway.ops.topics import needed_topics

SEVEN_DAYS_MS = str(7 * 86_400_000)


def _config(tmp_path: Path, broker: str, names: Callable[[str], str], topics: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{broker}"\nraw_topics = ["{names("raw")}"]\n'
        f'clean_topic = "{names("clean")}"\nfailure_topic = "{names("failures")}"\n'
        f'quarantine_topic = "{names("quarantine")}"\n'
        f'dead_letter_topic = "{names("dead-letter")}"\ngroup_id = "{names("group")}"\n'
        '[redis]\nnodes = ["redis://127.0.0.1:1/0"]\n' + topics
    )
    return path


TOPICS = """
[topics]
config = {"compression.type" = "zstd", "max.message.bytes" = 2097152}

[topics.clean]
config = {"compression.type" = "lz4", "message.timestamp.type" = "LogAppendTime"}

[topics.raw]
config = {"retention.ms" = 259200000}
"""


async def _describe(broker: str, topics: list[str]) -> dict[str, dict[str, str]]:
    """Every config of each topic, once the broker knows them all (a topic just created
    may be UNKNOWN_TOPIC_OR_PARTITION, code 3, to DescribeConfigs for a moment)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=broker)
    await admin.start()
    out: dict[str, dict[str, str]] = {}
    try:

        async def described() -> bool:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name) for name in topics]
            )
            codes = set()
            for response in responses:
                for code, _message, _type, name, entries in response.resources:
                    codes.add(code)
                    out[name] = {entry[0]: entry[1] for entry in entries}
            assert codes <= {0, 3}, codes
            return codes == {0}

        await until(described, what=f"DescribeConfigs knows {topics}")
    finally:
        await admin.close()
    return out


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30) -> None:
    """Ask again until `condition` holds (the broker's metadata catches up); fail after
    `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout_s}s: {what}"
        await asyncio.sleep(0.05)


async def _topic_findings(broker: str, config: Path) -> list[Finding]:
    """check-config --connect's topic findings (its group findings need a coordinator,
    which a broker that just started may not have yet: not this test's business)."""
    admin = admin_client(load_settings(config).kafka)
    await admin.start()
    try:
        return await check_kafka.topic_findings(admin, load_settings(config))
    finally:
        await admin.close()


async def _create(broker: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=broker)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        await admin.close()


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_topics_create_sets_each_roles_configs_over_the_sections(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    config = _config(tmp_path, broker, names, TOPICS)
    code, out = _cli("topics", "--create", "--partitions", "2", "--config", str(config))
    assert code == 0, out
    specs = needed_topics(load_settings(config), 2)
    described = asyncio.run(_describe(broker, [s.name for s in specs]))
    by_role = {spec.role: described[spec.name] for spec in specs}
    assert set(by_role) == {"raw", "clean", "failure", "quarantine", "dead-letter"}
    for role, got in by_role.items():
        assert got["cleanup.policy"] == "delete", role
        assert got["max.message.bytes"] == "2097152", role  # [topics] config: every topic
    assert by_role["clean"]["compression.type"] == "lz4"  # the role's over the section's
    assert by_role["clean"]["message.timestamp.type"] == "LogAppendTime"
    assert by_role["raw"]["compression.type"] == "zstd"
    assert by_role["raw"]["retention.ms"] == "259200000"  # over the gateway's 7 days
    assert by_role["failure"]["retention.ms"] == SEVEN_DAYS_MS
    assert by_role["quarantine"]["message.timestamp.type"] == "CreateTime"  # the default


def test_the_table_and_json_show_the_configured_configs(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    config = _config(tmp_path, broker, names, TOPICS)
    code, out = _cli("topics", "--config", str(config))
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[-1] == "configs"
    (clean,) = [row for row in rows if row.startswith(names("clean") + " ")]
    assert clean.endswith("compression.type=lz4,max.message.bytes=2097152,"
                          "message.timestamp.type=LogAppendTime")  # fmt: skip
    code, out = _cli("topics", "--output", "json", "--config", str(config))
    rows_json = {row["role"]: row for row in json.loads(out)}
    assert rows_json["raw"]["config"] == {
        "compression.type": "zstd", "max.message.bytes": "2097152", "retention.ms": "259200000",
    }  # fmt: skip


def test_check_config_connect_names_a_topic_created_without_a_configured_config(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    """A topic that existed before the setting keeps its configs (never altered):
    --connect says which config differs and how to change it."""
    config = _config(tmp_path, broker, names, TOPICS)
    asyncio.run(_create(broker, names("clean")))
    asyncio.run(_describe(broker, [names("clean")]))  # the broker knows it
    code, _ = _cli("topics", "--create", "--config", str(config))
    assert code == 0
    clean = asyncio.run(_describe(broker, [names("clean")]))[names("clean")]
    assert clean["compression.type"] == "producer", "an existing topic is left as it is"
    findings = asyncio.run(_topic_findings(broker, config))
    lines = [f.line() for f in findings if f.where == f"topic {names('clean')}"]
    assert any(
        "compression.type is producer, [topics] asks for lz4" in line
        and f"--entity-name {names('clean')} --add-config compression.type=lz4" in line
        for line in lines
    ), lines
    others = [f.line() for f in findings if f.where == f"topic {names('raw')}"]
    assert not [line for line in others if "[topics] asks" in line], others


def test_every_role_a_topic_can_have_has_its_table() -> None:
    roles = {spec.role.replace("-", "_") for spec in needed_topics(
        load_settings(delay={"enabled": True}))}  # fmt: skip
    assert roles == set(TOPIC_ROLES)


@pytest.mark.parametrize(
    ("topics", "says"),
    [
        ('[topics.clean]\nconfig = {"cleanup.policy" = "compact"}\n', "cleanup.policy must"),
        ('[topics]\nconfig = {"Min Insync" = 2}\n', "not a Kafka topic config name"),
        ("[topics.dead-letter]\nconfig = {}\n", "unknown key `dead-letter` in [topics]"),
    ],
)
def test_a_config_kafka_would_refuse_or_the_gateway_cannot_live_with_is_refused(
    tmp_path: Path, topics: str, says: str
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(topics)
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        load_settings(path)
