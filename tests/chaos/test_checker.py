"""The schedule generator and the checker on their own (pure, fast): a seed gives one
schedule, the guaranteed profile stays within the guarantees, and each rule of the
checker fails on the observations that break it."""

from __future__ import annotations

import dataclasses

import pytest

from devtools.chaos import Fault, Observations, Step, check, make_schedule
from devtools.chaos.checker import QuarantineCopy, SkippedCommand
from devtools.chaos.runner import _SKIPPED, traceback_error
from devtools.chaos.schedule import (
    DELAY_FAULTS,
    GRACE_MS,
    KINDS,
    ONCE_PER_RUN,
    RETRY_FAULTS,
    RunConfig,
)
from devtools.chaos.standin import DeadLetter, Delivery, fate
from devtools.chaos.timeline import StepRun
from devtools.chaos.traffic import RawEntry, RecordMaker, digest_of

VALUE = b'{"order": {"id": "x"}}'


def config(**changes: object) -> RunConfig:
    return dataclasses.replace(make_schedule(3, 10).config, **changes)  # type: ignore[arg-type]


def ids_with_fate(cfg: RunConfig, wanted: str, n: int) -> list[bytes]:
    found = [f"id-{i}".encode() for i in range(10_000)]
    return [i for i in found if fate(cfg.seed, i, cfg) == wanted][:n]


def entry(partition: int, offset: int, message_id: bytes | None, **kw: object) -> RawEntry:
    fields: dict[str, object] = {
        "kind": "new",
        "expect": "usable",
        "reason": None,
        "at": 1.0,
        "value_digest": digest_of(VALUE),
    }
    fields.update(kw)
    return RawEntry(partition, offset, message_id=message_id, **fields)  # type: ignore[arg-type]


def delivery(
    message_id: bytes,
    source: tuple[int, int],
    outcome: str = "ok",
    token: str = "11",
    attempt: int = 1,
) -> Delivery:
    return Delivery(
        message_id,
        token,
        attempt,
        source,
        (0, source[1]),
        outcome,
        2.0,  # type: ignore[arg-type]
        digest_of(VALUE),
    )


def observations(cfg: RunConfig, **kw: object) -> Observations:
    fields: dict[str, object] = {
        "entries": [],
        "deliveries": [],
        "dead": [],
        "quarantine": [],
        "step_runs": [],
        "raw_highwater": {},
    }
    fields.update(kw)
    obs = Observations(config=cfg, **fields)  # type: ignore[arg-type]
    if not kw.get("raw_highwater"):
        ends: dict[int, int | None] = {}
        for e in obs.entries:
            ends[e.partition] = max(ends.get(e.partition) or 0, e.offset + 1)
        obs.raw_highwater = ends
    return obs


def rules(obs: Observations) -> list[str]:
    return sorted({v.rule for v in check(obs) if not v.tolerated})


def test_a_seed_gives_one_schedule_and_forcing_a_choice_keeps_the_others():
    assert make_schedule(5, 60) == make_schedule(5, 60)
    assert make_schedule(5, 60) != make_schedule(6, 60)
    forced = make_schedule(5, 60, mode="release", session_timeout_s=20)
    free = make_schedule(5, 60)
    assert free.config.mode == "retry"  # the retry-only fault goes with release mode

    def others(steps: tuple[Step, ...]) -> list[Step]:
        return [dataclasses.replace(s, index=0) for s in steps if s.fault not in RETRY_FAULTS]

    assert others(forced.steps) == others(free.steps)
    assert (forced.config.id_spec, forced.config.gateways) == (
        free.config.id_spec,
        free.config.gateways,
    )
    assert free.config.delay  # seed 5 is a delay run: its records are stamped by `now_ms`
    assert RecordMaker(free.config, lambda: 0).next() == RecordMaker(free.config, lambda: 0).next()


@pytest.mark.parametrize("seed", range(40))
def test_every_fault_class_appears_and_guaranteed_redis_faults_hit_one_member(seed):
    schedule = make_schedule(seed, 30)
    wanted = set(Fault) - (set() if schedule.config.delay else set(DELAY_FAULTS))
    wanted -= set() if schedule.config.mode == "retry" else set(RETRY_FAULTS)
    assert {s.fault for s in schedule.steps} == wanted
    redis = {s.target for s in schedule.steps if s.fault.value.startswith("redis")}
    assert redis == {schedule.config.fragile_redis}
    for handover in (s for s in schedule.steps if s.fault is Fault.MEMBER_HANDOVER):
        # The second member only after the first (the fragile one) is repaired.
        assert handover.target == schedule.config.fragile_redis != handover.second
    assert all(
        0 <= s.target < schedule.config.gateways
        for s in schedule.steps
        if s.fault.value.startswith("gateway")
    )


@pytest.mark.parametrize("seed", [7, 9101, 12001])
def test_the_once_per_run_faults_come_once_and_leave_the_seeds_other_steps_as_they_were(seed):
    schedule = make_schedule(seed, 120)
    without = make_schedule(seed, 120, exclude=[f.value for f in ONCE_PER_RUN])
    once = [s for s in schedule.steps if s.fault in ONCE_PER_RUN]
    retry = schedule.config.mode == "retry"
    wanted = [f for f in ONCE_PER_RUN if retry or f not in RETRY_FAULTS]
    assert sorted(s.fault for s in once) == sorted(wanted)
    others = [dataclasses.replace(s, index=0) for s in schedule.steps if s not in once]
    assert others == [dataclasses.replace(s, index=0) for s in without.steps]
    assert [s.index for s in schedule.steps] == list(range(len(schedule.steps)))
    acked = next(s for s in once if s.fault is Fault.GATEWAY_KILL_ACKED)
    assert 0 <= acked.target < schedule.config.gateways and acked.size >= 1
    for stop in (s for s in once if s.fault is Fault.GATEWAY_STOP_RETRY_ACKED):
        assert 0 <= stop.target < schedule.config.gateways and stop.size >= 1
        assert stop.hold_s > schedule.config.session_timeout_s  # a zombie when resumed


def test_excluded_kinds_are_left_out_and_unknown_ones_refused():
    schedule = make_schedule(1, 30, exclude=["broker-stop", "non-utf8-header-name"])
    assert Fault.BROKER_STOP not in {s.fault for s in schedule.steps}
    maker = RecordMaker(schedule.config)
    assert "non-utf8-header-name" not in maker.hostile_kinds
    assert "non-utf8-header-name" in KINDS
    with pytest.raises(ValueError, match="unknown kinds"):
        make_schedule(1, 30, exclude=["no-such-fault"])


def test_a_clean_run_passes():
    cfg = config(mode="retry")
    (good,) = ids_with_fate(cfg, "ok", 1)
    (once,) = ids_with_fate(cfg, "once", 1)
    (always,) = ids_with_fate(cfg, "always", 1)
    obs = observations(
        cfg,
        entries=[
            entry(0, 0, good),
            entry(0, 1, good, kind="copy"),
            entry(0, 2, once),
            entry(0, 3, always),
            entry(0, 4, None, expect="quarantine", reason="empty_id"),
        ],
        deliveries=[
            delivery(good, (0, 0)),
            delivery(once, (0, 2), "failed", "21"),
            delivery(once, (0, 2), "ok", "22", 2),
            delivery(once, (0, 2), "repeat", "22", 2),  # the retry, repeated by the kill
            *(delivery(always, (0, 3), "failed", f"3{a}", a) for a in (1, 2, 3)),
        ],
        dead=[DeadLetter(always, cfg.max_attempts, (0, 3), 5.0)],
        quarantine=[QuarantineCopy([b"raw/0/4"], [b"empty_id: id is empty"], (0, 0))],
        step_runs=[StepRun(Step(0, Fault.GATEWAY_KILL, 0, 1.0), 1.5, 2.5)],
    )
    assert check(obs) == []


def test_an_id_never_processed_is_lost_and_named_with_the_fault_around_it():
    cfg = config()
    (good,) = ids_with_fate(cfg, "ok", 1)
    kill = StepRun(Step(4, Fault.GATEWAY_KILL, 1, 2.0), 0.5, 3.0)
    obs = observations(cfg, entries=[entry(2, 0, good)], step_runs=[kill])
    (violation,) = check(obs)
    assert violation.rule == "lost"
    assert good.decode() in violation.message and "raw 2/0" in violation.message
    assert "during [step 4: gateway-kill g1" in violation.message


def test_an_id_processed_successfully_twice_fails_unless_beyond_the_guarantees():
    cfg = config()
    (good,) = ids_with_fate(cfg, "ok", 1)
    seen = {
        "entries": [entry(0, 0, good), entry(1, 0, good, kind="copy")],
        "deliveries": [delivery(good, (0, 0), token="1"), delivery(good, (1, 0), token="2")],
    }
    assert rules(observations(cfg, **seen)) == ["twice"]
    beyond = check(observations(config(profile="beyond"), **seen))
    assert [(v.rule, v.tolerated) for v in beyond] == [("twice", True)]


def test_a_straight_forward_is_never_repeated_and_retries_and_delays_are_bounded_by_the_kills():
    """exactly_once on: what the raw path forwarded straight never repeats; retries
    (attempt 2 and on) and delayed deliveries may, within the crash window."""
    cfg = config(max_batch_records=2)
    good = ids_with_fate(cfg, "ok", 4)
    entries = [entry(0, i, m) for i, m in enumerate(good)]
    ok = [delivery(m, (0, i), token=str(i)) for i, m in enumerate(good)]
    again = [delivery(m, (0, i), "repeat", token=str(i)) for i, m in enumerate(good)]
    kill = StepRun(Step(0, Fault.GATEWAY_KILL, 0, 1.0), 0.0, 1.0)
    first = observations(cfg, entries=entries, deliveries=ok + again[:1], step_runs=[kill])
    assert rules(first) == ["repeats"]  # a first attempt, even right after a kill
    retried = [dataclasses.replace(d, attempt=2) for d in again]
    within = observations(cfg, entries=entries, deliveries=ok + retried[:3], step_runs=[kill])
    assert check(within) == []  # 3 <= 1 kill x (2 + 1)
    delayed = [dataclasses.replace(d, deliver_at=1) for d in again[:3]]
    assert (
        check(observations(cfg, entries=entries, deliveries=ok + delayed, step_runs=[kill])) == []
    )
    over = observations(cfg, entries=entries, deliveries=ok + retried, step_runs=[kill])
    assert rules(over) == ["repeats"]


def test_unusable_records_must_be_quarantined_once_with_their_coordinates_and_reason():
    cfg = config()
    bad = entry(1, 0, None, kind="empty-id", expect="quarantine", reason="empty_id")
    assert rules(observations(cfg, entries=[bad])) == ["quarantine"]
    wrong = QuarantineCopy([b"raw/1/0"], [b"missing_header: no header"], (0, 0))
    assert rules(observations(cfg, entries=[bad], quarantine=[wrong])) == ["quarantine"]
    forged = QuarantineCopy([b"forged/9/9", b"raw/1/0"], [b"x", b"empty_id: empty"], (0, 0))
    violations = check(observations(cfg, entries=[bad], quarantine=[forged]))
    assert [v.rule for v in violations] == ["quarantine"]
    assert "2 dedup-source" in violations[0].message


def test_dead_letters_only_for_ids_that_always_fail():
    cfg = config(mode="retry")
    (once,) = ids_with_fate(cfg, "once", 1)
    obs = observations(
        cfg,
        entries=[entry(0, 0, once)],
        deliveries=[delivery(once, (0, 0), "failed")],
        dead=[DeadLetter(once, cfg.max_attempts, (0, 0), 3.0)],
    )
    assert rules(obs) == ["dead-letter"]


def test_exits_tracebacks_and_a_short_ledger_are_violations():
    cfg = config()
    (good,) = ids_with_fate(cfg, "ok", 1)
    obs = observations(
        cfg,
        entries=[entry(0, 0, good)],
        deliveries=[delivery(good, (0, 0))],
        raw_highwater={0: 2},
        unexpected_exits=["g0 exited with code 1"],
        # g2: killed by the SIGTERM itself, before its handler was installed: no violation.
        final_exit_codes={0: 0, 1: None, 2: -15, 3: 1},
        tracebacks=["g1: KeyError"],
    )
    assert rules(obs) == ["exit", "ledger", "traceback"]
    exits = [v.message for v in check(obs) if v.rule == "exit"]
    assert len(exits) == 3 and not any(m.startswith("g2 ") for m in exits), exits


def test_a_valid_command_skipped_as_invalid_is_a_violation_and_garbage_is_not():
    cfg = config()
    (good,) = ids_with_fate(cfg, "ok", 1)
    stop = StepRun(Step(2, Fault.BROKER_STOP, hold_s=12.0), 1.0, 13.0)
    obs = observations(
        cfg,
        entries=[entry(0, 0, good)],
        deliveries=[delivery(good, (0, 0))],
        step_runs=[stop],
        sent_commands={"f/0/4": good},
        skipped_commands=[
            SkippedCommand(11.5, 1, "f/0/4", "no raw record at raw/0/0"),
            SkippedCommand(12.0, 0, "f/0/5", "not_json: garbage"),
        ],
    )
    (violation,) = check(obs)
    assert violation.rule == "command-invalid"
    assert "f/0/4" in violation.message and "during [step 2: broker-stop" in violation.message


def test_the_gateways_skipped_command_log_line_is_recognised():
    line = (
        "2026-11-26 18:50:01,123 WARNING gateway.failures.loop invalid failure command at "
        "chaos-5-failures/1/17 skipped (bad_header): 1 header name(s) not UTF-8"
    )
    match = _SKIPPED.match(line)
    assert match is not None
    assert (match[2], match[3], match[4]) == (
        "chaos-5-failures/1/17",
        "bad_header",
        "1 header name(s) not UTF-8",
    )


def test_a_hostile_command_not_skipped_is_a_violation():
    cfg = config()
    skipped = [SkippedCommand(3.0, 0, "f/1/3", "bad_header")]
    obs = observations(cfg, hostile_commands=["f/1/3", "f/0/9"], skipped_commands=skipped)
    (violation,) = check(obs)
    assert violation.rule == "command-hostile" and "f/0/9" in violation.message


def test_tier_records_are_quarantined_under_their_own_topic():
    cfg = config()
    (good,) = ids_with_fate(cfg, "ok", 1)
    tier = entry(0, 0, None, kind="tier-values", expect="quarantine", reason="bad_tier_record",
                 topic="c.delay.4s")  # fmt: skip
    copy = QuarantineCopy([b"c.delay.4s/0/0"], [b"bad_tier_record: x"], (0, 0))
    seen = {"entries": [entry(0, 0, good), tier], "deliveries": [delivery(good, (0, 0))]}
    assert check(observations(cfg, raw_topic="raw", quarantine=[copy], **seen)) == []
    assert rules(observations(cfg, raw_topic="raw", **seen)) == ["quarantine"]


def test_a_delayed_or_windowed_record_read_before_it_is_due_is_early():
    cfg = config(delay=True)
    (good,) = ids_with_fate(cfg, "ok", 1)
    seen = {"entries": [entry(0, 0, good, due_ms=10_000)]}
    on_time = dataclasses.replace(delivery(good, (0, 0)), read_ms=10_050, deliver_at=10_000)
    assert check(observations(cfg, deliveries=[on_time], **seen)) == []
    early = dataclasses.replace(on_time, read_ms=9_000)
    assert rules(observations(cfg, deliveries=[early], **seen)) == ["early"]
    windowed = dataclasses.replace(on_time, window=(8_000, 10_000))  # closes at 11 s
    assert GRACE_MS == 1000
    assert rules(observations(cfg, deliveries=[windowed], **seen)) == ["early"]


def test_a_window_must_reach_the_clean_topic_as_its_newest_version():
    cfg = config(delay=True)
    older, newer = ids_with_fate(cfg, "ok", 2)
    entries = [
        entry(0, 0, older, entity=b"e-1", timestamp_ms=2_100),
        entry(1, 0, newer, entity=b"e-1", timestamp_ms=2_900),
    ]

    def emitted(message_id: bytes, source: tuple[int, int]) -> Delivery:
        return dataclasses.replace(
            delivery(message_id, source), read_ms=5_000, window=(2_000, 4_000)
        )

    # The newest emitted, the older merged into it: neither lost.
    assert check(observations(cfg, entries=entries, deliveries=[emitted(newer, (1, 0))])) == []
    # Late updates: the oldest sent on its own, then the newest; the middle one merged.
    middle = dataclasses.replace(entries[0], offset=1, message_id=b"mid", timestamp_ms=2_500)
    both = [emitted(older, (0, 0)), emitted(newer, (1, 0))]
    assert check(observations(cfg, entries=[*entries, middle], deliveries=both)) == []
    # Coalescing switched off while the newer one waited: it comes plain, the older
    # one (dropped at its close before) is merged into it all the same.
    plain = dataclasses.replace(delivery(newer, (1, 0)), read_ms=5_000)
    assert check(observations(cfg, entries=entries, deliveries=[plain])) == []
    # Stamped hours ahead, windowed by the gateway's clock into the older one's window
    # (its dedup-deliver-at is that close), and delivered plain after the switch.
    ahead = dataclasses.replace(entries[1], timestamp_ms=9_000_000)
    plain_ahead = dataclasses.replace(plain, deliver_at=4_000 + GRACE_MS)
    assert check(observations(cfg, entries=[entries[0], ahead], deliveries=[plain_ahead])) == []
    # Stamped hours ahead with a delay of its own: delivered plain at its due, it stands
    # for the window of whichever moment between its production and its delivery.
    far = dataclasses.replace(entries[1], timestamp_ms=9_000_000, at=1.5)  # produced 1.5 s
    late = dataclasses.replace(plain, read_ms=20_000, deliver_at=19_000)
    seen = observations(cfg, entries=[entries[0], far], deliveries=[late], wall0_ms=0)
    assert check(seen) == []
    # The older emitted, the newer never: its window's newest version is missing.
    assert rules(observations(cfg, entries=entries, deliveries=[emitted(older, (0, 0))])) == [
        "lost",
        "window",
    ]


def test_forced_gateways_and_rate_keep_the_other_draws_and_are_in_the_reproduce_line():
    drawn = make_schedule(5, 60)
    forced = make_schedule(5, 60, gateways=1 if drawn.config.gateways != 1 else 2, rate=700)
    assert forced.config.rate == 700 and forced.config.gateways != drawn.config.gateways
    assert forced.config.fragile_redis == drawn.config.fragile_redis
    assert forced.config.mode == drawn.config.mode
    line = forced.reproduce()
    assert f"--gateways {forced.config.gateways} --rate 700" in line
    assert all(
        s.target < forced.config.gateways
        for s in forced.steps
        if s.fault.value.startswith("gateway")
    )


def test_a_traceback_is_named_by_its_last_exception_whatever_its_name():
    log = [
        "2026-11-28 07:50:52,100 ERROR aiokafka.producer.sender: Unexpected error",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in f',
        "KeyError: 'a'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "y.py", line 2, in g',
        "aiokafka.errors.ProducerFenced: There is a newer producer",
        "2026-11-28 07:50:53,000 INFO gateway: next record",
        "ValueError: in a later record's text, not this traceback's",
    ]
    assert traceback_error(log, 1) == (
        9,
        "aiokafka.errors.ProducerFenced: There is a newer producer",
    )
    group = [
        "  + Exception Group Traceback (most recent call last):",
        '  |   File "z.py", line 3, in h',
        "  | ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)",
        "  +-+---------------- 1 ----------------",
        "    | Traceback (most recent call last):",
        "    | RuntimeError: boom",
        "    +------------------------------------",
    ]
    assert traceback_error(group, 0) == (5, "RuntimeError: boom")
