"""The consumer-group protocol driven by hand, one request at a time (aiokafka's
request classes): for tests of the test broker's group coordinator, and for the
chaos harness's repair of the one gap of it that holds a group
(`clear_departed_leaders`, docs/development.md, "The test broker")."""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from aiokafka.errors import MemberIdRequired
from aiokafka.protocol.group import (
    JoinGroupRequest,
    LeaveGroupRequest,
    SyncGroupRequest,
)

logger = logging.getLogger(__name__)

SESSION_MS = 2000
PROTOCOL = "roundrobin"  # aiokafka's default assignor, so gateways can join the same group


class GroupMember:
    """One member of `group`, subscribed to `topic`; tracks its id and generation."""

    def __init__(self, bootstrap: str, group: str, topic: str, name: str) -> None:
        self.client = AIOKafkaClient(bootstrap_servers=bootstrap, client_id=name)
        self.group = group
        self.topic = topic
        self.member_id = ""
        self.generation = -1
        self.node = -1

    async def start(self) -> None:
        await self.client.bootstrap()
        # One broker: it coordinates every group.
        self.node = min(broker.nodeId for broker in self.client.cluster.brokers())

    async def close(self) -> None:
        await self.client.close()

    async def join(self, member_id: str | None = None) -> Any:
        """One JoinGroup (`member_id`: as whom, else as itself); the response."""
        metadata = ConsumerProtocolMemberMetadata(0, [self.topic], b"").encode()
        request = JoinGroupRequest(
            self.group, SESSION_MS, SESSION_MS,
            self.member_id if member_id is None else member_id,
            None, "consumer", [(PROTOCOL, metadata)],
        )  # fmt: skip
        response = await self.client.send(self.node, request)
        if response.error_code in (0, MemberIdRequired.errno):
            self.member_id = response.member_id
        if response.error_code == 0:
            self.generation = response.generation_id
        return response

    async def sync(self, assignments: dict[str, list[int]]) -> Any:
        """One SyncGroup, as the leader when `assignments` is not empty."""
        encoded = [
            (member, ConsumerProtocolMemberAssignment(0, [(self.topic, parts)], b"").encode())
            for member, parts in assignments.items()
        ]
        request = SyncGroupRequest(self.group, self.generation, self.member_id, None, encoded)
        return await self.client.send(self.node, request)

    async def leave(self) -> Any:
        return await self.client.send(self.node, LeaveGroupRequest(self.group, self.member_id))


async def clear_departed_leader(bootstrap: str, group: str) -> str | None:
    """Free `group` of a leader that left it while it rebalanced, which Tansu 0.6 keeps
    as the leader of a group no member may then lead (docs/development.md, "The test
    broker"); for a moment when no consumer of ours is in the group. A probe joins:
    if the broker names another leader, a second client joins under that id, syncs as
    that leader (the group forms) and leaves, which clears the lead. Returns the
    departed leader's id, or None when there was none.

    No client of ours leaves while it leads a group that has not formed (that leave
    is the gap itself): it goes silent instead, and the broker evicts it after its
    session (SESSION_MS), which clears the lead too."""
    probe = GroupMember(bootstrap, group, "-", "chaos-probe")
    await probe.start()
    as_leader: GroupMember | None = None
    probe_may_leave = True
    try:
        await probe.join()
        joined = await probe.join()
        if joined.error_code != 0:
            return None
        leader: str = joined.leader_id
        if leader == probe.member_id:
            probe_may_leave = await _lead(probe, joined)
            return None
        as_leader = GroupMember(bootstrap, group, "-", "chaos-probe")
        await as_leader.start()
        answer = await as_leader.join(member_id=leader)
        if answer.error_code != 0 or answer.leader_id != leader:
            return None
        if await _lead(as_leader, answer):
            await as_leader.leave()  # a formed group's leader: its leave clears the lead
        logger.info("group %s: cleared departed leader %s", group, leader)
        return leader
    finally:
        if probe_may_leave:
            await probe.leave()
        await probe.close()
        if as_leader is not None:
            await as_leader.close()


async def _lead(member: GroupMember, joined: Any) -> bool:
    """Sync as the leader `joined` named `member`, assigning nothing to every member
    it listed; whether the group formed."""
    members = {listed[0] for listed in joined.members} | {member.member_id}
    synced = await member.sync({m: [] for m in members})
    return bool(synced.error_code == 0)
