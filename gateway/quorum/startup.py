"""Start-up: wait until a majority of members answers, then refuse members that are
one redis-server (gateway/quorum/identity.py) and decide every claim path.

Waiting, it names every member that does not answer in one WARNING line at a
falling rate (`FallingReport`); it refuses to start when the URL's credentials are
refused and too few answer for a majority."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import RedisError

from gateway.errors import ConfigError, CredentialsRefused
from gateway.quorum.identity import describe, run_id_of, shared
from gateway.quorum.link import MemberLink
from gateway.waits import FallingReport, wait_or_stop

logger = logging.getLogger(__name__)


class MajorityWait:
    """The start-up wait of one quorum's members."""

    def __init__(
        self, members: Sequence[MemberLink], majority: int, timeout: float,
        refresh_epochs: Callable[[bool], Awaitable[None]],
        choose_claim: Callable[[MemberLink, bool], Awaitable[None]],
    ) -> None:  # fmt: skip
        self.members = list(members)
        self.size = len(self.members)
        self.majority = majority
        self.timeout = timeout  # `[redis] timeout`, seconds
        self.refresh_epochs = refresh_epochs  # (patient)
        self.choose_claim = choose_claim  # (member, at_start)

    async def wait(self, stop: asyncio.Event, retry_s: float, report_max_s: float) -> None:
        """Return once a majority answers; read every epoch; name every member that
        does not answer.

        Tries every `retry_s` (a member that comes back is used at once), but says
        so in one WARNING line at a falling rate (`FallingReport`: at once, then
        after 2, 4, 8 ... seconds, at most every `report_max_s`). Raises
        `CredentialsRefused` when members refuse the URL's credentials and too few
        answer for a majority (with a majority answering, it serves, an ERROR per
        member refusing); `ConfigError` when members that answer are one
        redis-server (the same run_id).
        """
        report = FallingReport(retry_s, report_max_s)
        while not stop.is_set():
            await self.refresh_epochs(True)
            # After the round, `failure` is set exactly on the members that did not answer.
            failed = {member.name: member.failure for member in self.members if member.failure}
            refused = [f"{name} ({detail})" for name, (kind, detail) in failed.items()
                       if kind == "auth"]  # fmt: skip
            answering = self.size - len(failed)
            if refused and answering < self.majority:
                raise CredentialsRefused(
                    "redis.nodes: credentials refused by "
                    + ", ".join(refused)
                    + "; check the user and password in these URLs"
                )
            down = [f"{name} ({kind}: {detail})" for name, (kind, detail) in failed.items()]
            names = {"redis": ", ".join(failed)}
            if answering >= self.majority:
                await self.refuse_one_server()
                await asyncio.gather(*(self.choose_claim(i, True)
                                       for i in self.members if i.up))  # fmt: skip
                for name, (kind, detail) in failed.items():
                    if kind == "auth":  # a password rotated on one member: serve, say so
                        logger.error("Redis member %s refuses the URL's credentials (%s): "
                                     "serving without it; fix its user and password",
                                     name, detail, extra={"redis": name})  # fmt: skip
                if down:
                    logger.warning("serving with Redis members unreachable: %s",
                                   ", ".join(down), extra=names)  # fmt: skip
                return
            if report.due():
                logger.warning(
                    "cannot reach a Redis majority (%d of %d needed, %d answer); unreachable: "
                    "%s; not ready, retrying every %gs (next report in %gs)",
                    self.majority, self.size, self.size - len(failed), ", ".join(down),
                    retry_s, report.every, extra=names,
                )  # fmt: skip
            await wait_or_stop(stop, retry_s)

    async def refuse_one_server(self) -> None:
        """Raise ConfigError when members that answer are one redis-server
        (gateway/quorum/identity.py)."""

        async def info(member: MemberLink) -> object:
            # Not `timed`: an ACL without INFO must not count the member as failing.
            try:
                return await asyncio.wait_for(member.client.info("server"), self.timeout)
            except (TimeoutError, RedisError, OSError):
                return None  # cannot tell: not refused

        named = [i.name for i in self.members if i.up and not i.cluster]
        infos = await asyncio.gather(*(info(i) for i in self.members if i.name in named))
        groups = shared(dict(zip(named, map(run_id_of, infos), strict=True)))
        if groups:
            raise ConfigError(describe(groups))
