"""A new deployment's first commands against real servers: `topics` prints and
creates what a config needs, `check-config --connect` reaches every Redis member
and the broker and names what is missing, refused, down or unsafe."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from devtools.harness import redis_urls
from gateway.cli import main
from tests.deployment.test_redis_acl import documented_acl


def write_config(
    path: Path, broker: str, prefix: str, nodes: list[str], delay: bool = False
) -> Path:
    """Without `delay`: two lanes (one with its own clean topic) and delay off; with
    it: one raw topic and the delay tiers on."""
    kafka = [
        "[kafka]",
        f'bootstrap_servers = "{broker}"',
        *([f'raw_topics = ["{prefix}-raw"]'] if delay else []),
        f'clean_topic = "{prefix}-clean"',
        f'failure_topic = "{prefix}-failures"',
        f'quarantine_topic = "{prefix}-quarantine"',
        f'dead_letter_topic = "{prefix}-dead"',
        f'group_id = "{prefix}-group"',
        "[redis]",
        "nodes = [" + ", ".join(f'"{n}"' for n in nodes) + "]",
        "[delay]",
        f"enabled = {'true' if delay else 'false'}",
        'tiers = ["1s", "1m"]',
    ]
    lanes = [
        "[[lanes]]",
        'name = "orders"',
        f'raw_topics = ["{prefix}-orders"]',
        f'clean_topic = "{prefix}-orders-clean"',
        "[[lanes]]",
        'name = "bulk"',
        f'raw_topics = ["{prefix}-bulk"]',
    ]
    path.write_text("\n".join(kafka if delay else kafka + lanes) + "\n")
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def bounded(servers: list) -> None:
    """maxmemory set (noeviction is redis-server's default): no warning about it."""
    for server in servers:
        with redis.Redis(port=server.port) as r:
            r.config_set("maxmemory", "100mb")


def test_topics_prints_the_table_and_creates_the_missing_ones(broker, names, tmp_path, capsys):
    prefix = names("first")
    config = str(write_config(tmp_path / "g.toml", broker, prefix, ["redis://127.0.0.1:1/0"]))
    wanted = [
        f"{prefix}-orders",
        f"{prefix}-bulk",
        f"{prefix}-orders-clean",
        f"{prefix}-clean",
        f"{prefix}-failures",
        f"{prefix}-quarantine",
        f"{prefix}-dead",
    ]
    code, table = run(capsys, "topics", "--config", config)
    assert code == 0
    for name in wanted:
        assert f"\n{name} " in table
    assert table.startswith("topic")

    code, out = run(capsys, "topics", "--config", config, "--create", "--dry-run")
    assert code == 0
    assert {f"would create {n}" for n in wanted} <= set(out.splitlines())
    code, out = run(capsys, "topics", "--config", config, "--check")
    assert code == 1 and out.count("MISSING") == len(wanted)  # the dry run created none

    code, out = run(capsys, "topics", "--config", config, "--create", "--partitions", "3")
    assert code == 0
    assert {f"created {n}" for n in wanted} <= set(out.splitlines())
    code, out = run(capsys, "topics", "--config", config, "--check", "--partitions", "3")
    assert code == 0 and "MISSING" not in out
    assert f"{prefix}-orders " in out and "exists, 3 partitions" in out
    code, out = run(capsys, "topics", "--config", config, "--create")
    assert (code, out.splitlines()[-1]) == (0, "every topic exists")


def test_topics_creates_the_delay_tiers_with_a_retention_past_the_largest(
    broker, names, tmp_path, capsys
):
    prefix = names("tiers")
    config = str(
        write_config(tmp_path / "g.toml", broker, prefix, ["redis://127.0.0.1:1/0"], delay=True)
    )
    code, out = run(capsys, "topics", "--config", config, "--create", "--output", "json")
    assert code == 0
    import json

    report = json.loads(out)
    tiers = {t["name"]: t for t in report["topics"] if t["role"] == "delay"}
    assert set(tiers) == {f"{prefix}-clean.delay.1s", f"{prefix}-clean.delay.1m"}
    assert set(report["created"]) >= set(tiers)
    assert all(t["retention"] == "7d" and t["cleanup"] == "delete" for t in tiers.values())
    configs = asyncio.run(_retention(broker, f"{prefix}-clean.delay.1m"))
    # Apache Kafka describes every config of the topic; these two are what was set.
    assert {key: configs.get(key) for key in ("retention.ms", "cleanup.policy")} == {
        "retention.ms": str(7 * 86_400_000),
        "cleanup.policy": "delete",
    }


async def _retention(broker: str, topic: str) -> dict[str, str]:
    from aiokafka.admin import AIOKafkaAdminClient

    from gateway.ops.check_kafka import _topic_configs

    admin = AIOKafkaAdminClient(bootstrap_servers=broker)
    await admin.start()
    try:
        # Created by the controller, known to the broker a moment later.
        for _ in range(100):
            if topic in (configs := await _topic_configs(admin, [topic])):
                return configs[topic]
            await asyncio.sleep(0.05)
        return (await _topic_configs(admin, [topic]))[topic]
    finally:
        await admin.close()


@pytest.fixture
def ready(broker, names, tmp_path, redis_servers, capsys):
    """Three bounded members, a config, and its topics created."""
    servers = redis_servers(3)
    bounded(servers)
    prefix = names("conn")
    config = write_config(tmp_path / "g.toml", broker, prefix, redis_urls(servers))
    assert main(["topics", "--config", str(config), "--create", "--partitions", "1"]) == 0
    capsys.readouterr()
    return servers, prefix, config


def test_connect_check_passes_when_everything_is_reached_and_fits(ready, capsys):
    _servers, _prefix, config = ready
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert code == 0, out
    lines = out.splitlines()
    assert lines and all(line.startswith("OK") for line in lines), out
    assert sum("may run the" in line for line in lines) == 3
    assert "OK    kafka: 7 of 7 topics exist" in lines
    assert (
        "OK    kafka.exactly_once: auto: the broker supports transactions; exactly-once output"
        in lines
    )


def test_connect_check_names_a_missing_topic(broker, names, tmp_path, redis_servers, capsys):
    servers = redis_servers(1)
    bounded(servers)
    prefix = names("missing")
    config = write_config(tmp_path / "g.toml", broker, prefix, redis_urls(servers))
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert code == 3
    assert (
        f"ERROR topic {prefix}-orders: missing (raw); "
        f"create it: dedup-gateway topics --create --config {config}" in out
    )
    lines = out.splitlines()
    assert "ERROR kafka: 0 of 7 topics exist" in lines, "a summary with missing topics is no OK"
    assert not any(line.startswith("OK    kafka:") and "topics exist" in line for line in lines)
    # A group nothing joined yet: said as such, not the broker's "Dead".
    assert f"OK    group {prefix}-group: usable (no members yet)" in lines, out
    assert "Dead" not in out


def test_connect_check_offers_the_nearest_topic_for_a_typo(
    broker, names, tmp_path, redis_servers, capsys
):
    servers = redis_servers(1)
    bounded(servers)
    prefix = names("typo")
    config = write_config(tmp_path / "g.toml", broker, prefix, redis_urls(servers))
    assert main(["topics", "--config", str(config), "--create", "--partitions", "1"]) == 0
    typo = tmp_path / "typo.toml"
    typo.write_text(config.read_text().replace(f'"{prefix}-clean"', f'"{prefix}-clen"'))
    capsys.readouterr()
    code, out = run(capsys, "check-config", "--config", str(typo), "--connect")
    assert code == 3, out
    assert (
        f"ERROR topic {prefix}-clen: missing (clean) (did you mean '{prefix}-clean'?); "
        f"create it: dedup-gateway topics --create --config {typo}" in out.splitlines()
    ), out


def test_connect_check_names_a_wrong_password_and_a_member_down(
    broker, names, tmp_path, redis_servers, capsys
):
    servers = redis_servers(3, password="right-pw")
    for server in servers:
        with redis.Redis(port=server.port, password="right-pw") as r:
            r.config_set("maxmemory", "100mb")
    servers[1].stop()
    urls = [
        f"redis://:{pw}@127.0.0.1:{s.port}/0"
        for pw, s in zip(["right-pw", "right-pw", "wrong-pw"], servers, strict=True)
    ]
    config = write_config(tmp_path / "g.toml", broker, names("auth"), urls)
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert code == 3
    assert f"ERROR redis 127.0.0.1:{servers[1].port}/0: cannot reach it" in out
    assert f"ERROR redis 127.0.0.1:{servers[2].port}/0: credentials refused" in out
    assert "ERROR redis: 1 of 3 members fully usable, a majority needs 2" in out
    assert "wrong-pw" not in out and "right-pw" not in out
    assert f"OK    redis 127.0.0.1:{servers[0].port}/0: reached, authenticated" in out


def test_connect_check_names_a_command_the_acl_denies_and_an_evicting_policy(
    broker, names, tmp_path, redis_servers, capsys
):
    (server,) = redis_servers(1, password="admin-pw")
    acl = [word for word in documented_acl() if word not in ("+hincrby", "+info")]
    with redis.Redis(port=server.port, password="admin-pw") as admin:
        admin.execute_command("ACL", "SETUSER", *acl)
        admin.config_set("maxmemory-policy", "allkeys-lru")
    url = f"redis://{acl[0]}:gw-pw@127.0.0.1:{server.port}/0"
    config = write_config(tmp_path / "g.toml", broker, names("acl"), [url])
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert code == 3
    where = f"redis 127.0.0.1:{server.port}/0"
    assert f"ERROR {where}: the user may not run HINCRBY on keys 'dd:*'" in out
    # An ACL without INFO: the policy cannot be read, and it says so.
    assert f"WARN  {where}: cannot read maxmemory-policy (the user may not run INFO)" in out
    with redis.Redis(port=server.port, password="admin-pw") as admin:
        admin.execute_command("ACL", "SETUSER", acl[0], "+hincrby", "+info")
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert f"ERROR {where}: maxmemory-policy is allkeys-lru" in out
    assert "may not run" not in out


def test_connect_check_reads_every_node_of_a_cluster_member(
    broker, names, tmp_path, redis_clusters, capsys
):
    cluster = redis_clusters(3)
    config = write_config(tmp_path / "g.toml", broker, names("cluster"), [cluster.url])
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert f"OK    redis {cluster.name_label}: all 16384 hash slots served" in out
    assert out.count(f"redis {cluster.name_label} node ") >= 6  # ACL and memory, per master
    assert code == 3  # its topics were not created


def test_connect_check_warns_of_a_raw_topic_kept_shorter_than_failures_are_retried(
    broker, names, tmp_path, redis_servers, capsys
):
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    servers = redis_servers(1)
    bounded(servers)
    prefix = names("short")
    config = write_config(tmp_path / "g.toml", broker, prefix, redis_urls(servers))

    async def short_raw_topic() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker)
        await admin.start()
        try:
            topic = NewTopic(f"{prefix}-orders", 1, 1, topic_configs={"retention.ms": "60000"})
            await admin.create_topics([topic])
        finally:
            await admin.close()

    asyncio.run(short_raw_topic())
    assert main(["topics", "--config", str(config), "--create", "--partitions", "1"]) == 0
    capsys.readouterr()
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert code == 1, out  # a warning only: it runs
    assert (
        f"WARN  topic {prefix}-orders: retention.ms 60000 is shorter than the failure retries"
        in out
    )
    assert f"topic {prefix}-bulk" not in out  # created by `topics` with 7 days
