"""Copies of one failure command that each hand the mark over on some of the counted
members, none on a majority: exactly one of them acts, the one whose command ref sorts
first, whichever order they ask in. Two acting sent the retry twice under one token
(chaos seed 20001); none acting would lose it (three copies on three members did). A
copy that misses a member's answer (not counted on its gateway) waits for it: that
member may hold another copy's move."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from devtools.harness import redis_urls
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.commands import Handover, HandoverDecision, handover_decision


@asynccontextmanager
async def claimed_on_three(servers: Sequence[Any], digest: bytes) -> AsyncIterator[Quorum]:
    """A quorum of the three servers (a 300 ms timeout) where token 11 holds `digest`."""
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    quorum = Quorum(settings.redis, Metrics())
    try:
        await quorum.check()
        assert await quorum.claim([digest], ["11"]) == [[1], [1], [1]]
        yield quorum
    finally:
        await quorum.close()


async def reaching(
    quorum: Quorum, servers: Sequence[Any], copy: Handover, hung: Sequence[int]
) -> list[int | str | None]:
    """The copy's handover while the `hung` servers are SIGSTOPped (no answer within the
    timeout); the quorum checked again after, as the first call may meet a connection
    the timeout closed."""
    for n in hung:
        servers[n].pause()
    try:
        replies = await quorum.handover([copy])
    finally:
        for n in hung:
            servers[n].resume()
    for _ in range(3):
        await quorum.check()
    return [r[0] for r in replies]


async def decisions(quorum: Quorum, copies: Sequence[Handover], answering: int) -> dict[str, str]:
    """Each copy asks again, as a command that waited does, and decides."""
    decided = {}
    for copy in copies:
        replies = await quorum.handover([copy])
        answers = [a for r in replies if (a := r[0]) is not None]
        assert len(answers) == answering, replies
        decision = handover_decision(answers, quorum.majority, copy.ref, quorum.size)
        decided[copy.ref] = decision.value
    return decided


async def test_two_copies_splitting_the_counted_members_agree_on_the_first_ref(
    redis_servers: Any,
) -> None:
    """Member 2 not counted (paused): neither copy acts while its answer is missing (it
    could hold either copy's move, as another gateway may count it: next test); once it
    is counted again, the copy that moves it acts, alone a majority, and the other skips."""
    servers = redis_servers(3)
    digest = mark_digest(b"failed-twice")
    first, later = (Handover(digest, "11", "12", ref) for ref in ("failures/0/7", "failures/1/3"))
    async with claimed_on_three(servers, digest) as quorum:
        assert await quorum.admin.pause(quorum.members[2], True)  # not counted
        # The later copy reaches member 1 alone, then the first copy member 0 alone.
        assert await reaching(quorum, servers, later, hung=[0]) == [None, 1, None]
        assert await reaching(quorum, servers, first, hung=[1]) == [1, None, None]
        assert await decisions(quorum, (later, first), answering=2) == {
            "failures/0/7": "wait", "failures/1/3": "wait"
        }  # fmt: skip
        assert await quorum.admin.pause(quorum.members[2], False)
        for _ in range(3):
            await quorum.check()
        assert await decisions(quorum, (later, first), answering=3) == {
            "failures/0/7": "skip", "failures/1/3": "act"
        }  # fmt: skip


async def test_a_copy_whose_gateway_does_not_count_a_member_the_other_moved_does_not_act(
    redis_servers: Any,
) -> None:
    """Gateway 1 dropped fills for member 2 (`repair_backlog = 1`), so it does not count
    it; gateway 2 does. The later copy, on gateway 2, moved members 1 and 2 (member 0
    hung): it acts, alone a majority. The first copy, on gateway 1, sees [1, the later
    copy's ref] and acted too (the first ref of a split), a retry twice under one token;
    now it waits for member 2's answer."""
    servers = redis_servers(3)
    digest = mark_digest(b"failed-on-two-gateways")
    first, later = (Handover(digest, "11", "12", ref) for ref in ("failures/0/7", "failures/1/3"))
    settings = load_settings(
        redis={"nodes": redis_urls(servers), "timeout": "300ms", "repair_backlog": 1}
    )
    async with claimed_on_three(servers, digest) as counting_all:
        dropping = Quorum(settings.redis, Metrics())
        try:
            await dropping.check()
            other = [(mark_digest(b"o-1"), "21", "21"), (mark_digest(b"o-2"), "22", "22")]
            dropping.queue_fills([[], [], other])  # one dropped: member 2 lacks a mark
            assert dropping.counted() == [True, True, False]
            assert counting_all.counted() == [True, True, True]
            assert await reaching(counting_all, servers, later, hung=[0]) == [None, 1, 1]
            replies = await dropping.handover([first])
            answers = [a for r in replies if (a := r[0]) is not None]
            assert answers == [1, later.ref]
            decision = handover_decision(answers, dropping.majority, first.ref, dropping.size)
            assert decision is HandoverDecision.WAIT
            assert await decisions(counting_all, [later], answering=3) == {later.ref: "act"}
            assert await decisions(counting_all, [first], answering=3) == {first.ref: "skip"}
        finally:
            await dropping.close()


async def test_three_copies_each_moving_one_of_three_members_agree_on_the_first_ref(
    redis_servers: Any,
) -> None:
    servers = redis_servers(3)
    digest = mark_digest(b"failed-thrice")
    refs = ("failures/0/7", "failures/1/3", "failures/2/5")
    copies = [Handover(digest, "11", "12", ref) for ref in refs]
    async with claimed_on_three(servers, digest) as quorum:
        for n, copy in enumerate(copies):  # copy n reaches member 2 - n alone
            reached = 2 - n
            hung = [m for m in range(3) if m != reached]
            replies = await reaching(quorum, servers, copy, hung)
            assert replies == [1 if m == reached else None for m in range(3)]
        assert await decisions(quorum, list(reversed(copies)), answering=3) == {
            refs[0]: "act", refs[1]: "skip", refs[2]: "skip"
        }  # fmt: skip
