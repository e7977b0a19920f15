"""`dedup-gateway release ID`: release one id's mark on every member, as the gateway would."""

from __future__ import annotations

from gateway.config import Settings
from gateway.contract.replies import (
    HELD_BY_ANOTHER,
    NO_LIVE_MARK,
    RELEASED,
    RELEASED_BEFORE,
    RELEASED_NOW,
)
from gateway.contract.tokens import TOMBSTONE, is_released, mark_digest
from gateway.ops.command_quorum import command_quorum
from gateway.ops.output import Output, id_fields, per_member, print_json, table
from gateway.quorum.admin import MarkView
from gateway.rules.commands import release_decision


async def release(
    settings: Settings,
    message_id: bytes,
    token: str | None,
    *,
    dry_run: bool = False,
    output: Output = "text",
) -> int:
    """Release the id's mark: only where it holds `token` when given, else whoever holds it.

    The mark becomes a tombstone (`-<token>`, gateway/quorum/keys.py): the next copy
    is new, a replay of the released source record is not. Exit code 0 when the
    gateway would count it released (failures.release_decision: free on a majority,
    released on one at least; with `dry_run`: would be), 1 otherwise.
    """
    quorum = command_quorum(settings.redis)
    digest = mark_digest(message_id)
    try:
        if dry_run:
            views = await quorum.admin.inspect(digest)
            results: list[int | str | None] = [
                None if v is None else would_release(v, token) for v in views
            ]
        elif token is not None:
            replies = await quorum.release([digest], [token])
            results = [r[0] for r in replies]
        else:
            results = await quorum.admin.delete(digest)
    finally:
        await quorum.close()
    deleted, unmarked = sum(1 for r in results if r in RELEASED), results.count(NO_LIVE_MARK)
    answers = [r for r in results if r is not None]
    ok = release_decision(answers, quorum.majority).released
    states = [_release_state(r, dry_run, token is not None) for r in results]
    names = [member.name for member in quorum.members]
    if output == "json":
        members = [{"member": n, "result": s} for n, s in zip(names, states, strict=True)]
        print_json({
            **id_fields(message_id), "token": token, "dry_run": dry_run,
            **per_member(members), "deleted": deleted, "no_mark": unmarked,
            "size": quorum.size, "majority": quorum.majority, "released": ok,
        })  # fmt: skip
        return 0 if ok else 1
    print(table(("member", "result"), list(zip(names, states, strict=True))))
    verb = "would be released" if dry_run else "released"
    free = f" (no live mark on {unmarked})" if unmarked else ""
    print(f"{verb} on {deleted} of {quorum.size} members{free}: {'ok' if ok else 'NOT released'}")
    return 0 if ok else 1


def would_release(view: MarkView, token: str | None) -> int:
    """What a release from `token` (scripts.RELEASE), or without one (DELETE), would
    answer on this member: 1 release now, 2 released before from that token, 3 no
    live mark, 0 not (held by another owner; without a token: absent or released)."""
    if token is None:
        return int(view.owner is not None and not is_released(view.owner))
    if view.owner is None:
        return NO_LIVE_MARK
    if view.owner == token:
        return RELEASED_NOW
    return RELEASED_BEFORE if view.owner == TOMBSTONE + token else HELD_BY_ANOTHER


def _release_state(result: int | str | None, dry_run: bool, with_token: bool) -> str:
    if result is None:
        return "no answer"
    if result == RELEASED_BEFORE:
        return "released before (from that token)"
    if result == NO_LIVE_MARK:
        return "no live mark"
    if result:
        return "would release" if dry_run else "released"
    return "held by another owner" if with_token else "absent / released before"
