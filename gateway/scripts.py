"""Lua scripts, one call per instance per batch, loaded once and called by SHA.

Each script loops over KEYS in order, so the marks of one batch are claimed in
record order: of two copies of an id in one batch, the first wins everywhere.
"""

# Claim each key for its owner, atomically with its TTL.
# KEYS[i]: mark key; ARGV[1]: TTL in ms; ARGV[i+1]: owner token for KEYS[i].
# Reply per key: 1 when the mark is held by that owner (just claimed, or a
# replay of the same source record), otherwise the owner token that holds it.
CLAIM = """
local ttl = ARGV[1]
local out = {}
for i, key in ipairs(KEYS) do
  local owner = ARGV[i + 1]
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
