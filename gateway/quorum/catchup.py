"""A member that is only behind is caught up by the gateways themselves.

A member *behind* kept its data (its epoch is `trusted`) but missed marks: a
gateway run that held them as fills stopped (its note, gateway/quorum/behind.py,
is stale: not written again for `STALE_AFTER` refreshes), or this run dropped
fills for it (a full `repair_backlog`). Every mark it missed is on the members
that answered those votes, which are counted. So the quorum's watch (every
`[redis] ping_interval`) starts a catch-up of such a member, one at a time:

1. Take the member's lease (`<prefix>catch-up`, on the member: one gateway at a
   time; renewed after every EXPORT call and before every IMPORT call, given up
   at the end). Its clock then is the cut-off: the notes covered are those
   written up to it.
2. Copy every live mark of the counted members into it (gateway/quorum/copy.py;
   members this run holds fills for, or dropped some for, are no source), at
   most `MARKS_PER_S`, counted in `dedup_gateway_catchup_marks_total`, a log line
   every `LOG_EVERY_S`.
3. Make the stale runs' notes about it void on it (and forget them on the
   others); forget this run's own drop if none happened since step 1. Read the
   epochs again: it is counted again, unless a live run still holds fills for
   it (that run sends them and clears its own note).

A member that lost its data (its epoch `recovering`) is not caught up: it lacks
every mark, not just some, and `dedup-gateway rebuild` (or 2 x ttl) completes it.
A catch-up that fails (a source or the member stops answering, its epoch changes,
the lease is lost) is logged and counted, and tried again at a later watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from gateway.metrics import Metrics
from gateway.quorum.admin import Admin
from gateway.quorum.behind import Behind, ForgetError
from gateway.quorum.copy import Copied, CopyError, copy_marks
from gateway.quorum.keys import EPOCH_TRUSTED
from gateway.quorum.link import MemberLink, Trust

logger = logging.getLogger(__name__)

# The rate a catch-up copies at (marks read per second): bounded, so that it costs
# the members little beside the data path (an EXPORT call reads up to 2,000).
MARKS_PER_S = 20_000
LEASE_MS = 30_000  # renewed after every call; a stopped gateway's lapses
LOG_EVERY_S = 10.0
RETRY_S = 5.0  # after a catch-up that failed


class CatchUp:
    """The catch-up of members that are behind, one at a time (the quorum's watch starts it)."""

    def __init__(
        self, members: Sequence[MemberLink], behind: Behind, admin: Admin, metrics: Metrics,
        refresh_epochs: Callable[[], Awaitable[None]],
    ) -> None:  # fmt: skip
        self.members = list(members)
        self.behind = behind
        self.admin = admin  # the copy's calls (gateway/quorum/copy.py)
        self.metrics = metrics
        self.refresh_epochs = refresh_epochs  # after a catch-up: it is counted again
        self.task: asyncio.Task[None] | None = None
        self.not_before = 0.0  # monotonic: no catch-up starts before (one failed)

    def due(self) -> MemberLink | None:
        """A member to catch up now, if any (and a source to copy from)."""
        if (self.task is not None and not self.task.done()) or time.monotonic() < self.not_before:
            return None
        for member in self.members:
            if self._behind(member) and self.sources(member):
                return member
        return None

    def _behind(self, member: MemberLink) -> bool:
        kept = member.epoch is not None and member.epoch.state == EPOCH_TRUSTED
        missed = bool(member.stale) or self.behind.lacks(member.name)
        return (
            member.up and not member.paused and kept and member.trust is Trust.RECOVERING and missed
        )

    def sources(self, member: MemberLink) -> list[MemberLink]:
        """The counted members that hold every mark they were given, as far as this
        run knows: none it holds fills for or dropped some for."""
        return [s for s in self.members
                if s is not member and s.up and s.counted and not s.backlog and not s.sending
                and not self.behind.lacks(s.name)]  # fmt: skip

    def start(self) -> None:
        """Start catching up the member that is due, if any."""
        member = self.due()
        if member is not None:
            self.task = asyncio.create_task(self._guarded(member), name=f"catch-up {member.name}")

    async def _guarded(self, member: MemberLink) -> None:
        try:
            await self.run(member)
        except Exception:  # a bug here must not stop the gateway: logged, tried again later
            self.not_before = time.monotonic() + RETRY_S
            self.metrics.catchups.labels(member.name, "failed").inc()
            logger.exception("catching Redis member %s up failed", member.name,
                             extra={"redis": member.name})  # fmt: skip

    async def run(self, member: MemberLink) -> bool:
        """Catch `member` up; whether it was (False: another gateway holds its lease, or
        the copy failed and is tried again later)."""
        behind, metrics = self.behind, self.metrics
        cut_off = await behind.lease(member, LEASE_MS)
        if not cut_off:
            return False
        stale, dropped_at = sorted(member.stale), behind.dropped.get(member.name)
        sources = self.sources(member)
        epoch = member.epoch
        if epoch is None or not sources:
            await behind.unlease(member)
            return False
        started = time.monotonic()
        copied = Copied()
        logged = [started]
        why = (f"stopped gateway run(s) {', '.join(stale)} held fills for it" if stale
               else "this gateway run dropped fills for it")  # fmt: skip
        logger.warning(
            "Redis member %s is behind (%s): catching it up from %s, at most %d marks/s",
            member.name, why, ", ".join(s.name for s in sources), MARKS_PER_S,
            extra={"redis": member.name},
        )  # fmt: skip

        async def advance(found: int, fraction: float) -> None:
            metrics.catchup_marks.labels(member.name).inc(found)
            now = time.monotonic()
            if now - logged[0] >= LOG_EVERY_S:
                logged[0] = now
                logger.info("catching Redis member %s up: %d marks read, about %d%% done",
                            member.name, copied.marks_read, fraction * 100,
                            extra={"redis": member.name})  # fmt: skip
            await asyncio.sleep(found / MARKS_PER_S)
            await renew()

        async def renew() -> None:
            # After every EXPORT call and before every IMPORT call: a gateway stalled
            # between them (a pause, a long GC) finds its lease gone rather than write
            # what it read before (IMPORT leaves what changed since its lookup anyway).
            if not await behind.lease(member, LEASE_MS):
                raise CopyError("its lease was lost (another gateway took it over?)")

        metrics.catchup_running.labels(member.name).set(1)
        try:
            await copy_marks(self.admin, member, epoch.id, sources, copied, advance,
                             before_import=renew)  # fmt: skip
            if stale:
                await behind.forget(member, stale, cut_off)
        except (CopyError, ForgetError) as exc:
            self.not_before = time.monotonic() + RETRY_S
            metrics.catchups.labels(member.name, "failed").inc()
            logger.warning("catching Redis member %s up failed (%s): tried again in %gs",
                           member.name, exc, RETRY_S, extra={"redis": member.name})  # fmt: skip
            return False
        finally:
            metrics.catchup_running.labels(member.name).set(0)
            await behind.unlease(member)
        if dropped_at is not None and behind.dropped.get(member.name) == dropped_at:
            del behind.dropped[member.name]
        metrics.catchups.labels(member.name, "done").inc()
        logger.warning(
            "Redis member %s caught up in %.1fs: %d marks read from %s, %d written, %d "
            "rewritten, %d already there, %d changed there meanwhile (left as written)",
            member.name, time.monotonic() - started, copied.marks_read,
            ", ".join(s.name for s in sources), copied.written, copied.rewritten,
            copied.already_there, copied.changed, extra={"redis": member.name},
        )  # fmt: skip
        await self.refresh_epochs()
        return True

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
