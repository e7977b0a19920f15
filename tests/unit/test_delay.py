"""Scheduled delivery, the pure parts: delay headers (bad values are quarantine
reasons), tier names and choice, routing of decided-new records, and the
`[delay]` settings."""

from __future__ import annotations

from collections import deque
from datetime import timedelta

import pytest
from aiokafka import ConsumerRecord, TopicPartition

from gateway.config import ConfigError, load_settings
from gateway.contract.records import H_DELIVER_AT, H_TIER_AT, OutRecord
from gateway.delay.coalescer import now_ms
from gateway.delay.loop import DelayLoop, _Partition
from gateway.delay.router import Router
from gateway.errors import BadRecord
from gateway.kafka.completion import PlainCompletion
from gateway.metrics import Metrics
from gateway.rules.tiers import next_step_ms, pick_tier, requested_due, tier_label, tier_topics

TS = 1_700_000_000_000  # a raw record's timestamp
DAY_MS = 86_400_000


def due(*headers: tuple[str, bytes], max_delay_ms: int = DAY_MS) -> int | None:
    return requested_due(list(headers), TS, "deliver-at", "deliver-after", max_delay_ms)


def test_no_delay_header_asks_for_nothing():
    assert due(("message-id", b"m-1")) is None


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([("deliver-at", str(TS + 5000).encode())], TS + 5000),
        ([("deliver-at", b"0")], 0),  # long past: due at once
        ([("deliver-after", b"90s")], TS + 90_000),
        ([("deliver-after", b"15m")], TS + 900_000),
        ([("deliver-after", b"250ms")], TS + 250),
        ([("deliver-after", b"1.5s")], TS + 1500),
        # The first header of a name counts, as for ids.
        ([("deliver-after", b"1s"), ("deliver-after", b"junk")], TS + 1000),
    ],
)
def test_deliver_at_is_epoch_ms_and_deliver_after_counts_from_the_record_timestamp(
    headers, expected
):
    assert due(*headers) == expected


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ([("deliver-at", b"soon")], "bad_deliver_at"),
        ([("deliver-at", b"-5")], "bad_deliver_at"),
        ([("deliver-at", b"")], "bad_deliver_at"),
        ([("deliver-at", b"1" * 40)], "bad_deliver_at"),
        ([("deliver-at", "\uff11\uff12".encode())], "bad_deliver_at"),  # fullwidth digits
        ([("deliver-after", b"90")], "bad_deliver_after"),  # no unit
        ([("deliver-after", b"tomorrow")], "bad_deliver_after"),
        ([("deliver-after", b"\xff\xfe")], "bad_deliver_after"),
        ([("deliver-after", b"9" * 30 + b"d")], "bad_deliver_after"),  # overflows a timedelta
        ([("deliver-after", b"1" * 400 + b"s")], "bad_deliver_after"),
        ([("deliver-at", b"1"), ("deliver-after", b"1s")], "conflicting_delay"),
        ([("deliver-after", b"25h")], "delay_too_long"),
        ([("deliver-at", str(TS + DAY_MS + 1).encode())], "delay_too_long"),
    ],
)
def test_bad_delay_headers_raise_bad_record_with_a_reason(headers, reason):
    with pytest.raises(BadRecord) as err:
        due(*headers)
    assert err.value.reason == reason


def test_a_delay_of_exactly_max_delay_is_accepted():
    assert due(("deliver-after", b"24h")) == TS + DAY_MS


@pytest.mark.parametrize(
    ("tier", "label"),
    [
        (timedelta(seconds=1), "1s"),
        (timedelta(seconds=16), "16s"),
        (timedelta(minutes=1), "1m"),
        (timedelta(minutes=16), "16m"),
        (timedelta(hours=4), "4h"),
        (timedelta(days=2), "2d"),
        (timedelta(milliseconds=250), "250ms"),
        (timedelta(seconds=90), "90s"),
    ],
)
def test_tier_labels_use_the_largest_unit_that_divides(tier, label):
    assert tier_label(tier) == label


def test_tier_topics_are_named_after_the_clean_topic():
    settings = load_settings(kafka={"clean_topic": "orders-clean"})
    assert tier_topics(settings) == [
        f"orders-clean.delay.{t}" for t in ("1s", "4s", "16s", "1m", "4m", "16m", "1h", "4h", "16h")
    ]


TIERS = [1000, 4000, 16000]


@pytest.mark.parametrize(
    ("remaining", "tier"),
    [(0, None), (999, None), (1000, 0), (3999, 0), (4000, 1), (15999, 1), (16000, 2), (10**9, 2)],
)
def test_pick_tier_is_the_largest_tier_not_longer_than_the_time_left(remaining, tier):
    assert pick_tier(remaining, TIERS) == tier


def test_next_step_is_tier_delay_after_entry_or_due_whichever_first():
    assert next_step_ms(100, 1000, 5000) == 1100
    assert next_step_ms(100, 1000, 600) == 600


def router(**delay: object) -> Router:
    settings = load_settings(
        kafka={"clean_topic": "c"}, delay={"enabled": True, "tiers": ["1s", "4s", "16s"], **delay}
    )
    return Router(settings, Metrics())


def out(*headers: tuple[str, bytes], timestamp: int | None = None) -> OutRecord:
    return OutRecord(b"k", b"v", timestamp or now_ms(), [*headers, ("dedup-id", b"m")], 0)


def test_route_sends_due_records_to_clean_and_the_rest_to_the_tier_that_fits():
    now = now_ms()
    plain = out()
    past = out(("deliver-at", str(now - 10).encode()))
    soon = out(("deliver-after", b"300ms"))
    later = out(("deliver-after", b"10s"))
    much_later = out(("deliver-after", b"1h"))
    rows, tiers = router().route([plain, past, soon, later, much_later])
    assert rows[0] is plain  # no header: untouched
    clean = [OutRecord(*r) for r in rows]  # the pipeline's rows are plain tuples
    delayed = {t: [OutRecord(*r) for r in rs] for t, rs in tiers.items()}
    assert dict(clean[1].headers)[H_DELIVER_AT] == str(now - 10).encode()
    assert H_TIER_AT not in dict(clean[1].headers)
    assert {t: len(r) for t, r in delayed.items()} == {"c.delay.1s": 1, "c.delay.4s": 1,
                                                      "c.delay.16s": 1}  # fmt: skip
    (waiting,) = delayed["c.delay.4s"]
    headers = dict(waiting.headers)
    assert int(headers[H_DELIVER_AT]) == later.timestamp_ms + 10_000
    assert now <= int(headers[H_TIER_AT]) <= now_ms()
    assert (waiting.key, waiting.value, waiting.timestamp_ms) == (b"k", b"v", later.timestamp_ms)


def test_a_timestamp_ahead_of_the_clock_cannot_stretch_the_wait_past_max_delay():
    r = router(max_delay="1m")
    ahead = now_ms() + 3_600_000  # a producer clock an hour fast
    with pytest.raises(BadRecord) as refused:
        r.due([("deliver-after", b"30s")], ahead)  # 30 s after its timestamp, 1 h from now
    assert refused.value.reason == "delay_too_long"
    assert r.due([("deliver-after", b"30s")], now_ms()) is not None


def test_every_tier_series_starts_at_zero():
    metrics = Metrics()
    r = Router(load_settings(delay={"enabled": True, "tiers": ["1s", "4s"]}), metrics)
    assert r.tiers.labels == ["1s", "4s"]
    for label in ("1s", "4s"):
        assert (
            metrics.registry.get_sample_value(
                "dedup_gateway_records_delayed_total", {"tier": label}
            )
            == 0
        )
        assert (
            metrics.registry.get_sample_value(
                "dedup_gateway_delay_backlog_records", {"tier": label}
            )
            == 0
        )


def test_checked_extractor_refuses_bad_delay_headers_before_the_id_is_claimed():
    class Raw:
        key = b"k"
        value = b"v"
        timestamp = TS
        headers = [("message-id", b"m-1"), ("deliver-at", b"tomorrow")]

    extract = router().checked(lambda rec: dict(rec.headers)["message-id"])
    with pytest.raises(BadRecord) as err:
        extract(Raw())  # type: ignore[arg-type]
    assert err.value.reason == "bad_deliver_at"
    Raw.headers = [("message-id", b"m-1"), ("deliver-after", b"5s")]
    assert extract(Raw()) == b"m-1"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sections", "hint"),
    [
        (
            {"delay": {"enabled": True, "max_delay": "2d"}},
            "delay.max_delay (2 days, 0:00:00) is longer than redis.ttl (1 day, 0:00:00)",
        ),
        ({"delay": {"tiers": ["4s", "1s"]}}, "smallest first"),
        ({"delay": {"tiers": ["1s", "1s"]}}, "smallest first"),
        ({"delay": {"tiers": ["5ms"]}}, "at least 10ms"),
        ({"delay": {"tiers": []}}, "at least 1 item"),
        ({"delay": {"deliver_at_header": "dedup-at"}}, "not start with 'dedup-'"),
        ({"delay": {"enabled": True, "deliver_after_header": "deliver-at"}}, "must differ"),
    ],
)
def test_bad_delay_settings_stop_start_up_naming_them(sections, hint):
    with pytest.raises(ConfigError) as err:
        load_settings(**sections)
    assert "invalid setting delay" in str(err.value)
    assert hint in str(err.value)


def test_max_delay_may_exceed_the_default_ttl_when_ttl_is_raised():
    settings = load_settings(redis={"ttl": "3d"}, delay={"enabled": True, "max_delay": "2d"})
    assert settings.delay.max_delay == timedelta(days=2)


def test_the_commit_point_stays_at_the_first_record_not_yet_moved():
    part = _Partition(taken=deque([5, 6, 7]), next_offset=8)
    part.moved.add(6)  # moved out of order (a smaller tier's step came first)
    assert part.commit_point() == 5  # 5 is still held: a restart must read it again
    part.moved.add(5)
    assert part.commit_point() == 7
    part.moved.add(7)
    assert part.commit_point() == 8  # everything taken moved: up to the next to read
    assert not part.taken and not part.moved


class _Consumer:
    """What DelayLoop._take asks of a consumer: its assignment, seek and pause."""

    def __init__(self, tp: TopicPartition) -> None:
        self.tp = tp
        self.sought: dict[TopicPartition, int] = {}
        self.paused: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return {self.tp}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.sought[tp] = offset

    def pause(self, *tps: TopicPartition) -> None:
        self.paused.update(tps)


def tier_record(tp: TopicPartition, offset: int, step_in_ms: int) -> ConsumerRecord:
    now = now_ms()
    headers = [(H_DELIVER_AT, str(now + step_in_ms).encode()), (H_TIER_AT, str(now).encode())]
    return ConsumerRecord(tp.topic, tp.partition, offset, now, 0, b"k", b"v", None, 1, 1, headers)


def delay_loop(tp: TopicPartition) -> tuple[DelayLoop, _Consumer]:
    settings = load_settings(
        kafka={"clean_topic": "c"}, delay={"enabled": True, "tiers": ["1s", "4s", "16s"]}
    )
    consumer = _Consumer(tp)
    completion = PlainCompletion(consumer, "delay", sink=None)  # type: ignore[arg-type]
    return DelayLoop(settings, consumer, completion, metrics=Metrics()), consumer  # type: ignore[arg-type]


def test_a_full_memory_pauses_the_partition_at_the_first_record_not_held(monkeypatch):
    tp = TopicPartition("c.delay.1s", 0)
    loop, consumer = delay_loop(tp)
    monkeypatch.setattr("gateway.delay.loop.MAX_HELD", 3)
    records = [tier_record(tp, offset, 500) for offset in range(10, 15)]
    now = now_ms()
    loop._take(tp, records, now)
    assert [h.record.offset for h in sorted(loop.held)] == [10, 11, 12]
    assert consumer.paused == {tp} and consumer.sought == {tp: 13}  # 13 is read again
    part = loop.book.parts[tp]
    assert part.next_offset == 13 and part.commit_point() == 10
    assert part.resume_at_ms is not None and part.resume_at_ms <= now + 1_000


def test_a_record_whose_step_is_beyond_the_lead_pauses_its_partition_until_near_it():
    tp = TopicPartition("c.delay.16s", 0)
    loop, consumer = delay_loop(tp)
    records = [tier_record(tp, 0, 500), tier_record(tp, 1, 8_000), tier_record(tp, 2, 500)]
    now = now_ms()
    loop._take(tp, records, now)
    assert [h.record.offset for h in loop.held] == [0]  # the one after 1 waits behind it
    assert consumer.sought == {tp: 1} and consumer.paused == {tp}
    resume = loop.book.parts[tp].resume_at_ms
    assert resume is not None and now + 8_000 - loop.lead_ms - 50 <= resume <= now + 8_000


def test_a_clock_stepped_back_between_extraction_and_routing_routes_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The due time was checked at extraction; an hour's step back of the wall clock
    before `route` (after the vote) raised `delay_too_long` there, which took the
    gateway down: the record is routed to its tier instead."""
    r = router(max_delay="1m")
    record = out(("deliver-after", b"50s"))
    r.due(record.headers, record.timestamp_ms)  # the check at extraction: fine
    stepped = now_ms() - 3_600_000
    monkeypatch.setattr("gateway.delay.router.now_ms", lambda: stepped)
    rows, tiers = r.route([record])
    assert not rows and sum(len(t) for t in tiers.values()) == 1
