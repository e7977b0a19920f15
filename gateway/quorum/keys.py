"""Every Redis key and value shape, in one place.

A mark says "this id was claimed by that source record": the digest of the id
mapped to an owner token. Marks are stored in hash buckets, not one key each:

    <prefix>m:<slice>:<shard>   hash   field <digest>  ->  value <owner token>
    <prefix>slice               hash   id -> current slice, ends -> its end (ms),
                                       buckets:<slice> -> that slice's bucket count
                                       when it opened, grown:<slice> -> its
                                       count now (absent: no split), marks:<slice>
                                       -> the marks its claims added (below)
                                       first -> the oldest slice id that may hold
                                       marks (absent: 1; lower after a rebuild),
                                       expires:<slice> -> the latest expiry (ms)
                                       its buckets were given (for the current
                                       slice: what its ledger's bits stand for),
                                       live -> `<id>:<older ids>,`, the older
                                       slices to search (below)
    <prefix>x:<slice>           string the slice's expiry ledger: bit i set
                                       when bucket i has its expiry (below)
    <prefix>h:<digest>          string the failure command that last handed
                                       the mark over (the failure loop only)
    <prefix>epoch               string `<id>:<since_ms>:<trusted|recovering>`,
                                       which data this member holds (below)
    <prefix>paused              string present while `dedup-gateway pause`
                                       holds the member: writing scripts refuse
    <prefix>behind              hash   `<member>|<gateway run id>` -> until (ms):
                                       that run holds fills for that other
                                       member (gateway/quorum/behind.py)
    <prefix>behind-at           hash   the same fields -> `<written ms>:<stale
                                       after ms>`: a note not written again
                                       that long is its stopped run's
    <prefix>caught-up           hash   `<run id>` (or `*`) -> cut-off (ms): that
                                       run's notes about this member written
                                       up to then are void (a catch-up or a
                                       rebuild completed it; catchup.py)
    <prefix>catch-up            string the gateway run catching this member
                                       up (its lease, a few seconds' life)

On a Redis Cluster member every key above lives once per key group, with
`<prefix>{<k>.<groups>}` in place of `<prefix>` (gateway/quorum/members.py): a
group's keys share one hash slot. Group 0's epoch is the member's; every
group holds a copy (so a claim checks its own group's), and
`<prefix>{0.<groups>}epoch-spread` names the epoch id once every group had
it: after that, a group without it lost its data, and the whole member is
given a new, recovering epoch (gateway/quorum/epochs.py, `_spread`).

- The digest is BLAKE2b-96 of the message id, so an id of any length costs 12
  bytes (collision odds for 10^9 live ids: about 6e-12).
- The owner token names the source record that claimed the id: a 63-bit
  number in decimal (a hash stores it as an 8-byte integer): the BLAKE2b of
  `topic/partition/attempt` plus the offset times an odd constant, modulo
  2^63. A replay of the same source record computes the same token in any
  process, so it is recognised as the owner instead of being dropped. Within
  one partition and attempt, distinct offsets give distinct tokens (an odd
  multiplier is invertible modulo 2^63); across partitions the hashed base
  makes a clash as unlikely as a 63-bit hash's. The hash is taken once per
  partition batch, so a token costs a multiply and an add. (Tokens were a
  BLAKE2b of `topic/partition/offset/attempt` up to commit 240535d: marks set
  by such a deployment are recognised as their owner's only until they
  expire, i.e. a record replayed across the upgrade is forwarded again.)
- A released mark (`release`, the failure loop's release mode, `redrive`)
  is not deleted: it holds `-<token>` of the owner it was released from. Any
  other copy claims it as if it were absent (its claim answers `=<token>`, so
  the vote knows that token is released, gateway/rules/vote.py), but a replay of the released
  source record (same token: a gateway that re-reads its uncommitted batch
  after a crash or rebalance) is a duplicate of `-<token>`. Deleting it
  instead let that replay take the id back under the old token, which the
  Spark job drops as a re-delivery, so the id was never processed (found by
  the chaos schedule, seed 8). It costs what a mark costs, until its bucket
  expires.
- Why buckets: a key per mark costs ~140 bytes in Redis (two dict entries,
  the key, the value object, the expiry entry; bench/RESULTS.md, naive-3); a
  small hash stores a field and its value in a listpack, under 45 bytes per
  mark with the hash's own share (tests/integration/test_marks.py). Redis 7.0
  has no per-field TTL, so marks are grouped by time instead: each member cuts its own clock into
  slices of ttl/SLICES_BACK; a slice's buckets expire `ttl` after the slice
  ends, so a mark lives between ttl and ttl*(1 + 1/SLICES_BACK). A lookup
  searches the current slice and the older ones whose buckets still live, by
  time (SLICES_BACK is 1: slices of `ttl`, marks held 1 to 2 windows, one
  older slice searched per new id; it was 2, slices of ttl/2, until the
  benchmark in host units showed the second older lookup cost a third of a
  new id's Redis CPU, bench/RESULTS.md "The mark store, round 2"): when a
  slice opens, the previous slice and those the previous one
  searched are kept in `live` while their `expires:<slice>` is later than
  now (with an unchanged ttl, the SLICES_BACK before it; after `ttl` is
  lowered, also the slices claimed under the old ttl, until their marks
  expire: a count of slices would drop them early). A slice opened without
  `live` (by an older gateway) searches the SLICES_BACK before it.
- `shard` comes from h, the digest's first 3 bytes, by linear hashing: a slice
  opens with `buckets:<slice>` = b buckets (the marks of the slice before / 32;
  `[redis] buckets` for a member's first slice) and grows to n = `grown:<slice>`
  by splitting one bucket at a time: with m the largest b x 2^k <= n, a digest
  is in bucket h % m, or h % 2m when h % m < n - m (split already). A claim that
  takes the slice past 32 marks per bucket splits bucket n - m into itself and
  bucket n, moving the marks whose h % 2m is n (scripts.BUCKET_FILL, at most
  scripts.MAX_SPLITS per call; at most 2^24 buckets). So a bucket holds ~16-64
  marks whatever the rate or the setting: a lookup scans its bucket, and ~300
  per bucket cost twice the Redis CPU per new id. Claims split only the
  current slice, a rebuild's import whichever slice it writes (a member
  rebuilt from empty opens its slices with `buckets`); a slice's count is
  in `<prefix>slice`, so a changed setting hides no live mark. A gateway from before splits computes
  h % buckets and misses moved marks: upgrading needs every older gateway
  stopped first (docs/operations.md, "Sizing Redis"). Redis keeps a hash
  compact up to `hash-max-listpack-entries` fields (512 by default), which the
  splits keep a bucket far below. A rebuild may
  add marks to slices older than the member's own (`first`), so a copied
  mark keeps about its original lifetime.
- A bucket's expiry is checked (PTTL) the first time the current slice writes
  to it, and raised to its slice's (slice end + ttl) when lower or absent, so
  a bucket created by a claim always expires. The slice's expiry ledger
  remembers which buckets were checked, one bit each, read once per script
  call: a PTTL per new id cost about a tenth of its Redis CPU. Raising `ttl`
  starts the ledger again, so it takes effect at once for every mark written
  after it; a gateway with a lower `ttl` gives the slice's buckets the longer
  expiry. A bucket whose bit is set is never emptied (Redis would delete it,
  and a mark written there again would have no expiry): the scripts that
  remove a field from a current slice's bucket are a claim undoing the field
  it just added, which empties only a bucket it created, whose bit is unset,
  and a split that moves every mark of its bucket, which clears the bit.

Epochs: a member that restarts empty (or is flushed, or replaced) forgets
its marks; counted in a vote it would call old ids new. Its epoch key says
which data it holds: a random id, `since_ms` (the member's clock when that
data began) and a state. Gateways agree through the key itself:

- Every gateway reads all epochs at start, every `[redis] ping_interval`, and
  whenever a claim meets an epoch other than the one it expects. The scripts
  that write marks (claim, fill, handover, import) carry the expected id and
  write nothing where another id, or none, is found: the first call after a
  restart is never counted, and a member without an epoch never gains
  marks (its slice meta stays absent).
- A member without an epoch gets one (SET NX: the first gateway's wins):
  - `trusted` if it holds marks (its slice meta exists): they were written
    before epochs existed (the first start of a version with them);
  - `recovering` if it holds none while another member does, or while this
    gateway knew it by an epoch: it lost its data (restarted empty, flushed,
    replaced, or missed the first start);
  - `trusted` if no member that answers holds marks and they are a
    majority: a fresh deployment, nothing was claimed yet;
  - otherwise not yet: it is not counted, and asked again at the next read.
- A `recovering` member takes claims (so it fills up) but its answers do
  not count, until `dedup-gateway rebuild` copies the live marks into it and
  sets it `trusted`, or until 2 x ttl after `since_ms` (every mark it could
  have missed has expired everywhere); the first gateway to see that sets it
  `trusted`. The id never changes while the data lives, so a gateway that
  knows the id never mistakes a rebuilt member for a lost one.
- Not detected: a member restored from an older snapshot keeps its epoch
  (its data was not wiped) but lost its latest marks. Run Redis with AOF.
"""

from __future__ import annotations

from dataclasses import dataclass

EPOCH_TRUSTED = "trusted"
EPOCH_RECOVERING = "recovering"


def handover_key(prefix: bytes, digest: bytes) -> bytes:
    """Side key naming the failure command that last handed a mark over."""
    return prefix + b"h:" + digest


@dataclass(frozen=True)
class Epoch:
    """A member's epoch key: `<id>:<since_ms>:<state>` (see the module docstring)."""

    id: str
    since_ms: int
    state: str  # EPOCH_TRUSTED or EPOCH_RECOVERING

    @classmethod
    def parse(cls, raw: str) -> Epoch | None:
        """The epoch a key holds; None when it is not one (treated as lost data)."""
        parts = raw.split(":")
        if len(parts) != 3 or not parts[0] or not parts[1].isdigit():
            return None
        if parts[2] not in (EPOCH_TRUSTED, EPOCH_RECOVERING):
            return None
        return cls(parts[0], int(parts[1]), parts[2])

    @property
    def raw(self) -> str:
        return f"{self.id}:{self.since_ms}:{self.state}"

    def with_state(self, state: str) -> Epoch:
        return Epoch(self.id, self.since_ms, state)
