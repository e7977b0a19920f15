--! writes
-- Pause a group (ARGV[2] '1') or resume it ('0'): a paused group refuses every
-- script that writes marks ('paused:'), so its slots can be migrated
-- (docs/redis-cluster.md, "Resharding a cluster member"). KEYS[1]: `<prefix>epoch`
-- (routing); ARGV[1]: key prefix. Reply: 1.

local prefix, paused = ARGV[1], ARGV[2]
if paused == '1' then redis.call('SET', prefix .. 'paused', '1')
else redis.call('DEL', prefix .. 'paused') end
return 1
