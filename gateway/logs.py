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


class RetriedIsNoError(logging.Filter):
    """aiokafka logs at ERROR some failures it retries by itself: the group coordinator
    not available yet while a new broker creates its offsets topic (every first start,
    twice), a partition's leader moving. Such a line, with a retriable `KafkaError` in
    its arguments, is a WARNING, and only shown where warnings are."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.levelno == logging.ERROR and any(
            isinstance(arg, KafkaError) and arg.retriable for arg in args
        ):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return logging.getLogger(record.name).isEnabledFor(logging.WARNING)
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
