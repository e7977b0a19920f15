"""How the parts beside the facade call the members (`Admin`, `Windows`): the members,
the transport each call goes by, the epochs a writing script needs, and the one rule
of which answers count. `Quorum` builds one and hands it over; nothing here reaches
back into the facade."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from gateway.quorum.epochs import Epochs
from gateway.quorum.link import MemberLink
from gateway.quorum.transport import Planned, Transport, place

# A script's reply per item: a code, or a string it names (HANDOVER: another copy's ref).
ItemReply = int | str


def reply(x: Any) -> ItemReply:
    """A member's reply to one item as the rules read it: bytes decoded, codes as ints."""
    if isinstance(x, bytes):
        return x.decode()
    return x if isinstance(x, str) else int(x)


class Calls:
    """Calls on the members of one quorum."""

    def __init__(
        self,
        members: Sequence[MemberLink],
        via: Callable[[MemberLink], Transport],
        epochs: Epochs,
        refresh_epochs: Callable[[], Awaitable[None]],
    ) -> None:
        self.members = list(members)
        self.size = len(self.members)
        self.via = via  # standalone or Redis Cluster
        self.epochs = epochs
        self.refresh_epochs = refresh_epochs

    async def epochs_known(self) -> None:
        """Read the epochs when none was read yet (a writing script carries its member's)."""
        if not self.epochs.read:
            await self.refresh_epochs()

    async def epochs_settled(self) -> None:
        """Read them again when a call found one changed."""
        if self.epochs.reread:
            await self.refresh_epochs()

    async def run_script(
        self, member: MemberLink, name: str, args: list[Any], bound_s: float | None = None,
        group: int = 0,
    ) -> Any | None:  # fmt: skip
        """One call of script `name` on one group of `member`; None for no answer."""
        return await self.via(member).run_script(member, name, args, bound_s, group)

    async def in_chunks(
        self, member: MemberLink, script: str, digests: Sequence[bytes],
        args_of: Callable[[Sequence[int]], list[Any]], width: int,
    ) -> list[Any] | None:  # fmt: skip
        """`script` on `member` over `digests` in chunks (gateway/quorum/transport.py)."""
        return await self.via(member).in_chunks(member, script, digests, args_of, width)

    async def per_item_on_counted(
        self, what: str, digests: Sequence[bytes],
        plan: Callable[..., Planned], needs_epoch: bool = False,
    ) -> list[list[ItemReply | None]]:  # fmt: skip
        """Per member, per digest, the reply of the calls `plan` makes (one reply per
        item); None where it gave no answer, or where the vote must not count it (not
        trusted, or paused). With `needs_epoch` the plan takes the member's epoch id first,
        and a member whose epoch is not known is not called (a script that writes needs it)."""
        await self.epochs_known()

        async def one(member: MemberLink) -> list[ItemReply | None]:
            out: list[ItemReply | None] = [None] * len(digests)
            if needs_epoch and (member.epoch is None or member.paused):
                return out
            planner = partial(plan, member.epoch.id) if needs_epoch and member.epoch else plan
            for positions, result in await self.via(member).grouped(member, what, digests, planner):
                if result is not None:
                    place(out, positions, [reply(x) for x in result] if isinstance(result, list)
                           else [reply(result)])  # fmt: skip
            if not member.trusted or member.paused:
                return [None] * len(digests)
            return out

        return list(await asyncio.gather(*(one(member) for member in self.members)))
