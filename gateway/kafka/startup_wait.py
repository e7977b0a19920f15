"""Waiting at start-up for what the gateway cannot work without (a Redis majority,
the Kafka broker): retried often, reported rarely.

A service that cannot reach its infrastructure should say so in one line naming
what it cannot reach, and keep waiting unready (an orchestrator's readiness
probe sees it), not fill the log with a line per attempt: the report is
repeated at a falling rate, after 2, 4, 8 ... seconds, at most every minute.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from gateway.config import KafkaSettings
from gateway.kafka.clients import aiokafka_options
from gateway.waits import FallingReport, wait_or_stop

logger = logging.getLogger(__name__)


async def wait_for_broker(kafka: KafkaSettings, stop: asyncio.Event, retry_s: float = 1.0) -> bool:
    """Return True once the broker answers (a bootstrap and an API version check);
    False when `stop` is set first. Retries every `retry_s`, reports as `FallingReport`."""
    report = FallingReport(retry_s)
    aiokafka_logger = logging.getLogger("aiokafka")
    while not stop.is_set():
        admin = AIOKafkaAdminClient(**aiokafka_options(kafka))
        # aiokafka logs an ERROR per failed connection: the report below says it once.
        level, aiokafka_logger.level = aiokafka_logger.level, logging.CRITICAL
        try:
            await admin.start()
        except (KafkaError, OSError) as exc:
            if report.due():
                logger.warning(
                    "cannot reach the Kafka broker at %s (%s); not ready, retrying every "
                    "%gs (next report in %gs)",
                    kafka.bootstrap_servers, exc, retry_s, report.every,
                )  # fmt: skip
        else:
            return True
        finally:
            await admin.close()
            aiokafka_logger.setLevel(level)
        await wait_or_stop(stop, retry_s)
    return False
