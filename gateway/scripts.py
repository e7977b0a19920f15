"""Lua scripts, one call per instance per batch, loaded once and called by SHA.

Marks live in hash buckets (see `gateway.keys` for the layout and why): a
mark is the field `<digest>` of `<prefix>m:<slice>:<shard>`, its value the
owner token. Every script starts with `PRELUDE`, which finds the slices
in force and the bucket that holds a digest. Time is the instance's own clock
(`TIME`), so all the gateways calling one instance agree on its slices.

Each script loops over its marks in order, so the marks of one batch are
claimed in record order: of two copies of an id in one batch, the first wins.

Common arguments, ARGV[1..4]: key prefix, TTL in ms, slice length in ms,
shards per slice.
"""

# SLICES_BACK: slices older than the current one that may still hold live
# marks. A slice lasts ttl/SLICES_BACK and its buckets expire `ttl` after it
# ends, so every mark lives between ttl and ttl * (1 + 1/SLICES_BACK), and
# the slice before the oldest one searched has always expired (see keys.py).
SLICES_BACK = 2

PRELUDE = f"""
local SLICES_BACK = {SLICES_BACK}
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
local slice_ms, buckets = tonumber(ARGV[3]), tonumber(ARGV[4])
local meta = prefix .. 'slice'

-- The slices to search, newest first: {{id, its bucket count}}. Each slice
-- keeps the bucket count it opened with, so changing `buckets` (or `ttl`)
-- takes effect at the next slice and never hides a live mark.
local function slices_from(id)
  local list = {{}}
  for s = id, math.max(id - SLICES_BACK, 1), -1 do
    list[#list + 1] = {{s, tonumber(redis.call('HGET', meta, 'buckets:' .. s)) or buckets}}
  end
  return list
end

-- Open a new slice if the current one has ended (the instance's clock).
-- Returns the slices to search (the first one is where new marks go) and
-- when the current slice's buckets expire (ms since the epoch).
local function open_slice()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local cur = redis.call('HMGET', meta, 'id', 'ends')
  local id, ends = tonumber(cur[1]) or 0, tonumber(cur[2]) or 0
  if now >= ends then
    id, ends = id + 1, now + slice_ms
    redis.call('HSET', meta, 'id', id, 'ends', string.format('%d', ends), 'buckets:' .. id, buckets)
    redis.call('HDEL', meta, 'buckets:' .. (id - SLICES_BACK - 1))
  end
  return slices_from(id), string.format('%d', ends + ttl)
end

-- The slices to search, without opening one (for scripts that only read or delete).
local function live_slices()
  return slices_from(tonumber(redis.call('HGET', meta, 'id')) or 0)
end

local function bucket_of(slice, digest)
  local a, b, c = string.byte(digest, 1, 3)
  return prefix .. 'm:' .. slice[1] .. ':' .. ((a * 65536 + b * 256 + c) % slice[2])
end

-- The bucket holding `digest` and its owner, newest slice first; nil, false if none.
local function find(slices, digest)
  for _, slice in ipairs(slices) do
    local bucket = bucket_of(slice, digest)
    local held = redis.call('HGET', bucket, digest)
    if held then return bucket, held end
  end
  return nil, false
end

-- Write a mark into the current slice; `fresh` collects the buckets to expire.
local function put(slices, digest, owner, fresh)
  local bucket = bucket_of(slices[1], digest)
  redis.call('HSET', bucket, digest, owner)
  fresh[bucket] = true
end

local function expire(fresh, expire_at)
  for bucket in pairs(fresh) do redis.call('PEXPIREAT', bucket, expire_at, 'NX') end
end
"""

# Claim each digest for its owner, unless a live mark holds it.
# The batch travels as two blobs, not 2n arguments: the client's per-argument
# encoding was the largest cost of a call (profiled).
# ARGV[5]: digest length L; ARGV[6]: the n digests, concatenated (n*L bytes);
# ARGV[7]: the n owner tokens, each followed by ','.
# Reply per digest: 1 when the mark is held by that owner (just claimed, or a
# replay of the same source record), otherwise the owner token that holds it.
CLAIM = (
    PRELUDE
    + """
local len, digests = tonumber(ARGV[5]), ARGV[6]
local slices, expire_at = open_slice()
local out, fresh = {}, {}
local i = 0
for owner in string.gmatch(ARGV[7], '([^,]+),') do
  local digest = string.sub(digests, i * len + 1, (i + 1) * len)
  i = i + 1
  local _, held = find(slices, digest)
  if not held then
    put(slices, digest, owner, fresh)
    out[i] = 1
  elseif held == owner then
    out[i] = 1
  else
    out[i] = held
  end
end
expire(fresh, expire_at)
return out
"""
)

# Rewrite a minority mark to the vote's winner, only if it still holds what the
# vote saw (compare-and-set), in the bucket that holds it (keeping its expiry).
# ARGV[5..]: digest, owner seen, winner; per mark. Reply: marks rewritten.
REPAIR = (
    PRELUDE
    + """
local slices = live_slices()
local n = 0
for i = 5, #ARGV, 3 do
  local bucket, held = find(slices, ARGV[i])
  if held == ARGV[i + 1] then
    redis.call('HSET', bucket, ARGV[i], ARGV[i + 2])
    n = n + 1
  end
end
return n
"""
)

# Delete each mark only where it still holds the presented token
# (compare-and-delete): a stale token, whose id was claimed again since,
# changes nothing. ARGV[5..]: digest, token; per mark.
# Reply per mark: 1 deleted, 0 not.
RELEASE = (
    PRELUDE
    + """
local slices = live_slices()
local out = {}
for i = 5, #ARGV, 2 do
  local bucket, held = find(slices, ARGV[i])
  if held == ARGV[i + 1] then
    redis.call('HDEL', bucket, ARGV[i])
    out[#out + 1] = 1
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
# lost is claimed for the next attempt: nobody else holds the id.
# KEYS[i]: mark i's handover side key; ARGV[5]: the marks' digests,
# concatenated (equal lengths); ARGV[6..]: failed token, next token, command
# ref; per mark.
# Reply per mark: 1 handed over now, 2 handed over by this same command
# before but its effect not yet done (a replay: redo it), 3 handed over by
# another copy of the command, 4 this command's effect is done, 0 held by
# another owner (a stale command).
HANDOVER = (
    PRELUDE
    + """
local len = #ARGV[5] / #KEYS
local slices, expire_at = open_slice()
local out, fresh = {}, {}
for i, by in ipairs(KEYS) do
  local digest = string.sub(ARGV[5], (i - 1) * len + 1, i * len)
  local failed, nxt, ref = ARGV[3 * i + 3], ARGV[3 * i + 4], ARGV[3 * i + 5]
  local bucket, held = find(slices, digest)
  if held == nxt then
    local last = redis.call('GET', by)
    if last == ref then out[i] = 2 elseif last == ref .. '!done' then out[i] = 4 else out[i] = 3 end
  elseif held == failed or held == false then
    if bucket then redis.call('HDEL', bucket, digest) end
    put(slices, digest, nxt, fresh)
    redis.call('SET', by, ref, 'PX', ttl)
    out[i] = 1
  else
    out[i] = 0
  end
end
expire(fresh, expire_at)
return out
"""
)

# After a command's effect is acknowledged, note it on its handover key, so a
# replay of that command finds it done. KEYS[i]: handover key; ARGV[i]: command ref.
MARK_DONE = """
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then
    redis.call('SET', key, ARGV[i] .. '!done', 'XX', 'KEEPTTL')
  end
end
return #KEYS
"""

# One digest's mark, for the operator: {owner, bucket TTL in ms, bucket
# encoding}, or {} when no live mark holds it. ARGV[5]: the digest.
INSPECT = (
    PRELUDE
    + """
local bucket, held = find(live_slices(), ARGV[5])
if not held then return {} end
return {held, redis.call('PTTL', bucket), redis.call('OBJECT', 'ENCODING', bucket)}
"""
)

# Delete one digest's mark whoever holds it (the operator's unconditional
# release). ARGV[5]: the digest. Reply: 1 deleted, 0 absent.
DELETE = (
    PRELUDE
    + """
local bucket = find(live_slices(), ARGV[5])
if not bucket then return 0 end
return redis.call('HDEL', bucket, ARGV[5])
"""
)
