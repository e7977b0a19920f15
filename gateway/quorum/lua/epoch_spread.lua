--! writes
-- Note on group 0 that its epoch id is on every group (only while it still holds
-- that epoch). KEYS[1]: `<prefix>epoch`; ARGV[1]: key prefix; ARGV[2]: the epoch.
-- Reply: 1 noted, 0 the epoch changed.

local epoch_key, prefix, expected = KEYS[1], ARGV[1], ARGV[2]
local epoch = redis.call('GET', epoch_key)
if epoch ~= expected then return 0 end
redis.call('SET', prefix .. 'epoch-spread', string.match(epoch, '^[^:]+'))
return 1
