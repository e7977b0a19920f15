--! no-writes
--! prelude
-- What each window holds now: ARGV[5]: digest length L; ARGV[6]: the key
-- digests, concatenated; ARGV[7]: the windows' starts, each followed by ','.
-- Reply per window, flattened: newest version ('' when no state), updates
-- taken, newest update's timestamp.

local len, digests = tonumber(ARGV[5]), ARGV[6]
local starts = string.gmatch(ARGV[7], '([^,]+),')
local out = {}
for i = 1, #digests / len do
  local kd = string.sub(digests, (i - 1) * len + 1, i * len)
  local got = redis.call('HMGET', prefix .. 'cs:' .. kd .. ':' .. starts(), 'v', 'n', 'l')
  out[3 * i - 2], out[3 * i - 1], out[3 * i] = got[1] or '', tonumber(got[2]) or 0,
    tonumber(got[3]) or 0
end
return out
