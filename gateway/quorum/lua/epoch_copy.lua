--! writes
-- Copy a cluster member's epoch (group 0's) to another group, where it is not
-- there already. KEYS[1]: `<prefix>epoch`; ARGV[1]: the epoch. Reply: 1 written.

local epoch_key, epoch = KEYS[1], ARGV[1]
if redis.call('GET', epoch_key) == epoch then return 0 end
redis.call('SET', epoch_key, epoch)
return 1
