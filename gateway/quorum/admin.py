"""What operator commands, `rebuild` and tests ask of one member or one id: a
mark's view, an unconditional release, a member's marks whole (export, lookup,
import) and its pause flag."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from gateway.quorum.calls import Calls, ItemReply
from gateway.quorum.keys import Epoch, handover_key
from gateway.quorum.link import MemberLink
from gateway.quorum.members import Group, group_of
from gateway.quorum.scripts import listed
from gateway.quorum.transport import Planned

# A mark a rebuild writes: digest, owner, remaining ms, handover note ('-': none, '?': keep
# the member's), its remaining ms; then what the copy's lookup saw on the member, its
# owner and its handover note ('' for none): it is written only while the member holds
# those still (a live claim that landed since is left as it is).
Imported = tuple[bytes, str, int, str, int, str, str]


@dataclass(frozen=True)
class MarkView:
    """One member's view of one id, for the operator."""

    owner: str | None  # None: no live mark
    ttl_ms: int  # of the bucket holding it; -2 when absent
    encoding: str | None  # "listpack" while the bucket is compact
    handed_over_by: str | None  # the failure command that last handed it over


class Admin:
    """Calls on one member or one id, outside the data path."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def delete(self, digest: bytes) -> list[ItemReply | None]:
        """Release the mark whoever holds it (operator release; a tombstone,
        gateway/quorum/keys.py); per member 1 released, 0 absent or released already,
        None for no answer (or a member that is not counted)."""

        def plan(group: Group, items: Sequence[int]) -> Planned:
            return [(("delete", [group.meta], [*group.layout, digest]), items)]

        results = await self.calls.per_item_on_counted("delete", [digest], plan)
        return [r[0] for r in results]

    async def inspect(self, digest: bytes) -> list[MarkView | None]:
        """Per member, the mark and its bucket (owner None when absent); None if down."""

        async def one(member: MemberLink) -> MarkView | None:
            n = self.group_index(member, digest)
            group = member.groups[n]
            found = await self.calls.run_script(member, "inspect", [*group.layout, digest], group=n)
            if found is None:
                return None
            key = handover_key(group.prefix, digest)
            handed = await member.timed("inspect", partial(member.client.get, key), group=n)
            by = handed.decode() if isinstance(handed, bytes) else None
            if not found:
                return MarkView(None, -2, None, by)
            owner, ttl, encoding = found
            return MarkView(owner.decode(), int(ttl), encoding.decode(), by)

        return list(await asyncio.gather(*(one(member) for member in self.calls.members)))

    async def lookup(
        self, member: MemberLink, digests: Sequence[bytes], notes: bool = False
    ) -> list[Any] | None:
        """Per digest, [owner or b'', its bucket's remaining ms (-2: absent)] on `member`,
        with `notes` also [handover note or b'', its remaining ms]; None when a call got
        no answer."""
        if not digests:
            return []
        width = len(digests[0])
        return await self.calls.in_chunks(
            member, "lookup", digests,
            lambda items: [width, b"".join(digests[k] for k in items), "1" if notes else "0"],
            width=4 if notes else 2,
        )  # fmt: skip

    async def export(self, member: MemberLink, group: int, cursor: list[Any], budget: int) -> Any:
        """One call of scripts.EXPORT on one group of `member`; None for no answer."""
        layout = member.groups[group].layout
        return await self.calls.run_script(
            member, "export", [*layout, *cursor, budget], group=group
        )

    async def import_marks(
        self, member: MemberLink, epoch_id: str, marks: Sequence[Imported]
    ) -> list[int] | str | None:
        """Write (digest, owner, remaining ms, handover note, its remaining ms, owner and
        note seen there) marks into `member` (scripts.IMPORT; note '-': none, '?': keep
        the member's), each only where the member still holds what was seen: per mark
        0 there already, 1 written, 2 rewritten, 3 changed since it was seen (left as it
        is); 'epoch' when its epoch changed (it lost its data again); None for no
        answer."""
        digests = [mark[0] for mark in marks]
        width = len(digests[0])
        flat = await self.calls.in_chunks(
            member,
            "import",
            digests,
            lambda items: [
                epoch_id,
                width,
                b"".join(digests[k] for k in items),
                *(listed(marks[k][field] for k in items) for field in range(1, 7)),
            ],
            width=1,
        )
        if flat is None:
            return "epoch" if member.epoch is None else None
        return [int(result[0]) for result in flat]

    async def set_epoch(self, member: MemberLink, seen: Epoch, new: Epoch) -> bool:
        """Replace `member`'s epoch `seen` by `new` (scripts.EPOCH_SET); False when it
        holds another (it lost its data again) or gave no answer."""
        return await self.calls.run_script(member, "epoch_set", [seen.raw, new.raw]) == 1

    async def pause(self, member: MemberLink, paused: bool) -> bool:
        """Set or clear `member`'s pause flag on every group; whether every group answered."""
        done = await asyncio.gather(
            *(self.calls.run_script(member, "pause", [g.prefix, "1" if paused else "0"], group=n)
              for n, g in enumerate(member.groups))
        )  # fmt: skip
        return all(d is not None for d in done)

    def group_index(self, member: MemberLink, digest: bytes) -> int:
        return 0 if not member.cluster else group_of(digest, len(member.groups))
