"""How each member's claims run (`[redis] claim`): the native claim, a Redis module
(gateway/quorum/native), where the setting allows it and the member has it at this
gateway's version, else the Lua script. Decided once per member and said in a log
line; decided again when a member that had the module restarted without it."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from gateway.errors import ConfigError
from gateway.quorum import native
from gateway.quorum.link import MemberLink

logger = logging.getLogger(__name__)


class ClaimPaths:
    """The claim path of every member of one quorum."""

    def __init__(self, setting: str, timeout: float) -> None:
        self.setting = setting  # `[redis] claim`: lua, module or auto
        self.timeout = timeout

    async def choose(self, member: MemberLink, at_start: bool = False) -> None:
        """Decide how `member`'s claims run (`[redis] claim`), once, and say so in a log
        line: the native claim where the setting allows it and the member has the
        module at this gateway's version (gateway/quorum/native), else the Lua script.
        `module` on a member without it: ConfigError at start-up (`at_start`), an
        ERROR line and the Lua script later (a member that came back without it
        still dedups, with the same replies). A member that cannot be asked now
        (down) stays undecided: the Lua script, asked again at its next claim."""
        if member.claim_path:
            return
        setting = f'[redis] claim = "{self.setting}"'
        if self.setting == "lua" or member.cluster:
            why = setting if self.setting == "lua" else "a Redis Cluster member"
            self._use(member, "lua", why)
            return
        try:
            has, why = await asyncio.wait_for(native.loaded(member.client), self.timeout)
        except (TimeoutError, RedisError, OSError):
            return  # no answer: asked again at its next claim
        if has:
            self._use(member, "module", why)
            return
        if self.setting == "module":
            message = (
                f"{setting}: Redis member {member.name} has no native claim ({why}); load the "
                'module there (`loadmodule`, docs/operations.md, "The native claim") or set '
                'claim = "auto"'
            )
            if at_start:
                raise ConfigError(message)
            logger.error("%s; its claims run as the Lua script meanwhile", message,
                         extra={"redis": member.name})  # fmt: skip
        self._use(member, "lua", f"{setting}: {why}")

    def _use(self, member: MemberLink, path: str, why: str) -> None:
        script = member.scripts["claim"]
        lua = script.lua if isinstance(script, native.NativeClaim) else script
        member.scripts["claim"] = (
            native.NativeClaim(member.client, lua) if path == "module" else lua
        )
        member.claim_path = path
        extra = {"redis": member.name, "claim": path}
        if path == "lua":
            logger.info("Redis member %s: claims run as the Lua script (%s)", member.name, why,
                        extra=extra)  # fmt: skip
        else:
            logger.info("Redis member %s: claims run as the native module command DD.CLAIM "
                        "(%s)", member.name, why, extra=extra)  # fmt: skip

    def lost_module(self, member: MemberLink) -> None:
        """A member whose native claim was refused as an unknown command (it restarted
        without the module): the Lua script from its next claim, and decided again."""
        if member.claim_path == "module" and member.failure is not None:
            kind, detail = member.failure
            if kind == "response" and "unknown command" in detail.lower():
                logger.warning("Redis member %s no longer has the native claim (%s): its "
                               "claims run as the Lua script until it is checked again",
                               member.name, detail, extra={"redis": member.name})  # fmt: skip
                self._use(member, "lua", "the module went away")
                member.claim_path = ""
