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


def configure(settings: LogSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.json_format:
        handler.setFormatter(UtcJsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # aiokafka logs every rebalance step at INFO; keep its warnings and errors.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
