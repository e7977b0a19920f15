"""The Redis quorum: members, key shapes, Lua scripts and the calls made on them."""
