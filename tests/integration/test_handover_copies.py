"""Copies of one failure command that each hand the mark over on some of the counted
members, none on a majority: exactly one of them acts, the one whose command ref sorts
first, whichever order they ask in. Two acting sent the retry twice under one token
(chaos seed 20001); none acting would lose it (three copies on three members did)."""

from __future__ import annotations

from typing import Any

from devtools.harness import redis_urls
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.commands import Handover, handover_decision


async def test_two_copies_splitting_the_counted_members_agree_on_the_first_ref(
    redis_servers: Any,
) -> None:
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    quorum = Quorum(settings.redis, Metrics())
    digest = mark_digest(b"failed-twice")
    first, later = (Handover(digest, "11", "12", ref) for ref in ("failures/0/7", "failures/1/3"))
    try:
        await quorum.check()
        assert await quorum.claim([digest], ["11"]) == [[1], [1], [1]]
        assert await quorum.admin.pause(quorum.members[2], True)  # not counted
        # The later copy reaches member 1 alone, then the first copy member 0 alone.
        for copy, hung in ((later, 0), (first, 1)):
            servers[hung].pause()  # SIGSTOP: no answer within the timeout
            try:
                replies = await quorum.handover([copy])
            finally:
                servers[hung].resume()
            assert [r[0] for r in replies] == [None if n == hung else 1 for n in (0, 1)] + [None]
        for _ in range(3):  # the first call may meet the connection the timeout closed
            await quorum.check()
        decided = {}
        for copy in (later, first):  # each asks again, as a command that waited does
            replies = await quorum.handover([copy])
            answers = [a for r in replies if (a := r[0]) is not None]
            assert len(answers) == 2, replies
            decided[copy.ref] = handover_decision(answers, quorum.majority, copy.ref)
        assert decided == {"failures/0/7": "act", "failures/1/3": "skip"}
    finally:
        await quorum.close()


async def test_three_copies_each_moving_one_of_three_members_agree_on_the_first_ref(
    redis_servers: Any,
) -> None:
    servers = redis_servers(3)
    settings = load_settings(redis={"nodes": redis_urls(servers), "timeout": "300ms"})
    quorum = Quorum(settings.redis, Metrics())
    digest = mark_digest(b"failed-thrice")
    refs = ("failures/0/7", "failures/1/3", "failures/2/5")
    copies = [Handover(digest, "11", "12", ref) for ref in refs]
    try:
        await quorum.check()
        assert await quorum.claim([digest], ["11"]) == [[1], [1], [1]]
        # Copy n reaches member 2 - n alone: the others hang past the timeout.
        for n, copy in enumerate(copies):
            reached = 2 - n
            hung = [servers[m] for m in range(3) if m != reached]
            for server in hung:
                server.pause()
            try:
                replies = await quorum.handover([copy])
            finally:
                for server in hung:
                    server.resume()
            assert [r[0] for r in replies] == [1 if m == reached else None for m in range(3)]
            for _ in range(3):  # the first call may meet a connection the timeout closed
                await quorum.check()
        decided = {}
        for copy in reversed(copies):  # each asks again, as a command that waited does
            replies = await quorum.handover([copy])
            answers = [a for r in replies if (a := r[0]) is not None]
            assert len(answers) == 3, replies
            decided[copy.ref] = handover_decision(answers, quorum.majority, copy.ref)
        assert decided == {refs[0]: "act", refs[1]: "skip", refs[2]: "skip"}
    finally:
        await quorum.close()
