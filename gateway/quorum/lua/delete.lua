--! writes
--! prelude
-- Release one digest's mark whoever holds it (the operator's unconditional
-- release), as RELEASE does. ARGV[5]: the digest. Reply: 1 released, 0 absent
-- or released already.

local bucket, held = find(live_slices(), ARGV[5], hash_of(ARGV[5]), 1)
if not held or released(held) then return 0 end
redis.call('HSET', bucket, ARGV[5], '-' .. held)
return 1
