--! writes
-- Copy a cluster member's epoch (group 0's) to another group, where it is not
-- there already. KEYS[1]: `<prefix>epoch`; ARGV[1]: the epoch. Reply: 1 written.

if redis.call('GET', KEYS[1]) == ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
