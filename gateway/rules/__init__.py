"""Pure decisions, no I/O: ids, the vote, classification, command decisions, tiers."""
