"""Lua scripts, one call per member per chunk of a batch, loaded once and called by SHA.

Marks live in hash buckets (see `gateway.quorum.keys` for the layout and why): a
mark is the field `<digest>` of `<prefix>m:<slice>:<shard>`, its value the
owner token. Every mark script starts with the prelude (lua/prelude.lua), which
finds the slices in force and the bucket that holds a digest. Time is the member's own clock
(`TIME`), so all the gateways calling one member agree on its slices.

Each script loops over its marks in order, so the marks of one call are
claimed in record order: of two copies of an id in one call, the first wins
(the gateway sends one batch's chunks to a member in order, on one
connection, so this holds for a whole batch).

What a script costs Redis is what sizes the chunks (below): a `redis.call`
is the unit, 1-2.5 us each on the machine measured (bench/RESULTS.md, "Claim
script cost"). A new id takes one HSETNX, and one PTTL the first time its
slice writes to its bucket (the expiry ledger); each older live slice adds one HGET.

Common arguments, ARGV[1..4]: key prefix, TTL in ms, slice length in ms,
shards per slice; KEYS[1]: the slice meta, `<prefix>slice`. Every key a script
touches starts with that prefix, which for a Redis Cluster member carries
the hash tag of one key group (gateway/quorum/members.py): all of a call's keys
share one slot, and the declared key routes the call to it. Every script
starts with a `#!lua` line, so a server with script flags (Redis 7+, Valkey)
refuses a call that strays into another slot instead of running it
half-way; the read-only ones are `no-writes`.

The scripts are files, `gateway/quorum/lua/<name>.lua` (package data). Each opens
with its directives, `--! writes` or `--! no-writes` (the `#!lua` line) and
`--! prelude` (the prelude is put before its body), then its arguments and
replies as comments (the loader drops those header lines), then its KEYS and
ARGV as named locals (a list of marks, one group of ARGV per mark, is read in
its loop).
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources

# The scripts below, as gateway/quorum/quorum.py registers them (the constant is the
# name upper-cased).
NAMES = ("claim", "fill", "repair", "release", "handover", "mark_done", "inspect", "delete",
         "export", "lookup", "import", "epoch_read", "epoch_create", "epoch_set", "epoch_copy",
         "epoch_spread", "pause", "coalesce_update", "coalesce_close", "behind",
         "slice_fill")  # fmt: skip

# SLICES_BACK: slices older than the current one that may still hold live
# marks. A slice lasts ttl/SLICES_BACK and its buckets expire `ttl` after it
# ends, so every mark lives between ttl and ttl * (1 + 1/SLICES_BACK), and
# the slice before the oldest one searched has always expired (see keys.py).
# One (slices of `ttl`): a new id is looked up in one older slice, not two, for
# marks held 1-2 windows instead of 1-1.5 (bench/RESULTS.md, "The mark store,
# round 2").
SLICES_BACK = 1

# BUCKET_FILL: marks per bucket a slice is sized for and grows to keep (prelude.lua, `grow`);
# MAX_SPLITS bounds a claim call's splits, MAX_BUCKETS a slice's buckets (the
# digest's 24 bits that pick a bucket).
BUCKET_FILL = 32
MAX_SPLITS = 32
MAX_BUCKETS = 2**24

# A bucket whose expiry is within this of its slice's is left as it is: PTTL is
# read a little after the script read TIME. Raising `ttl` by less is not applied.
EXPIRY_SLACK_MS = 1000

WRITES = "#!lua\n"
READS = "#!lua flags=no-writes\n"
_LUA = resources.files("gateway.quorum") / "lua"


def listed(values: Iterable[object]) -> str:
    """A list argument as the scripts split it (`string.gmatch(s, '([^,]*),')`, or
    `+` where no item is empty): every item followed by a comma; none may hold one."""
    return "".join(f"{value}," for value in values)


def _text(name: str) -> tuple[list[str], str]:
    """A .lua file's `--!` directives, and its text after the header comments."""
    text = (_LUA / f"{name}.lua").read_text()
    lines = text.splitlines(keepends=True)
    header = 0
    while header < len(lines) and lines[header].startswith("--"):
        header += 1
    directives = [line[3:].strip() for line in lines[:header] if line.startswith("--!")]
    return directives, "".join(lines[header:])


def _prelude() -> str:
    _, text = _text("prelude")
    for name, value in (
        ("SLICES_BACK", SLICES_BACK),
        ("EXPIRY_SLACK_MS", EXPIRY_SLACK_MS),
        ("FILL", BUCKET_FILL),
        ("MAX_SPLITS", MAX_SPLITS),
        ("MAX_BUCKETS", MAX_BUCKETS),
    ):
        text = text.replace("${" + name + "}", str(value))
    return text


PRELUDE = _prelude()


def load(name: str) -> str:
    """The script `name` as Redis gets it: `#!lua` line, prelude if asked, body."""
    directives, body = _text(name)
    flags = READS if "no-writes" in directives else WRITES
    return flags + (PRELUDE if "prelude" in directives else "") + body


CLAIM = load("claim")
FILL = load("fill")
REPAIR = load("repair")
RELEASE = load("release")
HANDOVER = load("handover")
MARK_DONE = load("mark_done")
INSPECT = load("inspect")
DELETE = load("delete")
EXPORT = load("export")
LOOKUP = load("lookup")
IMPORT = load("import")
EPOCH_READ = load("epoch_read")
EPOCH_CREATE = load("epoch_create")
EPOCH_SET = load("epoch_set")
EPOCH_COPY = load("epoch_copy")
EPOCH_SPREAD = load("epoch_spread")
PAUSE = load("pause")
COALESCE_UPDATE = load("coalesce_update")
COALESCE_CLOSE = load("coalesce_close")
BEHIND = load("behind")
SLICE_FILL = load("slice_fill")
