--! writes
-- Change an epoch if it still holds what the caller saw (compare-and-set; ''
-- for none). KEYS[1]: `<prefix>epoch`; ARGV[1]: the epoch seen; ARGV[2]: the
-- new value. Reply: 1 set, 0 not.

local epoch_key, expected, new = KEYS[1], ARGV[1], ARGV[2]
if (redis.call('GET', epoch_key) or '') ~= expected then return 0 end
redis.call('SET', epoch_key, new)
return 1
