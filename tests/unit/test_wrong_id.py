"""A `[dedup] id` that matches nothing is caught: json: paths checked at load time, the
quarantine share watched at run time, per-record warnings rate-limited with a count."""

from __future__ import annotations

import logging

import pytest

from gateway.config import ConfigError, load_settings
from gateway.errors import BadRecord
from gateway.metrics import Metrics
from gateway.raw.quarantine import LOG_BURST, LOG_EVERY_S, MIN_RECORDS, QuarantineWatch
from gateway.rules.ids import build_extractor
from tests.unit.test_ids import Rec


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        ("json:items[0].id", "not JSONPath"),
        ("json:$.id", "not JSONPath"),
        ("json:a]", "not JSONPath"),
        ("json:a.", "empty name"),
        ("json:.a", "empty name"),
        ("json:a..b", "empty name"),
        ("json:a. .b", "empty name"),
    ],
)
def test_a_json_path_that_can_match_nothing_is_refused_naming_dedup_id(spec, hint):
    with pytest.raises(ConfigError) as err:
        load_settings(dedup={"id": spec})
    assert str(err.value).startswith(f"invalid setting dedup.id: {spec!r}")
    assert hint in str(err.value)
    assert "\n" not in str(err.value)


def test_the_same_json_path_rule_holds_for_the_coalesce_key():
    with pytest.raises(ConfigError, match=r"invalid setting coalesce.key: .*not JSONPath"):
        load_settings(coalesce={"key": "json:items[0]"})


@pytest.mark.parametrize("spec", ["json:id", "json:order.id", "json:a-b.c_d", "json:x y"])
def test_dotted_json_paths_load_and_extract(spec):
    assert load_settings(dedup={"id": spec}).dedup.id == spec
    path = spec.removeprefix("json:").split(".")
    value = "{" + "".join(f'"{p}": {{' for p in path[:-1]) + f'"{path[-1]}": "i-1"'
    value += "}" * len(path)
    assert build_extractor(spec, 100)(Rec(value=value.encode())) == b"i-1"


@pytest.mark.parametrize(
    ("section", "setting"),
    [
        ({"quarantine_alarm_share": 0}, "quarantine_alarm_share"),
        ({"quarantine_alarm_share": 1.5}, "quarantine_alarm_share"),
        ({"quarantine_alarm_window": "5s"}, "quarantine_alarm_window"),
        ({"quarantine_alarm_window": "2h"}, "quarantine_alarm_window"),
    ],
)
def test_quarantine_alarm_settings_are_validated(section, setting):
    with pytest.raises(ConfigError, match=f"invalid setting dedup.{setting}:"):
        load_settings(dedup=section)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(**dedup):
    settings = load_settings(dedup=dedup)
    metrics = Metrics()
    metrics.preinit(settings)
    clock = Clock()
    return QuarantineWatch(settings, metrics, clock), metrics, clock


class _Rec:
    topic, partition = "raw", 0

    def __init__(self, offset: int) -> None:
        self.offset = offset


def _consume(watch, metrics, good: int, bad: int, start: int = 0) -> None:
    metrics.records_in.labels("raw").inc(good + bad)
    for offset in range(start, start + bad):
        metrics.quarantined.labels("missing_header").inc()
        watch.note(_Rec(offset), BadRecord("missing_header", "no header 'message-id'"))


def test_per_record_warnings_are_rate_limited_per_reason_with_a_count(caplog):
    caplog.set_level(logging.INFO)
    watch, metrics, clock = _watch()
    _consume(watch, metrics, 0, 200)
    watch.note(_Rec(999), BadRecord("not_json", "value is not JSON"))
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("quarantined raw/0/") for line in lines) == LOG_BURST + 1
    assert "quarantined raw/0/999: not_json: value is not JSON" in lines
    clock.now += LOG_EVERY_S
    watch.tick()
    more = [r.getMessage() for r in caplog.records if "more quarantined" in r.getMessage()]
    assert more == [
        f"... and {200 - LOG_BURST} more quarantined as missing_header in 10s "
        f"(raw/0/{LOG_BURST} .. raw/0/199), not logged one by one: "
        "dedup_gateway_records_quarantined_total counts every one"
    ]
    caplog.clear()
    _consume(watch, metrics, 0, 1, start=200)  # a new period: logged again
    assert [r.getMessage() for r in caplog.records] == [
        "quarantined raw/0/200: missing_header: no header 'message-id'"
    ]


def test_a_share_above_the_threshold_over_the_window_turns_degraded_with_one_line(caplog):
    caplog.set_level(logging.INFO)
    watch, metrics, clock = _watch(quarantine_alarm_share=0.5, quarantine_alarm_window="1m")
    watch.tick()
    _consume(watch, metrics, good=50, bad=40)  # 44%: not above
    clock.now += 1
    watch.tick()
    assert watch.degraded() is None and metrics.quarantine_alarm._value.get() == 0
    assert metrics.quarantine_share._value.get() == pytest.approx(40 / 90)
    _consume(watch, metrics, good=0, bad=20, start=40)  # 60 of 110
    for _ in range(5):
        clock.now += 1
        watch.tick()
    degraded = watch.degraded()
    assert degraded is not None and degraded.startswith("quarantined 55% of raw records")
    assert "missing_header 60 (no header 'message-id')" in degraded
    assert degraded.endswith("check [dedup] id = 'header:message-id'")
    assert metrics.quarantine_alarm._value.get() == 1
    summaries = [r for r in caplog.records if "quarantine_alarm_share" in r.getMessage()]
    assert len(summaries) == 1 and summaries[0].levelno == logging.WARNING
    assert "check [dedup] id = 'header:message-id' first" in summaries[0].getMessage()
    # A minute of good records: the share over the window falls, the alarm clears.
    clock.now += 61
    metrics.records_in.labels("raw").inc(100)
    watch.tick()
    assert watch.degraded() is None and metrics.quarantine_alarm._value.get() == 0
    assert "/readyz no longer degraded" in caplog.text


def test_too_few_records_are_not_judged():
    watch, metrics, clock = _watch()
    watch.tick()
    _consume(watch, metrics, good=0, bad=MIN_RECORDS - 1)
    clock.now += 1
    watch.tick()
    assert watch.degraded() is None
    _consume(watch, metrics, good=0, bad=1, start=MIN_RECORDS - 1)
    clock.now += 1
    watch.tick()
    assert watch.degraded() is not None
