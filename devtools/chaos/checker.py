"""The checker: each guarantee of the README as one rule over what a run saw (pure).

Input is `Observations`: the raw ledger (from the producer's acknowledgements),
the stand-in's deliveries and dead letters, the quarantine topic, the faults as
they ran, and the gateways' exits and tracebacks. Output is a list of
`Violation`s, each naming its rule, the id or record, and the fault around it.
"""

from __future__ import annotations

import contextlib
import signal
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from devtools.chaos.schedule import (
    BROKER_FAULTS,
    GRACE_MS,
    MAX_DELAY_S,
    WINDOW_MS,
    Fault,
    RunConfig,
    outlives_session,
)
from devtools.chaos.standin import DeadLetter, Delivery, fate, readable, source_of
from devtools.chaos.timeline import StepRun, step_context
from devtools.chaos.traffic import RawEntry

STOP_DEADLINE_S = 60.0  # SIGTERM to exit: the grace period of deploy/k8s and deploy/compose


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str
    tolerated: bool = False  # beyond the documented guarantees (profile `beyond`)


@dataclass(frozen=True)
class QuarantineCopy:
    sources: list[bytes]  # every dedup-source header: one expected
    errors: list[bytes]  # every dedup-error header: one expected
    at: tuple[int, int]  # quarantine partition, offset

    def coordinates(self) -> tuple[int, int] | None:
        """Raw partition and offset, when exactly one dedup-source names them."""
        if len(self.sources) != 1:
            return None
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            _, partition, offset = source_of(self.sources[0])
            return partition, offset
        return None


@dataclass(frozen=True)
class SkippedCommand:
    """A gateway's log line saying it skipped a failure command as invalid."""

    at: float
    gateway: int
    ref: str  # failure topic/partition/offset
    detail: str


@dataclass
class Observations:
    """Everything a run saw; the checker's input (plain data)."""

    config: RunConfig
    entries: list[RawEntry]
    deliveries: list[Delivery]
    dead: list[DeadLetter]
    quarantine: list[QuarantineCopy]
    step_runs: list[StepRun]
    raw_highwater: dict[int, int | None]
    unexpected_exits: list[str] = field(default_factory=list)
    final_exit_codes: dict[int, int | None] = field(default_factory=dict)
    tracebacks: list[str] = field(default_factory=list)
    sent_commands: dict[str, bytes] = field(default_factory=dict)  # ref -> id, real ones
    command_chaos: dict[str, int] = field(default_factory=dict)  # sent, duplicated, stale...
    skipped_commands: list[SkippedCommand] = field(default_factory=list)
    problems: list[Violation] = field(default_factory=list)  # found while running
    raw_topic: str = ""  # quarantine copies naming another topic name a tier record
    hostile_commands: list[str] = field(default_factory=list)  # their failure-topic refs
    wall0_ms: int = 0  # the wall clock at the run's t=0 (RawEntry.at is on the run's clock)


def check(obs: Observations) -> list[Violation]:
    """Every rule over one run's observations (see the package docstring)."""
    index = _Index(obs)
    return [
        *obs.problems,
        *_ledger(obs),
        *_contract(obs, index),
        *_quarantine(obs, index),
        *_lost(obs, index),
        *_twice(obs, index),
        *_dead_letters(obs, index),
        *_repeats(obs),
        *_commands(obs),
        *_hostile_commands(obs),
        *_delays(obs, index),
        *_exits(obs),
    ]


class _Index:
    """The observations looked up by id and by raw coordinates."""

    def __init__(self, obs: Observations) -> None:
        self.obs = obs
        self.raw = {(e.partition, e.offset): e for e in obs.entries if e.topic is None}
        self.copies: dict[bytes, list[RawEntry]] = defaultdict(list)
        for e in obs.entries:
            if e.message_id is not None:
                self.copies[e.message_id].append(e)
        self.deliveries: dict[bytes, list[Delivery]] = defaultdict(list)
        self.ok: dict[bytes, list[Delivery]] = defaultdict(list)
        self.forwarded: set[tuple[int, int]] = set()
        for d in obs.deliveries:
            self.deliveries[d.message_id].append(d)
            self.forwarded.add(d.source)
            if d.outcome == "ok":
                self.ok[d.message_id].append(d)
        self.dead: dict[bytes, list[DeadLetter]] = defaultdict(list)
        for letter in obs.dead:
            self.dead[letter.message_id].append(letter)
        # By (topic, partition, offset); the topic None for the raw topic.
        Where = tuple[str | None, int, int]
        self.quarantined: dict[Where, list[QuarantineCopy]] = defaultdict(list)
        for copy in obs.quarantine:
            for source in copy.sources:  # each copy under every place it names
                with contextlib.suppress(ValueError, UnicodeDecodeError):
                    topic, partition, offset = source_of(source)
                    raw = not obs.raw_topic or topic == obs.raw_topic
                    self.quarantined[(None if raw else topic, partition, offset)].append(copy)

    def when(self, at: float) -> str:
        return step_context(self.obs.step_runs, at)

    def history(self, message_id: bytes) -> str:
        """Where an id's copies came from and what happened to each delivery."""
        copies = self.copies.get(message_id, [])
        first = copies[0] if copies else None
        last = copies[-1] if len(copies) > 1 else None
        text = (
            f"{len(copies)} raw copies (first {first.where} at t={first.at:.1f}s "
            f"{self.when(first.at)}"
            + (f"; last {last.where} at t={last.at:.1f}s" if last else "")
            + ")"
            if first
            else "no raw copy"
        )
        seen = [
            f"attempt {d.attempt} {d.outcome} at t={d.at:.1f}s from raw {d.source[0]}/{d.source[1]}"
            for d in self.deliveries[message_id][:6]
        ]
        return text + (f"; deliveries: {', '.join(seen)}" if seen else "; never delivered")


def _ledger(obs: Observations) -> Iterator[Violation]:
    """The raw topic holds exactly what the producer's acknowledgements account for."""
    counts = Counter(e.partition for e in obs.entries if e.topic is None)
    for partition, high in sorted(obs.raw_highwater.items()):
        if high != counts[partition]:
            yield Violation(
                "ledger",
                f"raw partition {partition} ends at {high}, the producer's "
                f"acknowledgements account for {counts[partition]} records",
            )


def _contract(obs: Observations, ix: _Index) -> Iterator[Violation]:
    """Each clean delivery names a raw record that has its id and its value."""
    for d in obs.deliveries:
        where = f"clean {d.clean[0]}/{d.clean[1]}"
        entry = ix.raw.get(d.source)
        if entry is None:
            yield Violation(
                "contract",
                f"{where} names raw {d.source[0]}/{d.source[1]}, which was never produced",
            )
        elif entry.message_id is not None and entry.message_id != d.message_id:
            yield Violation(
                "contract",
                f"{where} has id {readable(d.message_id)!r}, its raw "
                f"record {entry.where} has {readable(entry.message_id)!r}",
            )
        elif entry.value_digest != d.value_digest:
            yield Violation("contract", f"{where}: value differs from its raw record {entry.where}")


def _quarantine(obs: Observations, ix: _Index) -> Iterator[Violation]:
    """Unusable records are quarantined with their coordinates and reason; usable ones never."""
    for copy in obs.quarantine:
        if copy.coordinates() is None or len(copy.errors) != 1:
            yield Violation(
                "quarantine",
                f"quarantine {copy.at[0]}/{copy.at[1]} carries "
                f"{len(copy.sources)} dedup-source and {len(copy.errors)} dedup-error "
                f"headers ({copy.sources!r:.120}): one of each must name its record",
            )
    for e in obs.entries:
        copies = ix.quarantined.get((e.topic, e.partition, e.offset), [])
        if e.expect == "quarantine":
            reasons = [
                c.errors[-1].decode(errors="replace").split(":", 1)[0] for c in copies if c.errors
            ]
            if not copies:
                yield Violation(
                    "quarantine",
                    f"{e.kind} record {e.where} (reason {e.reason}) "
                    f"produced at t={e.at:.1f}s {ix.when(e.at)} is not on the "
                    f"quarantine topic",
                )
            elif e.reason not in reasons:
                yield Violation(
                    "quarantine",
                    f"{e.kind} record {e.where} quarantined with "
                    f"reason {reasons}, expected {e.reason}",
                )
        elif e.expect == "usable" and copies:
            yield Violation(
                "quarantine",
                f"{e.kind} record {e.where} with the usable id "
                f"{readable(e.message_id or b'')!r} was quarantined: "
                f"{[c.errors for c in copies]!r:.200}",
            )


def _lost(obs: Observations, ix: _Index) -> Iterator[Violation]:
    """Every usable id is processed successfully or dead-lettered; every record whose
    treatment is open (`either`) is forwarded or quarantined."""
    for e in obs.entries:
        if e.expect != "either" or ix.quarantined.get((None, e.partition, e.offset)):
            continue
        resolved = (e.partition, e.offset) in ix.forwarded
        if e.message_id is not None:
            resolved = resolved or bool(ix.ok.get(e.message_id) or ix.dead.get(e.message_id))
        if not resolved:
            yield Violation(
                "lost",
                f"{e.kind} record {e.where} produced at t={e.at:.1f}s "
                f"{ix.when(e.at)} was neither forwarded nor quarantined",
            )
    usable = dict.fromkeys(
        e.message_id for e in obs.entries if e.expect == "usable" and e.message_id is not None
    )
    merged = _merged(obs, ix)
    for message_id in usable:
        if message_id in merged:
            continue
        if message_id is not None and not ix.ok.get(message_id) and not ix.dead.get(message_id):
            kind = fate(obs.config.seed, message_id, obs.config)
            yield Violation(
                "lost",
                f"id {readable(message_id)!r} (fate {kind}) was never "
                f"processed successfully nor dead-lettered: {ix.history(message_id)}",
            )


# A record stamped this far ahead of the gateway's clock is windowed by that clock
# (docs/coalescing.md, "Clocks": max_delay - window - grace).
AHEAD_MS = MAX_DELAY_S * 1000 - WINDOW_MS - GRACE_MS


def _merged(obs: Observations, ix: _Index) -> set[bytes]:
    """Ids of coalesced records that a newer version of their window stands for: one
    of their key reached the clean topic with a window holding their timestamp (or,
    stamped beyond max_delay ahead, windowed by the gateway's clock: any window). A
    version without `dedup-window` (coalescing switched off while it waited, after
    the older one's close dropped it) stands for the fixed window of its stamp, or
    the one its `dedup-deliver-at` closes (stamped far ahead, windowed by the clock)."""
    versions: dict[bytes, list[tuple[tuple[int, int, int], tuple[int, int]]]] = defaultdict(list)
    for d in obs.deliveries:
        e = ix.raw.get(d.source)
        if e is None or e.entity is None:
            continue
        stamp = e.timestamp_ms or 0
        windows = (
            [d.window]
            if d.window
            else [(stamp - stamp % WINDOW_MS, stamp - stamp % WINDOW_MS + WINDOW_MS)]
        )
        if d.window is None and d.deliver_at is not None:
            windows.append((d.deliver_at - GRACE_MS - WINDOW_MS, d.deliver_at - GRACE_MS))
        produced = obs.wall0_ms + int(e.at * 1000)
        if stamp - produced > AHEAD_MS:
            # Windowed by the clock of whichever gateway took it, between its production
            # and its delivery: delivered plain (its due, or coalescing off), that window
            # is not named; taken again after a crash, it comes out in a later window
            # than the one its first take put it in, whose older versions it merged.
            windows.append((produced - produced % WINDOW_MS, d.read_ms))
        versions[e.entity] += [((stamp, *d.source), w) for w in windows]
    merged = set()
    for e in obs.entries:
        if e.entity is None or e.message_id is None or e.topic is not None:
            continue
        ts = e.timestamp_ms or 0
        ahead = ts - (obs.wall0_ms + int(e.at * 1000)) > AHEAD_MS
        mine = (ts, e.partition, e.offset)
        for newer, (start, end) in versions.get(e.entity, []):
            if newer > mine and (ahead or start <= ts < end):
                merged.add(e.message_id)
                break
    return merged


def _twice(obs: Observations, ix: _Index) -> Iterator[Violation]:
    """No id is processed successfully twice (a retry or release only follows a failure)."""
    for message_id, successes in ix.ok.items():
        if len(successes) > 1:
            detail = "; ".join(
                f"token {d.token} attempt {d.attempt} from raw {d.source[0]}/"
                f"{d.source[1]} at t={d.at:.1f}s {ix.when(d.at)}"
                for d in successes
            )
            yield Violation(
                "twice",
                f"id {readable(message_id)!r} processed successfully "
                f"{len(successes)} times: {detail}",
                tolerated=obs.config.profile == "beyond",
            )


def _dead_letters(obs: Observations, ix: _Index) -> Iterator[Violation]:
    """Only ids that always fail are dead-lettered, and only at `max_attempts`."""
    config = obs.config
    for message_id, letters in ix.dead.items():
        kind = fate(config.seed, message_id, config)
        if kind != "always":
            yield Violation(
                "dead-letter",
                f"id {readable(message_id)!r} (fate {kind}: it "
                f"succeeds when retried) was dead-lettered: {ix.history(message_id)}",
            )
        for letter in letters:
            if letter.attempt != config.max_attempts:
                yield Violation(
                    "dead-letter",
                    f"id {readable(message_id)!r} dead-lettered at "
                    f"attempt {letter.attempt}, max_attempts is "
                    f"{config.max_attempts}",
                )


def crash_events(obs: Observations) -> int:
    """Faults after which the crash window may repeat deliveries: gateway kills and
    exits, stops that outlive the session, broker stops (each member's session)."""
    events = len(obs.unexpected_exits)
    for run in obs.step_runs:
        if outlives_session(run.step, obs.config):
            events += 1
        elif run.step.fault in (*BROKER_FAULTS, Fault.CONFIG_CHANGE):
            events += obs.config.gateways
    return events


def _repeats(obs: Observations) -> Iterator[Violation]:
    """Deliveries of a token already processed. The gateways run with `exactly_once`
    on and the stand-in reads `read_committed`: a record the raw path forwarded
    straight to the clean topic is never delivered again. What may repeat stays
    within the crash window, max_batch_records per raw partition per event: retries
    (in transactions too: two copies of one command both act when one got no answer
    from a member the other moved, docs/failures.md) and records that went through the delay
    tiers (a move ahead of an earlier record still waiting in its tier partition is
    committed with that partition's offset behind it, and moved again after a
    restart; with coalescing switched off, a window's emitted version too)."""
    config = obs.config
    events = crash_events(obs)
    bound = events * (config.max_batch_records + 1)
    repeats: dict[int, list[Delivery]] = defaultdict(list)
    for d in obs.deliveries:
        if d.outcome != "repeat":
            continue
        if d.attempt < 2 and d.deliver_at is None and d.window is None:
            yield Violation(
                "repeats",
                f"id {readable(d.message_id)!r} (raw {d.source[0]}/{d.source[1]}, attempt "
                f"{d.attempt}, forwarded straight) delivered again under token {d.token} at "
                f"t={d.at:.1f}s, exactly_once on {step_context(obs.step_runs, d.at)}",
            )
        else:
            repeats[d.source[0]].append(d)
    for partition, found in sorted(repeats.items()):
        if len(found) > bound:
            yield Violation(
                "repeats",
                f"raw partition {partition}: {len(found)} repeated retries or delayed "
                f"deliveries (a dedup-token seen before), bound {bound} = {events} kills or "
                f"session-long stops x (max_batch_records {config.max_batch_records} + 1); "
                f"first at t={found[0].at:.1f}s {step_context(obs.step_runs, found[0].at)}",
            )


def _commands(obs: Observations) -> Iterator[Violation]:
    """A command the job sent for a record it failed is never skipped as invalid (only
    garbage is; the README: not JSON, bad fields, a mismatched id, a record retention
    removed). The id may still come through, when a rebalance replays the command."""
    skipped: dict[str, list[SkippedCommand]] = defaultdict(list)
    for s in obs.skipped_commands:
        if s.ref in obs.sent_commands:
            skipped[s.ref].append(s)
    for ref, found in skipped.items():
        first = found[0]
        yield Violation(
            "command-invalid",
            f"g{first.gateway} skipped the command {ref} for id "
            f"{readable(obs.sent_commands[ref])!r}, a valid one, as invalid at "
            f"t={first.at:.1f}s {step_context(obs.step_runs, first.at)} "
            f"({len(found)}x): {first.detail}",
        )


def _hostile_commands(obs: Observations) -> Iterator[Violation]:
    """Every command with hostile headers is skipped as invalid (a log line naming it)."""
    skipped = {s.ref for s in obs.skipped_commands}
    for ref in obs.hostile_commands:
        if ref not in skipped:
            yield Violation(
                "command-hostile",
                f"the command {ref} with a header name that is not UTF-8 or garbage header "
                f"values was not logged as skipped",
            )


def _delays(obs: Observations, ix: _Index) -> Iterator[Violation]:
    """Delay runs: no clean record before its due time or its window's close (`early`);
    of each window that reached the clean topic, its newest version did (`window`: late
    updates may send older ones on their own, before it)."""
    for d in obs.deliveries:
        e = ix.raw.get(d.source)
        due = max(
            e.due_ms if e is not None and e.due_ms is not None else 0,
            d.deliver_at or 0,
            d.window[1] + GRACE_MS if d.window is not None else 0,
        )
        if d.read_ms and d.read_ms < due:
            yield Violation(
                "early",
                f"clean {d.clean[0]}/{d.clean[1]} (raw {d.source[0]}/{d.source[1]}, id "
                f"{readable(d.message_id)!r}) read {due - d.read_ms} ms before it was due "
                f"(asked {e.due_ms if e else None}, dedup-deliver-at {d.deliver_at}, "
                f"window {d.window}) at t={d.at:.1f}s {ix.when(d.at)}",
            )
    by_entity: dict[bytes, list[RawEntry]] = defaultdict(list)
    for e in obs.entries:
        if e.entity is not None and e.topic is None and e.expect == "usable":
            by_entity[e.entity].append(e)
    windows: dict[tuple[bytes, tuple[int, int]], list[RawEntry]] = defaultdict(list)
    for d in obs.deliveries:
        e = ix.raw.get(d.source)
        if d.window is not None and e is not None and e.entity is not None:
            windows[(e.entity, d.window)].append(e)
    for (entity, (start, end)), emitted in windows.items():
        if any(not start <= (e.timestamp_ms or 0) < end for e in emitted):
            continue  # stamped far ahead, windowed by the gateway's clock: not by stamps
        inside = [o for o in by_entity[entity] if start <= (o.timestamp_ms or 0) < end]
        if not inside:
            continue  # a key of records whose treatment is open (`either`)
        newest = max(inside, key=lambda o: (o.timestamp_ms or 0, o.partition, o.offset))
        resolved = (newest.partition, newest.offset) in ix.forwarded or (
            newest.message_id is not None and bool(ix.deliveries.get(newest.message_id))
        )  # or a copy of its id claimed it first: then that copy is the version
        if not resolved:
            yield Violation(
                "window",
                f"window {start}/{end} of key {readable(entity)!r} reached the clean topic "
                f"({len(emitted)}x, e.g. {emitted[0].where}), but not its newest version "
                f"{newest.where} (stamped {newest.timestamp_ms}, id "
                f"{readable(newest.message_id or b'')!r}): "
                f"{ix.history(newest.message_id or b'')}",
            )


def answered_sigterm(code: int | None) -> bool:
    """A gateway's exit code after SIGTERM: 0 (drained), or killed by that SIGTERM
    itself, which comes only before the gateway's handler is installed (Python still
    starting, `gateway/cli.py`), when nothing is in flight (as the supervisor treats
    a worker's, gateway/service/workers.py)."""
    return code in (0, -signal.SIGTERM)


def _exits(obs: Observations) -> Iterator[Violation]:
    """Gateways exit only by the schedule's SIGKILL or the final SIGTERM (code 0)."""
    for text in obs.unexpected_exits:
        yield Violation("exit", text)
    for gateway, code in sorted(obs.final_exit_codes.items()):
        if not answered_sigterm(code):
            yield Violation(
                "exit",
                f"g{gateway} answered SIGTERM with exit code {code} (None: "
                f"still running after {STOP_DEADLINE_S:.0f}s, killed)",
            )
    for text in obs.tracebacks:
        yield Violation("traceback", text)


def stats(obs: Observations) -> dict[str, int]:
    return {
        "faults": len(obs.step_runs),
        "raw": len(obs.entries),
        "usable_ids": len({e.message_id for e in obs.entries if e.expect != "quarantine"}),
        "hostile": sum(e.kind not in ("new", "copy", "resend") for e in obs.entries),
        "deliveries": len(obs.deliveries),
        "repeats": sum(d.outcome == "repeat" for d in obs.deliveries),
        "failures": sum(d.outcome == "failed" for d in obs.deliveries),
        "dead": len(obs.dead),
        "quarantined": len(obs.quarantine),
        **{
            f"commands_{k}": obs.command_chaos.get(k, 0)
            for k in ("sent", "duplicated", "stale", "reordered", "garbage")
        },
    }
