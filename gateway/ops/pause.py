"""`dedup-gateway pause MEMBER` / `resume MEMBER`: take a member out of the vote and back."""

from __future__ import annotations

from gateway.config import Settings
from gateway.ops.command_quorum import command_quorum
from gateway.ops.output import Output, print_json


async def set_paused(
    settings: Settings, member: str, paused: bool, *, force: bool = False,
    output: Output = "text",
) -> int:  # fmt: skip
    """Pause `member` (every gateway stops counting it and sending it claims at its
    next call, gateway/quorum/quorum.py) or resume it. A pause that would leave fewer than
    a majority of trusted members answering is refused unless `force`: every
    partition would block. Exit code 0 done, 1 refused or some key group did not
    answer (run it again), 2 no such member."""
    quorum = command_quorum(settings.redis)  # a cluster member takes a call per key group
    try:
        await quorum.refresh_epochs()
        target = next((i for i in quorum.members if i.name == member), None)
        names = [i.name for i in quorum.members]
        if target is None:
            print(f"no member {member!r}; members: {', '.join(names)}")
            return 2
        others = [i.name for i in quorum.members if i is not target and i.up and i.trusted
                  and not i.paused]  # fmt: skip
        if paused and len(others) < quorum.majority and not force:
            done, why = (
                False,
                (
                    f"refused: only {len(others)} other members are up and trusted "
                    f"({', '.join(others) or 'none'}), fewer than a majority ({quorum.majority}); "
                    "every partition would block (--force to pause anyway)"
                ),
            )
        else:
            done = await quorum.admin.pause(target, paused)
            why = "" if done else "some key groups did not answer: run it again"
    finally:
        await quorum.close()
    verb = "paused" if paused else "resumed"
    if output == "json":
        print_json({"member": member, "paused": paused, "done": done, "error": why})
    else:
        print(f"{member}: {verb}" if done else f"{member}: NOT {verb}: {why}")
    return 0 if done else 1
