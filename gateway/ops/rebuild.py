"""`dedup-gateway rebuild MEMBER`: copy the live marks into a member that lost them.

A member that restarted empty is *recovering* (gateway/quorum/keys.py, "Epochs"):
its answers do not count until a whole mark lifetime (2 x ttl) has passed.
A rebuild shortens that to the copy time, while the gateways keep running:

1. Read every member's epoch; the member must answer and have one.
2. Copy the sources' marks into it (gateway/quorum/copy.py): read bucket by
   bucket, each digest's owner picked by the vote's rule over the sources,
   written with about the source's remaining lifetime, only where the member
   still holds what the copy looked up there (a gateway's claim meanwhile
   stays). Every call names the member's epoch: if it lost its data again
   meanwhile, the rebuild stops.
3. Set the member's epoch `trusted` (compare-and-set on the epoch read in 1),
   and make every gateway run's note that it is behind, written before the
   rebuild began, void on it (gateway/quorum/behind.py): a member that held
   such a note and was down or hung meanwhile does not bring it back. Gateways
   count it again at their next epoch read (`[redis] ping_interval`).

A rebuild writes nothing else: the quorum an operator command builds gives no
member an epoch, spreads none and promotes none (gateway/ops/command_quorum.py),
so `--dry-run` writes nothing at all.

Handover notes (`<prefix>h:<digest>`, the failure loop's) are copied with the
marks they belong to (an absent one deleted): without them a replayed
failure command would be "another copy" there and "redo" on the source, and
with no third member to break that tie its partition would wait until the
note expired (chaos seed 732, two members emptied).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from gateway.config import Settings
from gateway.ops.command_quorum import command_quorum
from gateway.progress import Progress
from gateway.quorum.admin import Admin
from gateway.quorum.behind import Behind, ForgetError
from gateway.quorum.copy import Copied, CopyError, copy_marks
from gateway.quorum.keys import EPOCH_TRUSTED
from gateway.quorum.link import MemberLink

OK, FAILED, USAGE = 0, 1, 2  # exit codes


@dataclass
class Report:
    member: str
    sources: list[str]
    dry_run: bool
    marks_read: int = 0  # distinct digests found on the sources
    written: int = 0  # absent on the member: added (or, dry run, would be)
    rewritten: int = 0  # held by another owner on the member: rewritten
    already_there: int = 0
    ties: int = 0  # sources split evenly: the smallest token was taken
    changed: int = 0  # written on the member by a gateway since the copy read it: left
    epoch_before: str | None = None
    epoch_after: str | None = None
    error: str | None = None


class RebuildError(Exception):
    """The rebuild cannot go on; the message says why."""


async def rebuild(
    settings: Settings, member: str, *, source: str | None, dry_run: bool, output: str,
    progress: Progress | None = None,
) -> int:  # fmt: skip
    """Copy the live marks into `member` (host:port/db, as the metrics label names it)
    from `source` (one member) or, when None, from every trusted member; then mark its
    epoch trusted. `dry_run`: count what would be copied, write nothing. `output`:
    "text" or "json"; `progress`: where marks read are counted as they go. Returns the
    exit code: 0 done, 1 failed, 2 bad arguments."""
    quorum = command_quorum(settings.redis)
    report = Report(member, [], dry_run)
    progress = progress or Progress("rebuild")
    try:
        await quorum.refresh_epochs()  # command_quorum: as patient as a first contact
        parts = Parts(quorum.members, quorum.admin, quorum.behind)
        code = await _rebuild(parts, report, source, progress)
    except (RebuildError, CopyError, ForgetError) as exc:
        report.error, code = str(exc), FAILED
    finally:
        await quorum.close()
        progress.finish()
    _print(report, "json" if output == "json" else "text")
    return code


@dataclass(frozen=True)
class Parts:
    """What a rebuild works with: the members (their epochs read), the calls on one
    member (copy, epoch), the notes about a member."""

    members: Sequence[MemberLink]
    admin: Admin
    behind: Behind


async def _rebuild(parts: Parts, report: Report, source: str | None, progress: Progress) -> int:
    names = [member.name for member in parts.members]
    target = _named(parts.members, report.member)
    if target is None:
        report.error = f"no member {report.member!r}; members: {', '.join(names)}"
        return USAGE
    if source is not None:
        chosen = _named(parts.members, source)
        if chosen is None or chosen is target:
            report.error = f"--from must be another member, one of: {', '.join(names)}"
            return USAGE
        if not chosen.up:
            raise RebuildError(f"source {chosen.name} does not answer")
        sources = [chosen]
    else:
        sources = [i for i in parts.members if i is not target and i.up and i.trusted]
        if not sources:
            hint = _from_hint(parts.members, target)
            raise RebuildError("no trusted member to copy from; " + hint)
    report.sources = [s.name for s in sources]
    if not target.up or target.epoch is None or not (target.epoch.id or report.dry_run):
        raise RebuildError(f"{target.name} does not answer or has no epoch yet; try again")
    epoch = target.epoch
    report.epoch_before = epoch.raw
    began_ms = await parts.behind.clock(target)  # notes written up to now are covered
    if began_ms is None:
        raise RebuildError(f"{target.name} stopped answering")
    copied = Copied()

    async def advance(found: int, fraction: float) -> None:
        progress.advance(found, fraction)

    try:
        await copy_marks(parts.admin, target, epoch.id, sources, copied, advance, report.dry_run)
    finally:
        report.marks_read, report.written, report.rewritten = (
            copied.marks_read, copied.written, copied.rewritten)  # fmt: skip
        report.already_there, report.ties = copied.already_there, copied.ties
        report.changed = copied.changed
    if report.dry_run:
        report.epoch_after = epoch.raw
        return OK
    trusted = epoch.with_state(EPOCH_TRUSTED)
    if not await parts.admin.set_epoch(target, epoch, trusted):
        raise RebuildError(f"{target.name}'s epoch changed during the rebuild; run it again")
    # Complete now: every note about it written before the copy began is void on it.
    await parts.behind.forget(target, None, began_ms)
    report.epoch_after = trusted.raw
    return OK


def kept_their_data(members: Sequence[MemberLink]) -> list[str]:
    """Members not counted that kept their data (their epoch says trusted): not
    counted only because a stopped gateway run noted they missed fills, they lack
    just those; the source `--from` should name when no member is trusted."""
    return [
        i.name for i in members
        if i.up and not i.trusted and i.epoch is not None and i.epoch.state == EPOCH_TRUSTED
    ]  # fmt: skip


def _from_hint(members: Sequence[MemberLink], target: MemberLink) -> str:
    """What `--from` should name: a member that kept its data; an emptied one gives nothing."""
    kept = [name for name in kept_their_data(members) if name != target.name]
    if kept:
        return (
            f"{', '.join(kept)} kept its data (not counted: noted as behind by a stopped "
            f"gateway run, it lacks only the fills that run held); take its marks with "
            f"--from {kept[0]}"
        )
    return "name one with --from to take its marks as they are"


def _named(members: Sequence[MemberLink], name: str) -> MemberLink | None:
    return next((member for member in members if member.name == name), None)


def _print(report: Report, output: Literal["text", "json"]) -> None:
    if output == "json":
        print(json.dumps(asdict(report), sort_keys=True))
        return
    mode = " (dry run: nothing written)" if report.dry_run else ""
    print(f"rebuild {report.member} from {', '.join(report.sources) or '-'}{mode}")
    print(
        f"  marks read {report.marks_read}, written {report.written}, rewritten "
        f"{report.rewritten}, already there {report.already_there}, ties {report.ties}, "
        f"changed meanwhile {report.changed}"
    )
    print(f"  epoch {report.epoch_before} -> {report.epoch_after}")
    if report.error:
        print(f"  error: {report.error}")
