--! writes
--! prelude
-- Release each mark only where it still holds the presented token
-- (compare-and-set): a stale token, whose id was claimed again since, changes
-- nothing. The mark becomes '-' .. token (see `claim`): the id is free for any
-- other copy, while a replay of the released source record stays a duplicate.
-- A mark released from that token already (a command repeated or redone; a
-- vote's repair that saw the release elsewhere first) answers 2: released, not now.
-- A member with no live mark (it missed the claim and its fill; expired) answers
-- 3: the id is free there already, and nothing is written.
-- ARGV[5..]: digest, token; per mark. Reply per mark: 1 released now, 2 released
-- before, 3 no live mark, 0 held by another owner.

local slices = live_slices()
local out = {}
for i = 5, #ARGV, 2 do
  local bucket, held = find(slices, ARGV[i], hash_of(ARGV[i]), 1)
  if held == ARGV[i + 1] then
    redis.call('HSET', bucket, ARGV[i], '-' .. held)
    out[#out + 1] = 1
  elseif held == '-' .. ARGV[i + 1] then
    out[#out + 1] = 2
  elseif not held then
    out[#out + 1] = 3
  else
    out[#out + 1] = 0
  end
end
return out
