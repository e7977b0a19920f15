--! no-writes
--! prelude
-- A rebuild's reading side (gateway/ops/rebuild.py): the marks of this member,
-- bucket by bucket, newest slice first, from slice ARGV[5] ('start': the
-- current one) and shard ARGV[6]. ARGV[7] bounds a call's work (buckets
-- visited plus marks returned), so the call stays short. Reply: {1 when every
-- slice is done else 0, next slice, next shard, then digest, owner, bucket's
-- remaining ms, handover note ('' when none) and its remaining ms, per mark}.

local from, shard, budget = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local slices = live_slices()
local out = {1, 0, 0}
for _, slice in ipairs(slices) do
  if not from or slice[3] <= from then
    local s = (slice[3] == from) and shard or 0
    while s < slice[2] do
      if budget <= 0 then
        out[1], out[2], out[3] = 0, slice[3], s
        return out
      end
      local bucket = fmt('%s%d', slice[1], s)
      local all = redis.call('HGETALL', bucket)
      if #all > 0 then
        local left = redis.call('PTTL', bucket)
        for j = 1, #all, 2 do
          local n, note = #out, prefix .. 'h:' .. all[j]
          local by = redis.call('GET', note)
          out[n + 1] = all[j]
          out[n + 2] = all[j + 1]
          out[n + 3] = left
          out[n + 4] = by or ''
          out[n + 5] = by and redis.call('PTTL', note) or -2
        end
      end
      budget = budget - 1 - #all / 2
      s = s + 1
    end
  end
end
return out
