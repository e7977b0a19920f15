--! writes
--! prelude
-- A rebuild's writing side: make each digest held by the given owner on the
-- member being rebuilt. A mark held by another owner is rewritten where it
-- is; an absent one goes into the slice whose buckets expire soonest after
-- the source's (now + its remaining ms), so a copy lives about as long as the
-- original (never shorter, at most one slice longer). Slices older than this
-- member's own are opened for that (`first` in the slice meta). A mark that
-- outlives the current slice's buckets (claimed before `ttl` was lowered) goes
-- there, its bucket kept until it ends (the ledger's expiry then only grows).
-- ARGV[5]: the epoch id the caller expects (nothing is written if it changed);
-- ARGV[6]: digest length L; ARGV[7]: the digests, concatenated; ARGV[8]: the
-- owners, each followed by ','; ARGV[9]: the remaining ms, each followed by ',';
-- ARGV[10] and ARGV[11]: the handover notes and their remaining ms, each
-- followed by ',': the member's note becomes the source's (deleted for '-',
-- left alone for '?': the source does not hold the winner), so a replayed
-- failure command gets the same answer here as there.
-- ARGV[12] and ARGV[13]: what the copy's lookup saw on this member (LOOKUP with
-- notes), its mark and its handover note, each followed by ',' ('' for none): a
-- digest is written only while the member still holds both (compare-and-set).
-- One that changed since (a live claim, release or handover landed between the
-- lookup and this call) is left as the live path wrote it: newer than anything
-- the copy read, it was overwritten with the older owner before (a tombstone
-- over a new owner, a failed attempt's token over a handover).
-- Reply per digest: 0 already held by that owner, 1 written, 2 rewritten from
-- another owner, 3 changed since the lookup, left as it is. Or 'epoch:<epoch
-- held>' when the epoch differs.

local epoch_id = ARGV[5]
local len, digests = tonumber(ARGV[6]), ARGV[7]
local owner_list, left_list = ARGV[8], ARGV[9]
local note_list, note_left_list = ARGV[10], ARGV[11]
local seen_list, seen_note_list = ARGV[12], ARGV[13]
local mismatch = epoch_differs(epoch_id)
if mismatch then return mismatch end
local slices, at, now = open_slice()
local cur = slices[1][3]
local owners, lefts = string.gmatch(owner_list, '([^,]+),'), string.gmatch(left_list, '([^,]+),')
local notes, note_lefts = string.gmatch(note_list, '([^,]+),'), string.gmatch(note_left_list, '([^,]+),')
local seens, seen_notes = string.gmatch(seen_list, '([^,]*),'), string.gmatch(seen_note_list, '([^,]*),')
-- The search entry of slice cur - k, opened (and kept searched until `expires`) if needed.
local function slice_back(k, expires)
  local s = cur - k
  if k > 0 then
    local known = tonumber(redis.call('HGET', meta, 'expires:' .. s))
    if not known or known < expires then redis.call('HSET', meta, 'expires:' .. s, fmt('%d', expires)) end
  end
  for _, slice in ipairs(slices) do
    if slice[3] == s then return slice end
  end
  redis.call('HSETNX', meta, 'buckets:' .. s, buckets)
  if s < (tonumber(redis.call('HGET', meta, 'first')) or 1) then redis.call('HSET', meta, 'first', s) end
  local older = {s}
  for j = 2, #slices do older[#older + 1] = slices[j][3] end
  table.sort(older, function(a, b) return a > b end)
  redis.call('HSET', meta, 'live', live_field(cur, older))
  slices = slices_from(cur, older)
  for _, slice in ipairs(slices) do
    if slice[3] == s then return slice end
  end
end
local out, done, added = {}, {}, {}
for i = 1, #digests / len do
  local digest, owner, left = string.sub(digests, (i - 1) * len + 1, i * len), owners(), lefts()
  local note, note_left = notes(), tonumber(note_lefts())
  local seen, seen_note = seens(), seen_notes()
  local h = hash_of(digest)
  local bucket, held = find(slices, digest, h, 1)
  local by = prefix .. 'h:' .. digest
  if (held or '') ~= seen or (redis.call('GET', by) or '') ~= seen_note then
    out[i] = 3
  else
    if note == '-' then
      redis.call('DEL', by)
    elseif note ~= '?' and note_left > 0 then
      redis.call('SET', by, note, 'PX', note_left)
    end
    if held == owner then
      out[i] = 0
    elseif held then
      redis.call('HSET', bucket, digest, owner)
      out[i] = 2
    elseif now + tonumber(left) > at then
      -- Claimed under a longer ttl (it was lowered since): the current slice's bucket is
      -- kept until the source's mark ends, and the slice searched as long.
      local keep = now + tonumber(left)
      bucket = bucket_of(slices[1], h)
      redis.call('HSET', bucket, digest, owner)
      expire_at(bucket, keep, now)
      local known = tonumber(redis.call('HGET', meta, 'expires:' .. cur))
      if not known or known < keep then redis.call('HSET', meta, 'expires:' .. cur, fmt('%d', keep)) end
      added[cur] = (added[cur] or 0) + 1
      out[i] = 1
    else
      local k = math.floor((at - now - tonumber(left)) / slice_ms)
      k = math.max(0, math.min(k, SLICES_BACK))
      bucket = bucket_of(slice_back(k, at - k * slice_ms), h)
      redis.call('HSET', bucket, digest, owner)
      added[cur - k] = (added[cur - k] or 0) + 1
      if not done[bucket] then  -- any slice: the ledger is not used here
        done[bucket] = true
        expire_at(bucket, at - k * slice_ms, now)
      end
      out[i] = 1
    end
  end
end
-- Each slice written keeps ~FILL marks per bucket (prelude.lua, `grow`): a member
-- rebuilt from empty has one first slice of `buckets`, however many marks it gets.
for _, slice in ipairs(slices) do
  if added[slice[3]] then grow(slice, added[slice[3]], now, nil) end
end
return out
