--! no-writes
--! prelude
-- The current slice's fill, for the metric and `inspect`: {marks written into it,
-- its buckets now, its id}; {0, 0, 0} before the first claim. A slice counts the
-- marks its claims added (`grow`), not those a fill, handover or rebuild wrote.

local slices = live_slices()
if #slices == 0 or slices[1][3] == 0 then return {0, 0, 0} end
local cur = slices[1]
return {tonumber(redis.call('HGET', meta, 'marks:' .. cur[3])) or 0, cur[2], cur[3]}
