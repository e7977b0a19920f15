"""`dedup-gateway inspect ID`: each member's view of one id's mark, and whether it
waits in a delay tier."""

from __future__ import annotations

from dataclasses import asdict

from gateway.config import Settings
from gateway.contract.records import source_ref
from gateway.contract.tokens import is_released, mark_digest
from gateway.delay.scan import Scan, find_waiting
from gateway.errors import BrokerUnreachable
from gateway.kafka.admin import reaching_broker
from gateway.ops.command_quorum import command_quorum
from gateway.ops.output import (
    Output,
    id_fields,
    per_member,
    print_json,
    table,
    ttl_text,
    when_text,
)
from gateway.progress import Progress
from gateway.quorum.admin import MarkView


async def inspect(settings: Settings, message_id: bytes, output: Output = "text") -> int:
    """Print each member's mark for `message_id`: owner token, TTL, bucket encoding."""
    quorum = command_quorum(settings.redis)
    digest = mark_digest(message_id)
    try:
        views = await quorum.admin.inspect(digest)
        fills = await quorum.slice_fill()
    finally:
        await quorum.close()
    names = [member.name for member in quorum.members]
    if output == "json":
        waiting = await _scan(settings, message_id) if settings.delay.enabled else None
        members = [{"member": name, "answered": view is not None,
                    **(asdict(view) if view is not None else {}),
                    **({"slice_marks": fill[0], "slice_buckets": fill[1]}
                       if fill is not None else {})}
                   for name, view, fill in zip(names, views, fills, strict=True)]  # fmt: skip
        print_json({
            **id_fields(message_id), "digest": digest.hex(), **per_member(members),
            "waiting": None if waiting is None else [asdict(w) for w in waiting.waiting],
        })  # fmt: skip
        return 0
    shown = id_fields(message_id)
    print(f"marks for id {shown['id']} (base64 {shown['id_b64']}, digest {digest.hex()})")
    rows = [
        [*_inspect_row(name, view), _fill_text(fill)]
        for name, view, fill in zip(names, views, fills, strict=True)
    ]
    print(table(("member", "owner token", "ttl", "bucket", "last handover by",
                 "current slice: marks per bucket"), rows))  # fmt: skip
    if settings.delay.enabled:  # scheduled delivery: a read of what waits in the tiers
        await _print_waiting(settings, message_id)
    return 0


async def _scan(settings: Settings, message_id: bytes) -> Scan:
    """The delay tiers' scan, its progress on stderr (it may read many records)."""
    progress = Progress("inspect: delay tier records read")
    try:
        async with reaching_broker(settings.kafka):
            scan = await find_waiting(settings, message_id, progress)
    except BrokerUnreachable:  # nothing read: no progress report, the one line says why
        raise
    except BaseException:
        progress.finish()
        raise
    progress.finish()
    return scan


async def _print_waiting(settings: Settings, message_id: bytes) -> None:
    scan = await _scan(settings, message_id)
    if not scan.waiting:
        print("not waiting in any delay tier")
    else:
        print(f"waiting in delay tiers ({scan.scanned} tier records read):")
        rows = [
            [w.tier, when_text(w.due_ms), when_text(w.step_ms), when_text(w.tier_at_ms),
             source_ref(w.topic, w.partition, w.offset), w.source]
            for w in scan.waiting
        ]  # fmt: skip
        print(table(("tier", "due", "next step", "in tier since", "at", "source"), rows))
    if not scan.complete:
        print("scan stopped at its limit: the tiers hold more")


def _inspect_row(name: str, view: MarkView | None) -> list[str]:
    if view is None:
        return [name, "NO ANSWER", "", "", ""]
    # bucket "listpack": compact; "hashtable": raise [redis] buckets
    owner = view.owner or "(none)"
    if is_released(owner):
        owner = f"released (was {owner[1:]})"
    return [name, owner, ttl_text(view.ttl_ms), view.encoding or "",
            view.handed_over_by or ""]  # fmt: skip


def _fill_text(fill: tuple[int, int] | None) -> str:
    """A member's current slice: its marks per bucket (~32 kept by splitting buckets)."""
    if fill is None:
        return ""
    marks, buckets = fill
    return f"{marks / buckets:.1f} ({marks:,} in {buckets:,})" if buckets else "no slice yet"
