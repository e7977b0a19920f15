--! writes
-- The notes that a member is behind (gateway/quorum/behind.py): a gateway run
-- that queued fills for a member writes, on the members that answered, that it
-- holds marks the member lacks, and clears its note once it sent them. Every
-- gateway reads the notes with the epochs (epoch_read) and does not count a
-- member another run noted, until they are cleared, a rebuild completed the
-- member, or they expire.
-- KEYS[1]: the slice meta (routes the call); ARGV[1]: key prefix; ARGV[2]:
-- 'note', 'clear' or 'forget'; ARGV[3]: the lagging member's name; ARGV[4]:
-- the gateway run id; ARGV[5]: how long a note lasts (ms, 'note').
-- The key `<prefix>behind`: field '<member>|<run id>' -> until (ms, this member's clock).
-- Reply: 1.

local key, mode, member, run = ARGV[1] .. 'behind', ARGV[2], ARGV[3], ARGV[4]
if mode == 'note' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local life = tonumber(ARGV[5])
  redis.call('HSET', key, member .. '|' .. run, string.format('%d', now + life))
  if redis.call('PTTL', key) < life then redis.call('PEXPIRE', key, life) end
elseif mode == 'clear' then
  redis.call('HDEL', key, member .. '|' .. run)
else  -- 'forget': every run's note about the member (a rebuild completed it)
  local pairs_ = redis.call('HGETALL', key)
  for i = 1, #pairs_, 2 do
    local field = pairs_[i]
    if string.sub(field, 1, #member + 1) == member .. '|' then redis.call('HDEL', key, field) end
  end
end
return 1
