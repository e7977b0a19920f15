"""`dedup-gateway rebuild MEMBER`: copy the live marks into a member that lost them.

A member that restarted empty is *recovering* (gateway/quorum/keys.py, "Epochs"):
its answers do not count until a whole mark lifetime (1.5 x ttl) has passed.
A rebuild shortens that to the copy time, while the gateways keep running:

1. Read every member's epoch; the member must answer and have one.
2. Read the sources' marks bucket by bucket (`scripts.EXPORT`, short calls).
   With several sources, each digest's owner is picked by the vote's rule
   (most marks, ties to the smallest token: `vote.leader`) over what every
   source holds (`scripts.LOOKUP`); a digest is copied once, with the first
   source that holds it.
3. Write them into the member (`scripts.IMPORT`): absent marks are added with
   about the source's remaining lifetime, marks held by another owner are
   rewritten. Every call names the member's epoch: if it lost its data again
   meanwhile, the rebuild stops.
4. Set the member's epoch `trusted` (compare-and-set on the epoch read in 1);
   gateways count it again at their next epoch read (`[redis] ping_interval`).

Handover notes (`<prefix>h:<digest>`, the failure loop's) are copied with the
marks they belong to (an absent one deleted): without them a replayed
failure command would be "another copy" there and "redo" on the source, and
with no third member to break that tie its partition would wait until the
note expired (chaos seed 732, two members emptied).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from gateway.config import Settings
from gateway.ops.command_quorum import command_quorum
from gateway.progress import Progress
from gateway.quorum.admin import Imported
from gateway.quorum.keys import EPOCH_TRUSTED
from gateway.quorum.link import MemberLink
from gateway.quorum.quorum import Quorum
from gateway.quorum.scripts import SLICES_BACK
from gateway.rules.vote import leader

OK, FAILED, USAGE = 0, 1, 2  # exit codes
# A mark as a source exports it: owner, remaining ms, handover note ('' for none), its ms.
Exported = tuple[str, int, str, int]

# Buckets visited plus marks read per EXPORT call: a few ms of Redis work
# (4-7 ms measured on a loaded 2-core machine, docs/operations.md).
EXPORT_BUDGET = 2000


@dataclass
class Report:
    member: str
    sources: list[str]
    dry_run: bool
    marks_read: int = 0  # distinct digests found on the sources
    written: int = 0  # absent on the member: added (or, dry run, would be)
    rewritten: int = 0  # held by another owner on the member: rewritten
    already_there: int = 0
    ties: int = 0  # sources split evenly: the smallest token was taken
    epoch_before: str | None = None
    epoch_after: str | None = None
    error: str | None = None


class RebuildError(Exception):
    """The rebuild cannot go on; the message says why."""


async def rebuild(
    settings: Settings, member: str, *, source: str | None, dry_run: bool, output: str,
    progress: Progress | None = None,
) -> int:  # fmt: skip
    """Copy the live marks into `member` (host:port/db, as the metrics label names it)
    from `source` (one member) or, when None, from every trusted member; then mark its
    epoch trusted. `dry_run`: count what would be copied, write nothing. `output`:
    "text" or "json"; `progress`: where marks read are counted as they go. Returns the
    exit code: 0 done, 1 failed, 2 bad arguments."""
    quorum = command_quorum(settings.redis)
    report = Report(member, [], dry_run)
    progress = progress or Progress("rebuild")
    try:
        code = await _rebuild(quorum, report, source, progress)
    except RebuildError as exc:
        report.error, code = str(exc), FAILED
    finally:
        await quorum.close()
        progress.finish()
    _print(report, "json" if output == "json" else "text")
    return code


async def _rebuild(quorum: Quorum, report: Report, source: str | None, progress: Progress) -> int:
    names = [inst.name for inst in quorum.members]
    await quorum.refresh_epochs()  # command_quorum: as patient as a first contact
    target = _named(quorum, report.member)
    if target is None:
        report.error = f"no member {report.member!r}; members: {', '.join(names)}"
        return USAGE
    if source is not None:
        chosen = _named(quorum, source)
        if chosen is None or chosen is target:
            report.error = f"--from must be another member, one of: {', '.join(names)}"
            return USAGE
        if not chosen.up:
            raise RebuildError(f"source {chosen.name} does not answer")
        sources = [chosen]
    else:
        sources = [i for i in quorum.members if i is not target and i.up and i.trusted]
        if not sources:
            raise RebuildError("no trusted member to copy from; " + _from_hint(quorum, target))
    report.sources = [s.name for s in sources]
    if not target.up or target.epoch is None:
        raise RebuildError(f"{target.name} does not answer or has no epoch yet; try again")
    epoch = target.epoch
    report.epoch_before = epoch.raw
    for n in range(len(sources)):
        await _copy_from(quorum, target, epoch.id, sources, n, report, progress)
    if report.dry_run:
        report.epoch_after = epoch.raw
        return OK
    trusted = epoch.with_state(EPOCH_TRUSTED)
    done = await quorum.run_script(target, "epoch_set", [epoch.raw, trusted.raw])
    if done != 1:
        raise RebuildError(f"{target.name}'s epoch changed during the rebuild; run it again")
    await quorum.behind.forget(target)  # complete now: no gateway's note about it holds
    report.epoch_after = trusted.raw
    return OK


def kept_their_data(quorum: Quorum) -> list[str]:
    """Members not counted that kept their data (their epoch says trusted): not
    counted only because a stopped gateway run noted they missed fills, they lack
    just those; the source `--from` should name when no member is trusted."""
    return [
        i.name for i in quorum.members
        if i.up and not i.trusted and i.epoch is not None and i.epoch.state == EPOCH_TRUSTED
    ]  # fmt: skip


def _from_hint(quorum: Quorum, target: MemberLink) -> str:
    """What `--from` should name: a member that kept its data; an emptied one gives nothing."""
    kept = [name for name in kept_their_data(quorum) if name != target.name]
    if kept:
        return (
            f"{', '.join(kept)} kept its data (not counted: noted as behind by a stopped "
            f"gateway run, it lacks only the fills that run held); take its marks with "
            f"--from {kept[0]}"
        )
    return "name one with --from to take its marks as they are"


async def _copy_from(
    quorum: Quorum, target: MemberLink, epoch_id: str, sources: Sequence[MemberLink], n: int,
    report: Report, progress: Progress,
) -> None:  # fmt: skip
    """Copy the marks sources[n] holds and no earlier source holds, group by group
    (a cluster member's key groups, gateway/quorum/members.py)."""
    src, others = sources[n], [s for k, s in enumerate(sources) if k != n]
    groups = len(src.groups)
    for group in range(groups):
        cursor: list[Any] = ["start", 0]
        slices_seen, buckets = 0, max(1, int(src.groups[group].layout[-1]))
        while True:
            reply = await quorum.export(src, group, cursor, EXPORT_BUDGET)
            if reply is None:
                raise RebuildError(f"source {src.name} stopped answering")
            done, next_slice, next_shard, *flat = reply
            found = {flat[i]: (flat[i + 1].decode(), int(flat[i + 2]), flat[i + 3].decode(),
                               int(flat[i + 4]))
                     for i in range(0, len(flat), 5)}  # fmt: skip
            if found:
                await _copy_marks(quorum, target, epoch_id, found, others, sources[:n], report)
            # How far: slices of a group are read newest first, each shard by shard
            # (an estimate: the live slices are about SLICES_BACK + 1).
            slices_seen += next_slice != cursor[0]
            in_group = (
                1.0 if done else (slices_seen - 1 + int(next_shard) / buckets) / (SLICES_BACK + 1)
            )
            progress.advance(len(found), (n + (group + min(in_group, 1.0)) / groups) / len(sources))
            if done:
                break
            cursor = [next_slice, next_shard]


async def _copy_marks(
    quorum: Quorum, target: MemberLink, epoch_id: str, found: dict[bytes, Exported],
    others: Sequence[MemberLink], earlier: Sequence[MemberLink], report: Report,
) -> None:  # fmt: skip
    digests = list(found)
    views = await asyncio.gather(*(_lookup(quorum, o, digests) for o in others))
    picks: list[Imported] = []
    for j, digest in enumerate(digests):
        owner, left, note, note_left = found[digest]
        held = Counter([owner])
        lifetime = {owner: left}
        copied_before = False
        for other, view in zip(others, views, strict=True):
            their, their_left = view[j]
            if their is None:
                continue
            copied_before |= other in earlier
            held[their] += 1
            lifetime[their] = max(lifetime.get(their, 0), their_left)
        if copied_before:
            continue
        winner, marks = leader(held)
        report.ties += sum(1 for count in held.values() if count == marks) > 1
        # The source's handover note (or its absence: '-') goes with its own owner
        # only; '?' leaves the member's as it is.
        kept = (note or "-", note_left) if winner == owner else ("?", -2)
        picks.append((digest, winner, lifetime[winner], *kept))
    report.marks_read += len(picks)
    if report.dry_run:
        there_now = await _lookup(quorum, target, [pick[0] for pick in picks])
        for pick, (there, _) in zip(picks, there_now, strict=True):
            winner = pick[1]
            _count(report, 0 if there == winner else 1 if there is None else 2)
        return
    if not picks:
        return
    reply = await quorum.import_marks(target, epoch_id, picks)
    if reply is None:
        raise RebuildError(f"{target.name} stopped answering")
    if isinstance(reply, str):  # its epoch changed: it lost its data again
        raise RebuildError(f"{target.name} lost its data during the rebuild; run it again")
    for result in reply:
        _count(report, result)


async def _lookup(
    quorum: Quorum, inst: MemberLink, digests: list[bytes]
) -> list[tuple[str | None, int]]:
    """Per digest, the owner `inst` holds (None: absent) and its remaining ms."""
    if not digests:
        return []
    reply = await quorum.lookup(inst, digests)
    if reply is None:
        raise RebuildError(f"{inst.name} stopped answering")
    return [(owner.decode() or None, int(left)) for owner, left in reply]


def _count(report: Report, result: int) -> None:
    if result == 0:
        report.already_there += 1
    elif result == 1:
        report.written += 1
    else:
        report.rewritten += 1


def _named(quorum: Quorum, name: str) -> MemberLink | None:
    return next((inst for inst in quorum.members if inst.name == name), None)


def _print(report: Report, output: Literal["text", "json"]) -> None:
    if output == "json":
        print(json.dumps(asdict(report), sort_keys=True))
        return
    mode = " (dry run: nothing written)" if report.dry_run else ""
    print(f"rebuild {report.member} from {', '.join(report.sources) or '-'}{mode}")
    print(
        f"  marks read {report.marks_read}, written {report.written}, rewritten "
        f"{report.rewritten}, already there {report.already_there}, ties {report.ties}"
    )
    print(f"  epoch {report.epoch_before} -> {report.epoch_after}")
    if report.error:
        print(f"  error: {report.error}")
