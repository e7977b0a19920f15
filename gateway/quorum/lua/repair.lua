--! writes
--! prelude
-- Rewrite a minority mark to the vote's winner, only if it still holds what the
-- vote saw, or that owner's tombstone (its release landed after the vote: the
-- next copy must not find a free id there), compare-and-set, in the bucket
-- that holds it (keeping its expiry).
-- ARGV[5..]: digest, owner seen, winner; per mark. Reply: marks rewritten.

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
