"""A seed becomes a run configuration and a schedule of faults (pure: no I/O).

Every fault class appears once, in a seeded order, then weighted random faults
follow until the schedule is about `duration_s` long. Under the `guaranteed`
profile every Redis fault hits the same member, so no id can lose a majority of
its marks (docs/guarantees.md, the row "One of 3 Redis members down, hung, or
restarted empty");
under `beyond` any member may fail. In some runs (`cluster`) member 0 is a
Redis Cluster of 3 masters with a replica each: its Redis faults hit one of
its masters (a kill longer than the cluster's node timeout fails it over to
its replica).
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

# gateway/kafka/read_back.py: RawFetcher.fetch gives a raw record up as gone after 10 s.
RAW_FETCH_DEADLINE_S = 10.0
SHORT_SESSION_S = 2.0  # kills are noticed fast; a broker stop outlives every session
LONG_SESSION_S = 20.0  # a broker stop past the raw-fetch deadline outlives no session
CLUSTER_SHARE = 0.3  # runs whose member 0 is a Redis Cluster, unless forced

Profile = Literal["guaranteed", "beyond"]
Mode = Literal["retry", "release"]


class Fault(enum.StrEnum):
    GATEWAY_KILL = "gateway-kill"  # SIGKILL a gateway; restarted after `hold_s`
    GATEWAY_STOP = "gateway-stop"  # SIGSTOP a gateway for `hold_s`, then SIGCONT
    REDIS_KILL = "redis-kill"  # SIGKILL a member; restarted (empty) after `hold_s`
    REDIS_STOP = "redis-stop"  # SIGSTOP a member for `hold_s` (hung: holds its socket)
    REDIS_RESTART_EMPTY = "redis-restart-empty"  # SIGKILL a member and start it at once
    BROKER_STOP = "broker-stop"  # SIGSTOP the broker past the raw-fetch deadline
    HOSTILE_BURST = "hostile-burst"  # `size` hostile raw records at once
    GARBAGE_COMMANDS = "garbage-commands"  # `size` malformed or forged failure commands
    # Delay runs only (`RunConfig.delay`), so the schedules of other seeds stay as they were:
    HOSTILE_TIERS = "hostile-tiers"  # `size` records no gateway wrote, on the delay tier topics
    HOSTILE_COMMANDS = "hostile-commands"  # `size` commands with header names not UTF-8
    CONFIG_CHANGE = "config-change"  # rolling restart: a tier removed, coalescing off, ttl lowered
    # Member `target` hung while gateway `size` % gateways is SIGKILLed and restarted, then
    # repaired (runbook); then member `second` restarted empty and repaired.
    MEMBER_HANDOVER = "member-handover"
    # Once per run, placed by a draw of their own (`_once_per_run`), so the seeds' other
    # steps stay what they were before these existed:
    BROKER_RESTART = "broker-restart"  # SIGKILL the broker mid-transaction; start it after `hold_s`
    # Gateway `target` restarted to SIGKILL itself at its `size`-th raw batch whose copies
    # the broker acknowledged, before the offsets commit (gateway/faults.py); restarted.
    GATEWAY_KILL_ACKED = "gateway-kill-acked"
    # Retry runs only: gateway `target` restarted to SIGSTOP itself at its `size`-th retry
    # whose copy the broker acknowledged, before its transaction commits (fault point
    # `retry-acked`); resumed `hold_s` later, past its session: a zombie in a retry step.
    GATEWAY_STOP_RETRY_ACKED = "gateway-stop-retry-acked"


WEIGHTS = {
    Fault.GATEWAY_KILL: 5,
    Fault.GATEWAY_STOP: 4,
    Fault.REDIS_KILL: 2,
    Fault.REDIS_STOP: 2,
    Fault.REDIS_RESTART_EMPTY: 2,
    Fault.BROKER_STOP: 1,
    Fault.HOSTILE_BURST: 2,
    Fault.GARBAGE_COMMANDS: 2,
    Fault.HOSTILE_TIERS: 2,
    Fault.HOSTILE_COMMANDS: 1,
    Fault.CONFIG_CHANGE: 0,  # once per run
    Fault.MEMBER_HANDOVER: 0,  # once per run
    Fault.BROKER_RESTART: 0,  # once per run, `_once_per_run`
    Fault.GATEWAY_KILL_ACKED: 0,  # once per run, `_once_per_run`
    Fault.GATEWAY_STOP_RETRY_ACKED: 0,  # once per retry run, `_once_per_run`
}
# Placed in this order, each by the next draws of one generator: a fault added here comes
# last, so the seeds' earlier ones stay where they were.
ONCE_PER_RUN = (Fault.BROKER_RESTART, Fault.GATEWAY_KILL_ACKED, Fault.GATEWAY_STOP_RETRY_ACKED)
RETRY_FAULTS = (Fault.GATEWAY_STOP_RETRY_ACKED,)  # retry mode only
DELAY_FAULTS = (
    Fault.HOSTILE_TIERS, Fault.HOSTILE_COMMANDS, Fault.CONFIG_CHANGE, Fault.MEMBER_HANDOVER,
)  # fmt: skip
GATEWAY_FAULTS = (
    Fault.GATEWAY_KILL,
    Fault.GATEWAY_STOP,
    Fault.GATEWAY_KILL_ACKED,
    Fault.GATEWAY_STOP_RETRY_ACKED,
)
BROKER_FAULTS = (Fault.BROKER_STOP, Fault.BROKER_RESTART)
REDIS_FAULTS = (Fault.REDIS_KILL, Fault.REDIS_STOP, Fault.REDIS_RESTART_EMPTY)

HEADER_HOSTILE = (
    "missing-id",
    "empty-id",
    "huge-id",
    "non-utf8-id",
    "duplicate-id-headers",
    "forged-dedup-headers",
    "non-utf8-header-name",
    "oversize-record",
    "tombstone",
    "missing-id-forged-source",
)
JSON_HOSTILE = (
    "not-json",
    "nesting-bomb",
    "missing-field",
    "empty-id",
    "huge-id",
    "numeric-id",
    "lone-surrogate-id",
    "non-utf8-value",
    "forged-dedup-headers",
    "non-utf8-header-name",
    "oversize-record",
)
# Raw records whose delay or coalescing headers are bad (delay runs, either id syntax).
DELAY_HOSTILE = (
    "bad-deliver-at",
    "bad-deliver-after",
    "conflicting-delay",
    "delay-too-long",
    "no-coalesce-key",
)
# What delay runs configure (`processes.gateway_toml`), and what their config change leaves.
TIERS = ("1s", "4s", "16s")  # the change removes the last one: its records are drained
MAX_DELAY_S = 30  # delays asked for: up to 25 s, so some wait in the 16s tier
TTL_BEFORE = "1h"
# Lowered by the change (at least max_delay). A mark must outlive the longest way from
# its claim to its last failure command in a schedule (a broker stop, a gateway stop
# past its session, a rebalance: about a minute); with 40 s, retries were lost when
# their commands came after the mark expired (documented: an id lives `ttl`).
TTL_AFTER_S = 75
WINDOW_MS = 2000  # fixed coalescing windows
GRACE_MS = 1000
ENTITY_HEADER = "entity-id"  # the coalescing key
ENTITIES = 150  # coalescing keys of the new records: a few versions per key and window
DELAY_SHARE = 0.4  # of the seeds, unless forced
# What `exclude` may name.
KINDS = frozenset([*Fault, *HEADER_HOSTILE, *JSON_HOSTILE, *DELAY_HOSTILE])


@dataclass(frozen=True)
class Step:
    """One fault: after progress is seen, wait `pause_s`, then inject it."""

    index: int
    fault: Fault
    target: int = -1  # gateway or Redis member index
    hold_s: float = 0.0  # how long the fault lasts (stop, or down before a restart)
    size: int = 0  # records or commands, for the bursts (member-handover: its gateway)
    second: int = -1  # member-handover: the member faulted after `target` is repaired
    pause_s: float = 0.0

    def __str__(self) -> str:
        if self.fault is Fault.GATEWAY_KILL_ACKED:
            what = f"g{self.target} at its acked batch {self.size}, down {self.hold_s:.1f}s"
        elif self.fault is Fault.GATEWAY_STOP_RETRY_ACKED:
            what = f"g{self.target} at its acked retry {self.size}, stopped {self.hold_s:.1f}s"
        elif self.fault in GATEWAY_FAULTS:
            what = f"g{self.target} for {self.hold_s:.1f}s"
        elif self.fault in REDIS_FAULTS:
            what = f"redis-{self.target}" + (f" for {self.hold_s:.1f}s" if self.hold_s else "")
        elif self.fault in BROKER_FAULTS:
            what = f"for {self.hold_s:.1f}s"
        elif self.fault is Fault.MEMBER_HANDOVER:
            what = (
                f"redis-{self.target} hung {self.hold_s:.1f}s across a kill of "
                f"g{self.size}, repaired, then redis-{self.second} restarted empty"
            )
        elif self.fault is Fault.CONFIG_CHANGE:
            what = f"(tier {TIERS[-1]} removed, coalescing off, ttl {TTL_AFTER_S}s)"
        else:
            what = f"x{self.size}"
        return f"step {self.index}: {self.fault} {what} (after {self.pause_s:.1f}s)"


@dataclass(frozen=True)
class RunConfig:
    """Everything about a run that is not a fault; derived from the seed."""

    seed: int
    profile: Profile
    mode: Mode
    id_spec: str  # "header:message-id" or "json:order.id"
    gateways: int
    fragile_redis: int  # the member the Redis faults hit, under the `guaranteed` profile
    session_timeout_s: float
    raw_partitions: int = 4
    clean_partitions: int = 3
    max_batch_records: int = 200
    max_attempts: int = 3
    max_id_bytes: int = 256
    rate: int = 300  # raw records per second
    duplicate_share: float = 0.25
    hostile_share: float = 0.01
    fail_once_share: float = 0.05
    fail_always_share: float = 0.02  # retry mode only: these reach the dead-letter topic
    command_duplicate_share: float = 0.15
    command_stale_share: float = 0.15
    command_reorder_share: float = 0.1
    excluded: frozenset[str] = frozenset()  # fault and hostile-record kinds left out
    cluster: bool = False  # member 0 is a Redis Cluster (3 masters, a replica each)
    # [delay] tiers and [coalesce] windows on, producer clocks skewed by hours, hostile
    # records on the tiers and the failure topic, a config change, a member handover.
    delay: bool = False
    delayed_share: float = 0.15  # of the new records: deliver-at or deliver-after
    skew_share: float = 0.02  # of the new records: a timestamp hours off

    @property
    def json_ids(self) -> bool:
        return self.id_spec.startswith("json:")


@dataclass(frozen=True)
class Schedule:
    config: RunConfig
    steps: tuple[Step, ...]
    duration_s: float  # what it was sized for

    def describe(self) -> str:
        c = self.config
        where = f"redis-{c.fragile_redis}" if c.profile == "guaranteed" else "any member"
        lines = [
            f"seed {c.seed}: profile={c.profile} mode={c.mode} id={c.id_spec} "
            f"gateways={c.gateways} session={c.session_timeout_s:g}s redis=3 (faults on {where}"
            + (", redis-0 a 3-master cluster with replicas" if c.cluster else "")
            + ") "
            + (f"delay=tiers {','.join(TIERS)} coalesce=fixed {WINDOW_MS}ms " if c.delay else "")
            + f"max_batch_records={c.max_batch_records} max_attempts={c.max_attempts} "
            f"rate={c.rate}/s"
            + (f" excluded={','.join(sorted(c.excluded))}" if c.excluded else ""),
        ]
        lines += [f"  {step}" for step in self.steps]
        return "\n".join(lines)

    def reproduce(self) -> str:
        """The command line that runs this schedule again."""
        c = self.config
        return (
            f"python -m devtools.chaos --seed {c.seed} --schedules 1 "
            f"--schedule-seconds {self.duration_s:g} --profile {c.profile} --mode {c.mode} "
            f"--session {c.session_timeout_s:g} --cluster {'yes' if c.cluster else 'no'}"
            f" --delay {'yes' if c.delay else 'no'} --gateways {c.gateways} --rate {c.rate}"
            + (f" --exclude {','.join(sorted(c.excluded))}" if c.excluded else "")
        )


def make_schedule(
    seed: int,
    duration_s: float = 60.0,
    profile: Profile = "guaranteed",
    mode: Mode | None = None,
    exclude: Iterable[str] = (),
    session_timeout_s: float | None = None,
    cluster: bool | None = None,
    delay: bool | None = None,
    gateways: int | None = None,
    rate: int | None = None,
) -> Schedule:
    """The run configuration and faults for `seed`.

    `mode`, `session_timeout_s`, `cluster`, `delay` and `gateways` force those choices
    (else the seed makes them; `cluster` and `delay` by draws of their own); `rate`: raw
    records per second (else RunConfig's); `exclude` leaves out
    fault classes and hostile record kinds by name (see `KINDS`), e.g. to confirm the
    rest passes while one is being fixed.
    """
    excluded = frozenset(exclude)
    if unknown := excluded - KINDS:
        raise ValueError(f"unknown kinds {sorted(unknown)}; known: {sorted(KINDS)}")
    rng = random.Random(f"{seed}:schedule")
    # Every draw is made whatever is forced, so forcing one choice keeps the others.
    draws = [rng.random() for _ in range(3)]
    # Its own draw: the seeds' schedules stay what they were before clusters.
    if cluster is None:
        cluster = random.Random(f"{seed}:cluster").random() < CLUSTER_SHARE
    if delay is None:
        delay = random.Random(f"{seed}:delay").random() < DELAY_SHARE
    drawn_gateways = rng.choice((2, 3))  # drawn in every run, as `fragile` below
    gateways = gateways or drawn_gateways
    fragile = rng.randrange(3)  # drawn in every run, so the draws after it stay the same
    config = RunConfig(
        seed=seed,
        profile=profile,
        mode=mode or ("release" if draws[0] < 0.3 else "retry"),
        id_spec="json:order.id" if draws[1] < 0.25 else "header:message-id",
        gateways=gateways,
        fragile_redis=0 if cluster else fragile,  # a cluster run's faults hit the cluster
        session_timeout_s=session_timeout_s
        or (LONG_SESSION_S if draws[2] < 0.25 else SHORT_SESSION_S),
        excluded=excluded,
        cluster=cluster,
        delay=delay,
        **({"rate": rate} if rate else {}),
    )
    kinds = [
        f
        for f in Fault
        if f not in excluded and (delay or f not in DELAY_FAULTS) and f not in ONCE_PER_RUN
    ]
    first = kinds[:]
    rng.shuffle(first)
    if Fault.CONFIG_CHANGE in first:  # early: old copies must outlive the new ttl after it
        first.remove(Fault.CONFIG_CHANGE)
        first.insert(max(0, len(first) - 2), Fault.CONFIG_CHANGE)
    broker_stops_max = 1 + int(duration_s // 120)
    steps: list[Step] = []
    spent = 0.0
    while kinds and (first or spent < duration_s):
        if first:
            fault = first.pop()
        else:
            fault = rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
            stops = sum(s.fault is Fault.BROKER_STOP for s in steps)
            if fault is Fault.BROKER_STOP and stops >= broker_stops_max:
                continue
        step = _make_step(rng, len(steps), fault, config)
        steps.append(step)
        spent += step.pause_s + _cost_s(step, config)
    once = [
        f
        for f in ONCE_PER_RUN
        if f not in excluded and (config.mode == "retry" or f not in RETRY_FAULTS)
    ]
    steps = _once_per_run(seed, once, steps, config)
    return Schedule(config, tuple(steps), duration_s)


def _once_per_run(
    seed: int, faults: list[Fault], steps: list[Step], config: RunConfig
) -> list[Step]:
    """`steps` with each of `faults` inserted once, where a draw of its own puts it."""
    rng = random.Random(f"{seed}:once")
    for fault in faults:
        steps.insert(rng.randrange(len(steps) + 1), _make_step(rng, 0, fault, config))
    return [dataclasses.replace(step, index=i) for i, step in enumerate(steps)]


def _make_step(rng: random.Random, index: int, fault: Fault, config: RunConfig) -> Step:
    pause = round(rng.uniform(0.0, 2.0), 2)
    member = config.fragile_redis if config.profile == "guaranteed" else rng.randrange(3)
    session = config.session_timeout_s
    if fault is Fault.GATEWAY_KILL:
        gateway, hold = rng.randrange(config.gateways), rng.uniform(0, 2.5)
        return Step(index, fault, gateway, round(hold, 2), pause_s=pause)
    if fault is Fault.GATEWAY_STOP:
        # Short stops stay well inside the session (no rebalance); long ones outlive it.
        short = rng.random() < 0.5
        hold = rng.uniform(0.2, 0.4 * session) if short else rng.uniform(session + 0.5, session + 4)
        return Step(index, fault, rng.randrange(config.gateways), round(hold, 2), pause_s=pause)
    if fault is Fault.REDIS_KILL:
        return Step(index, fault, member, round(rng.uniform(0.5, 4.0), 2), pause_s=pause)
    if fault is Fault.REDIS_STOP:
        return Step(index, fault, member, round(rng.uniform(0.5, 3.0), 2), pause_s=pause)
    if fault is Fault.REDIS_RESTART_EMPTY:
        return Step(index, fault, member, pause_s=pause)
    if fault is Fault.BROKER_STOP:
        hold = rng.uniform(RAW_FETCH_DEADLINE_S + 1, RAW_FETCH_DEADLINE_S + 3)
        return Step(index, fault, hold_s=round(hold, 2), pause_s=pause)
    if fault is Fault.BROKER_RESTART:  # transactions are open at any moment: one is cut
        return Step(index, fault, hold_s=round(rng.uniform(0.5, 3.0), 2), pause_s=pause)
    if fault is Fault.GATEWAY_KILL_ACKED:
        gateway, batch = rng.randrange(config.gateways), rng.randint(1, 12)
        return Step(index, fault, gateway, round(rng.uniform(0, 2.0), 2), batch, pause_s=pause)
    if fault is Fault.GATEWAY_STOP_RETRY_ACKED:  # past its session: a zombie when resumed
        gateway, retry = rng.randrange(config.gateways), rng.randint(1, 5)
        hold = round(rng.uniform(session + 0.5, session + 4), 2)
        return Step(index, fault, gateway, hold, retry, pause_s=pause)
    if fault is Fault.CONFIG_CHANGE:
        return Step(index, fault, pause_s=pause)
    if fault is Fault.MEMBER_HANDOVER:
        second = (member + 1 + rng.randrange(2)) % 3
        gateway, hold = rng.randrange(config.gateways), round(rng.uniform(1.5, 3.0), 2)
        return Step(index, fault, member, hold, size=gateway, pause_s=pause, second=second)
    return Step(index, fault, size=rng.randint(3, 12), pause_s=pause)


def _cost_s(step: Step, config: RunConfig) -> float:
    """A rough guess of the wall time a step takes, to size a schedule."""
    if step.fault in BROKER_FAULTS:
        return step.hold_s + 6
    if step.fault in (Fault.GATEWAY_KILL_ACKED, Fault.GATEWAY_STOP_RETRY_ACKED):
        return step.hold_s + config.session_timeout_s + 8
    if step.fault is Fault.GATEWAY_KILL:
        return step.hold_s + config.session_timeout_s + 3
    if step.fault is Fault.GATEWAY_STOP:
        return step.hold_s + 1
    if step.fault in (Fault.CONFIG_CHANGE, Fault.MEMBER_HANDOVER):
        return step.hold_s + 3 * config.gateways + 5
    return 1 + step.hold_s / 2


def outlives_session(step: Step, config: RunConfig) -> bool:
    """A fault after which the group moves partitions (so the crash window applies)."""
    if step.fault in (
        Fault.GATEWAY_KILL, Fault.GATEWAY_KILL_ACKED, Fault.GATEWAY_STOP_RETRY_ACKED,
        Fault.MEMBER_HANDOVER,
    ):  # fmt: skip
        return True
    return step.fault is Fault.GATEWAY_STOP and step.hold_s >= config.session_timeout_s
