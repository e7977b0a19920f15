--! writes
-- The notes that a member is behind (gateway/quorum/behind.py): a gateway run
-- that queued fills for a member writes, on the members that answered, that it
-- holds marks the member lacks, and clears its note once it sent them. Every
-- gateway reads the notes with the epochs (epoch_read) and does not count a
-- member another run noted, until they are cleared, the member is caught up
-- (by a gateway, gateway/quorum/catchup.py, or `dedup-gateway rebuild`), or
-- they expire.
-- KEYS[1]: the slice meta (routes the call); ARGV[1]: key prefix; ARGV[2]: the
-- mode (below); ARGV[3]: the lagging member's name; ARGV[4]: the gateway run id
-- ('forget': '' for every run; 'void': run ids, or '*' for every run, each
-- followed by ','); ARGV[5]:
-- how long a note or a lease lasts, or the void's cut-off (ms); ARGV[6]: after
-- how long without being written again a note is stale (its run stopped), or
-- how long a void lasts (ms).
-- On the member holding notes: `<prefix>behind` field '<member>|<run id>' ->
-- until and `<prefix>behind-at` the same field -> '<written>:<stale after>'
-- (ms, this member's clock); 'note', 'clear', 'forget' (a run's notes, or every
-- run's: the member was caught up).
-- On the caught-up member itself: `<prefix>caught-up` field <run id> -> cut-off
-- (ms, its clock): that run's notes about it written at or before the cut-off
-- are void, wherever they are (a member that did not answer the forget keeps
-- them) ('void'); `<prefix>catch-up` the run id of the gateway catching it up
-- ('lease': taken or renewed, the reply is this member's clock, 0 when another
-- run holds it; 'unlease'); 'clock': the reply is this member's clock.
-- Reply: 1, or the lease's.

local prefix, mode, member, run = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local key, at = prefix .. 'behind', prefix .. 'behind-at'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local field = member .. '|' .. run
if mode == 'note' then
  local life = tonumber(ARGV[5])
  redis.call('HSET', key, field, string.format('%d', now + life))
  redis.call('HSET', at, field, string.format('%d:%s', now, ARGV[6]))
  if redis.call('PTTL', key) < life then redis.call('PEXPIRE', key, life) end
  if redis.call('PTTL', at) < life then redis.call('PEXPIRE', at, life) end
elseif mode == 'clear' then
  redis.call('HDEL', key, field)
  redis.call('HDEL', at, field)
elseif mode == 'forget' then
  local pairs_ = redis.call('HGETALL', key)
  for i = 1, #pairs_, 2 do
    local f = pairs_[i]
    if (run ~= '' and f == field) or (run == '' and string.sub(f, 1, #member + 1) == member .. '|') then
      redis.call('HDEL', key, f)
      redis.call('HDEL', at, f)
    end
  end
elseif mode == 'void' then
  local void = prefix .. 'caught-up'
  for r in string.gmatch(run, '([^,]+),') do redis.call('HSET', void, r, ARGV[5]) end
  redis.call('PEXPIRE', void, tonumber(ARGV[6]))
elseif mode == 'lease' then
  local lease = prefix .. 'catch-up'
  local held = redis.call('GET', lease)
  if held and held ~= run then return 0 end
  redis.call('SET', lease, run, 'PX', tonumber(ARGV[5]))
  return now
elseif mode == 'clock' then
  return now
elseif mode == 'unlease' then
  local lease = prefix .. 'catch-up'
  if redis.call('GET', lease) == run then redis.call('DEL', lease) end
end
return 1
