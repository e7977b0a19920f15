"""Every Redis key and value shape, in one place.

A mark says "this id was claimed by that source record": the digest of the id
mapped to an owner token. Marks are stored in hash buckets, not one key each:

    <prefix>m:<slice>:<shard>   hash   field <digest>  ->  value <owner token>
    <prefix>slice               hash   id -> current slice, ends -> its end (ms),
                                       buckets:<slice> -> that slice's bucket count
    <prefix>h:<digest>          string the failure command that last handed
                                       the mark over (the failure loop only)

- The digest is BLAKE2b-96 of the message id, so an id of any length costs 12
  bytes (collision odds for 10^9 live ids: about 6e-12).
- The owner token names the source record that claimed the id: a 63-bit
  BLAKE2b of `topic/partition/offset/attempt`, in decimal, which a hash stores
  as an 8-byte integer. A replay of the same source record computes the same
  token, so it is recognised as the owner instead of being dropped.
- Why buckets: a key per mark costs ~140 bytes in Redis (two dict entries,
  the key, the value object, the expiry entry; bench/RESULTS.md, naive-3); a
  small hash stores a field and its value in a listpack, under 45 bytes per
  mark with the hash's own share (tests/integration/test_marks.py). Redis 7.0 has no per-field TTL,
  so marks are grouped by time instead: each instance cuts its own clock into
  slices of ttl/SLICES_BACK; a slice's buckets expire `ttl` after the slice
  ends, so a mark lives between ttl and ttl*(1 + 1/SLICES_BACK). A lookup
  searches the current slice and the SLICES_BACK before it; the one before
  those ended at least ttl ago, so its buckets are gone.
- `shard` is the digest's first 3 bytes modulo `[redis] buckets`. A slice
  keeps the `buckets` and length it opened with (in `<prefix>slice`), so a
  changed setting takes effect at the next slice and hides no live mark.
  Redis keeps a hash compact up to `hash-max-listpack-entries` fields (512 by
  default); past that a bucket turns into a hash table: still correct, at
  60-110 bytes per mark. docs/operations.md sizes `buckets`.
"""

from __future__ import annotations

from hashlib import blake2b

DIGEST_BYTES = 12


def mark_digest(message_id: bytes) -> bytes:
    """The field a message id's mark is stored under."""
    return blake2b(message_id, digest_size=DIGEST_BYTES).digest()


def owner_token(topic: str, partition: int, offset: int, attempt: int = 1) -> str:
    """Token of the source record (and attempt) that owns a mark; what a release presents."""
    source = f"{topic}/{partition}/{offset}/{attempt}".encode()
    return str(int.from_bytes(blake2b(source, digest_size=8).digest(), "big") >> 1)


def dead_token(topic: str, partition: int, offset: int) -> str:
    """The owner a dead-lettered record's mark is handed to (attempt 0 is never used)."""
    return owner_token(topic, partition, offset, attempt=0)


def handover_key(prefix: bytes, digest: bytes) -> bytes:
    """Side key naming the failure command that last handed a mark over."""
    return prefix + b"h:" + digest


def source_ref(topic: str, partition: int, offset: int) -> str:
    """The `dedup-source` header value."""
    return f"{topic}/{partition}/{offset}"


def parse_source_ref(ref: str) -> tuple[str, int, int]:
    """Inverse of `source_ref`; raises ValueError on anything else."""
    topic, partition, offset = ref.rsplit("/", 2)
    if not topic:
        raise ValueError(f"no topic in source reference {ref!r}")
    return topic, int(partition), int(offset)
