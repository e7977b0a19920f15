--! no-writes
--! prelude
-- One digest's mark, for the operator: {owner, bucket TTL in ms, bucket
-- encoding}, or {} when no live mark holds it. ARGV[5]: the digest.

local digest = ARGV[5]
local bucket, held = find(live_slices(), digest, hash_of(digest), 1)
if not held then return {} end
return {held, redis.call('PTTL', bucket), redis.call('OBJECT', 'ENCODING', bucket)}
