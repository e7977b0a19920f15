"""How a Redis call's failure is classified (pure: the call is a stand-in)."""

from __future__ import annotations

import pytest

from devtools.harness import counter_value
from gateway.config import load_settings
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum


def quorum() -> Quorum:
    # Nothing listens there; no connection is made, the calls below are stand-ins.
    return Quorum(load_settings(redis={"nodes": ["redis://127.0.0.1:1/0"]}).redis, Metrics())


async def test_a_write_to_a_connection_the_server_closed_counts_as_no_answer() -> None:
    q = quorum()
    (member,) = q.members

    async def closed_under_the_handshake() -> None:
        # What uvloop raises, and redis-py passes on, when a reconnect's HELLO meets a
        # member that closed the connection (a chaos schedule's restart-empty).
        raise RuntimeError(
            "unable to perform operation on <TCPTransport closed=True reading=False "
            "0x5592715ce330>; the handler is closed"
        )

    assert await member.timed("claim", closed_under_the_handshake) is None
    assert member.failure is not None and member.failure[0] == "connection"
    assert counter_value(q.metrics.redis_errors, member.name, "connection") == 1
    await q.close()


async def test_any_other_runtime_error_is_a_bug_and_is_raised() -> None:
    q = quorum()
    (member,) = q.members

    async def bug() -> None:
        raise RuntimeError("something of ours")

    with pytest.raises(RuntimeError, match="something of ours"):
        await member.timed("claim", bug)
    await q.close()
