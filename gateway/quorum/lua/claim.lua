--! writes
--! prelude
-- Claim each digest for its owner, unless a live mark holds it.
-- The digests travel as two blobs, not 2n arguments: the client's per-argument
-- encoding was the largest cost of a call (profiled).
-- ARGV[5]: the epoch id the caller expects (nothing is written if the member
-- holds another); ARGV[6]: digest length L; ARGV[7]: the n digests,
-- concatenated (n*L bytes); ARGV[8]: the n owner tokens, each followed by ','.
-- Reply per digest: 1 when the mark is held by that owner (just claimed, or a
-- replay of the same source record), '=<token>' when it was just claimed over
-- <token>'s tombstone (a released mark), otherwise the owner token that holds
-- it ('-<token>' to the released record itself).
-- Or, instead of a list, 'epoch:<epoch held>' when the epoch differs.

local epoch_id = ARGV[5]
local len, digests = tonumber(ARGV[6]), ARGV[7]
local owners = ARGV[8]
local mismatch = epoch_differs(epoch_id)
if mismatch then return mismatch end
local slices, at, now = open_slice()
local ledger = ledger_of(slices, at)
local out = {}
local i, added, a = 0, 0, 0
for owner in string.gmatch(owners, '([^,]+),') do
  i = i + 1
  out[i], a = claim(slices, string.sub(digests, (i - 1) * len + 1, i * len), owner, now, ledger)
  added = added + a
end
if added > 0 then grow(slices[1], added, now, ledger) end
return out
