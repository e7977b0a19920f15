"""A replicated Apache Kafka cluster on loopback: three KRaft nodes (or more), the shape a
production deployment has (replication factor 3, `min.insync.replicas` 2).

Each node is a combined broker and controller (`process.roles=broker,controller`), so
three JVMs, not six: the controller quorum then has three voters and survives one node
down, as the partitions' replicas do, and killing a node kills a partition leader, a
coordinator and perhaps the active controller at once, as losing a machine does.
Separate controllers would add three JVMs (~0.5 GiB of heap each) for a split
production clusters of this size rarely make. Three nodes at -Xmx512m stay well
within a 2-core, 24 GiB machine: 0.9 GiB resident in all, measured idle with one
topic of 3 partitions (start-up 13 s beside a chaos run).

    with KafkaCluster(tmp_path) as cluster:
        cluster.bootstrap                     # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
        node = await cluster.leader_of("clean", 0)
        cluster.nodes[node].kill(); cluster.nodes[node].start()
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from devtools.localstack import KafkaBroker, free_port, kafka_broker

# Over the single node's BROKER_SETTINGS: every internal topic replicated as a careful
# production cluster has it, and a write acknowledged by two replicas at least.
CLUSTER_SETTINGS = {
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "unclean.leader.election.enable": "false",
}


def free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


@dataclass
class KafkaCluster:
    """`size` KRaft nodes under `state_dir/node-<id>`; `nodes[id]` is node `id` (1-based,
    its `node.id`), to kill, stop and start again (its data kept)."""

    state_dir: Path
    size: int = 3
    settings: dict[str, str] = field(default_factory=dict)  # over CLUSTER_SETTINGS
    nodes: dict[int, KafkaBroker] = field(default_factory=dict)

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{node.port}" for node in self.nodes.values())

    def start(self) -> KafkaCluster:
        ports = free_ports(2 * self.size)
        listen, control = ports[: self.size], ports[self.size :]
        voters = ",".join(f"{i + 1}@127.0.0.1:{port}" for i, port in enumerate(control))
        for i in range(self.size):
            node_id = i + 1
            props = {**CLUSTER_SETTINGS, "node.id": str(node_id), **self.settings}
            node = kafka_broker(
                self.state_dir / f"node-{node_id}",
                port=listen[i],
                settings=props,
                controller_port=control[i],
                voters=voters,
            )
            node.name = f"broker-{node_id}"
            self.nodes[node_id] = node
        # Side by side: a node says it started once a majority of voters elected a leader.
        try:
            with ThreadPoolExecutor(self.size) as pool:
                list(pool.map(KafkaBroker.start, self.nodes.values()))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def leader_of(self, topic: str, partition: int) -> int:
        """The node id leading `topic`'s `partition` now."""
        described = await self._describe(topic)
        for part in described["partitions"]:
            if part["partition"] == partition:
                return int(part["leader"])
        raise LookupError(f"{topic} has no partition {partition}")

    async def replication(self, topic: str) -> int:
        """How many replicas each of `topic`'s partitions has (the fewest)."""
        described = await self._describe(topic)
        return min(len(part["replicas"]) for part in described["partitions"])

    async def _describe(self, topic: str) -> dict[str, Any]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            (described,) = await admin.describe_topics([topic])
        finally:
            await admin.close()
        return described  # type: ignore[no-any-return]
