--! writes
-- Give a group an epoch if it has none (first contact, or its data was
-- lost): '<id>:<since, ms by this member's clock>:<state>'. The first caller
-- sets it (NX); the reply is the epoch the group holds now.
-- KEYS[1]: `<prefix>epoch`; ARGV[1]: a random id; ARGV[2]: 'trusted' or 'recovering'.

local epoch_key, id, state = KEYS[1], ARGV[1], ARGV[2]
local t = redis.call('TIME')
local since = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('SET', epoch_key, string.format('%s:%d:%s', id, since, state), 'NX')
return redis.call('GET', epoch_key)
