"""Every Redis key and value shape, in one place.

A mark is `<prefix><digest>` -> `<owner token>`, with a TTL (the dedup window):
- the digest is BLAKE2b-96 of the message id, so an id of any length costs 12
  bytes of key (collision odds for 10^9 live ids: about 6e-12);
- the owner token names the source record that claimed the id: a 63-bit
  BLAKE2b of `topic/partition/offset/attempt`, written in decimal so Redis
  stores it as an integer inside the value object (no separate string).
A replay of the same source record computes the same token, so it is
recognised as the owner instead of being dropped as a duplicate.
"""

from __future__ import annotations

from hashlib import blake2b

DIGEST_BYTES = 12


def mark_key(prefix: bytes, message_id: bytes) -> bytes:
    return prefix + blake2b(message_id, digest_size=DIGEST_BYTES).digest()


def owner_token(topic: str, partition: int, offset: int, attempt: int = 1) -> str:
    """Token of the source record (and attempt) that owns a mark; what a release presents."""
    source = f"{topic}/{partition}/{offset}/{attempt}".encode()
    return str(int.from_bytes(blake2b(source, digest_size=8).digest(), "big") >> 1)


def dead_token(topic: str, partition: int, offset: int) -> str:
    """The owner a dead-lettered record's mark is handed to (attempt 0 is never used)."""
    return owner_token(topic, partition, offset, attempt=0)


def handover_key(mark: bytes) -> bytes:
    """Side key naming the failure command that last handed `mark` over."""
    return mark + b":h"


def source_ref(topic: str, partition: int, offset: int) -> str:
    """The `dedup-source` header value."""
    return f"{topic}/{partition}/{offset}"


def parse_source_ref(ref: str) -> tuple[str, int, int]:
    """Inverse of `source_ref`; raises ValueError on anything else."""
    topic, partition, offset = ref.rsplit("/", 2)
    if not topic:
        raise ValueError(f"no topic in source reference {ref!r}")
    return topic, int(partition), int(offset)
