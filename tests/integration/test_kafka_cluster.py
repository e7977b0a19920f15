"""The gateway on a replicated three-node KRaft cluster (devtools/kafka_cluster.py):
`topics --create` gives every topic 3 replicas and `min.insync.replicas` 2,
`check-config --connect` warns of a topic that would lose writes with one broker, and a
gateway with exactly-once output loses and repeats nothing while the broker leading a
clean partition, then the one coordinating its group, is SIGKILLed and restarted.

In `make test-long` (`-m kafka_cluster`): three JVMs for the module."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from devtools.harness import (
    Topics,
    clean_ids,
    make_settings,
    redis_urls,
    start_process,
    write_toml,
)
from devtools.kafka_cluster import KafkaCluster
from devtools.topics import committed_offsets, create_topics, wait_committed
from devtools.traffic import produce_traffic
from gateway import cli
from gateway.ops.check_kafka import _topic_configs

pytestmark = pytest.mark.kafka_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with KafkaCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


def create_with_the_cli(config: Path) -> None:
    assert cli.main(["topics", "--config", str(config), "--create"]) == 0


async def min_insync(bootstrap: str, topic: str) -> str | None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return (await _topic_configs(admin, [topic]))[topic].get("min.insync.replicas")
    finally:
        await admin.close()


def test_topics_create_replicates_three_ways_and_check_config_warns_of_one_replica(
    cluster, redis_servers, names, tmp_path, capsys
):
    topics = Topics(names)
    settings = make_settings(cluster.bootstrap, topics, redis_urls(redis_servers(1)))
    config = write_toml(tmp_path / "gateway.toml", settings)
    create_with_the_cli(config)
    for topic in (topics.raw, topics.clean, topics.failures):
        assert asyncio.run(cluster.replication(topic)) == 3
        assert asyncio.run(min_insync(cluster.bootstrap, topic)) == "2"
    capsys.readouterr()
    cli.main(["check-config", "--config", str(config), "--connect"])
    assert "replica" not in capsys.readouterr().out

    # A clean topic someone made by hand with one replica: named, with the fix.
    lone = names("lone-clean")
    asyncio.run(create_topics(cluster.bootstrap, {lone: 1}))  # replication factor 1
    kafka = settings.kafka.model_copy(update={"clean_topic": lone})
    alone = write_toml(tmp_path / "alone.toml", settings.model_copy(update={"kafka": kafka}))
    cli.main(["check-config", "--config", str(alone), "--connect"])
    out = capsys.readouterr().out
    assert f"WARN  topic {lone}: 1 replica on a cluster of 3+ brokers" in out, out

    # A failure topic with 3 replicas but min.insync.replicas 1: named, with the command.
    loose = names("loose-failures")
    asyncio.run(create_replicated(cluster.bootstrap, loose, {"min.insync.replicas": "1"}))
    kafka = settings.kafka.model_copy(update={"failure_topic": loose})
    config = write_toml(tmp_path / "loose.toml", settings.model_copy(update={"kafka": kafka}))
    cli.main(["check-config", "--config", str(config), "--connect"])
    out = capsys.readouterr().out
    assert f"WARN  topic {loose}: min.insync.replicas 1: a write acknowledged by one" in out, out
    assert "--add-config min.insync.replicas=2" in out


async def create_replicated(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 3, topic_configs=configs)])
    finally:
        await admin.close()


async def test_a_leader_and_the_group_coordinator_killed_mid_stream_lose_and_repeat_nothing(
    cluster, redis_servers, names, tmp_path
):
    bootstrap = cluster.bootstrap
    topics = Topics(names)
    settings = make_settings(
        bootstrap, topics, redis_urls(redis_servers(3)),
        kafka={"exactly_once": "on", "max_batch_records": 200, "session_timeout": "6s"},
    )  # fmt: skip
    config = write_toml(tmp_path / "gateway.toml", settings)
    await asyncio.to_thread(create_with_the_cli, config)
    log = tmp_path / "gateway.log"
    gateway = start_process(config, log)
    killed: list[int] = []
    ends: Counter[int] = Counter()  # raw partition -> records produced
    unique: set[str] = set()

    async def produce_round(prefix: str) -> None:
        traffic = await produce_traffic(
            bootstrap, topics.raw, 8_000, duplicate_share=0.2, seed=50, id_prefix=prefix
        )
        ends.update(traffic.per_partition)
        unique.update(traffic.unique_ids)

    async def forwarded() -> int:
        return sum((await committed_offsets(bootstrap, topics.group, topics.raw)).values())

    try:
        for victim in ("leader", "coordinator"):
            mark = await forwarded()
            await produce_round(victim)
            deadline = time.monotonic() + 120
            while await forwarded() < mark + 500:  # records flowing
                assert time.monotonic() < deadline and gateway.poll() is None, log.read_text()
                await asyncio.sleep(0.02)
            if victim == "leader":
                node = await cluster.leader_of(topics.clean, 0)
            else:
                node = await coordinator(bootstrap, topics.group)
            cluster.nodes[node].kill()
            killed.append(node)
            assert await forwarded() < sum(ends.values()), "all forwarded before the kill"
            await asyncio.sleep(3)
            await asyncio.to_thread(cluster.nodes[node].start)
        await produce_round("after")  # and on, with every node back
        await wait_committed(bootstrap, topics.group, topics.raw, dict(ends), 180)
        assert gateway.poll() is None, log.read_text()[-3000:]
    finally:
        gateway.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(gateway.wait, 60)
    assert code == 0, log.read_text()[-3000:]
    ids = await clean_ids(bootstrap, topics.clean)
    assert set(ids) == unique  # nothing lost
    assert max(ids.values()) == 1, [i for i, n in ids.items() if n > 1][:10]  # nothing repeated
    assert len(killed) == 2


async def coordinator(bootstrap: str, group: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return await admin.find_coordinator(group)
    finally:
        await admin.close()
