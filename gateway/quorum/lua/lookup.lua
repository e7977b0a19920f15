--! no-writes
--! prelude
-- Owners of many digests (a rebuild asks every source): per digest, the owner
-- and its bucket's remaining ms, or '' and -2 when no live mark holds it; with
-- ARGV[7] = '1' also its handover note ('' when none) and the note's remaining
-- ms (what IMPORT compares against, and copies).
-- ARGV[5]: digest length L; ARGV[6]: the digests, concatenated.

local len, digests, notes = tonumber(ARGV[5]), ARGV[6], ARGV[7] == '1'
local slices = live_slices()
local out = {}
for i = 1, #digests / len do
  local digest = string.sub(digests, (i - 1) * len + 1, i * len)
  local bucket, held = find(slices, digest, hash_of(digest), 1)
  local n = #out
  out[n + 1] = held or ''
  out[n + 2] = bucket and redis.call('PTTL', bucket) or -2
  if notes then
    local note = prefix .. 'h:' .. digest
    local by = redis.call('GET', note)
    out[n + 3] = by or ''
    out[n + 4] = by and redis.call('PTTL', note) or -2
  end
end
return out
