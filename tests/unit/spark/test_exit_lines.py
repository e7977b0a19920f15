"""How `python -m spark_sink` ends, as pure units: the line for a failed query, the
line and the event for a stopping signal, and the topic check's answer for a topic
the job's user may not describe (the broker's ACLs: no authorising broker here, so an
admin client that answers as one does). The real runs: tests/integration/spark/
test_one_line_errors.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gateway.config import ConfigError
from spark_sink.__main__ import failed_line, stop_on_signals, stopped_line
from spark_sink.config import load_sink_settings
from spark_sink.preflight import TOPIC_AUTHORIZATION_FAILED, check_topics


def test_a_failed_query_is_its_first_line_without_the_jvm_stack() -> None:
    exc = RuntimeError(
        "[STREAM_FAILED] Query [id = 1] terminated with exception: boom\n\n"
        "JVM stacktrace:\norg.apache.spark.SparkException: boom\n\tat org.x.Y(Y.scala:1)"
    )
    assert failed_line(exc) == (
        "the job failed: [STREAM_FAILED] Query [id = 1] terminated with exception: boom; "
        "the batch in flight runs again at the next start"
    )
    assert len(failed_line(RuntimeError("x" * 5000))) < 700
    assert failed_line(RuntimeError("")).startswith("the job failed: RuntimeError;")


def test_the_first_signal_sets_the_event_and_a_second_ends_the_process() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as (stop, seen):
        assert not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5) and seen == [signal.SIGTERM]
        # A second SIGTERM is the default's again: the process would end at once.
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == before
    assert stopped_line(signal.SIGTERM) == (
        "spark_sink: SIGTERM: stopped; the batch in flight runs again at the next start"
    )


class DenyingAdmin:
    """Lists `listed`; describing any other topic answers TOPIC_AUTHORIZATION_FAILED."""

    def __init__(self, listed: list[str]) -> None:
        self.listed = listed

    async def list_topics(self) -> list[str]:
        return self.listed

    async def describe_topics(self, names: list[str]) -> list[dict[str, object]]:
        return [{"topic": n, "error_code": TOPIC_AUTHORIZATION_FAILED} for n in names]


def test_a_topic_the_user_may_not_describe_is_said_as_not_authorised() -> None:
    settings = load_sink_settings(kafka={"clean_topic": "orders-clean", "failure_topic": "f"})
    with pytest.raises(ConfigError) as err:
        asyncio.run(check_topics(DenyingAdmin(["f"]), settings))  # type: ignore[arg-type]
    assert str(err.value) == (
        'kafka.clean_topic = "orders-clean": not authorised (the job\'s user needs Describe '
        "and Read on it)"
    )
