"""A gap of the test broker's group coordinator (Tansu 0.6), pinned so that the docs
stay true: a LeaveGroup from the group's leader while the group is rebalancing
removes the member but keeps it as the leader, so no later member is ever
assigned a partition (docs/development.md, "The test broker"). Apache Kafka
elects a remaining member instead. When Tansu does too, the first and the last
test fail: then drop the docs entry and the chaos harness's
`clear_departed_leader`.

The group protocol is driven by hand (aiokafka's request classes), so every step
is one request and its answer, in order: no timing decides the outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import MemberIdRequired, RebalanceInProgressError

from devtools.groups import GroupMember, clear_departed_leader


async def _topic(broker: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=broker)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 2, 1)])
    finally:
        await admin.close()


async def _formed_group(broker: str, group: str, topic: str) -> GroupMember:
    """A one-member group, formed: its member (the leader) joined and synced."""
    leader = GroupMember(broker, group, topic, "leader")
    await leader.start()
    first = await leader.join()
    assert first.error_code == MemberIdRequired.errno  # KIP-394: a second join, with the id
    joined = await leader.join()
    assert joined.leader_id == leader.member_id
    await leader.sync({leader.member_id: [0, 1]})
    return leader


async def _left_while_rebalancing(
    broker: str, group: str, topic: str
) -> tuple[GroupMember, GroupMember]:
    """A formed group's leader leaves just after a new member's first join (its
    MEMBER_ID_REQUIRED) started a rebalance, as a gateway stopping then does: the
    leader (closed) and the other member (still open)."""
    leader = await _formed_group(broker, group, topic)
    other = GroupMember(broker, group, topic, "other")
    await other.start()
    assert (await other.join()).error_code == MemberIdRequired.errno
    await leader.leave()
    await leader.close()
    return leader, other


async def _newcomer(broker: str, group: str, topic: str) -> tuple[GroupMember, Any]:
    """A new member that joined (both joins of KIP-394), and its JoinGroup response."""
    newcomer = GroupMember(broker, group, topic, "newcomer")
    await newcomer.start()
    await newcomer.join()
    return newcomer, await newcomer.join()


async def test_a_leader_that_leaves_a_rebalancing_group_stays_its_leader(
    broker: str, names: Callable[[str], str]
) -> None:
    group, topic = names("gap-group"), names("gap-topic")
    await _topic(broker, topic)
    leader, other = await _left_while_rebalancing(broker, group, topic)
    newcomer, joined = await _newcomer(broker, group, topic)
    try:
        assert joined.leader_id == leader.member_id  # the member that left
        assert joined.leader_id not in (newcomer.member_id, other.member_id)
        # No member is the leader, so none gets an assignment; nothing evicts a
        # leader that is not a member.
        assert (await newcomer.sync({})).error_code == RebalanceInProgressError.errno
    finally:
        await newcomer.close()
        await other.close()


async def test_a_leader_that_leaves_a_formed_group_hands_the_lead_on(
    broker: str, names: Callable[[str], str]
) -> None:
    """The same leave with no rebalance going on: the next member leads."""
    group, topic = names("gap-group"), names("gap-topic")
    await _topic(broker, topic)
    leader = await _formed_group(broker, group, topic)
    await leader.leave()
    await leader.close()
    newcomer, joined = await _newcomer(broker, group, topic)
    try:
        assert joined.leader_id == newcomer.member_id
        synced = await newcomer.sync({newcomer.member_id: [0, 1]})
        assert synced.error_code == 0
    finally:
        await newcomer.close()


async def test_the_chaos_harness_clears_a_departed_leader(
    broker: str, names: Callable[[str], str]
) -> None:
    group, topic = names("gap-group"), names("gap-topic")
    await _topic(broker, topic)
    leader, other = await _left_while_rebalancing(broker, group, topic)
    await other.close()
    assert await clear_departed_leader(broker, group) == leader.member_id
    assert await clear_departed_leader(broker, group) is None  # nothing left to clear
    newcomer, joined = await _newcomer(broker, group, topic)
    try:
        assert joined.leader_id == newcomer.member_id
    finally:
        await newcomer.close()
