--! no-writes
--! prelude
-- Owners of many digests (a rebuild asks every source): per digest, the owner
-- and its bucket's remaining ms, or '' and -2 when no live mark holds it.
-- ARGV[5]: digest length L; ARGV[6]: the digests, concatenated.

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
