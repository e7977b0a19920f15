"""Copying the live marks of some members into another: `dedup-gateway rebuild`
(gateway/ops/rebuild.py) and a gateway's catch-up of a member that is behind
(catchup.py).

The sources' marks are read bucket by bucket (`scripts.EXPORT`, short calls).
Each chunk read is then looked up (`scripts.LOOKUP`), on the member first, then on
every source: each digest's owner is picked by the vote's rule (most marks, ties to
the smallest token: `vote.leader`) over what every source holds then; a digest is
copied once, with the first source that holds it. They are written into the member
(`scripts.IMPORT`): absent marks are added with about the source's remaining
lifetime, marks held by another owner are rewritten, each only where the member
still holds what its lookup saw (compare-and-set, mark and handover note). A live
claim, release or handover that lands on the member meanwhile is newer than what the
copy read, and is left as it is (counted `changed`): the copy wrote the older owner
over it before, a tombstone over a new owner or a failed attempt's token over a
handover, and after one more member lost its data a later copy was forwarded. The
member is looked up before the sources, so what they answer is at least as new.
Every call names the member's epoch: if it lost its data meanwhile, the copy stops.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.quorum.admin import Admin, Imported
from gateway.quorum.link import MemberLink
from gateway.quorum.scripts import SLICES_BACK
from gateway.rules.vote import leader

# A mark as a source exports it: owner, remaining ms, handover note ('' for none), its ms.
Exported = tuple[str, int, str, int]

# Buckets visited plus marks read per EXPORT call: a few ms of Redis work
# (4-7 ms measured on a loaded 2-core machine, docs/operations.md).
EXPORT_BUDGET = 2000

# Called after each EXPORT call: marks it read, and how far the copy is (0 to 1).
Advance = Callable[[int, float], Awaitable[None]]
# Called before each IMPORT call (the catch-up renews its lease there: raises CopyError
# when it is lost).
BeforeImport = Callable[[], Awaitable[None]]


class CopyError(Exception):
    """The copy cannot go on; the message says why."""


@dataclass
class Copied:
    """What a copy found and did (or, dry run, would do)."""

    marks_read: int = 0  # distinct digests found on the sources
    written: int = 0  # absent on the member: added
    rewritten: int = 0  # held by another owner on the member: rewritten
    already_there: int = 0
    ties: int = 0  # sources split evenly: the smallest token was taken
    # Changed on the member since the copy looked it up (a live claim, release or
    # handover): left as the live path wrote it.
    changed: int = 0


@dataclass(frozen=True)
class Seen:
    """One digest on one member, as LOOKUP with notes answers."""

    owner: str | None  # None: no live mark
    left: int  # its bucket's remaining ms
    note: str | None  # its handover note, None for none
    note_left: int


async def copy_marks(
    admin: Admin, target: MemberLink, epoch_id: str, sources: Sequence[MemberLink],
    copied: Copied, advance: Advance, dry_run: bool = False,
    before_import: BeforeImport | None = None,
) -> None:  # fmt: skip
    """Copy every source's live marks into `target`, whose epoch must stay `epoch_id`."""
    step = _Step(admin, target, epoch_id, sources, copied, dry_run, before_import)
    for n in range(len(sources)):
        await _copy_from(step, n, advance)


@dataclass(frozen=True)
class _Step:
    """What every chunk of one copy needs."""

    admin: Admin
    target: MemberLink
    epoch_id: str
    sources: Sequence[MemberLink]
    copied: Copied
    dry_run: bool
    before_import: BeforeImport | None


async def _copy_from(step: _Step, n: int, advance: Advance) -> None:
    """Copy the marks sources[n] holds and no earlier source holds, group by group
    (a cluster member's key groups, gateway/quorum/members.py)."""
    admin, sources = step.admin, step.sources
    src = sources[n]
    groups = len(src.groups)
    for group in range(groups):
        cursor: list[Any] = ["start", 0]
        slices_seen, buckets = 0, max(1, int(src.groups[group].layout[-1]))
        while True:
            reply = await admin.export(src, group, cursor, EXPORT_BUDGET)
            if reply is None:
                raise CopyError(f"source {src.name} stopped answering")
            done, next_slice, next_shard, *flat = reply
            found = list(dict.fromkeys(flat[i] for i in range(0, len(flat), 5)))
            if found:
                await copy_found(step, found, n)
            # How far: slices of a group are read newest first, each shard by shard
            # (an estimate: the live slices are about SLICES_BACK + 1).
            slices_seen += next_slice != cursor[0]
            in_group = (
                1.0 if done else (slices_seen - 1 + int(next_shard) / buckets) / (SLICES_BACK + 1)
            )
            await advance(len(found), (n + (group + min(in_group, 1.0)) / groups) / len(sources))
            if done:
                break
            cursor = [next_slice, next_shard]


async def copy_found(step: _Step, digests: list[bytes], n: int) -> None:
    """Copy these digests, found on sources[n], unless an earlier source holds them.

    The member is looked up first: a write that lands there after that lookup is left
    as it is (IMPORT compares against it), and the sources, looked up next, answer at
    least as new a state as the member's. The exporting source is looked up again with
    the others, so its owner and note are of that moment too, not of its EXPORT call."""
    admin, target, copied = step.admin, step.target, step.copied
    there = await lookup(admin, target, digests)
    views = await asyncio.gather(*(lookup(admin, s, digests) for s in step.sources))
    picks: list[Imported] = []
    for j, digest in enumerate(digests):
        own = views[n][j]
        if own.owner is None or any(views[k][j].owner is not None for k in range(n)):
            continue  # gone from it since (expired), or copied with an earlier source
        held: Counter[str] = Counter()
        lifetime: dict[str, int] = {}
        for view in views:
            if (their := view[j]).owner is not None:
                held[their.owner] += 1
                lifetime[their.owner] = max(lifetime.get(their.owner, 0), their.left)
        winner, marks = leader(held)
        copied.ties += sum(1 for count in held.values() if count == marks) > 1
        # The source's handover note (or its absence: '-') goes with its own owner
        # only; '?' leaves the member's as it is.
        kept = (own.note or "-", own.note_left) if winner == own.owner else ("?", -2)
        seen = there[j]
        picks.append((digest, winner, lifetime[winner], *kept, seen.owner or "",
                      seen.note or ""))  # fmt: skip
    copied.marks_read += len(picks)
    if step.dry_run:
        for pick in picks:  # pick[5]: the owner seen on the member
            _count(copied, 0 if pick[5] == pick[1] else 1 if not pick[5] else 2)
        return
    if not picks:
        return
    if step.before_import is not None:
        await step.before_import()
    reply = await admin.import_marks(target, step.epoch_id, picks)
    if reply is None:
        raise CopyError(f"{target.name} stopped answering")
    if isinstance(reply, str):  # its epoch changed: it lost its data again
        raise CopyError(f"{target.name} lost its data during the copy; run it again")
    for result in reply:
        _count(copied, result)


async def lookup(admin: Admin, member: MemberLink, digests: list[bytes]) -> list[Seen]:
    """Per digest, what `member` holds: owner, remaining ms, handover note."""
    if not digests:
        return []
    reply = await admin.lookup(member, digests, notes=True)
    if reply is None:
        raise CopyError(f"{member.name} stopped answering")
    return [
        Seen(owner.decode() or None, int(left), note.decode() or None, int(note_left))
        for owner, left, note, note_left in reply
    ]


def _count(copied: Copied, result: int) -> None:
    if result == 0:
        copied.already_there += 1
    elif result == 1:
        copied.written += 1
    elif result == 2:
        copied.rewritten += 1
    else:
        copied.changed += 1
