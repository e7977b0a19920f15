--! writes
--! prelude
-- Hand a mark from a failed attempt's token to the next attempt's (retry) or
-- to the dead-letter token, atomically, with a fresh TTL (it moves to the
-- current slice), and note which command delivery did it in a side key, so a
-- crash replay of that delivery (same failure-topic offset) redoes its effect
-- while another copy of the command does nothing. A mark that expired or was
-- lost, or was released, is claimed for the next attempt: nobody else holds the id.
-- So is a mark still held by an earlier attempt of the same source record: this
-- member missed a handover the majority made (it gave no answer then), and is
-- brought up to date now. Left at 0, it tied with a member that did the handover
-- while a third recovered, and the command waited forever (chaos seed 1). A mark
-- held by a later attempt (or the dead letter) shows the command is stale: 5.
-- KEYS[i + 1]: mark i's handover side key; ARGV[5]: the epoch id the caller
-- expects (nothing is written if the member holds another); ARGV[6]: the
-- marks' digests, concatenated (equal lengths); ARGV[7..]: failed token, next
-- token, command ref, the earlier attempts' tokens and the later ones (each
-- token followed by a comma); per mark.
-- Reply per mark (named in gateway/contract/replies.py): 1 handed over now, 2 handed over
-- by this same command before but its effect not yet done (a replay: redo it),
-- the ref of another copy of the command that handed it over (a string), 6 handed
-- over by a copy whose note is gone, 4 this command's effect is done, 5 held by a
-- later attempt, 0 held by another owner. Or 'epoch:<epoch held>'. The other copy's
-- ref lets copies that each moved some members agree on the one that acts
-- (gateway/rules/commands.py).

local epoch_id, digests = ARGV[5], ARGV[6]
local marks = #KEYS - 1  -- KEYS[2..]: each mark's handover key
local mismatch = epoch_differs(epoch_id)
if mismatch then return mismatch end
local len = #digests / marks
local slices, at, now = open_slice()
local ledger = ledger_of(slices, at)
local out = {}
for i = 1, marks do
  local by = KEYS[i + 1]
  local digest = string.sub(digests, (i - 1) * len + 1, i * len)
  local failed, nxt, ref = ARGV[5 * i + 2], ARGV[5 * i + 3], ARGV[5 * i + 4]
  local earlier, later = ARGV[5 * i + 5], ARGV[5 * i + 6]
  local h = hash_of(digest)
  local bucket, held = find(slices, digest, h, 1)
  if held == nxt then
    local last = redis.call('GET', by)
    if last == ref then
      out[i] = 2
    elseif last == ref .. '!done' then
      out[i] = 4
    else
      out[i] = last and (string.gsub(last, '!done$', '')) or 6
    end
  elseif held and string.find(',' .. later, ',' .. held .. ',', 1, true) then
    out[i] = 5
  elseif held == failed or held == false or released(held)
      or string.find(',' .. earlier, ',' .. held .. ',', 1, true) then
    -- Moved to the current slice. Held there already, it is overwritten: an HDEL
    -- could empty (so delete) a bucket the ledger holds (see ledger_of).
    if bucket and bucket ~= bucket_of(slices[1], h) then redis.call('HDEL', bucket, digest) end
    put(slices, digest, nxt, now, ledger)
    -- The note lives as long as the mark (its bucket's expiry, up to a slice past
    -- `ttl`): a replay of this command while the mark lives must find it, or it
    -- reads as another copy's handover and the retry is never done (chaos seed 9510).
    local left = redis.call('PTTL', (bucket_of(slices[1], h)))
    redis.call('SET', by, ref, 'PX', math.max(left, ttl))
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
