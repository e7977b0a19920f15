"""Raw data is read with isolation_level read_committed by every consumer the gateway builds
(the test broker has no transactions, so this checks the clients' configuration)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gateway
from gateway.config import load_settings
from gateway.kafka.clients import build_consumer

PACKAGE = Path(gateway.__file__).parent


async def test_every_consumer_shape_the_gateway_builds_reads_committed_data_only():
    kafka = load_settings().kafka
    consumers = [  # the calls gateway/service/app.py and gateway/ops/ make
        build_consumer(kafka, "g", max_partition_fetch_bytes=4 * 1024 * 1024,
                       fetch_max_wait_ms=100, session_timeout_ms=10_000),
        build_consumer(kafka, "g.failures"),
        build_consumer(kafka, None, auto_offset_reset="none"),
        build_consumer(kafka, "g.redrive"),
    ]  # fmt: skip
    try:
        for consumer in consumers:
            assert consumer._isolation_level == "read_committed"
        with pytest.raises(TypeError, match="isolation_level"):  # no caller can override it
            build_consumer(kafka, "g", isolation_level="read_uncommitted")
    finally:
        for consumer in consumers:
            await consumer.stop()


def test_the_gateway_builds_consumers_only_through_build_consumer():
    """A consumer built elsewhere would not get read_committed from build_consumer."""
    built_at = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "AIOKafkaConsumer":
                built_at.append(path.relative_to(PACKAGE).as_posix())
    assert built_at == ["kafka/clients.py"]
