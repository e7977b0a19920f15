--! writes
--! prelude
-- Coalescing windows (gateway/delay/coalescer.py; key shapes in gateway/quorum/keys.py). A
-- window's state is the hash `<prefix>cs:<key digest>:<start>`: v, the newest
-- version seen (a digit string: comparing strings compares versions), n, the
-- updates taken, l, the newest update's timestamp; it lives `ttl`. In trailing
-- mode `<prefix>cw:<key digest>` names the start of the key's open window.
-- ARGV[5]: the epoch id the caller expects; ARGV[6]: 'fixed' or 'trailing';
-- ARGV[7]: window ms; ARGV[8]: max_window ms; ARGV[9]: digest length L;
-- (key names holding a digest are built with `..`: string.format's %s stops at a
-- zero byte, which one digest in ~20 holds);
-- ARGV[10]: the key digests, concatenated; ARGV[11]: the records' timestamps
-- and ARGV[12] their versions, each followed by ','.
-- Reply per record: its window's start, 1 if this call opened the window, else 0,
-- and the window's newest timestamp before this update (0 if none) (flattened);
-- or 'epoch:<epoch held>'. A replay of an update (same
-- version) changes nothing; a replayed older update counts once more in n.

local epoch_id = ARGV[5]
local trailing, W, MW = ARGV[6] == 'trailing', tonumber(ARGV[7]), tonumber(ARGV[8])
local len, digests = tonumber(ARGV[9]), ARGV[10]
local stamps, versions = string.gmatch(ARGV[11], '([^,]+),'), string.gmatch(ARGV[12], '([^,]+),')
local mismatch = epoch_differs(epoch_id)
if mismatch then return mismatch end
local out = {}
for i = 1, #digests / len do
  local kd, ts, v = string.sub(digests, (i - 1) * len + 1, i * len), tonumber(stamps()), versions()
  local start
  if trailing then
    -- The open window takes the update unless it closed before the update's time:
    -- `window` after its newest update, at most `max_window` after its start.
    local pointer = prefix .. 'cw:' .. kd
    local s = tonumber(redis.call('GET', pointer))
    if s then
      local l = tonumber(redis.call('HGET', prefix .. 'cs:' .. kd .. ':' .. fmt('%d', s), 'l')) or s
      if ts < math.min(l + W, s + MW) then start = s end
    end
    if not start then
      start = ts
      redis.call('SET', pointer, fmt('%d', start), 'PX', ttl)
    end
  else
    start = ts - ts % W
  end
  local state = prefix .. 'cs:' .. kd .. ':' .. fmt('%d', start)
  local got = redis.call('HMGET', state, 'v', 'l')
  local held, last, opened = got[1], tonumber(got[2]), 0
  if not held then
    redis.call('HSET', state, 'v', v, 'n', 1, 'l', fmt('%d', ts))
    opened = 1
  elseif v ~= held then
    if v > held then redis.call('HSET', state, 'v', v) end
    if ts > last then redis.call('HSET', state, 'l', fmt('%d', ts)) end
    redis.call('HINCRBY', state, 'n', 1)
  end
  redis.call('PEXPIRE', state, ttl)
  out[3 * i - 2], out[3 * i - 1], out[3 * i] = start, opened, last or 0
end
return out
