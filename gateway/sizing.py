"""How big one round trip to a quorum member is: chunk sizes and the timeout they need."""

from __future__ import annotations

# Chunks (gateway/quorum/transport.py). DIGEST_COST_US: a new id's Redis CPU with three
# slices to search, measured with bench/script_cost.py on a shared 2-core
# machine (bench/RESULTS.md, "Claim script cost"; 6-8 us with one slice), kept
# as a bound since slices last `ttl` (two live: 5.7 us, "The mark store, round 2"). A
# chunk of CHUNK_DIGESTS is then at most ~6 ms of work: Redis serves other
# clients between chunks (a pipelined chunk of 500 is about one 16 KB read of
# its input buffer, so smaller chunks would not interleave any finer).
# CHUNKS_PER_TRIP chunks share one round trip; `[redis] timeout` bounds a
# round trip and must leave TIMEOUT_MARGIN times its expected work for a
# loaded member: less than MIN_TIMEOUT_MS is refused at start.
DIGEST_COST_US = 12


CHUNK_DIGESTS = 500


CHUNKS_PER_TRIP = 4


TRIP_MS = DIGEST_COST_US * CHUNK_DIGESTS * CHUNKS_PER_TRIP // 1000


TIMEOUT_MARGIN = 5


MIN_TIMEOUT_MS = TRIP_MS * TIMEOUT_MARGIN
