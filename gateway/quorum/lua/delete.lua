--! writes
--! prelude
-- Release one digest's mark whoever holds it (the operator's unconditional
-- release), as RELEASE does. ARGV[5]: the digest. Reply: 1 released, 0 absent
-- or released already.

local digest = ARGV[5]
local bucket, held = find(live_slices(), digest, hash_of(digest), 1)
if not held or released(held) then return 0 end
redis.call('HSET', bucket, digest, '-' .. held)
return 1
