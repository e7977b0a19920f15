"""Coalescing windows on the members (gateway/delay/coalescer.py, scripts.COALESCE_*)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.quorum.calls import Calls
from gateway.quorum.link import MemberLink
from gateway.quorum.scripts import listed


class Windows:
    """The coalescing-window calls, on every member."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls

    async def coalesce_update(
        self, digests: Sequence[bytes], stamps: Sequence[int], versions: Sequence[str],
        mode: str, window_ms: int, max_window_ms: int, on: Sequence[bool] | None = None,
    ) -> list[list[tuple[int, bool, int]] | None]:  # fmt: skip
        """Per member, per update: (its window's start, whether it opened the window, the
        window's newest timestamp before it, 0 if none); None where the member gave no
        answer (or had another epoch), or is not `on`."""
        if not digests:
            return [[] for _ in self.calls.members]
        await self.calls.epochs_known()
        width = len(digests[0])

        async def one(member: MemberLink, asked: bool) -> list[tuple[int, bool, int]] | None:
            if member.epoch is None or member.paused or not asked:
                return None
            head = [member.epoch.id, mode, window_ms, max_window_ms, width]
            flat = await self.calls.in_chunks(
                member, "coalesce_update", digests,
                lambda items: [*head, b"".join(digests[k] for k in items),
                               listed(stamps[k] for k in items),
                               listed(versions[k] for k in items)],
                width=3,
            )  # fmt: skip
            if flat is None:
                return None
            return [(int(start), int(opened) == 1, int(prev)) for start, opened, prev in flat]

        asked = on if on is not None else [True] * self.calls.size
        members = self.calls.members
        out = list(await asyncio.gather(*(one(i, a) for i, a in zip(members, asked, strict=True))))
        await self.calls.epochs_settled()
        return out

    async def coalesce_close(
        self, digests: Sequence[bytes], starts: Sequence[int]
    ) -> list[list[tuple[str, int, int]] | None]:
        """Per member, per window: (newest version or '', updates, newest timestamp);
        None where the member gave no answer."""
        if not digests:
            return [[] for _ in self.calls.members]
        width = len(digests[0])

        async def one(member: MemberLink) -> list[tuple[str, int, int]] | None:
            flat = await self.calls.in_chunks(
                member, "coalesce_close", digests,
                lambda items: [width, b"".join(digests[k] for k in items),
                               listed(starts[k] for k in items)],
                width=3,
            )  # fmt: skip
            if flat is None:
                return None
            return [(v.decode(), int(n), int(last)) for v, n, last in flat]

        return list(await asyncio.gather(*(one(member) for member in self.calls.members)))
