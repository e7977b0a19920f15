"""Lua scripts, one call per instance per chunk of a batch, loaded once and called by SHA.

Marks live in hash buckets (see `gateway.keys` for the layout and why): a
mark is the field `<digest>` of `<prefix>m:<slice>:<shard>`, its value the
owner token. Every mark script starts with `PRELUDE`, which finds the slices
in force and the bucket that holds a digest. Time is the instance's own clock
(`TIME`), so all the gateways calling one instance agree on its slices.

Each script loops over its marks in order, so the marks of one call are
claimed in record order: of two copies of an id in one call, the first wins
(the gateway sends one batch's chunks to an instance in order, on one
connection, so this holds for a whole batch).

What a script costs Redis is what sizes the chunks (below): a `redis.call`
is the unit, 1-2.5 us each on the machine measured (bench/RESULTS.md, "Claim
script cost"). A new id takes one HSETNX, and one PTTL the first time its
slice writes to its bucket (the expiry ledger); each older live slice adds one HGET.

Common arguments, ARGV[1..4]: key prefix, TTL in ms, slice length in ms,
shards per slice; KEYS[1]: the slice meta, `<prefix>slice`. Every key a script
touches starts with that prefix, which for a Redis Cluster member carries
the hash tag of one key group (gateway/members.py): all of a call's keys
share one slot, and the declared key routes the call to it. Every script
starts with a `#!lua` line, so a server with script flags (Redis 7+, Valkey)
refuses a call that strays into another slot instead of running it
half-way; the read-only ones are `no-writes`.
"""

# Chunks (gateway/quorum.py). DIGEST_COST_US: a new id's Redis CPU with three
# slices to search, measured with bench/script_cost.py on a shared 2-core
# machine (bench/RESULTS.md, "Claim script cost"; 6-8 us with one slice). A
# chunk of CHUNK_DIGESTS is then at most ~6 ms of work: Redis serves other
# clients between chunks (a pipelined chunk of 500 is about one 16 KB read of
# its input buffer, so smaller chunks would not interleave any finer).
# CHUNKS_PER_TRIP chunks share one round trip; `[redis] timeout` bounds a
# round trip and must leave TIMEOUT_MARGIN times its expected work for a
# loaded instance: less than MIN_TIMEOUT_MS is refused at start.
DIGEST_COST_US = 12
CHUNK_DIGESTS = 500
CHUNKS_PER_TRIP = 4
TRIP_MS = DIGEST_COST_US * CHUNK_DIGESTS * CHUNKS_PER_TRIP // 1000
TIMEOUT_MARGIN = 5
MIN_TIMEOUT_MS = TRIP_MS * TIMEOUT_MARGIN

# The scripts below, as gateway/quorum.py registers them (the constant is the name upper-cased).
NAMES = ("claim", "fill", "repair", "release", "handover", "mark_done", "inspect", "delete",
         "export", "lookup", "import", "epoch_read", "epoch_create", "epoch_set", "epoch_copy",
         "epoch_spread", "pause", "coalesce_update", "coalesce_close")  # fmt: skip

# SLICES_BACK: slices older than the current one that may still hold live
# marks. A slice lasts ttl/SLICES_BACK and its buckets expire `ttl` after it
# ends, so every mark lives between ttl and ttl * (1 + 1/SLICES_BACK), and
# the slice before the oldest one searched has always expired (see keys.py).
SLICES_BACK = 2

# A bucket whose expiry is within this of its slice's is left as it is: PTTL is
# read a little after the script read TIME. Raising `ttl` by less is not applied.
EXPIRY_SLACK_MS = 1000

WRITES = "#!lua\n"
READS = "#!lua flags=no-writes\n"

PRELUDE = f"""
local SLICES_BACK, SLACK = {SLICES_BACK}, {EXPIRY_SLACK_MS}
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
local slice_ms, buckets = tonumber(ARGV[3]), tonumber(ARGV[4])
local meta = KEYS[1]
local fmt = string.format  -- '%d' formats a number much faster than `..` does

local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The slices to search, newest first: {{bucket name prefix, bucket count, id}}.
-- Each slice keeps the bucket count it opened with, so changing `buckets` (or
-- `ttl`) takes effect at the next slice and never hides a live mark. `first`:
-- the oldest slice that may exist (1, or lower after a rebuild copied marks).
local function slices_from(id)
  local fields = {{'first'}}
  for k = 0, SLICES_BACK do fields[#fields + 1] = 'buckets:' .. (id - k) end
  local got = redis.call('HMGET', meta, unpack(fields))
  local first, list = tonumber(got[1]) or 1, {{}}
  for k = 0, SLICES_BACK do
    if id - k < first then break end
    list[#list + 1] = {{fmt('%sm:%d:', prefix, id - k), tonumber(got[k + 2]) or buckets, id - k}}
  end
  return list
end

-- Open a new slice if the current one has ended (the instance's clock).
-- Returns the slices to search (the first one is where new marks go), when
-- the current slice's buckets expire, and now (ms since the epoch).
local function open_slice()
  local now = clock()
  local cur = redis.call('HMGET', meta, 'id', 'ends')
  local id, ends = tonumber(cur[1]) or 0, tonumber(cur[2]) or 0
  if now >= ends then
    id, ends = id + 1, now + slice_ms
    redis.call('HSET', meta, 'id', id, 'ends', fmt('%d', ends), 'buckets:' .. id, buckets)
    redis.call('HDEL', meta, 'buckets:' .. (id - SLICES_BACK - 1), 'expires:' .. (id - 1))
  end
  return slices_from(id), ends + ttl, now
end

-- The slices to search, without opening one (for scripts that only read or delete).
local function live_slices()
  return slices_from(tonumber(redis.call('HGET', meta, 'id')) or 0)
end

local function hash_of(digest)
  local a, b, c = string.byte(digest, 1, 3)
  return a * 65536 + b * 256 + c
end

-- The bucket of a digest hashed `h` in `slice`, and its index there.
local function bucket_of(slice, h)
  local index = h % slice[2]
  return fmt('%s%d', slice[1], index), index
end

-- A released mark holds '-' .. the token it was released from (a tombstone,
-- gateway/keys.py): nobody owns the id, but a replay of that same source
-- record must not take it back.
local function released(held)
  return string.byte(held, 1) == 45  -- '-'
end

-- The bucket holding `digest` and its owner, from slices[from] on, newest
-- first; nil, false if none. `h` is hash_of(digest).
local function find(slices, digest, h, from)
  for k = from, #slices do
    local bucket = bucket_of(slices[k], h)
    local held = redis.call('HGET', bucket, digest)
    if held then return bucket, held end
  end
  return nil, false
end

-- Make `bucket` expire at `at` unless it already expires then or later. A
-- bucket just created has no expiry, and one that got its expiry before `ttl`
-- was raised expires too early: a mark written now must live `ttl` (raising
-- ttl shortens nothing). Lowering ttl keeps the later expiry of marks already there.
local function expire_at(bucket, at, now)
  local left = redis.call('PTTL', bucket)
  if left < 0 or now + left < at - SLACK then redis.call('PEXPIREAT', bucket, fmt('%d', at)) end
end

-- The current slice's expiry ledger (gateway/keys.py), read once per call: a
-- bucket's expiry is checked once per slice instead of once per call (with
-- 16,384 buckets nearly every new id has a bucket of its own in a call, and
-- its PTTL was about a tenth of a new id's Redis CPU, bench/RESULTS.md). Bit i set:
-- bucket i exists and expires at `expires:<slice>` of the slice meta (less
-- SLACK) or later. That is the largest `at` any caller asked for: a gateway
-- with a lower ttl gives the buckets the longer expiry, a raised ttl starts
-- the ledger again. A bucket is only ever emptied (and so deleted by Redis)
-- in an older slice, or by a claim that just created it (its bit is 0).
local function ledger_of(slices, at)
  local id = slices[1][3]
  local key, field = fmt('%sx:%d', prefix, id), 'expires:' .. id
  local since = tonumber(redis.call('HGET', meta, field))
  if since and at <= since then
    return {{key = key, at = since, bits = redis.call('GET', key) or '', done = {{}}}}
  end
  if since then redis.call('DEL', key) end
  redis.call('HSET', meta, field, fmt('%d', at))
  return {{key = key, at = at, bits = '', done = {{}}}}
end

-- Make bucket `index` of the current slice, `bucket`, expire with its slice;
-- its expiry is read (PTTL) only if the ledger has no bit for it yet.
local function expire(ledger, bucket, index, now)
  local done = ledger.done
  if done[index] then return end
  done[index] = true
  local byte = string.byte(ledger.bits, math.floor(index / 8) + 1)
  if byte and bit.band(byte, bit.rshift(128, index % 8)) ~= 0 then return end
  expire_at(bucket, ledger.at, now)
  redis.call('SETBIT', ledger.key, index, 1)
  if ledger.bits == '' and not ledger.timed then  -- created by this call
    ledger.timed = true
    redis.call('PEXPIREAT', ledger.key, fmt('%d', ledger.at))
  end
end

-- Claim `digest` for `owner` unless a live mark holds it. Returns 1 when
-- `owner` holds it now (just claimed, or a replay of the same source record),
-- else the owner that does. HSETNX in the current slice decides a new id in
-- one call; older slices are searched only for what it claimed (and undone if
-- an older slice holds the id). A released mark is claimed by any other
-- owner, which is told so: '=' .. the released token (the vote then counts
-- that token as released on the instances the release has not reached yet,
-- gateway/vote.py). To the owner it was released from it stays released
-- ('-' .. owner: the replay is a duplicate, the next copy can still claim it).
local function claim(slices, digest, owner, now, ledger)
  local h = hash_of(digest)
  local bucket, index = bucket_of(slices[1], h)
  local held
  if redis.call('HSETNX', bucket, digest, owner) == 1 then
    local _, older = find(slices, digest, h, 2)
    if not older then
      expire(ledger, bucket, index, now)
      return 1
    end
    if released(older) and older ~= '-' .. owner then
      expire(ledger, bucket, index, now)
      return '=' .. string.sub(older, 2)
    end
    redis.call('HDEL', bucket, digest)
    held = older
  else
    held = redis.call('HGET', bucket, digest)
    if released(held) and held ~= '-' .. owner then
      redis.call('HSET', bucket, digest, owner)
      expire(ledger, bucket, index, now)
      return '=' .. string.sub(held, 2)
    end
  end
  if held == owner then return 1 end
  return held
end

-- Write a mark into the current slice, whoever held the digest there.
local function put(slices, digest, owner, now, ledger)
  local bucket, index = bucket_of(slices[1], hash_of(digest))
  redis.call('HSET', bucket, digest, owner)
  expire(ledger, bucket, index, now)
end

-- False when the instance still holds the data the caller knows (its epoch
-- starts with the id `expected`, gateway/keys.py) and is not paused; else the
-- reply that says so, 'epoch:<the epoch it holds>' or 'paused:', and the
-- script must write nothing.
local function epoch_differs(expected)
  local got = redis.call('MGET', prefix .. 'epoch', prefix .. 'paused')
  local epoch = got[1]
  if got[2] then return 'paused:' end
  if epoch and string.sub(epoch, 1, #expected + 1) == expected .. ':' then return false end
  return 'epoch:' .. (epoch or '')
end
"""

# Claim each digest for its owner, unless a live mark holds it.
# The digests travel as two blobs, not 2n arguments: the client's per-argument
# encoding was the largest cost of a call (profiled).
# ARGV[5]: the epoch id the caller expects (nothing is written if the instance
# holds another); ARGV[6]: digest length L; ARGV[7]: the n digests,
# concatenated (n*L bytes); ARGV[8]: the n owner tokens, each followed by ','.
# Reply per digest: 1 when the mark is held by that owner (just claimed, or a
# replay of the same source record), '=<token>' when it was just claimed over
# <token>'s tombstone (a released mark), otherwise the owner token that holds
# it ('-<token>' to the released record itself).
# Or, instead of a list, 'epoch:<epoch held>' when the epoch differs.
CLAIM = (
    WRITES
    + PRELUDE
    + """
local mismatch = epoch_differs(ARGV[5])
if mismatch then return mismatch end
local len, digests = tonumber(ARGV[6]), ARGV[7]
local slices, at, now = open_slice()
local ledger = ledger_of(slices, at)
local out = {}
local i = 0
for owner in string.gmatch(ARGV[8], '([^,]+),') do
  i = i + 1
  out[i] = claim(slices, string.sub(digests, (i - 1) * len + 1, i * len), owner, now, ledger)
end
return out
"""
)

# Complete the marks of an instance that gave no answer to a vote
# (gateway/quorum.py): each digest ends up held by the vote's winner where it
# is absent or released (not by the winner itself: a release that landed after
# the vote stays), or where it holds the token the unanswered claim carried (that
# claim may have run late, e.g. on an instance that hung, once it resumed);
# any other owner's mark is left as it is (the next vote that sees it repairs it).
# ARGV[5]: the epoch id the caller expects (nothing is written if the instance
# holds another); ARGV[6]: digest length L; ARGV[7]: the digests,
# concatenated; ARGV[8]: the winners, each followed by ','; ARGV[9]: the
# tokens sent, each followed by ','. Reply: marks written, or 'epoch:<epoch held>'.
FILL = (
    WRITES
    + PRELUDE
    + """
local mismatch = epoch_differs(ARGV[5])
if mismatch then return mismatch end
local len, digests = tonumber(ARGV[6]), ARGV[7]
local slices, at, now = open_slice()
local ledger = ledger_of(slices, at)
local winners, sent = string.gmatch(ARGV[8], '([^,]+),'), string.gmatch(ARGV[9], '([^,]+),')
local n = 0
for i = 1, #digests / len do
  local digest, winner, token = string.sub(digests, (i - 1) * len + 1, i * len), winners(), sent()
  local bucket, held = find(slices, digest, hash_of(digest), 1)
  if not held or (released(held) and held ~= winner and held ~= '-' .. winner) then
    put(slices, digest, winner, now, ledger)
    n = n + 1
  elseif held == token and held ~= winner then
    redis.call('HSET', bucket, digest, winner)
    n = n + 1
  end
end
return n
"""
)

# Rewrite a minority mark to the vote's winner, only if it still holds what the
# vote saw, or that owner's tombstone (its release landed after the vote: the
# next copy must not find a free id there), compare-and-set, in the bucket
# that holds it (keeping its expiry).
# ARGV[5..]: digest, owner seen, winner; per mark. Reply: marks rewritten.
REPAIR = (
    WRITES
    + PRELUDE
    + """
local slices = live_slices()
local n = 0
for i = 5, #ARGV, 3 do
  local bucket, held = find(slices, ARGV[i], hash_of(ARGV[i]), 1)
  if held and (held == ARGV[i + 1] or held == '-' .. ARGV[i + 1]) then
    redis.call('HSET', bucket, ARGV[i], ARGV[i + 2])
    n = n + 1
  end
end
return n
"""
)

# Release each mark only where it still holds the presented token
# (compare-and-set): a stale token, whose id was claimed again since, changes
# nothing. The mark becomes '-' .. token (see `claim`): the id is free for any
# other copy, while a replay of the released source record stays a duplicate.
# A mark released from that token already (a command repeated or redone; a
# vote's repair that saw the release elsewhere first) answers 2: released, not now.
# A member with no live mark (it missed the claim and its fill; expired) answers
# 3: the id is free there already, and nothing is written.
# ARGV[5..]: digest, token; per mark. Reply per mark: 1 released now, 2 released
# before, 3 no live mark, 0 held by another owner.
RELEASE = (
    WRITES
    + PRELUDE
    + """
local slices = live_slices()
local out = {}
for i = 5, #ARGV, 2 do
  local bucket, held = find(slices, ARGV[i], hash_of(ARGV[i]), 1)
  if held == ARGV[i + 1] then
    redis.call('HSET', bucket, ARGV[i], '-' .. held)
    out[#out + 1] = 1
  elseif held == '-' .. ARGV[i + 1] then
    out[#out + 1] = 2
  elseif not held then
    out[#out + 1] = 3
  else
    out[#out + 1] = 0
  end
end
return out
"""
)

# Hand a mark from a failed attempt's token to the next attempt's (retry) or
# to the dead-letter token, atomically, with a fresh TTL (it moves to the
# current slice), and note which command delivery did it in a side key, so a
# crash replay of that delivery (same failure-topic offset) redoes its effect
# while another copy of the command does nothing. A mark that expired or was
# lost, or was released, is claimed for the next attempt: nobody else holds the id.
# So is a mark still held by an earlier attempt of the same source record: this
# member missed a handover the majority made (it gave no answer then), and is
# brought up to date now. Left at 0, it tied with a member that did the handover
# while a third recovered, and the command waited forever (chaos seed 1). A mark
# held by a later attempt (or the dead letter) shows the command is stale: 5.
# KEYS[i + 1]: mark i's handover side key; ARGV[5]: the epoch id the caller
# expects (nothing is written if the instance holds another); ARGV[6]: the
# marks' digests, concatenated (equal lengths); ARGV[7..]: failed token, next
# token, command ref, the earlier attempts' tokens and the later ones (each
# token followed by a comma); per mark.
# Reply per mark (named in gateway/quorum.py): 1 handed over now, 2 handed over
# by this same command before but its effect not yet done (a replay: redo it),
# 3 handed over by another copy of the command, 4 this command's effect is
# done, 5 held by a later attempt, 0 held by another owner. Or 'epoch:<epoch held>'.
HANDOVER = (
    WRITES
    + PRELUDE
    + """
local mismatch = epoch_differs(ARGV[5])
if mismatch then return mismatch end
local len = #ARGV[6] / (#KEYS - 1)
local slices, at, now = open_slice()
local ledger = ledger_of(slices, at)
local out = {}
for i = 1, #KEYS - 1 do
  local by = KEYS[i + 1]
  local digest = string.sub(ARGV[6], (i - 1) * len + 1, i * len)
  local failed, nxt, ref = ARGV[5 * i + 2], ARGV[5 * i + 3], ARGV[5 * i + 4]
  local earlier, later = ARGV[5 * i + 5], ARGV[5 * i + 6]
  local h = hash_of(digest)
  local bucket, held = find(slices, digest, h, 1)
  if held == nxt then
    local last = redis.call('GET', by)
    if last == ref then out[i] = 2 elseif last == ref .. '!done' then out[i] = 4 else out[i] = 3 end
  elseif held and string.find(',' .. later, ',' .. held .. ',', 1, true) then
    out[i] = 5
  elseif held == failed or held == false or released(held)
      or string.find(',' .. earlier, ',' .. held .. ',', 1, true) then
    -- Moved to the current slice. Held there already, it is overwritten: an HDEL
    -- could empty (so delete) a bucket the ledger holds (see ledger_of).
    if bucket and bucket ~= bucket_of(slices[1], h) then redis.call('HDEL', bucket, digest) end
    put(slices, digest, nxt, now, ledger)
    redis.call('SET', by, ref, 'PX', ttl)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""
)

# After a command's effect is acknowledged, note it on its handover key, so a
# replay of that command finds it done. KEYS[i]: handover key; ARGV[i]: command ref.
MARK_DONE = (
    WRITES
    + """
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then
    redis.call('SET', key, ARGV[i] .. '!done', 'XX', 'KEEPTTL')
  end
end
return #KEYS
"""
)

# One digest's mark, for the operator: {owner, bucket TTL in ms, bucket
# encoding}, or {} when no live mark holds it. ARGV[5]: the digest.
INSPECT = (
    READS
    + PRELUDE
    + """
local bucket, held = find(live_slices(), ARGV[5], hash_of(ARGV[5]), 1)
if not held then return {} end
return {held, redis.call('PTTL', bucket), redis.call('OBJECT', 'ENCODING', bucket)}
"""
)

# Release one digest's mark whoever holds it (the operator's unconditional
# release), as RELEASE does. ARGV[5]: the digest. Reply: 1 released, 0 absent
# or released already.
DELETE = (
    WRITES
    + PRELUDE
    + """
local bucket, held = find(live_slices(), ARGV[5], hash_of(ARGV[5]), 1)
if not held or released(held) then return 0 end
redis.call('HSET', bucket, ARGV[5], '-' .. held)
return 1
"""
)

# A rebuild's reading side (gateway/rebuild.py): the marks of this instance,
# bucket by bucket, newest slice first, from slice ARGV[5] ('start': the
# current one) and shard ARGV[6]. ARGV[7] bounds a call's work (buckets
# visited plus marks returned), so the call stays short. Reply: {1 when every
# slice is done else 0, next slice, next shard, then digest, owner, bucket's
# remaining ms, handover note ('' when none) and its remaining ms, per mark}.
EXPORT = (
    READS
    + PRELUDE
    + """
local slices = live_slices()
local from, shard, budget = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local out = {1, 0, 0}
for _, slice in ipairs(slices) do
  if not from or slice[3] <= from then
    local s = (slice[3] == from) and shard or 0
    while s < slice[2] do
      if budget <= 0 then
        out[1], out[2], out[3] = 0, slice[3], s
        return out
      end
      local bucket = fmt('%s%d', slice[1], s)
      local all = redis.call('HGETALL', bucket)
      if #all > 0 then
        local left = redis.call('PTTL', bucket)
        for j = 1, #all, 2 do
          local n, note = #out, prefix .. 'h:' .. all[j]
          local by = redis.call('GET', note)
          out[n + 1] = all[j]
          out[n + 2] = all[j + 1]
          out[n + 3] = left
          out[n + 4] = by or ''
          out[n + 5] = by and redis.call('PTTL', note) or -2
        end
      end
      budget = budget - 1 - #all / 2
      s = s + 1
    end
  end
end
return out
"""
)

# Owners of many digests (a rebuild asks every source): per digest, the owner
# and its bucket's remaining ms, or '' and -2 when no live mark holds it.
# ARGV[5]: digest length L; ARGV[6]: the digests, concatenated.
LOOKUP = (
    READS
    + PRELUDE
    + """
local len, digests = tonumber(ARGV[5]), ARGV[6]
local slices = live_slices()
local out = {}
for i = 1, #digests / len do
  local digest = string.sub(digests, (i - 1) * len + 1, i * len)
  local bucket, held = find(slices, digest, hash_of(digest), 1)
  out[2 * i - 1] = held or ''
  out[2 * i] = bucket and redis.call('PTTL', bucket) or -2
end
return out
"""
)

# A rebuild's writing side: make each digest held by the given owner on the
# instance being rebuilt. A mark held by another owner is rewritten where it
# is; an absent one goes into the slice whose buckets expire soonest after
# the source's (now + its remaining ms), so a copy lives about as long as the
# original (never shorter, at most one slice longer). Slices older than this
# instance's own are opened for that (`first` in the slice meta).
# ARGV[5]: the epoch id the caller expects (nothing is written if it changed);
# ARGV[6]: digest length L; ARGV[7]: the digests, concatenated; ARGV[8]: the
# owners, each followed by ','; ARGV[9]: the remaining ms, each followed by ',';
# ARGV[10] and ARGV[11]: the handover notes and their remaining ms, each
# followed by ',': the member's note becomes the source's (deleted for '-',
# left alone for '?': the source does not hold the winner), so a replayed
# failure command gets the same answer here as there.
# Reply per digest: 0 already held by that owner, 1 written, 2 rewritten from
# another owner. Or 'epoch:<epoch held>' when the epoch differs.
IMPORT = (
    WRITES
    + PRELUDE
    + """
local mismatch = epoch_differs(ARGV[5])
if mismatch then return mismatch end
local len, digests = tonumber(ARGV[6]), ARGV[7]
local slices, at, now = open_slice()
local cur = slices[1][3]
local owners, lefts = string.gmatch(ARGV[8], '([^,]+),'), string.gmatch(ARGV[9], '([^,]+),')
local notes, note_lefts = string.gmatch(ARGV[10], '([^,]+),'), string.gmatch(ARGV[11], '([^,]+),')
local out, done = {}, {}
for i = 1, #digests / len do
  local digest, owner, left = string.sub(digests, (i - 1) * len + 1, i * len), owners(), lefts()
  local note, note_left = notes(), tonumber(note_lefts())
  if note == '-' then
    redis.call('DEL', prefix .. 'h:' .. digest)
  elseif note ~= '?' and note_left > 0 then
    redis.call('SET', prefix .. 'h:' .. digest, note, 'PX', note_left)
  end
  local h = hash_of(digest)
  local bucket, held = find(slices, digest, h, 1)
  if held == owner then
    out[i] = 0
  elseif held then
    redis.call('HSET', bucket, digest, owner)
    out[i] = 2
  else
    local k = math.floor((at - now - tonumber(left)) / slice_ms)
    k = math.max(0, math.min(k, SLICES_BACK))
    if k >= #slices then
      for s = cur - #slices, cur - k, -1 do redis.call('HSETNX', meta, 'buckets:' .. s, buckets) end
      redis.call('HSET', meta, 'first', cur - k)
      slices = slices_from(cur)
    end
    bucket = bucket_of(slices[k + 1], h)
    redis.call('HSET', bucket, digest, owner)
    if not done[bucket] then  -- any slice: the ledger is not used here
      done[bucket] = true
      expire_at(bucket, at - k * slice_ms, now)
    end
    out[i] = 1
  end
end
return out
"""
)

# The group's epoch (gateway/keys.py), its clock, whether it has ever held
# marks (its slice meta exists), whether it is paused, and the epoch id last
# copied to every group of the member (group 0 of a cluster member; see
# gateway/quorum.py): {epoch or false, now in ms, 1 or 0, 1 or 0, id or false}.
# KEYS[1]: `<prefix>epoch`; ARGV[1]: key prefix.
EPOCH_READ = (
    READS
    + """
local t = redis.call('TIME')
local marks = redis.call('HGET', ARGV[1] .. 'slice', 'id') and 1 or 0
local paused = redis.call('EXISTS', ARGV[1] .. 'paused')
return {redis.call('GET', KEYS[1]), t[1] * 1000 + math.floor(t[2] / 1000), marks, paused,
        redis.call('GET', ARGV[1] .. 'epoch-spread')}
"""
)

# Give a group an epoch if it has none (first contact, or its data was
# lost): '<id>:<since, ms by this instance's clock>:<state>'. The first caller
# sets it (NX); the reply is the epoch the group holds now.
# KEYS[1]: `<prefix>epoch`; ARGV[1]: a random id; ARGV[2]: 'trusted' or 'recovering'.
EPOCH_CREATE = (
    WRITES
    + """
local t = redis.call('TIME')
local since = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('SET', KEYS[1], string.format('%s:%d:%s', ARGV[1], since, ARGV[2]), 'NX')
return redis.call('GET', KEYS[1])
"""
)

# Change an epoch if it still holds what the caller saw (compare-and-set; ''
# for none). KEYS[1]: `<prefix>epoch`; ARGV[1]: the epoch seen; ARGV[2]: the
# new value. Reply: 1 set, 0 not.
EPOCH_SET = (
    WRITES
    + """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
)

# Copy a cluster member's epoch (group 0's) to another group, where it is not
# there already. KEYS[1]: `<prefix>epoch`; ARGV[1]: the epoch. Reply: 1 written.
EPOCH_COPY = (
    WRITES
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""
)

# Note on group 0 that its epoch id is on every group (only while it still holds
# that epoch). KEYS[1]: `<prefix>epoch`; ARGV[1]: key prefix; ARGV[2]: the epoch.
# Reply: 1 noted, 0 the epoch changed.
EPOCH_SPREAD = (
    WRITES
    + """
local epoch = redis.call('GET', KEYS[1])
if epoch ~= ARGV[2] then return 0 end
redis.call('SET', ARGV[1] .. 'epoch-spread', string.match(epoch, '^[^:]+'))
return 1
"""
)

# Pause a group (ARGV[2] '1') or resume it ('0'): a paused group refuses every
# script that writes marks ('paused:'), so its slots can be migrated
# (docs/operations.md, "Resharding a cluster member"). KEYS[1]: `<prefix>epoch`
# (routing); ARGV[1]: key prefix. Reply: 1.
PAUSE = (
    WRITES
    + """
if ARGV[2] == '1' then redis.call('SET', ARGV[1] .. 'paused', '1')
else redis.call('DEL', ARGV[1] .. 'paused') end
return 1
"""
)

# Coalescing windows (gateway/coalesce.py; key shapes in gateway/keys.py). A
# window's state is the hash `<prefix>cs:<key digest>:<start>`: v, the newest
# version seen (a digit string: comparing strings compares versions), n, the
# updates taken, l, the newest update's timestamp; it lives `ttl`. In trailing
# mode `<prefix>cw:<key digest>` names the start of the key's open window.
# ARGV[5]: the epoch id the caller expects; ARGV[6]: 'fixed' or 'trailing';
# ARGV[7]: window ms; ARGV[8]: max_window ms; ARGV[9]: digest length L;
# (key names holding a digest are built with `..`: string.format's %s stops at a
# zero byte, which one digest in ~20 holds);
# ARGV[10]: the key digests, concatenated; ARGV[11]: the records' timestamps
# and ARGV[12] their versions, each followed by ','.
# Reply per record: its window's start, 1 if this call opened the window, else 0,
# and the window's newest timestamp before this update (0 if none) (flattened);
# or 'epoch:<epoch held>'. A replay of an update (same
# version) changes nothing; a replayed older update counts once more in n.
COALESCE_UPDATE = (
    WRITES
    + PRELUDE
    + """
local mismatch = epoch_differs(ARGV[5])
if mismatch then return mismatch end
local trailing, W, MW = ARGV[6] == 'trailing', tonumber(ARGV[7]), tonumber(ARGV[8])
local len, digests = tonumber(ARGV[9]), ARGV[10]
local stamps, versions = string.gmatch(ARGV[11], '([^,]+),'), string.gmatch(ARGV[12], '([^,]+),')
local out = {}
for i = 1, #digests / len do
  local kd, ts, v = string.sub(digests, (i - 1) * len + 1, i * len), tonumber(stamps()), versions()
  local start
  if trailing then
    -- The open window takes the update unless it closed before the update's time:
    -- `window` after its newest update, at most `max_window` after its start.
    local pointer = prefix .. 'cw:' .. kd
    local s = tonumber(redis.call('GET', pointer))
    if s then
      local l = tonumber(redis.call('HGET', prefix .. 'cs:' .. kd .. ':' .. fmt('%d', s), 'l')) or s
      if ts < math.min(l + W, s + MW) then start = s end
    end
    if not start then
      start = ts
      redis.call('SET', pointer, fmt('%d', start), 'PX', ttl)
    end
  else
    start = ts - ts % W
  end
  local state = prefix .. 'cs:' .. kd .. ':' .. fmt('%d', start)
  local got = redis.call('HMGET', state, 'v', 'l')
  local held, last, opened = got[1], tonumber(got[2]), 0
  if not held then
    redis.call('HSET', state, 'v', v, 'n', 1, 'l', fmt('%d', ts))
    opened = 1
  elseif v ~= held then
    if v > held then redis.call('HSET', state, 'v', v) end
    if ts > last then redis.call('HSET', state, 'l', fmt('%d', ts)) end
    redis.call('HINCRBY', state, 'n', 1)
  end
  redis.call('PEXPIRE', state, ttl)
  out[3 * i - 2], out[3 * i - 1], out[3 * i] = start, opened, last or 0
end
return out
"""
)

# What each window holds now: ARGV[5]: digest length L; ARGV[6]: the key
# digests, concatenated; ARGV[7]: the windows' starts, each followed by ','.
# Reply per window, flattened: newest version ('' when no state), updates
# taken, newest update's timestamp.
COALESCE_CLOSE = (
    READS
    + PRELUDE
    + """
local len, digests = tonumber(ARGV[5]), ARGV[6]
local starts = string.gmatch(ARGV[7], '([^,]+),')
local out = {}
for i = 1, #digests / len do
  local kd = string.sub(digests, (i - 1) * len + 1, i * len)
  local got = redis.call('HMGET', prefix .. 'cs:' .. kd .. ':' .. starts(), 'v', 'n', 'l')
  out[3 * i - 2], out[3 * i - 1], out[3 * i] = got[1] or '', tonumber(got[2]) or 0,
    tonumber(got[3]) or 0
end
return out
"""
)
