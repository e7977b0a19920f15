"""Log lines: JSON with an ISO-8601 UTC timestamp and structured fields; plain text unchanged."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from aiokafka.errors import GroupCoordinatorNotAvailableError, UnknownError

from gateway.config import LogSettings
from gateway.logs import RetriedIsNoError, configure


@pytest.fixture
def configured() -> Iterator[Callable[[LogSettings], io.StringIO]]:
    """`configure`, with its handler writing to a buffer; the root logger is restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def apply(settings: LogSettings) -> io.StringIO:
        configure(settings)
        out = io.StringIO()
        (handler,) = root.handlers
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(out)
        return out

    yield apply
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_have_a_utc_iso_timestamp_and_extra_fields_as_top_level_keys(configured):
    stderr = configured(LogSettings(json=True))
    before = datetime.now(UTC)
    logging.getLogger("gateway.pipeline").warning(
        "quarantined %s: %s", "raw/2/17", "bad_header: 1 header dropped",
        extra={"topic": "raw", "partition": 2, "offset": 17, "redis": "127.0.0.1:6379/0"},
    )  # fmt: skip
    (line,) = stderr.getvalue().splitlines()
    entry = json.loads(line)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["ts"]), entry["ts"]
    logged = datetime.strptime(entry["ts"], "%Y-%m-%dT%H:%M:%S.%f%z")
    assert abs((logged - before).total_seconds()) < 5  # UTC, not local time
    assert entry["level"] == "WARNING"
    assert entry["name"] == "gateway.pipeline"
    assert entry["message"] == "quarantined raw/2/17: bad_header: 1 header dropped"
    assert (entry["topic"], entry["partition"], entry["offset"]) == ("raw", 2, 17)
    assert entry["redis"] == "127.0.0.1:6379/0"


def test_plain_text_mode_is_one_line_without_json(configured):
    stderr = configured(LogSettings(json=False))
    logging.getLogger("gateway.source").info("partitions assigned: %s", "raw-0", extra={"n": 1})
    (line,) = stderr.getvalue().splitlines()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO gateway.source partitions assigned: raw-0", line
    )


@pytest.mark.parametrize("level", ["INFO", "ERROR"])
def test_a_failure_aiokafka_retries_is_a_warning_not_an_error(configured, level):
    stderr = configured(LogSettings(level=level))
    coordinator = logging.getLogger("aiokafka.consumer.group_coordinator")
    coordinator.error("Group Coordinator Request failed: %s", GroupCoordinatorNotAvailableError())
    coordinator.error("Group Coordinator Request failed: %s", UnknownError())  # not retriable
    lines = stderr.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == (
        ["WARNING", "ERROR"] if level == "INFO" else ["ERROR"]
    )
    assert "UnknownError" in lines[-1]


def test_a_broker_that_is_down_is_a_warning_at_most_once_per_window_with_a_count() -> None:
    now = [100.0]
    retried = RetriedIsNoError(window_s=10.0, clock=lambda: now[0])

    def shown(message: str, *args: object, name: str = "aiokafka") -> logging.LogRecord | None:
        record = logging.LogRecord(name, logging.ERROR, __file__, 1, message, args, None)
        return record if retried.filter(record) else None

    first = shown("Unable connect to node with id %s: %s", 3, ConnectionRefusedError(111))
    assert first is not None and first.levelname == "WARNING"
    for node in range(1, 100):  # one per request while the broker is down
        now[0] += 0.05
        assert shown("Unable connect to node with id %s: %s", node, OSError()) is None
    other = shown("Unable to update metadata from %s", [3])  # its own message: its own count
    assert other is not None and other.levelname == "WARNING"
    now[0] = 111.0
    later = shown("Unable connect to node with id %s: %s", 3, OSError())
    assert later is not None
    assert later.getMessage().endswith("(99 more like it in the 11s before)")
    # Not aiokafka's, or not retried: every line, as it came.
    assert shown("a member failed: %s", "x", name="gateway.quorum").levelname == "ERROR"  # type: ignore[union-attr]
    assert shown("a member failed: %s", "x", name="gateway.quorum") is not None
    assert shown("Group Coordinator Request failed: %s", UnknownError()).levelname == "ERROR"  # type: ignore[union-attr]
