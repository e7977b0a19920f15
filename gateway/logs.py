"""Logging set-up: one line per event, plain text or JSON (`[log] json = true`)."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from gateway.config import LogSettings

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure(settings: LogSettings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if settings.json_format:
        handler.setFormatter(JsonFormatter(FORMAT, rename_fields={"levelname": "level"}))
    else:
        handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # aiokafka logs every rebalance step at INFO; keep its warnings and errors.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
