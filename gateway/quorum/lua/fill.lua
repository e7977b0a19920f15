--! writes
--! prelude
-- Complete the marks of a member that gave no answer to a vote
-- (gateway/quorum/fills.py): each digest ends up held by the vote's winner where it
-- is absent or released (not by the winner itself: a release that landed after
-- the vote stays), or where it holds the token the unanswered claim carried (that
-- claim may have run late, e.g. on a member that hung, once it resumed);
-- any other owner's mark is left as it is (the next vote that sees it repairs it).
-- ARGV[5]: the epoch id the caller expects (nothing is written if the member
-- holds another); ARGV[6]: digest length L; ARGV[7]: the digests,
-- concatenated; ARGV[8]: the winners, each followed by ','; ARGV[9]: the
-- tokens sent, each followed by ','. Reply: marks written, or 'epoch:<epoch held>'.

local epoch_id = ARGV[5]
local len, digests = tonumber(ARGV[6]), ARGV[7]
local winner_list, sent_list = ARGV[8], ARGV[9]
local mismatch = epoch_differs(epoch_id)
if mismatch then return mismatch end
local slices, at, now = open_slice()
local ledger = ledger_of(slices, at)
local winners, sent = string.gmatch(winner_list, '([^,]+),'), string.gmatch(sent_list, '([^,]+),')
local n = 0
for i = 1, #digests / len do
  local digest, winner, token = string.sub(digests, (i - 1) * len + 1, i * len), winners(), sent()
  local bucket, held = find(slices, digest, hash_of(digest), 1)
  if not held or (released(held) and held ~= winner and held ~= '-' .. winner) then
    put(slices, digest, winner, now, ledger)
    n = n + 1
  elseif held == token and held ~= winner then
    redis.call('HSET', bucket, digest, winner)
    n = n + 1
  end
end
return n
