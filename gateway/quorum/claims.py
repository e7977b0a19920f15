"""The data path's claim: one vote's digests claimed on every member.

Each member gets the claims of one vote after another, in the order the votes
began (its `claiming` lock); before them, up to a chunk of its queued fills
(gateway/quorum/fills.py), so that the claims see the completed marks. What every
standalone member gets the same of (a chunk's payload, the decoding of replies
another member answered alike) is built once per vote."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gateway.quorum.behind import Behind
from gateway.quorum.claim_path import ClaimPaths
from gateway.quorum.epochs import Epochs
from gateway.quorum.fills import Fills
from gateway.quorum.link import MemberLink
from gateway.quorum.members import Group
from gateway.quorum.scripts import listed
from gateway.quorum.transport import Planned, Transport, chunks, place
from gateway.rules.vote import MINE, Reply


@dataclass
class ClaimBatch:
    """One vote's digests and owners, and what every standalone member gets the same
    of, built once per vote: a chunk's payload (its digests and tokens), and the
    decoding of a chunk's replies another member answered alike (the usual case)."""

    digests: Sequence[bytes]
    owners: Sequence[str]
    payloads: dict[tuple[int, int], tuple[bytes, str]] = field(default_factory=dict)
    decoded: dict[tuple[int, int], tuple[list[Any], list[Reply]]] = field(default_factory=dict)

    def payload(self, chunk: Sequence[int]) -> tuple[bytes, str]:
        if not isinstance(chunk, range):  # a cluster group's items: gathered
            blob = b"".join([self.digests[k] for k in chunk])
            return blob, listed(self.owners[k] for k in chunk)
        key = (chunk.start, chunk.stop)
        built = self.payloads.get(key)
        if built is None:  # the whole batch in order: slice, do not gather
            built = self.payloads[key] = (
                b"".join(self.digests[chunk.start : chunk.stop]),
                listed(self.owners[chunk.start : chunk.stop]),
            )
        return built

    def plan(self, epoch_id: str, group: Group, items: Sequence[int]) -> Planned:
        """The claim calls for one key group's items, chunk by chunk."""
        head = [*group.layout, epoch_id, len(self.digests[0])]
        planned: Planned = []
        for chunk in chunks(items):
            blob, tokens = self.payload(chunk)
            planned.append((("claim", [group.meta], [*head, blob, tokens]), chunk))
        return planned

    def readable(self, positions: Sequence[int], result: list[Any]) -> list[Reply]:
        """The chunk's replies with the other owners' tokens as text."""
        if result.count(MINE) == len(result):
            return result
        if not isinstance(positions, range):
            return [r if r == MINE else r.decode() for r in result]
        key = (positions.start, positions.stop)
        seen = self.decoded.get(key)
        if seen is not None and seen[0] == result:
            return seen[1]
        text: list[Reply] = [r if r == MINE else r.decode() for r in result]
        self.decoded[key] = (result, text)
        return text


@dataclass
class Claims:
    """The claims of one quorum's members."""

    members: Sequence[MemberLink]
    via: Callable[[MemberLink], Transport]  # standalone or Redis Cluster
    epochs: Epochs
    fills: Fills
    behind: Behind
    paths: ClaimPaths

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        """Per member, the reply for each digest: MINE, the owner that holds it, or
        None where the member gave no answer (down, timed out, its chunk failed, or
        its data was lost since we last looked, or it is paused). A member that is
        not trusted answers too: `counted()` says which answers the vote may count.

        Every digest must have the same length (they do: `keys.mark_digest`).
        """
        if not digests:
            return [[] for _ in self.members]
        if not self.epochs.read:  # a first contact (connect, load the script): as patient
            await self.epochs.refresh(patient=True)
        batch = ClaimBatch(digests, owners)
        out = list(await asyncio.gather(*(self._in_order(m, batch) for m in self.members)))
        if self.epochs.reread:
            await self.epochs.refresh()
        return out

    async def _in_order(self, member: MemberLink, batch: ClaimBatch) -> list[Reply]:
        # A member that answers gets the claims of one vote after another, in the
        # order the votes began: the raw loop claims a batch while it finishes the one
        # before, and copies of an id in both, reaching two members in opposite
        # orders, split them 1:1, which no vote decides while a third member does
        # not answer (the partitions blocked until it did: test_repair_queue.py). A
        # member that does not answer gets no claim while an earlier vote's is in
        # flight (no answer, as a timeout): sent beside it, both could run when it
        # came back, in either order; waited for, a hung member would hold every
        # vote for a timeout each.
        if not member.up and member.claiming.locked():
            return [None] * len(batch.digests)
        async with member.claiming:
            return await self._claim_on(member, batch)

    async def _claim_on(self, member: MemberLink, batch: ClaimBatch) -> list[Reply]:
        n = len(batch.digests)
        if member.epoch is None or member.paused:  # what it would answer could not be counted
            return [None] * n
        # The epoch these claims expect: the one known now (the fills' answer may
        # change what the gateway knows; the scripts then refuse).
        epoch_id = member.epoch.id
        fills = self.fills.take(member)
        if fills:  # first, so that this batch's claims see the completed marks
            sent = await self.fills.send(member, fills)
            if sent:
                await self.behind.clear(member)
        if not member.claim_path and member.up:  # a member down is not waited for twice
            await self.paths.choose(member)
        results = await self.via(member).grouped(
            member, "claim", batch.digests, partial(batch.plan, epoch_id)
        )
        if any(result is None for _, result in results):
            self.paths.lost_module(member)
        replies: list[Reply] = [None] * n
        for positions, result in results:
            if result is not None:
                place(replies, positions, batch.readable(positions, result))
        return replies
