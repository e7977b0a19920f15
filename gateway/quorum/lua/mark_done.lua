--! writes
-- After a command's effect is acknowledged, note it on its handover key, so a
-- replay of that command finds it done. KEYS[i]: handover key; ARGV[i]: command ref.

for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then
    redis.call('SET', key, ARGV[i] .. '!done', 'XX', 'KEEPTTL')
  end
end
return #KEYS
