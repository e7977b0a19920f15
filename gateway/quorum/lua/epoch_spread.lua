--! writes
-- Note on group 0 that its epoch id is on every group (only while it still holds
-- that epoch). KEYS[1]: `<prefix>epoch`; ARGV[1]: key prefix; ARGV[2]: the epoch.
-- Reply: 1 noted, 0 the epoch changed.

local epoch = redis.call('GET', KEYS[1])
if epoch ~= ARGV[2] then return 0 end
redis.call('SET', ARGV[1] .. 'epoch-spread', string.match(epoch, '^[^:]+'))
return 1
