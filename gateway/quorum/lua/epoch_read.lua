--! no-writes
-- The group's epoch (gateway/quorum/keys.py), its clock, whether it has ever held
-- marks (its slice meta exists), whether it is paused, and the epoch id last
-- copied to every group of the member (group 0 of a cluster member; see
-- gateway/quorum/epochs.py), the notes of members behind held here and when
-- each was written (lua/behind.lua, flat field/value lists), and the notes
-- about this member that a catch-up made void (run id -> cut-off):
-- {epoch or false, now in ms, 1 or 0, 1 or 0, id or false, notes, written, void}.
-- KEYS[1]: `<prefix>epoch`; ARGV[1]: key prefix.

local epoch_key, prefix = KEYS[1], ARGV[1]
local t = redis.call('TIME')
local marks = redis.call('HGET', prefix .. 'slice', 'id') and 1 or 0
local paused = redis.call('EXISTS', prefix .. 'paused')
return {redis.call('GET', epoch_key), t[1] * 1000 + math.floor(t[2] / 1000), marks, paused,
        redis.call('GET', prefix .. 'epoch-spread'), redis.call('HGETALL', prefix .. 'behind'),
        redis.call('HGETALL', prefix .. 'behind-at'), redis.call('HGETALL', prefix .. 'caught-up')}
