"""Every transaction that writes copies sends input offsets, whose TxnOffsetCommit checks
the group generation (issue 52): a step whose commit points did not move (a retry
behind an older command still scheduled, a move ahead of a record still held) sends
them at their current points, and one with none to send aborts. On a broker:
tests/integration/test_exactly_once.py (`test_a_zombie_stalled_in_...`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.producer.transaction_manager import TransactionManager

from gateway.kafka.exactly_once import StepAborted, Transactions
from gateway.kafka.offsets import OffsetBook, PartitionOffsets
from gateway.kafka.transactions import TransactionalProducer

A, B, GONE = (TopicPartition("commands", p) for p in range(3))


def consumer(*assigned: TopicPartition) -> Any:
    return SimpleNamespace(assignment=lambda: set(assigned), _group_id="group")


def test_a_partition_whose_point_did_not_move_is_sent_at_it() -> None:
    book: OffsetBook[PartitionOffsets] = OffsetBook(PartitionOffsets)
    for tp in (A, B, GONE):
        part = book.of(tp)
        part.take(10)  # an older command still scheduled
        part.take(11)
        part.next_offset = 12
        part.committed = 10
    book.of(A).moved.add(11)  # done behind the one still scheduled: no point moved
    book.of(B).moved.update({10, 11})  # moved to 12
    assert book.due_commits(consumer(A, B)) == {B: 12}
    assert book.fencing_commits(consumer(A, B)) == {A: 10, B: 12}  # not GONE: revoked


class Producer:
    """What `Transactions.run` uses of a transactional producer."""

    def __init__(self) -> None:
        self._txn_manager = SimpleNamespace(
            txn_partitions=set(), is_fatal_error=lambda: False, is_in_transaction=lambda: True
        )
        self.calls: list[str] = []

    async def begin(self) -> None:
        self.calls.append("begin")

    async def send_group_offsets(self, offsets: Any, group_id: str, member: Any) -> None:
        self.calls.append(f"offsets {sorted(offsets.values())}")

    async def commit_transaction(self) -> None:
        self.calls.append("commit")

    async def abort_after_error(self) -> None:
        self.calls.append("abort")


async def test_a_transaction_that_wrote_copies_and_has_no_offset_aborts() -> None:
    producer = Producer()
    transactions = Transactions("failures", producer, Producer, 12.0)  # type: ignore[arg-type]

    async def step(offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        producer._txn_manager.txn_partitions.add(TopicPartition("clean", 0))  # a copy out
        return offsets

    member = (3, "member-1", None)
    with pytest.raises(StepAborted, match="no input offset"):
        await transactions.run(step({GONE: 5}), consumer(A), member)  # revoked: filtered out
    assert producer.calls == ["begin", "abort"]
    producer.calls.clear()
    assert await transactions.run(step({A: 5}), consumer(A), member) == {A: 5}
    assert producer.calls == ["begin", "offsets [5]", "commit"]


async def test_a_broker_away_while_offsets_are_sent_aborts_the_transaction() -> None:
    # Chaos seed 4 (a broker restart): the group coordinator's lookup raised inside
    # aiokafka's sender routine, which logged a traceback and died.
    txn = TransactionManager("gateway.failures", 60_000)
    txn.set_pid_and_epoch(7, 0)
    txn.begin_transaction()
    waiter = txn.add_offsets_to_txn({A: 5}, "group")

    async def lookup(*_: Any) -> int:
        raise KafkaError(repr(KafkaConnectionError("Connection closed")))

    producer: Any = SimpleNamespace(
        _sender=SimpleNamespace(_txn_manager=txn, _find_coordinator=lookup)
    )
    await TransactionalProducer._txn_offset_commit(producer, {A: 5}, "group")  # no raise
    assert txn.state.name == "ABORTABLE_ERROR"
    with pytest.raises(KafkaError, match="Connection closed"):
        await waiter
    assert isinstance(txn._transaction_waiter.exception(), KafkaError)  # the step's error
