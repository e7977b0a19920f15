"""`stop_within`: a client's stop that raises what ended it (a producer's sender that
died on an EndTxn error, chaos seed 52304) is a stop, its connections closed; it took
the failure loop, and the gateway, down."""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.errors import KafkaError

from gateway.kafka.clients import stop_within


class Client:
    def __init__(self, error: Exception | None) -> None:
        self.error, self.closed = error, False
        self._client = self

    async def stop(self) -> None:
        if self.error is not None:
            raise self.error

    async def close(self) -> None:
        self.closed = True


async def test_a_stop_that_raises_a_kafka_error_closes_the_connections(caplog: Any) -> None:
    failing = Client(KafkaError("EndTxn answered UnknownError"))
    with caplog.at_level(logging.WARNING, logger="gateway.kafka.clients"):
        await stop_within(failing)  # type: ignore[arg-type]
    assert failing.closed
    assert "stopped on KafkaError" in caplog.text
    clean = Client(None)
    await stop_within(clean)  # type: ignore[arg-type]
    assert not clean.closed  # its own stop closed what it had
