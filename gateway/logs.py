"""Logging set-up: one line per event, plain text or JSON (`[log] json = true`).

JSON lines carry `ts` (ISO-8601 UTC, milliseconds: `2026-11-23T14:22:01.123Z`),
`level`, `name`, `message`, and every field a call passes with `extra=` (topic,
partition, offset, redis, group...) as a top-level key, so log pipelines can
filter on coordinates without parsing messages.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from aiokafka.errors import KafkaError
from pythonjsonlogger.json import JsonFormatter

from gateway.config import LogSettings

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class UtcJsonFormatter(JsonFormatter):
    """python-json-logger's formatter with `ts` in UTC, as logging.Formatter builds
    `asctime` from these three attributes when no datefmt is given."""

    converter = staticmethod(time.gmtime)
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    def __init__(self) -> None:
        super().__init__(FORMAT, rename_fields={"asctime": "ts", "levelname": "level"})


# aiokafka's ERROR lines about a broker it cannot reach, which it retries by itself; their
# arguments carry no KafkaError (an OSError, a list of node ids).
RETRIED_CONNECTION_ERRORS = frozenset(
    {"Unable connect to node with id %s: %s", "Unable to update metadata from %s"}
)
REPEAT_WINDOW_S = 10.0


class RetriedIsNoError(logging.Filter):
    """aiokafka logs at ERROR some failures it retries by itself: the group coordinator
    not available yet while a new broker creates its offsets topic (every first start,
    twice), a partition's leader moving, a broker of the cluster down. Such a line, with
    a retriable `KafkaError` in its arguments or one of `RETRIED_CONNECTION_ERRORS`, is a
    WARNING, and only shown where warnings are. And aiokafka's warnings come at most one
    per message per `REPEAT_WINDOW_S`, the next saying how many it stands for: a broker
    down logs a line per request (458 "Unable connect" lines over two 3 s outages of one
    node of three in tests/integration/test_kafka_cluster.py)."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self.shown: dict[tuple[str, object], tuple[float, int]] = {}  # -> (when, held since)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.levelno == logging.ERROR and (
            any(isinstance(arg, KafkaError) and arg.retriable for arg in args)
            or (record.name.startswith("aiokafka") and record.msg in RETRIED_CONNECTION_ERRORS)
        ):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            if not logging.getLogger(record.name).isEnabledFor(logging.WARNING):
                return False
        if record.levelno != logging.WARNING or not record.name.startswith("aiokafka"):
            return True
        key, now = (record.name, record.msg), self.clock()
        when, held = self.shown.get(key, (-self.window_s, 0))
        if now - when < self.window_s:
            self.shown[key] = (when, held + 1)
            return False
        self.shown[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the {now - when:.0f}s before)"
        return True


def configure(settings: LogSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RetriedIsNoError())
    if settings.json_format:
        handler.setFormatter(UtcJsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # aiokafka logs every rebalance step at INFO; keep its warnings and errors.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
