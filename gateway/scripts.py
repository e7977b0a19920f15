"""Lua scripts, one call per instance per batch, loaded once and called by SHA.

Each script loops over KEYS in order, so the marks of one batch are claimed in
record order: of two copies of an id in one batch, the first wins everywhere.
"""

# Claim each key for its owner, atomically with its TTL.
# The batch travels as two blobs, not 2n arguments: the client's per-argument
# encoding was the largest cost of a call (profiled), and these are standalone
# instances, so nothing needs the keys declared in KEYS for routing.
# ARGV[1]: TTL in ms; ARGV[2]: key length L; ARGV[3]: the n keys, concatenated
# (n*L bytes); ARGV[4]: the n owner tokens, each followed by ','.
# Reply per key: 1 when the mark is held by that owner (just claimed, or a
# replay of the same source record), otherwise the owner token that holds it.
CLAIM = """
local ttl, len, keys = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local out = {}
local i = 0
for owner in string.gmatch(ARGV[4], '([^,]+),') do
  local key = string.sub(keys, i * len + 1, (i + 1) * len)
  i = i + 1
  local held = redis.call('SET', key, owner, 'NX', 'PX', ttl, 'GET')
  if held == false or held == owner then
    out[i] = 1
  else
    out[i] = held
  end
end
return out
"""

# Rewrite a minority mark to the vote's winner, only if it still holds what the
# vote saw (compare-and-set), keeping its TTL.
# KEYS[i]: mark key; ARGV[2i-1]: the owner seen; ARGV[2i]: the winner.
# Reply: how many marks were rewritten.
REPAIR = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[2 * i - 1] then
    redis.call('SET', key, ARGV[2 * i], 'XX', 'KEEPTTL')
    n = n + 1
  end
end
return n
"""

# Delete each mark only where it still holds the presented token
# (compare-and-delete): a stale token, whose id was claimed again since,
# changes nothing.
# KEYS[i]: mark key; ARGV[i]: token. Reply per key: 1 deleted, 0 not.
RELEASE = """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then
    redis.call('DEL', key)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# Hand a mark from a failed attempt's token to the next attempt's (retry) or
# to the dead-letter token, atomically, and note which command delivery did it
# in a side key, so a crash replay of that delivery (same failure-topic
# offset) redoes its effect while another copy of the command does nothing.
# A mark that expired or was lost is claimed for the next attempt: nobody
# else holds the id.
# KEYS[2i-1]: mark key; KEYS[2i]: its handover key; ARGV[1]: TTL in ms;
# ARGV[3i-1]: failed token; ARGV[3i]: next token; ARGV[3i+1]: command ref.
# Reply per mark: 1 handed over now, 2 handed over by this same command
# before but its effect not yet done (a replay: redo it), 3 handed over by
# another copy of the command, 4 this command's effect is done, 0 held by
# another owner (a stale command).
HANDOVER = """
local ttl = ARGV[1]
local out = {}
for i = 1, #KEYS / 2 do
  local mark, by = KEYS[2 * i - 1], KEYS[2 * i]
  local failed, nxt, ref = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  local held = redis.call('GET', mark)
  if held == nxt then
    local last = redis.call('GET', by)
    if last == ref then out[i] = 2 elseif last == ref .. '!done' then out[i] = 4 else out[i] = 3 end
  elseif held == failed or held == false then
    redis.call('SET', mark, nxt, 'PX', ttl)
    redis.call('SET', by, ref, 'PX', ttl)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# After a command's effect is acknowledged, note it on its handover key, so a
# replay of that command finds it done. KEYS[i]: handover key; ARGV[i]: command ref.
MARK_DONE = """
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i] then
    redis.call('SET', key, ARGV[i] .. '!done', 'XX', 'KEEPTTL')
  end
end
return #KEYS
"""
