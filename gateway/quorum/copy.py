"""Copying the live marks of some members into another: `dedup-gateway rebuild`
(gateway/ops/rebuild.py) and a gateway's catch-up of a member that is behind
(catchup.py).

The sources' marks are read bucket by bucket (`scripts.EXPORT`, short calls).
With several sources, each digest's owner is picked by the vote's rule (most
marks, ties to the smallest token: `vote.leader`) over what every source holds
(`scripts.LOOKUP`); a digest is copied once, with the first source that holds
it. They are written into the member (`scripts.IMPORT`): absent marks are added
with about the source's remaining lifetime, marks held by another owner are
rewritten. Every call names the member's epoch: if it lost its data meanwhile,
the copy stops.
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


async def copy_marks(
    admin: Admin, target: MemberLink, epoch_id: str, sources: Sequence[MemberLink],
    copied: Copied, advance: Advance, dry_run: bool = False,
) -> None:  # fmt: skip
    """Copy every source's live marks into `target`, whose epoch must stay `epoch_id`."""
    for n in range(len(sources)):
        await _copy_from(admin, target, epoch_id, sources, n, copied, advance, dry_run)


async def _copy_from(
    admin: Admin, target: MemberLink, epoch_id: str, sources: Sequence[MemberLink], n: int,
    copied: Copied, advance: Advance, dry_run: bool,
) -> None:  # fmt: skip
    """Copy the marks sources[n] holds and no earlier source holds, group by group
    (a cluster member's key groups, gateway/quorum/members.py)."""
    src, others = sources[n], [s for k, s in enumerate(sources) if k != n]
    groups = len(src.groups)
    for group in range(groups):
        cursor: list[Any] = ["start", 0]
        slices_seen, buckets = 0, max(1, int(src.groups[group].layout[-1]))
        while True:
            reply = await admin.export(src, group, cursor, EXPORT_BUDGET)
            if reply is None:
                raise CopyError(f"source {src.name} stopped answering")
            done, next_slice, next_shard, *flat = reply
            found = {flat[i]: (flat[i + 1].decode(), int(flat[i + 2]), flat[i + 3].decode(),
                               int(flat[i + 4]))
                     for i in range(0, len(flat), 5)}  # fmt: skip
            if found:
                await _copy_found(admin, target, epoch_id, found, others, sources[:n], copied,
                                  dry_run)  # fmt: skip
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


async def _copy_found(
    admin: Admin, target: MemberLink, epoch_id: str, found: dict[bytes, Exported],
    others: Sequence[MemberLink], earlier: Sequence[MemberLink], copied: Copied, dry_run: bool,
) -> None:  # fmt: skip
    digests = list(found)
    views = await asyncio.gather(*(lookup(admin, o, digests) for o in others))
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
        copied.ties += sum(1 for count in held.values() if count == marks) > 1
        # The source's handover note (or its absence: '-') goes with its own owner
        # only; '?' leaves the member's as it is.
        kept = (note or "-", note_left) if winner == owner else ("?", -2)
        picks.append((digest, winner, lifetime[winner], *kept))
    copied.marks_read += len(picks)
    if dry_run:
        there_now = await lookup(admin, target, [pick[0] for pick in picks])
        for pick, (there, _) in zip(picks, there_now, strict=True):
            winner = pick[1]
            _count(copied, 0 if there == winner else 1 if there is None else 2)
        return
    if not picks:
        return
    reply = await admin.import_marks(target, epoch_id, picks)
    if reply is None:
        raise CopyError(f"{target.name} stopped answering")
    if isinstance(reply, str):  # its epoch changed: it lost its data again
        raise CopyError(f"{target.name} lost its data during the copy; run it again")
    for result in reply:
        _count(copied, result)


async def lookup(
    admin: Admin, member: MemberLink, digests: list[bytes]
) -> list[tuple[str | None, int]]:
    """Per digest, the owner `member` holds (None: absent) and its remaining ms."""
    if not digests:
        return []
    reply = await admin.lookup(member, digests)
    if reply is None:
        raise CopyError(f"{member.name} stopped answering")
    return [(owner.decode() or None, int(left)) for owner, left in reply]


def _count(copied: Copied, result: int) -> None:
    if result == 0:
        copied.already_there += 1
    elif result == 1:
        copied.written += 1
    else:
        copied.rewritten += 1
