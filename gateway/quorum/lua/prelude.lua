-- The prelude every mark script starts with (gateway/quorum/scripts.py includes it):
-- the common arguments, the slices in force, the bucket of a digest.

local SLICES_BACK, SLACK = ${SLICES_BACK}, ${EXPIRY_SLACK_MS}
local FILL, MAX_SPLITS, MAX_BUCKETS = ${FILL}, ${MAX_SPLITS}, ${MAX_BUCKETS}
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
local slice_ms, buckets = tonumber(ARGV[3]), tonumber(ARGV[4])
local meta = KEYS[1]
local fmt = string.format  -- '%d' formats a number much faster than `..` does

local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The older slices to search from slice `id`, newest first. The meta's `live`
-- field, '<id>:<older ids, each followed by ','>', names them: written when
-- slice <id> opened, they are the slices whose buckets expire after that (by
-- time, not by count: after `ttl` is lowered, the slices claimed under the
-- old ttl stay searched as long as their marks live). A slice opened without
-- it (by a gateway before this field) searches the SLICES_BACK before it.
local function older_of(id, live)
  local list = {}
  if live then
    local colon = string.find(live, ':', 1, true)
    if colon and tonumber(string.sub(live, 1, colon - 1)) == id then
      for k in string.gmatch(string.sub(live, colon + 1), '(%d+),') do list[#list + 1] = tonumber(k) end
      return list
    end
  end
  for k = 1, SLICES_BACK do list[k] = id - k end
  return list
end

-- A slice's buckets grow one at a time (linear hashing, gateway/quorum/keys.py):
-- `base` buckets when it opened, `n` now. `m` is the largest base x 2^k <= n: a
-- digest hashed h is in bucket h % m, or h % 2m once bucket h % m was split
-- (h % m < n - m). With n = base (no split) it is h % base, as before growth.
local function slice_entry(id, base, n)
  n = n or base
  local m = base
  while m * 2 <= n do m = m * 2 end
  return {fmt('%sm:%d:', prefix, id), n, id, m}
end

-- The slices to search, newest first: {bucket name prefix, bucket count, id,
-- modulus}: slice `id` and its `older` ones. Each slice keeps the bucket count it
-- opened with and grew to (`buckets:<id>`, `grown:<id>`), so changing `buckets`
-- (or `ttl`) takes effect at the next slice and never hides a live mark.
-- `first`: the oldest slice that may exist (1, or lower after a rebuild copied marks).
local function slices_from(id, older)
  local fields = {'first', 'buckets:' .. id, 'grown:' .. id}
  for k = 1, #older do
    fields[2 * k + 2] = 'buckets:' .. older[k]
    fields[2 * k + 3] = 'grown:' .. older[k]
  end
  local got = redis.call('HMGET', meta, unpack(fields))
  local first, list = tonumber(got[1]) or 1, {}
  if id < first then return list end
  list[1] = slice_entry(id, tonumber(got[2]) or buckets, tonumber(got[3]))
  for k = 1, #older do
    if older[k] < first then break end
    list[#list + 1] = slice_entry(older[k], tonumber(got[2 * k + 2]) or buckets,
                                  tonumber(got[2 * k + 3]))
  end
  return list
end

-- The `live` field for slice `id` with these older slices.
local function live_field(id, older)
  local parts = {}
  for k = 1, #older do parts[k] = fmt('%d,', older[k]) end
  return fmt('%d:', id) .. table.concat(parts)
end

-- The older slices of a slice opened at `now` after slice `id`: `id` and those of
-- its `older` ones whose buckets still live (`expires:<slice>`, the latest expiry
-- any call gave them; absent: the SLICES_BACK rule). The others are forgotten.
local function still_live(id, older, now)
  local candidates = {id}
  for k = 1, #older do candidates[k + 1] = older[k] end
  local fields = {}
  for k = 1, #candidates do fields[k] = 'expires:' .. candidates[k] end
  local got = redis.call('HMGET', meta, unpack(fields))
  local keep, gone = {}, {}
  for k = 1, #candidates do
    local s, expires = candidates[k], tonumber(got[k])
    if (expires and expires > now) or (not expires and s > id - SLICES_BACK) then
      keep[#keep + 1] = s
    else
      for _, field in ipairs({'buckets:', 'expires:', 'grown:', 'marks:'}) do
        gone[#gone + 1] = field .. s
      end
    end
  end
  if #gone > 0 then redis.call('HDEL', meta, unpack(gone)) end
  return keep
end

-- Open a new slice if the current one has ended (the member's clock).
-- Returns the slices to search (the first one is where new marks go), when
-- the current slice's buckets expire, and now (ms since the epoch).
local function open_slice()
  local now = clock()
  local cur = redis.call('HMGET', meta, 'id', 'ends', 'live')
  local id, ends = tonumber(cur[1]) or 0, tonumber(cur[2]) or 0
  local older = older_of(id, cur[3])
  if now >= ends then
    -- Sized for FILL marks per bucket at the rate the slice before saw (`buckets`
    -- for a member's first slice); it splits buckets as it fills past that (`grow`).
    local size = buckets
    if id > 0 then
      local marks = tonumber(redis.call('HGET', meta, 'marks:' .. id))
      if marks then size = math.max(1, math.min(MAX_BUCKETS, math.ceil(marks / FILL))) end
    end
    older = id > 0 and still_live(id, older, now) or {}
    id, ends = id + 1, now + slice_ms
    redis.call('HSET', meta, 'id', id, 'ends', fmt('%d', ends), 'buckets:' .. id, size,
               'live', live_field(id, older))
  end
  return slices_from(id, older), ends + ttl, now
end

-- The slices to search, without opening one (for scripts that only read or delete).
local function live_slices()
  local cur = redis.call('HMGET', meta, 'id', 'live')
  local id = tonumber(cur[1]) or 0
  return slices_from(id, older_of(id, cur[2]))
end

local function hash_of(digest)
  local a, b, c = string.byte(digest, 1, 3)
  return a * 65536 + b * 256 + c
end

-- The bucket of a digest hashed `h` in `slice`, and its index there.
local function bucket_of(slice, h)
  local m = slice[4]
  local index = h % m
  if index < slice[2] - m then index = h % (2 * m) end
  return fmt('%s%d', slice[1], index), index
end

-- A released mark holds '-' .. the token it was released from (a tombstone,
-- gateway/quorum/keys.py): nobody owns the id, but a replay of that same source
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

-- The current slice's expiry ledger (gateway/quorum/keys.py), read once per call: a
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
    return {key = key, at = since, bits = redis.call('GET', key) or '', done = {}}
  end
  if since then redis.call('DEL', key) end
  redis.call('HSET', meta, field, fmt('%d', at))
  return {key = key, at = at, bits = '', done = {}}
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
-- that token as released on the members the release has not reached yet,
-- gateway/rules/vote.py). To the owner it was released from it stays released
-- ('-' .. owner: the replay is a duplicate, the next copy can still claim it).
-- Also returns 1 when it added a field to the current slice (`grow` counts them).
local function claim(slices, digest, owner, now, ledger)
  local h = hash_of(digest)
  local bucket, index = bucket_of(slices[1], h)
  local held
  if redis.call('HSETNX', bucket, digest, owner) == 1 then
    local _, older = find(slices, digest, h, 2)
    if not older then
      expire(ledger, bucket, index, now)
      return 1, 1
    end
    if released(older) and older ~= '-' .. owner then
      expire(ledger, bucket, index, now)
      return '=' .. string.sub(older, 2), 1
    end
    redis.call('HDEL', bucket, digest)
    held = older
  else
    held = redis.call('HGET', bucket, digest)
    if released(held) and held ~= '-' .. owner then
      redis.call('HSET', bucket, digest, owner)
      expire(ledger, bucket, index, now)
      return '=' .. string.sub(held, 2), 0
    end
  end
  if held == owner then return 1, 0 end
  return held, 0
end

-- Write a mark into the current slice, whoever held the digest there.
local function put(slices, digest, owner, now, ledger)
  local bucket, index = bucket_of(slices[1], hash_of(digest))
  redis.call('HSET', bucket, digest, owner)
  expire(ledger, bucket, index, now)
end

-- Count `added` new marks in `slice` and split its buckets while it holds more
-- than FILL per bucket (linear hashing: bucket n - m splits into itself and n,
-- by one more bit of h), at most MAX_SPLITS per call, so a bucket stays near
-- FILL marks whatever the rate or the `buckets` setting (~300 per bucket cost
-- about twice the Redis CPU per new id, bench/RESULTS.md). Claims grow the
-- current slice (`ledger`: its expiry ledger); a rebuild's import any slice it
-- writes (no ledger: a new bucket gets its source bucket's expiry and no bit, so
-- the next claim there checks it). A split that moves every mark of its bucket
-- empties it (Redis deletes it): its ledger bit, if any, is cleared, so the next
-- write there gives it its expiry again.
local function grow(slice, added, now, ledger)
  local marks = redis.call('HINCRBY', meta, 'marks:' .. slice[3], added)
  local n, m, splits = slice[2], slice[4], 0
  local ledger_key = fmt('%sx:%d', prefix, slice[3])
  while marks > FILL * n and n < MAX_BUCKETS and splits < MAX_SPLITS do
    local p = n - m
    local from, to = fmt('%s%d', slice[1], p), fmt('%s%d', slice[1], n)
    local all = redis.call('HGETALL', from)
    local moved, fields = {}, {}
    for j = 1, #all, 2 do
      if hash_of(all[j]) % (2 * m) ~= p then
        moved[#moved + 1], moved[#moved + 2] = all[j], all[j + 1]
        fields[#fields + 1] = all[j]
      end
    end
    if #fields > 0 then
      local left = redis.call('PTTL', from)
      if left < 0 then left = ttl + slice_ms end  -- never without an expiry
      redis.call('HSET', to, unpack(moved))
      local at = now + left
      if ledger then at = math.max(ledger.at, at) end
      redis.call('PEXPIREAT', to, fmt('%d', at))
      if ledger then redis.call('SETBIT', ledger.key, n, 1) end
      redis.call('HDEL', from, unpack(fields))
      if 2 * #fields == #all and redis.call('EXISTS', ledger_key) == 1 then
        redis.call('SETBIT', ledger_key, p, 0)
      end
    end
    n, splits = n + 1, splits + 1
    if n == 2 * m then m = 2 * m end
  end
  if splits > 0 then
    redis.call('HSET', meta, 'grown:' .. slice[3], n)
    slice[2], slice[4] = n, m
  end
end

-- False when the member still holds the data the caller knows (its epoch
-- starts with the id `expected`, gateway/quorum/keys.py) and is not paused; else the
-- reply that says so, 'epoch:<the epoch it holds>' or 'paused:', and the
-- script must write nothing.
local function epoch_differs(expected)
  local got = redis.call('MGET', prefix .. 'epoch', prefix .. 'paused')
  local epoch = got[1]
  if got[2] then return 'paused:' end
  if epoch and string.sub(epoch, 1, #expected + 1) == expected .. ':' then return false end
  return 'epoch:' .. (epoch or '')
end
