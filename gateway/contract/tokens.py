"""Owner tokens: which source record (and attempt) owns a mark; what a release presents."""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b

_TOKEN_MASK = 2**63 - 1


_OFFSET_STEP = 0x9E3779B97F4A7C15  # odd (2^64 / golden ratio): spreads neighbouring offsets


def owner_token(topic: str, partition: int, offset: int, attempt: int = 1) -> str:
    """Token of the source record (and attempt) that owns a mark; what a release presents."""
    return owner_tokens(topic, partition, (offset,), attempt)[0]


def owner_tokens(topic: str, partition: int, offsets: Iterable[int], attempt: int = 1) -> list[str]:
    """`owner_token` of each offset of one partition: the one definition of a token."""
    source = f"{topic}/{partition}/{attempt}".encode()
    base = int.from_bytes(blake2b(source, digest_size=8).digest(), "big")
    return [str((base + offset * _OFFSET_STEP) & _TOKEN_MASK) for offset in offsets]


def dead_token(topic: str, partition: int, offset: int) -> str:
    """The owner a dead-lettered record's mark is handed to (attempt 0 is never used)."""
    return owner_token(topic, partition, offset, attempt=0)


TOMBSTONE = "-"  # a released mark's value is TOMBSTONE + the token it was released from


def is_released(owner: str) -> bool:
    """A released mark's value, `-<token>` (see the module docstring)."""
    return owner.startswith(TOMBSTONE)


DIGEST_BYTES = 12


def mark_digest(message_id: bytes) -> bytes:
    """The field a message id's mark is stored under."""
    return blake2b(message_id, digest_size=DIGEST_BYTES).digest()


def mark_digests(message_ids: Iterable[bytes]) -> list[bytes]:
    """`mark_digest` of each id (inline: a call per id was a tenth of the cost)."""
    return [blake2b(i, digest_size=DIGEST_BYTES).digest() for i in message_ids]
