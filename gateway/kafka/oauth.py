"""OAUTHBEARER tokens for the gateway's aiokafka clients (`[kafka.client]`).

aiokafka asks a token provider for a token at each connection's SASL
handshake. Three sources, one of them set (gateway/client_properties.py):
- `sasl.oauthbearer.token`: a static token (tests, short jobs);
- `sasl.oauthbearer.token.file`: a file read at each handshake, so a token
  rotated in place (a Kubernetes projected token, a sidecar's output) is picked up;
- `sasl.oauthbearer.token.command`: a command (split like a shell would, not run
  by one) whose standard output is the token, run at each handshake.
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

from aiokafka.abc import AbstractTokenProvider

from gateway.client_properties import TOKEN_COMMAND, TOKEN_FILE, TOKEN_STATIC, ClientValue

COMMAND_TIMEOUT_S = 30.0


class TokenError(Exception):
    """No token could be had from the configured source."""


class StaticToken(AbstractTokenProvider):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, token: str) -> None:
        self._token = token

    async def token(self) -> str:
        return self._token


class FileToken(AbstractTokenProvider):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, path: Path) -> None:
        self.path = path

    async def token(self) -> str:
        try:
            text = await asyncio.to_thread(self.path.read_text)
        except OSError as exc:
            raise TokenError(f"{TOKEN_FILE} {self.path}: {exc}") from None
        if not text.strip():
            raise TokenError(f"{TOKEN_FILE} {self.path} is empty")
        return text.strip()


class CommandToken(AbstractTokenProvider):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, command: str) -> None:
        self.argv = shlex.split(command)

    async def token(self) -> str:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise TokenError(f"{TOKEN_COMMAND} took over {COMMAND_TIMEOUT_S:.0f}s") from None
        if proc.returncode != 0 or not out.strip():
            # Its output is not shown: a token command's stderr can echo the credential.
            raise TokenError(
                f"{TOKEN_COMMAND} exited {proc.returncode} with "
                f"{'no token' if proc.returncode == 0 else 'an error'} ({len(err)} bytes on "
                "stderr, not shown: run the command by hand to see them)"
            )
        return out.decode().strip()


def token_provider(properties: dict[str, ClientValue]) -> AbstractTokenProvider | None:
    """The provider `properties` name, or None when they name no token source."""
    if TOKEN_STATIC in properties:
        return StaticToken(str(properties[TOKEN_STATIC]))
    if TOKEN_FILE in properties:
        return FileToken(Path(str(properties[TOKEN_FILE])))
    if TOKEN_COMMAND in properties:
        return CommandToken(str(properties[TOKEN_COMMAND]))
    return None
