"""Exactly-once output with aiokafka 0.14: transactions fenced by the consumer group (KIP-447).

aiokafka commits a transaction's offsets with TxnOffsetCommit v0, which carries no
group generation, and reads committed offsets without asking for stable ones. Then a
gateway stalled past its session (a zombie) could still commit a batch whose partitions
another gateway has taken, and a reader of the clean topic would see the batch twice.
Two protocol versions aiokafka lacks close that, the way Kafka's Java client does:

- **TxnOffsetCommit v3** carries the consumer's generation, member id and group instance
  id: the group coordinator refuses a zombie's offsets (ILLEGAL_GENERATION,
  UNKNOWN_MEMBER_ID, FENCED_INSTANCE_ID), which this module turns into an abortable
  `CommitFailedError`: the transaction aborts, and none of its copies is ever read by a
  `read_committed` reader.
- **OffsetFetch v7 with `require_stable`**: a consumer that takes partitions over waits
  (UNSTABLE_OFFSET_COMMIT, retried) until a transaction holding offsets for them has
  ended, so it never reads from an offset a zombie's commit then moves past.

Both need Kafka 2.5 or later. aiokafka is pinned to 0.14.x: the protocol classes it
is extended with here are private, and tests/integration/test_exactly_once.py runs
both against Apache Kafka.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import aiokafka.consumer.consumer
import aiokafka.errors as Errors
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.errors import CommitFailedError
from aiokafka.producer.sender import CoordinationType, EndTxnHandler, TxnOffsetCommitHandler
from aiokafka.producer.transaction_manager import TransactionState
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)
from aiokafka.structs import OffsetAndMetadata

logger = logging.getLogger(__name__)

# (generation, member id, group instance id) of the consumer whose offsets a
# transaction commits.
Member = tuple[int, str, str | None]
GroupMember = Callable[[], Member]


def group_member(consumer: AIOKafkaConsumer) -> Member:
    """Who `consumer` is in its group now. Taken when a batch is fetched, not when its
    offsets are sent: aiokafka rejoins in the background, and a member evicted while
    it stalled resets to generation -1, which the coordinator would take for a
    commit with no group metadata at all and accept."""
    coordinator = consumer._coordinator
    return coordinator.generation, coordinator.member_id, coordinator._group_instance_id


# A zombie's offsets: its generation is gone, or so is its membership.
FENCED_CODES = frozenset({22, 25, 82})  # ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID, FENCED_INSTANCE_ID
UNSTABLE_OFFSET_COMMIT = 88
NO_OFFSET = -1


class UnstableOffsetCommitError(Errors.KafkaError):  # type: ignore[misc]
    """A transaction holding offsets for the partition has not ended yet: ask again."""

    retriable = True


def _topics(*partition: tuple[str, Any]) -> CompactArray:
    """A flexible version's topics array: name, partitions of `partition`'s fields."""
    return CompactArray(
        ("name", CompactString("utf-8")),
        ("partitions", CompactArray(*partition, ("tags", TaggedFields))),
        ("tags", TaggedFields),
    )


# --- TxnOffsetCommit v3 -------------------------------------------------------------


class TxnOffsetCommitResponse_v3(Response):  # type: ignore[misc]
    API_KEY = 28
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("topics", _topics(("partition_index", Int32), ("error_code", Int16))),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitRequest_v3(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 28
    API_VERSION = 3
    RESPONSE_TYPE = TxnOffsetCommitResponse_v3
    SCHEMA = Schema(
        ("transactional_id", CompactString("utf-8")),
        ("group_id", CompactString("utf-8")),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", CompactString("utf-8")),
        ("group_instance_id", CompactString("utf-8")),  # None: null
        (
            "topics",
            _topics(
                ("partition_index", Int32),
                ("committed_offset", Int64),
                ("committed_leader_epoch", Int32),
                ("committed_metadata", CompactString("utf-8")),
            ),
        ),
        ("tags", TaggedFields),
    )


class GroupTxnOffsetCommitRequest(Request[TxnOffsetCommitRequest_v3]):  # type: ignore[misc]
    API_KEY = 28

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def build(self, request_struct_class: type[TxnOffsetCommitRequest_v3]) -> Any:
        return request_struct_class(**self._fields)


class GroupTxnOffsetCommitHandler(TxnOffsetCommitHandler):  # type: ignore[misc]
    """aiokafka's handler, with the group's generation in the request and the
    fencing errors made abortable."""

    def __init__(self, sender: Any, offsets: Any, group_id: str, member: GroupMember) -> None:
        super().__init__(sender, offsets, group_id)
        self._member = member

    def create_request(self) -> GroupTxnOffsetCommitRequest:
        txn = self._sender._txn_manager
        generation, member_id, instance_id = self._member()
        topics: dict[str, list[tuple[int, int, int, str, dict[int, bytes]]]] = (
            collections.defaultdict(list)
        )
        for tp, offset in sorted(self._offsets.items()):
            topics[tp.topic].append((tp.partition, offset.offset, -1, offset.metadata, {}))
        return GroupTxnOffsetCommitRequest(
            {
                "transactional_id": txn.transactional_id,
                "group_id": self._group_id,
                "producer_id": txn.producer_id,
                "producer_epoch": txn.producer_epoch,
                "generation_id": generation,
                "member_id": member_id,
                "group_instance_id": instance_id,
                "topics": [(topic, parts, {}) for topic, parts in topics.items()],
                "tags": {},
            }
        )

    def handle_response(self, resp: Any) -> Any:
        errors = [(t, [(p, code) for p, code, _ in parts]) for t, parts, _ in resp.topics]
        fenced = [
            f"{topic}/{p}" for topic, parts in errors for p, code in parts if code in FENCED_CODES
        ]
        if fenced:
            abortable(
                self._sender._txn_manager,
                CommitFailedError(
                    f"the group moved on: offsets of {', '.join(fenced)} refused "
                    f"(generation {self._member()[0]})"
                ),
            )
            return None
        return super().handle_response(SimpleNamespace(errors=errors))


def abortable(txn: Any, exc: Exception) -> None:
    """aiokafka's `TransactionManager.error_transaction`, but keeping the partitions the
    transaction wrote: that one forgets them, and the abort that follows then sends no
    EndTxn (an empty transaction), leaving the transaction open on the broker, and
    `read_committed` readers of those partitions held, until `transaction_timeout`."""
    txn._transition_to(TransactionState.ABORTABLE_ERROR)
    for _, _, fut in txn._pending_txn_offsets:
        fut.set_exception(exc)
    txn._pending_txn_offsets.clear()
    txn._transaction_waiter.set_exception(exc)


class TransactionEndFailed(Errors.ProducerFenced):  # type: ignore[misc]
    """EndTxn answered an error aiokafka does not expect: this producer's transaction
    has an outcome it cannot learn, and Kafka's own client ends the producer (fatal)."""


# The EndTxn errors aiokafka's handler acts on; any other one it raises inside the
# producer's sender task, which then dies with a traceback.
_END_TXN_HANDLED = (
    Errors.NoError,
    Errors.CoordinatorNotAvailableError,
    Errors.NotCoordinatorError,
    Errors.CoordinatorLoadInProgressError,
    Errors.ConcurrentTransactions,
    Errors.InvalidProducerEpoch,
    Errors.InvalidTxnState,
)


class FencingEndTxnHandler(EndTxnHandler):  # type: ignore[misc]
    """aiokafka's EndTxn handler; an unexpected error ends the producer as a fence does.

    Kafka 4.1 answers UNKNOWN_SERVER_ERROR to an EndTxn that meets the coordinator's own
    abort of the same transaction after `transaction_timeout` (its IllegalStateException
    "already a pending state PREPARE_EPOCH_FENCE"; a gateway stopped for seconds gets
    there). Whatever the broker did, the offsets committed with the transaction say where
    to read again, so the loop renews its producer and reads from them."""

    def handle_response(self, resp: Any) -> Any:
        error_type = Errors.for_code(resp.error_code)
        if error_type in _END_TXN_HANDLED:
            return super().handle_response(resp)
        logger.warning(
            "transaction %s: EndTxn answered %s; the producer is replaced",
            self._sender._txn_manager.transactional_id,
            error_type.__name__,
        )
        raise TransactionEndFailed(f"EndTxn answered {error_type.__name__}")


class TransactionalProducer(AIOKafkaProducer):  # type: ignore[misc]
    """An AIOKafkaProducer whose transactions commit a consumer's offsets under KIP-447."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._member: GroupMember = lambda: (-1, "", None)  # set per transaction
        self._sender._do_txn_offset_commit = self._txn_offset_commit
        self._sender._do_txn_commit = self._txn_commit

    async def send_group_offsets(
        self, offsets: dict[TopicPartition, int], group_id: str, member: Member
    ) -> None:
        """Add `offsets` (next offset to read) of `group_id` to the transaction, as the
        group member that read their records (`group_member` when it fetched them)."""
        self._member = lambda: member
        await self.send_offsets_to_transaction(offsets, group_id)

    async def begin(self) -> None:
        """`begin_transaction`, without yielding to the event loop once the producer id
        is known: aiokafka's awaits it even then, and the next batch's work ran before
        this one's first copy went out (~12 ms a batch, bench/RESULTS.md)."""
        if self._txn_manager.has_pid():
            self._ensure_transactional()
            self._txn_manager.begin_transaction()
        else:
            await self.begin_transaction()

    async def abort_after_error(self) -> None:
        """Abort the transaction an error ended; the error was raised to the caller
        already, so the transaction's own record of it is marked seen."""
        waiter = self._txn_manager._transaction_waiter
        if waiter.done() and not waiter.cancelled():
            waiter.exception()
        await self.abort_transaction()

    async def _txn_offset_commit(self, offsets: Any, group_id: str) -> None:
        """aiokafka's `Sender._do_txn_offset_commit`, with the group-aware handler."""
        if not offsets:
            return
        sender = self._sender
        try:
            node_id = await sender._find_coordinator(CoordinationType.GROUP, group_id)
        except Errors.GroupAuthorizationFailedError as exc:
            sender._txn_manager.error_transaction(exc)
            return
        except Errors.KafkaError as exc:
            # The broker went away during the lookup (chaos seed 4, a broker restart):
            # raised here, it ended aiokafka's sender routine with a traceback. The
            # transaction aborts instead, and the loop reads its partitions again.
            abortable(sender._txn_manager, exc)
            return
        await GroupTxnOffsetCommitHandler(sender, offsets, group_id, self._member).do(node_id)

    async def _txn_commit(self, commit_result: bool) -> None:
        """aiokafka's `Sender._do_txn_commit`, with `FencingEndTxnHandler`."""
        sender = self._sender
        await sender._message_accumulator.flush_for_commit()
        txn = sender._txn_manager
        if txn.is_empty_transaction():  # nothing sent: nothing to end on the broker
            txn.complete_transaction()
            return
        node_id = await sender._find_coordinator(CoordinationType.TRANSACTION, txn.transactional_id)
        await FencingEndTxnHandler(sender, commit_result).do(node_id)


# --- OffsetFetch v7, require_stable --------------------------------------------------


class OffsetFetchResponse_v7(Response):  # type: ignore[misc]
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            _topics(
                ("partition_index", Int32),
                ("committed_offset", Int64),
                ("committed_leader_epoch", Int32),
                ("metadata", CompactString("utf-8")),
                ("error_code", Int16),
            ),
        ),
        ("error_code", Int16),
        ("tags", TaggedFields),
    )


class OffsetFetchRequest_v7(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 9
    API_VERSION = 7
    RESPONSE_TYPE = OffsetFetchResponse_v7
    SCHEMA = Schema(
        ("group_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("partition_indexes", CompactArray(Int32)),
                ("tags", TaggedFields),
            ),
        ),
        ("require_stable", Boolean),
        ("tags", TaggedFields),
    )


class StableOffsetFetchRequest(Request[OffsetFetchRequest_v7]):  # type: ignore[misc]
    API_KEY = 9

    def __init__(self, group_id: str, topics: list[tuple[str, list[int]]]) -> None:
        self._group_id = group_id
        self._topics = topics

    def build(self, request_struct_class: type[OffsetFetchRequest_v7]) -> Any:
        topics: list[tuple[str, list[int], dict[int, bytes]]] = [
            (topic, parts, {}) for topic, parts in self._topics
        ]
        return request_struct_class(self._group_id, topics, True, {})


class StableOffsetsCoordinator(GroupCoordinator):  # type: ignore[misc]
    """aiokafka's group coordinator, reading committed offsets with `require_stable`."""

    async def _do_fetch_commit_offsets(
        self, partitions: list[TopicPartition]
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        by_topic: dict[str, list[int]] = collections.defaultdict(list)
        for tp in partitions:
            by_topic[tp.topic].append(tp.partition)
        response = await self._send_req(
            StableOffsetFetchRequest(self.group_id, list(by_topic.items()))
        )
        self._raise_for(response.error_code, None)
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        for topic, topic_partitions, _ in response.topics:
            for partition, offset, _epoch, metadata, error_code, _ in topic_partitions:
                tp = TopicPartition(topic, partition)
                if error_code == Errors.UnknownTopicOrPartitionError.errno:
                    logger.warning("committed offset of %s: unknown topic or partition", tp)
                    continue
                self._raise_for(error_code, tp)
                if offset != NO_OFFSET:
                    offsets[tp] = OffsetAndMetadata(offset, metadata or "")
        return offsets

    def _raise_for(self, error_code: int, tp: TopicPartition | None) -> None:
        """aiokafka's handling of an OffsetFetch error, plus UNSTABLE_OFFSET_COMMIT
        (retried by `fetch_committed_offsets`, as a load in progress is)."""
        if error_code == 0:
            return
        if error_code == UNSTABLE_OFFSET_COMMIT:
            raise UnstableOffsetCommitError(f"{tp}: a transaction holds its offset")
        error_type = Errors.for_code(error_code)
        if error_type is Errors.GroupLoadInProgressError:
            raise error_type()
        if error_type is Errors.NotCoordinatorForGroupError:
            self.coordinator_dead()
            raise error_type()
        if error_type is Errors.GroupAuthorizationFailedError:
            raise error_type(self.group_id)
        logger.error("unknown error fetching offsets for %s: %s", tp, error_type())
        raise Errors.KafkaError(repr(error_type()))


def install_stable_offset_fetch() -> None:
    """Every group consumer this process starts from now on reads stable offsets.

    aiokafka builds its coordinator in `AIOKafkaConsumer.start()` from the name in its
    module; a consumer of a group no transaction writes to behaves as before."""
    aiokafka.consumer.consumer.GroupCoordinator = StableOffsetsCoordinator
