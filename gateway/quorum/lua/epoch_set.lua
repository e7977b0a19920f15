--! writes
-- Change an epoch if it still holds what the caller saw (compare-and-set; ''
-- for none). KEYS[1]: `<prefix>epoch`; ARGV[1]: the epoch seen; ARGV[2]: the
-- new value. Reply: 1 set, 0 not.

if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
