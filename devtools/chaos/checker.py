"""The checker: each guarantee of the README as one rule over what a run saw (pure).

Input is `Observations`: the raw ledger (from the producer's acknowledgements),
the stand-in's deliveries and dead letters, the quarantine topic, the faults as
they ran, and the gateways' exits and tracebacks. Output is a list of
`Violation`s, each naming its rule, the id or record, and the fault around it.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from devtools.chaos.schedule import Fault, RunConfig, outlives_session
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
        *_exits(obs),
    ]


class _Index:
    """The observations looked up by id and by raw coordinates."""

    def __init__(self, obs: Observations) -> None:
        self.obs = obs
        self.raw = {(e.partition, e.offset): e for e in obs.entries}
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
        self.quarantined: dict[tuple[int, int], list[QuarantineCopy]] = defaultdict(list)
        for copy in obs.quarantine:
            for source in copy.sources:  # each copy under every place it names
                with contextlib.suppress(ValueError, UnicodeDecodeError):
                    _, partition, offset = source_of(source)
                    self.quarantined[(partition, offset)].append(copy)

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
    counts = Counter(e.partition for e in obs.entries)
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
        copies = ix.quarantined.get((e.partition, e.offset), [])
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
        if e.expect != "either" or ix.quarantined.get((e.partition, e.offset)):
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
    for message_id in usable:
        if message_id is not None and not ix.ok.get(message_id) and not ix.dead.get(message_id):
            kind = fate(obs.config.seed, message_id, obs.config)
            yield Violation(
                "lost",
                f"id {readable(message_id)!r} (fate {kind}) was never "
                f"processed successfully nor dead-lettered: {ix.history(message_id)}",
            )


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
        elif run.step.fault is Fault.BROKER_STOP:
            events += obs.config.gateways
    return events


def _repeats(obs: Observations) -> Iterator[Violation]:
    """Deliveries of a token already processed stay within the documented crash window:
    max_batch_records per raw partition per event (+1: a retry repeated by a kill)."""
    config = obs.config
    events = crash_events(obs)
    bound = events * (config.max_batch_records + 1)
    repeats: dict[int, list[Delivery]] = defaultdict(list)
    for d in obs.deliveries:
        if d.outcome == "repeat":
            repeats[d.source[0]].append(d)
    for partition, found in sorted(repeats.items()):
        if len(found) > bound:
            yield Violation(
                "repeats",
                f"raw partition {partition}: {len(found)} repeated "
                f"deliveries (a dedup-token seen before), bound {bound} = {events} "
                f"kills or session-long stops x (max_batch_records "
                f"{config.max_batch_records} + 1); first at t={found[0].at:.1f}s "
                f"{step_context(obs.step_runs, found[0].at)}",
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


def _exits(obs: Observations) -> Iterator[Violation]:
    """Gateways exit only by the schedule's SIGKILL or the final SIGTERM (code 0)."""
    for text in obs.unexpected_exits:
        yield Violation("exit", text)
    for gateway, code in sorted(obs.final_exit_codes.items()):
        if code != 0:
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
