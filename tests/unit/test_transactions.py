"""What the broker must support for `[kafka] exactly_once`, and what start-up does
without it (the check reads the versions the broker announced; no broker here)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import ProducerFenced

from gateway.config import Settings
from gateway.errors import ConfigError
from gateway.kafka.admin import transactions_unsupported
from gateway.kafka.completion import transactional_id
from gateway.kafka.exactly_once import Transactions, end_bound_s
from gateway.kafka.transactions import FencingEndTxnHandler
from gateway.service.app import Gateway

KAFKA_4 = {22: (0, 5), 28: (0, 5), 9: (1, 9)}


def producer_with(versions: dict[int, tuple[int, int]]) -> Any:
    async def get_conn(node: int) -> Any:
        return SimpleNamespace(_versions=versions)

    cluster = SimpleNamespace(brokers=lambda: [SimpleNamespace(nodeId=1)])
    return SimpleNamespace(client=SimpleNamespace(cluster=cluster, _get_conn=get_conn))


async def test_a_kafka_4_broker_supports_exactly_once() -> None:
    assert await transactions_unsupported(producer_with(KAFKA_4).client) is None


@pytest.mark.parametrize(
    ("versions", "lacks"),
    [
        ({28: (0, 3), 9: (1, 7)}, "transactions"),
        ({22: (0, 1), 28: (0, 2), 9: (1, 7)}, "TxnOffsetCommit v3"),
        ({22: (0, 1), 28: (0, 3), 9: (1, 6)}, "OffsetFetch v7"),
    ],
)
async def test_a_broker_without_what_it_needs_is_named(versions, lacks) -> None:
    why = await transactions_unsupported(producer_with(versions).client)
    assert why is not None and lacks in why


@pytest.mark.parametrize("mode", ["on", "auto", "off"])
async def test_exactly_once_on_refuses_to_start_without_transactions_auto_goes_on(
    mode, caplog
) -> None:
    settings = Settings.model_validate({"kafka": {"exactly_once": mode}})
    gateway = Gateway(settings)
    old = producer_with({28: (0, 3), 9: (1, 7)})
    if mode == "on":
        with pytest.raises(ConfigError, match=r"kafka\.exactly_once: the broker lacks"):
            await gateway._exactly_once(old)
        return
    with caplog.at_level(logging.WARNING):
        assert await gateway._exactly_once(old) is False
    assert ("at-least-once output" in caplog.text) == (mode == "auto")


def test_the_transactional_id_is_stable_with_a_group_instance_id_and_unique_without() -> None:
    static = Settings.model_validate({"kafka": {"group_id": "g", "group_instance_id": "pod-0"}})
    assert transactional_id(static.kafka) == transactional_id(static.kafka) == "g.raw.pod-0"
    assert transactional_id(static.kafka, "delay") == "g.delay.pod-0"
    dynamic = Settings.model_validate({"kafka": {"group_id": "g"}})
    assert transactional_id(dynamic.kafka) != transactional_id(dynamic.kafka)


def end_txn_handler() -> Any:
    completed: list[bool] = []
    txn = SimpleNamespace(
        transactional_id="g.raw.0",
        producer_id=7,
        producer_epoch=0,
        complete_transaction=lambda: completed.append(True),
    )
    sender = SimpleNamespace(_txn_manager=txn, _retry_backoff=0.1)
    return FencingEndTxnHandler(sender, True), completed


def test_an_end_txn_the_broker_failed_unexpectedly_ends_the_producer_as_a_fence(
    caplog,
) -> None:
    # Kafka 4.1's answer to an EndTxn meeting its own timeout abort (PREPARE_EPOCH_FENCE):
    # aiokafka raised it inside the sender task, which died with a traceback.
    handler, completed = end_txn_handler()
    with caplog.at_level(logging.WARNING), pytest.raises(ProducerFenced):
        handler.handle_response(SimpleNamespace(error_code=-1))
    assert not completed
    assert "EndTxn answered UnknownError" in caplog.text
    assert all(r.levelno < logging.ERROR for r in caplog.records)


def test_an_end_txn_that_succeeds_or_is_retried_is_aiokafkas() -> None:
    handler, completed = end_txn_handler()
    assert handler.handle_response(SimpleNamespace(error_code=0)) is None
    assert completed == [True]
    # CONCURRENT_TRANSACTIONS (51): tried again after the backoff
    assert handler.handle_response(SimpleNamespace(error_code=51)) == 0.1


async def test_a_new_producer_that_does_not_start_is_tried_again(caplog) -> None:
    # A broker just back: aiokafka's coordinator lookup asserted, and the loop that
    # renewed its fenced producer died with it (chaos seed 14004).
    started: list[Any] = []

    class Producer:
        def __init__(self) -> None:
            self._sender = SimpleNamespace(sender_task=None)
            self._txn_manager = SimpleNamespace(_transaction_waiter=None, _pending_txn_offsets=[])
            self._message_accumulator = SimpleNamespace(_batches={}, _pending_batches=set())

        async def start(self) -> None:
            started.append(self)
            if len(started) < 3:
                raise AssertionError("Did we not perform bootstrap?")

        async def stop(self) -> None:
            pass

    transactions = Transactions("raw", Producer(), Producer, 12.0)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        await transactions._renew()
    assert len(started) == 3 and transactions.producer is started[-1]
    assert caplog.text.count("did not start") == 2


def test_a_transactions_end_is_given_up_after_its_timeout_and_a_round_trip_not_before_60s() -> None:
    assert end_bound_s(10) == 60.0  # the default: a broker restart is not a stall
    assert end_bound_s(120) == 122.0  # past the broker's own abort, and its answer
