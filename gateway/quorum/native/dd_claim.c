/*
 * The native claim: a Redis module command, DD.CLAIM, that does what the Lua
 * claim script does (gateway/quorum/lua/claim.lua and prelude.lua), with the
 * same arguments and the same reply, for members where an operator can load
 * modules (`[redis] claim`, docs/operations.md). The Lua script stays the
 * portable default; tests/integration/test_native_claim.py runs both on the same
 * claims and compares replies and key contents.
 *
 *   DD.CLAIM <meta> <prefix> <ttl ms> <slice ms> <buckets> <epoch id> <digest length>
 *            <digests, concatenated> <owner tokens, each followed by ','>
 *
 * is `EVALSHA <claim> 1 <meta> <prefix> ...`: KEYS[1] is the first argument,
 * ARGV[1..8] the rest. Every comment below names the Lua function it mirrors;
 * read those for the why. What differs is how, not what:
 *
 * - the per-id work (HSETNX, the older slices' HGET, the tombstone's HSET or
 *   HDEL, PTTL / PEXPIREAT and the ledger's SETBIT) uses the keyspace API: no
 *   command dispatch, no argument objects. The rare per-call work (the slice
 *   meta's writes, a bucket split) goes through RedisModule_Call, as Lua does;
 * - the expiry ledger is read in place (one bit per bucket touched), not copied
 *   whole per call;
 * - effects are replicated as the commands Lua would have run (HSET, HDEL,
 *   PEXPIREAT, SETBIT), never the call itself (it reads the member's clock),
 *   and only when the server propagates at all (AOF on, or a replication
 *   backlog): a server with neither would drop them anyway.
 * - every argument and every number it reads from the slice meta is checked
 *   against bounds first (MAX_* below), and its arithmetic cannot overflow: a
 *   client other than the gateway that sends bad numbers gets an error reply
 *   ("ERR DD.CLAIM: ttl out of range"), never a crash, a hang or an allocation
 *   of any size; where the Lua claim fails on an input (a wrong key type, a
 *   digest shorter than 3 bytes), this fails too.
 *   tests/integration/test_native_fuzz.py fuzzes it built with ASan and UBSan.
 *
 * The constants are the ones gateway/quorum/scripts.py puts into the prelude; the
 * module's version (DD_CLAIM_VERSION) is what the gateway checks in MODULE LIST
 * (gateway/quorum/native/__init__.py): a change to the claim's semantics must
 * change both, or the gateway uses the Lua script.
 *
 * Build: gcc -O2 -shared -fPIC -o dd_claim.so dd_claim.c (the project's
 * `make setup` does, into ~/.cache/dedup-gateway/redis-module/). Load:
 * `loadmodule /path/dd_claim.so` in redis.conf, or `redis-server --loadmodule`.
 */

#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "redismodule.h"

#ifndef SLICES_BACK
#define SLICES_BACK 1
#endif
#ifndef EXPIRY_SLACK_MS
#define EXPIRY_SLACK_MS 1000
#endif
#ifndef BUCKET_FILL
#define BUCKET_FILL 32
#endif
#ifndef MAX_SPLITS
#define MAX_SPLITS 32
#endif
#ifndef MAX_BUCKETS
#define MAX_BUCKETS (1LL << 24)
#endif

#define DD_CLAIM_VERSION 2
#define NAME_MAX_LEN 128 /* prefix (<= 32 + a cluster hash tag) and a slice's key */

/* Bounds on what a call may bring (arguments) or find (the slice meta). The
 * gateway never comes near them; another client's bad numbers get an error
 * reply, never arithmetic that overflows, an allocation of any size or a loop
 * without end. Times are Lua's exact integers (2^53: the script computes in
 * doubles), slice ids what its `'buckets:' .. id` writes in digits (10^13);
 * ttl and a slice's length at most 2^42 ms (139 years).
 * More older slices than MAX_OLDER fail the Lua claim too (its unpack). */
#define MAX_PREFIX_LEN 64
#define MAX_EXACT (1LL << 53)
#define MAX_ID 10000000000000LL /* 10^13: Lua's `..` writes up to 14 digits, not 1e+14 */
#define MAX_SPAN_MS (1LL << 42)
#define MAX_DIGEST_LEN (1LL << 20)
#define MAX_OLDER 1024

#define ERR_PREFIX "ERR DD.CLAIM: "

/* Buckets whose expiry was read (the Lua claim's PTTL calls): INFO dedup. */
static long long expiry_reads = 0;

typedef struct {
    char name[NAME_MAX_LEN]; /* '<prefix>m:<id>:' */
    size_t name_len;
    long long n;  /* buckets now */
    long long id;
    long long m;  /* modulus: largest base * 2^k <= n */
} Slice;

typedef struct {
    RedisModuleCtx *ctx;
    RedisModuleString *meta;
    const char *prefix;
    size_t prefix_len;
    long long ttl, slice_ms, buckets;
    int propagate; /* whether writes are replicated (AOF, replicas) */
} Call;

typedef struct {
    RedisModuleKey *key;   /* the ledger, open for the claim loop */
    RedisModuleString *name;
    long long at;
    int empty_at_start;    /* Lua: ledger.bits == '' */
    int unread;            /* Lua did not read its bits (a new `expires:`): none count */
    int wrong_type;        /* not a string: the first SETBIT fails, as Lua's */
    int timed;
    /* `done`: the bucket indexes this call checked, an open-addressing set */
    long long *done;
    size_t done_cap;
} Ledger;

typedef struct {
    int mine;                  /* reply 1 */
    RedisModuleString *value;  /* else: this bulk string (owned) */
} Reply;

/* An effect, replicated as the command Lua would have run (when the server
 * propagates at all: `propagates`). */
#define REPLICATE(c, cmd, fmt, ...)                                         \
    do {                                                                    \
        if ((c)->propagate) RedisModule_Replicate((c)->ctx, cmd, fmt, __VA_ARGS__); \
    } while (0)

/* -- small helpers ------------------------------------------------------- */

/* The text of an error reply that names a meta field (one command runs at a time). */
static char err_buf[128];

static const char *field_error(const char *field) {
    snprintf(err_buf, sizeof err_buf, ERR_PREFIX "slice meta field %s out of range", field);
    return err_buf;
}

static RedisModuleString *fmt_str(RedisModuleCtx *ctx, const char *fmt, ...) {
    char buf[NAME_MAX_LEN * 2];
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (len < 0) len = 0;
    if ((size_t)len >= sizeof buf) len = sizeof buf - 1;
    return RedisModule_CreateString(ctx, buf, (size_t)len);
}

/* `head` then `tail`, binary-safe (Lua's `..`). */
static RedisModuleString *concat(RedisModuleCtx *ctx, const char *head, size_t head_len,
                                 const char *tail, size_t tail_len) {
    RedisModuleString *s = RedisModule_CreateString(ctx, head, head_len);
    RedisModule_StringAppendBuffer(ctx, s, tail, tail_len);
    return s;
}

/* The prefix as Lua's fmt('%s...', prefix) writes it: up to a NUL byte. */
static int fmt_prefix_len(const Call *c) {
    const char *nul = memchr(c->prefix, 0, c->prefix_len);
    return (int)(nul ? (size_t)(nul - c->prefix) : c->prefix_len);
}

/* A field of the slice meta (HGET), or NULL. */
static RedisModuleString *meta_get(RedisModuleKey *meta, const char *field) {
    RedisModuleString *value = NULL;
    if (RedisModule_KeyType(meta) != REDISMODULE_KEYTYPE_HASH) return NULL;
    RedisModule_HashGet(meta, REDISMODULE_HASH_CFIELDS, field, &value, NULL);
    return value;
}

/* A number field of the slice meta, as Lua's tonumber(): 1 and `*out` when an
 * integer in [lo, hi]; 0 when absent or not a number (the caller's `or`
 * default); -1 (`*err` set) when a number out of those bounds, or one Lua would
 * read and this module does not (a fraction, an exponent, inf). */
static int meta_ll(RedisModuleKey *meta, const char *field, long long lo, long long hi,
                   long long *out, const char **err) {
    RedisModuleString *value = meta_get(meta, field);
    if (value == NULL) return 0;
    long long v;
    double d;
    int got = 0, integer = RedisModule_StringToLongLong(value, &v) == REDISMODULE_OK;
    if (integer && v >= lo && v <= hi) {
        *out = v;
        got = 1;
    } else if (integer || RedisModule_StringToDouble(value, &d) == REDISMODULE_OK) {
        *err = field_error(field);
        got = -1;
    }
    RedisModule_FreeString(NULL, value);
    return got;
}

static int wrong_type(RedisModuleKey *key, int want) {
    int type = RedisModule_KeyType(key);
    return type != REDISMODULE_KEYTYPE_EMPTY && type != want;
}

/* A RedisModule_Call's reply, or NULL (and `*err` set) when it failed. */
static RedisModuleCallReply *call_checked(const char **err, RedisModuleCallReply *reply) {
    if (reply == NULL) {
        *err = ERR_PREFIX "a command it runs failed";
        return NULL;
    }
    if (RedisModule_CallReplyType(reply) == REDISMODULE_REPLY_ERROR) {
        *err = ERR_PREFIX "a command it runs returned an error";
        RedisModule_FreeCallReply(reply);
        return NULL;
    }
    return reply;
}

/* A RedisModule_Call whose reply is not needed: 1 when it succeeded, else 0 and `*err`. */
static int call_ok(const char **err, RedisModuleCallReply *reply) {
    reply = call_checked(err, reply);
    if (reply == NULL) return 0;
    RedisModule_FreeCallReply(reply);
    return 1;
}

static long long reply_ll(RedisModuleCallReply *r) {
    return RedisModule_CallReplyType(r) == REDISMODULE_REPLY_INTEGER
               ? RedisModule_CallReplyInteger(r)
               : -1;
}

/* -- prelude.lua ---------------------------------------------------------- */

/* older_of: the older slices named by `live` ('<id>:<older>,...') when it is
 * slice `id`'s; else the SLICES_BACK before `id`. Returns the count, or -1
 * (`*err` set) for an id out of range or more than MAX_OLDER of them. */
static long long older_of(long long id, RedisModuleString *live, long long **out,
                          const char **err) {
    size_t len = 0, count = 0;
    const char *s = live ? RedisModule_StringPtrLen(live, &len) : NULL;
    const char *colon = s ? memchr(s, ':', len) : NULL;
    size_t hl = colon ? (size_t)(colon - s) : 0;
    char head[32];
    char *end = NULL;
    long long first = 0;
    if (colon && hl > 0 && hl < sizeof head) {
        memcpy(head, s, hl);
        head[hl] = 0;
        first = strtoll(head, &end, 10);
    }
    if (end == head + hl && hl > 0 && first == id) {
        /* gmatch('(%d+),'): every maximal digit run followed by ',' */
        size_t cap = len / 2 + 1 < MAX_OLDER + 1 ? len / 2 + 1 : MAX_OLDER + 1;
        long long *list = RedisModule_Alloc(sizeof(long long) * cap);
        const char *p = colon + 1, *stop = s + len;
        while (p < stop) {
            if (*p < '0' || *p > '9') {
                p++;
                continue;
            }
            const char *q = p;
            long long v = 0;
            int over = 0;
            for (; q < stop && *q >= '0' && *q <= '9'; q++) {
                over |= __builtin_mul_overflow(v, 10, &v);
                over |= __builtin_add_overflow(v, *q - '0', &v);
            }
            if (q < stop && *q == ',') {
                if (over || v > MAX_ID || count == MAX_OLDER) {
                    RedisModule_Free(list);
                    *err = field_error("live");
                    return -1;
                }
                list[count++] = v;
            }
            p = q;
        }
        *out = list;
        return (long long)count;
    }
    long long *list = RedisModule_Alloc(sizeof(long long) * SLICES_BACK);
    for (int k = 1; k <= SLICES_BACK; k++) list[count++] = id - k; /* |id| <= MAX_ID */
    *out = list;
    return (long long)count;
}

/* slice_entry: base and n are in [1, MAX_BUCKETS] (slices_from) */
static void slice_entry(Call *c, Slice *slice, long long id, long long base, long long n) {
    long long m = base;
    while (m <= n / 2) m *= 2;
    int len = snprintf(slice->name, sizeof slice->name, "%.*sm:%lld:", fmt_prefix_len(c),
                       c->prefix, id);
    slice->name_len = (size_t)len < sizeof slice->name ? (size_t)len : sizeof slice->name - 1;
    slice->n = n;
    slice->id = id;
    slice->m = m;
}

/* One slice's entry from its `buckets:<id>` and `grown:<id>`; 0 and `*err` on a
 * field out of range. */
static int slice_of(Call *c, RedisModuleKey *meta, long long id, Slice *out, const char **err) {
    char field[64];
    long long base = c->buckets, n;
    snprintf(field, sizeof field, "buckets:%lld", id);
    if (meta_ll(meta, field, 1, MAX_BUCKETS, &base, err) < 0) return 0;
    snprintf(field, sizeof field, "grown:%lld", id);
    int has_n = meta_ll(meta, field, 1, MAX_BUCKETS, &n, err);
    if (has_n < 0) return 0;
    slice_entry(c, out, id, base, has_n ? n : base);
    return 1;
}

/* slices_from: slice `id` and its `older` ones down to `first`; 0 with `*err`
 * set on a field out of range. */
static size_t slices_from(Call *c, RedisModuleKey *meta, long long id, long long *older,
                          size_t n_older, Slice *out, const char **err) {
    long long first = 1;
    if (meta_ll(meta, "first", -MAX_ID, MAX_ID, &first, err) < 0) return 0;
    if (id < first) return 0;
    if (!slice_of(c, meta, id, &out[0], err)) return 0;
    size_t count = 1;
    for (size_t k = 0; k < n_older; k++) {
        if (older[k] < first) break;
        if (!slice_of(c, meta, older[k], &out[count++], err)) return 0;
    }
    return count;
}

/* still_live: `id` and those of `older` whose buckets still live; HDEL the rest's
 * fields. Writes the kept ones into `keep`, returns their count. */
static size_t still_live(Call *c, long long id, long long *older, size_t n_older,
                         long long now, long long *keep, const char **err) {
    RedisModuleKey *meta = RedisModule_OpenKey(c->ctx, c->meta, REDISMODULE_READ);
    size_t n_keep = 0, n_gone = 0;
    RedisModuleString **gone = RedisModule_Alloc(sizeof(*gone) * 4 * (n_older + 1));
    static const char *fields[] = {"buckets:", "expires:", "grown:", "marks:"};
    char field[64];
    for (size_t k = 0; k <= n_older && !*err; k++) {
        long long s = k == 0 ? id : older[k - 1], expires;
        snprintf(field, sizeof field, "expires:%lld", s);
        int has = meta_ll(meta, field, -MAX_EXACT, MAX_EXACT, &expires, err);
        if (has < 0) break;
        if ((has && expires > now) || (!has && s > id - SLICES_BACK)) {
            keep[n_keep++] = s;
        } else {
            for (int f = 0; f < 4; f++) gone[n_gone++] = fmt_str(c->ctx, "%s%lld", fields[f], s);
        }
    }
    RedisModule_CloseKey(meta);
    if (!*err && n_gone > 0)
        call_ok(err, RedisModule_Call(c->ctx, "HDEL", "!sv", c->meta, gone, n_gone));
    for (size_t k = 0; k < n_gone; k++) RedisModule_FreeString(c->ctx, gone[k]);
    RedisModule_Free(gone);
    return n_keep;
}

/* The current slice as the meta has it: `id`, `ends` and its older slices. */
typedef struct {
    long long id, ends;
    long long *older; /* owned */
    size_t n_older;
} Current;

/* open_slice's read: 0 and `*err` on a meta that is not a hash or a field out
 * of range. `*size` is the next slice's size should one open (Lua's `size`). */
static int read_current(Call *c, RedisModuleKey *meta, Current *cur, long long *size,
                        const char **err) {
    if (wrong_type(meta, REDISMODULE_KEYTYPE_HASH)) {
        *err = "WRONGTYPE Operation against a key holding the wrong kind of value";
        return 0;
    }
    cur->id = cur->ends = 0;
    if (meta_ll(meta, "id", -MAX_ID, MAX_ID, &cur->id, err) < 0) return 0;
    if (meta_ll(meta, "ends", -MAX_EXACT, MAX_EXACT, &cur->ends, err) < 0) return 0;
    RedisModuleString *live = meta_get(meta, "live");
    long long n_older = older_of(cur->id, live, &cur->older, err);
    if (live) RedisModule_FreeString(NULL, live);
    if (n_older < 0) return 0;
    cur->n_older = (size_t)n_older;
    *size = c->buckets;
    if (cur->id > 0) {
        char field[64];
        long long marks;
        snprintf(field, sizeof field, "marks:%lld", cur->id);
        int has = meta_ll(meta, field, LLONG_MIN, LLONG_MAX, &marks, err);
        if (has < 0) return 0;
        if (has) {
            /* max(1, min(MAX_BUCKETS, ceil(marks / FILL))), without overflow */
            long long need = marks <= 0 ? 1 : marks / BUCKET_FILL + (marks % BUCKET_FILL != 0);
            *size = need < MAX_BUCKETS ? need : MAX_BUCKETS;
        }
    }
    return 1;
}

/* open_slice's write: the next slice, `size` buckets, from `now` (HSET on the meta). */
static int next_slice(Call *c, Current *cur, long long size, long long now, const char **err) {
    long long *keep = RedisModule_Alloc(sizeof(long long) * (cur->n_older + 1));
    size_t n_keep = 0;
    if (cur->id > 0) n_keep = still_live(c, cur->id, cur->older, cur->n_older, now, keep, err);
    RedisModule_Free(cur->older);
    cur->older = keep;
    cur->n_older = n_keep;
    if (*err) return 0;
    cur->id += 1; /* <= MAX_ID + 1 */
    if (__builtin_add_overflow(now, c->slice_ms, &cur->ends)) {
        *err = ERR_PREFIX "slice out of range";
        return 0;
    }
    /* live_field */
    size_t cap = 32 + 24 * cur->n_older, used = 0;
    char *lf = RedisModule_Alloc(cap);
    used += (size_t)snprintf(lf, cap, "%lld:", cur->id);
    for (size_t k = 0; k < cur->n_older; k++)
        used += (size_t)snprintf(lf + used, cap - used, "%lld,", cur->older[k]);
    RedisModuleString *args[8];
    args[0] = RedisModule_CreateString(c->ctx, "id", 2);
    args[1] = RedisModule_CreateStringFromLongLong(c->ctx, cur->id);
    args[2] = RedisModule_CreateString(c->ctx, "ends", 4);
    args[3] = RedisModule_CreateStringFromLongLong(c->ctx, cur->ends);
    args[4] = fmt_str(c->ctx, "buckets:%lld", cur->id);
    args[5] = RedisModule_CreateStringFromLongLong(c->ctx, size);
    args[6] = RedisModule_CreateString(c->ctx, "live", 4);
    args[7] = RedisModule_CreateString(c->ctx, lf, used);
    RedisModule_Free(lf);
    int ok = call_ok(err, RedisModule_Call(c->ctx, "HSET", "!sv", c->meta, args, (size_t)8));
    for (int k = 0; k < 8; k++) RedisModule_FreeString(c->ctx, args[k]);
    return ok;
}

/* open_slice: the slices to search (the first one takes new marks), when the
 * current slice's buckets expire, and now. Returns the slice count (0: none,
 * `*err` set). */
static size_t open_slice(Call *c, Slice **slices_out, long long *at, long long *now_out,
                         const char **err) {
    long long now = RedisModule_Milliseconds(), size;
    Current cur = {0};
    RedisModuleKey *meta = RedisModule_OpenKey(c->ctx, c->meta, REDISMODULE_READ);
    int ok = read_current(c, meta, &cur, &size, err);
    RedisModule_CloseKey(meta);
    if (ok && now >= cur.ends) ok = next_slice(c, &cur, size, now, err);
    size_t count = 0;
    if (ok) {
        *slices_out = RedisModule_Alloc(sizeof(Slice) * (cur.n_older + 1));
        meta = RedisModule_OpenKey(c->ctx, c->meta, REDISMODULE_READ);
        count = slices_from(c, meta, cur.id, cur.older, cur.n_older, *slices_out, err);
        RedisModule_CloseKey(meta);
        if (__builtin_add_overflow(cur.ends, c->ttl, at) && !*err) *err = field_error("ends");
        if (count == 0 && !*err)
            *err = ERR_PREFIX "no current slice (its id is below the meta's first)";
    }
    if (cur.older) RedisModule_Free(cur.older);
    *now_out = now;
    return *err ? 0 : count;
}

static uint32_t hash_of(const char *digest) {
    const unsigned char *d = (const unsigned char *)digest;
    return (uint32_t)d[0] * 65536u + (uint32_t)d[1] * 256u + (uint32_t)d[2];
}

/* bucket_of: the bucket's key name and its index (n, m <= MAX_BUCKETS). */
static RedisModuleString *bucket_of(RedisModuleCtx *ctx, const Slice *slice, uint32_t h,
                                    long long *index_out) {
    long long m = slice->m, index = h % m;
    if (index < slice->n - m) index = h % (2 * m);
    char buf[NAME_MAX_LEN + 24];
    memcpy(buf, slice->name, slice->name_len);
    int len = snprintf(buf + slice->name_len, sizeof buf - slice->name_len, "%lld", index);
    if (index_out) *index_out = index;
    return RedisModule_CreateString(ctx, buf, slice->name_len + (size_t)len);
}

static int released(RedisModuleString *held) {
    size_t len;
    const char *p = RedisModule_StringPtrLen(held, &len);
    return len > 0 && p[0] == '-';
}

/* held ~= '-' .. owner */
static int not_tombstone_of(RedisModuleString *held, const char *owner, size_t owner_len) {
    size_t len;
    const char *p = RedisModule_StringPtrLen(held, &len);
    return !(len == owner_len + 1 && p[0] == '-' && memcmp(p + 1, owner, owner_len) == 0);
}

/* find: the owner held for `digest` in slices[from..], newest first; NULL if none. */
static RedisModuleString *find(Call *c, Slice *slices, size_t n_slices,
                               RedisModuleString *digest, uint32_t h, size_t from,
                               const char **err) {
    for (size_t k = from; k < n_slices; k++) {
        RedisModuleString *name = bucket_of(c->ctx, &slices[k], h, NULL);
        RedisModuleKey *key = RedisModule_OpenKey(c->ctx, name, REDISMODULE_READ);
        RedisModuleString *held = NULL;
        int type = RedisModule_KeyType(key);
        if (type == REDISMODULE_KEYTYPE_HASH) {
            RedisModule_HashGet(key, REDISMODULE_HASH_NONE, digest, &held, NULL);
        } else if (type != REDISMODULE_KEYTYPE_EMPTY) {
            *err = "WRONGTYPE Operation against a key holding the wrong kind of value";
        }
        RedisModule_CloseKey(key);
        RedisModule_FreeString(c->ctx, name);
        if (held || *err) return held;
    }
    return NULL;
}

/* The ledger's `done` set (Lua: ledger.done[index]); 1 when `index` was there. */
static int done_add(Ledger *l, long long index) {
    size_t mask = l->done_cap - 1, i = ((size_t)index * 2654435761u) & mask;
    while (l->done[i] != -1) {
        if (l->done[i] == index) return 1;
        i = (i + 1) & mask;
    }
    l->done[i] = index;
    return 0;
}

/* expire_at: make `bucket` (open for writing) expire at `at` unless it already
 * expires then or later (less the slack). */
static void expire_at(Call *c, RedisModuleKey *key, RedisModuleString *name, long long at,
                      long long now) {
    mstime_t left = RedisModule_GetExpire(key);
    long long until;
    expiry_reads++;
    if (RedisModule_KeyType(key) == REDISMODULE_KEYTYPE_EMPTY) left = -2;
    /* now + left overflows only for an expiry later than any `at` */
    if (left < 0 || (!__builtin_add_overflow(now, left, &until) && until < at - EXPIRY_SLACK_MS)) {
        RedisModule_SetAbsExpire(key, at);
        REPLICATE(c, "PEXPIREAT", "sl", name, at);
        RedisModule_NotifyKeyspaceEvent(c->ctx, REDISMODULE_NOTIFY_GENERIC, "expire", name);
    }
}

/* expire: bucket `index` of the current slice expires with its slice; its expiry
 * is read only if the ledger has no bit for it yet. 0 (`*err`) when the ledger
 * is not a string (Lua's SETBIT fails). */
static int expire(Call *c, Ledger *l, RedisModuleKey *key, RedisModuleString *name,
                  long long index, long long now, const char **err) {
    if (done_add(l, index)) return 1;
    size_t len = 0;
    size_t byte = (size_t)(index / 8);
    if (!l->unread) {
        const unsigned char *bits =
            (const unsigned char *)RedisModule_StringDMA(l->key, &len, REDISMODULE_READ);
        if (bits && byte < len && (bits[byte] & (128u >> (index % 8))) != 0) return 1;
    }
    expire_at(c, key, name, l->at, now);
    if (l->wrong_type) {
        *err = "WRONGTYPE Operation against a key holding the wrong kind of value";
        return 0;
    }
    /* SETBIT ledger index 1 */
    RedisModule_StringDMA(l->key, &len, REDISMODULE_READ);
    if (len < byte + 1) RedisModule_StringTruncate(l->key, byte + 1);
    unsigned char *w = (unsigned char *)RedisModule_StringDMA(l->key, &len, REDISMODULE_WRITE);
    w[byte] |= (unsigned char)(128u >> (index % 8));
    REPLICATE(c, "SETBIT", "sll", l->name, index, 1LL);
    RedisModule_NotifyKeyspaceEvent(c->ctx, REDISMODULE_NOTIFY_STRING, "setbit", l->name);
    if (l->empty_at_start && !l->timed) { /* created by this call */
        l->timed = 1;
        RedisModule_SetAbsExpire(l->key, l->at);
        REPLICATE(c, "PEXPIREAT", "sl", l->name, l->at);
        RedisModule_NotifyKeyspaceEvent(c->ctx, REDISMODULE_NOTIFY_GENERIC, "expire", l->name);
    }
    return 1;
}

/* ledger_of: the current slice's ledger, opened for the claim loop. */
static int ledger_of(Call *c, Slice *current, long long at, Ledger *l, size_t n_digests,
                     const char **err) {
    char field[64];
    long long since;
    memset(l, 0, sizeof *l);
    l->name = fmt_str(c->ctx, "%.*sx:%lld", fmt_prefix_len(c), c->prefix, current->id);
    snprintf(field, sizeof field, "expires:%lld", current->id);
    RedisModuleKey *meta = RedisModule_OpenKey(c->ctx, c->meta, REDISMODULE_READ);
    int has = meta_ll(meta, field, -MAX_EXACT, MAX_EXACT, &since, err);
    RedisModule_CloseKey(meta);
    if (has < 0) return 0;
    if (has && at <= since) {
        l->at = since;
    } else {
        if (has && !call_ok(err, RedisModule_Call(c->ctx, "DEL", "!s", l->name))) return 0;
        RedisModuleString *f = RedisModule_CreateString(c->ctx, field, strlen(field));
        RedisModuleString *v = RedisModule_CreateStringFromLongLong(c->ctx, at);
        int ok = call_ok(err, RedisModule_Call(c->ctx, "HSET", "!sss", c->meta, f, v));
        RedisModule_FreeString(c->ctx, f);
        RedisModule_FreeString(c->ctx, v);
        if (!ok) return 0;
        l->at = at;
        /* Lua starts from bits = '' here: a ledger left without its meta field
         * (the meta deleted) vouches for no bucket. */
        l->unread = 1;
    }
    l->key = RedisModule_OpenKey(c->ctx, l->name, REDISMODULE_READ | REDISMODULE_WRITE);
    if (wrong_type(l->key, REDISMODULE_KEYTYPE_STRING)) {
        if (!l->unread) { /* Lua's GET fails */
            *err = "WRONGTYPE Operation against a key holding the wrong kind of value";
            return 0;
        }
        l->wrong_type = 1;
    }
    size_t len = 0;
    if (!l->wrong_type) RedisModule_StringDMA(l->key, &len, REDISMODULE_READ);
    l->empty_at_start = l->unread || len == 0;
    l->done_cap = 16;
    while (l->done_cap < 2 * n_digests + 2) l->done_cap *= 2;
    l->done = RedisModule_Alloc(sizeof(long long) * l->done_cap);
    for (size_t k = 0; k < l->done_cap; k++) l->done[k] = -1;
    return 1;
}

static void ledger_close(Ledger *l) {
    if (l->key) RedisModule_CloseKey(l->key);
    l->key = NULL;
}

/* The reply for a tombstone just claimed over: '=' .. the released token (frees it). */
static RedisModuleString *claimed_over(Call *c, RedisModuleString *tombstone) {
    size_t len;
    const char *p = RedisModule_StringPtrLen(tombstone, &len);
    RedisModuleString *out = concat(c->ctx, "=", 1, p + 1, len - 1); /* len >= 1: released */
    RedisModule_FreeString(c->ctx, tombstone);
    return out;
}

/* claim: 1 when `owner` holds `digest` now, else the reply that says who does;
 * `*added` 1 when a field was added to the current slice. */
static int claim(Call *c, Slice *slices, size_t n_slices, RedisModuleString *digest,
                 const char *owner, size_t owner_len, long long now, Ledger *l, Reply *out,
                 int *added, const char **err) {
    uint32_t h = hash_of(RedisModule_StringPtrLen(digest, NULL));
    long long index;
    RedisModuleString *name = bucket_of(c->ctx, &slices[0], h, &index);
    RedisModuleKey *key = RedisModule_OpenKey(c->ctx, name, REDISMODULE_READ | REDISMODULE_WRITE);
    RedisModuleString *held = NULL;
    RedisModuleString *owner_s = RedisModule_CreateString(c->ctx, owner, owner_len);
    *added = 0;
    out->mine = 0;
    out->value = NULL;
    if (wrong_type(key, REDISMODULE_KEYTYPE_HASH)) {
        *err = "WRONGTYPE Operation against a key holding the wrong kind of value";
        goto done;
    }
    if (RedisModule_HashSet(key, REDISMODULE_HASH_NX | REDISMODULE_HASH_COUNT_ALL, digest, owner_s,
                            NULL) == 1) {
        REPLICATE(c, "HSET", "sss", name, digest, owner_s);
        RedisModule_NotifyKeyspaceEvent(c->ctx, REDISMODULE_NOTIFY_HASH, "hset", name);
        RedisModuleString *older = find(c, slices, n_slices, digest, h, 1, err);
        if (*err) goto done;
        if (older == NULL) {
            *added = 1;
            if (expire(c, l, key, name, index, now, err)) out->mine = 1;
            goto done;
        }
        if (released(older) && not_tombstone_of(older, owner, owner_len)) {
            *added = 1;
            if (expire(c, l, key, name, index, now, err)) out->value = claimed_over(c, older);
            else RedisModule_FreeString(c->ctx, older);
            goto done;
        }
        RedisModule_HashSet(key, REDISMODULE_HASH_NONE, digest, REDISMODULE_HASH_DELETE, NULL);
        REPLICATE(c, "HDEL", "ss", name, digest);
        RedisModule_NotifyKeyspaceEvent(c->ctx, REDISMODULE_NOTIFY_HASH, "hdel", name);
        held = older;
    } else {
        RedisModule_HashGet(key, REDISMODULE_HASH_NONE, digest, &held, NULL);
        if (held == NULL) { /* not reached: HSETNX found it */
            *err = ERR_PREFIX "a field vanished";
            goto done;
        }
        if (released(held) && not_tombstone_of(held, owner, owner_len)) {
            RedisModule_HashSet(key, REDISMODULE_HASH_NONE, digest, owner_s, NULL);
            REPLICATE(c, "HSET", "sss", name, digest, owner_s);
            RedisModule_NotifyKeyspaceEvent(c->ctx, REDISMODULE_NOTIFY_HASH, "hset", name);
            if (expire(c, l, key, name, index, now, err)) out->value = claimed_over(c, held);
            else RedisModule_FreeString(c->ctx, held);
            goto done;
        }
    }
    {
        size_t len;
        const char *p = RedisModule_StringPtrLen(held, &len);
        if (len == owner_len && memcmp(p, owner, len) == 0) {
            out->mine = 1;
            RedisModule_FreeString(c->ctx, held);
        } else {
            out->value = held;
        }
    }
done:
    RedisModule_CloseKey(key);
    RedisModule_FreeString(c->ctx, name);
    RedisModule_FreeString(c->ctx, owner_s);
    return *err == NULL;
}

/* One split of grow: bucket p = n - m of `slice` into itself and bucket n, by one
 * more bit of the hash (2m <= 2 * MAX_BUCKETS). */
static int split_bucket(Call *c, Slice *slice, long long n, long long m, long long now,
                        Ledger *l, const char **err) {
    long long p = n - m;
    RedisModuleString *from = fmt_str(c->ctx, "%.*s%lld", (int)slice->name_len, slice->name, p);
    RedisModuleString *to = fmt_str(c->ctx, "%.*s%lld", (int)slice->name_len, slice->name, n);
    RedisModuleCallReply *all = call_checked(err, RedisModule_Call(c->ctx, "HGETALL", "s", from));
    size_t total = all ? RedisModule_CallReplyLength(all) : 0;
    RedisModuleString **moved = RedisModule_Alloc(sizeof(*moved) * (total + 1));
    RedisModuleString **fields = RedisModule_Alloc(sizeof(*fields) * (total / 2 + 1));
    size_t n_moved = 0, n_fields = 0;
    for (size_t j = 0; j + 1 < total; j += 2) {
        RedisModuleCallReply *f = RedisModule_CallReplyArrayElement(all, j);
        RedisModuleCallReply *v = RedisModule_CallReplyArrayElement(all, j + 1);
        size_t flen;
        const char *fp = RedisModule_CallReplyStringPtr(f, &flen);
        if (fp == NULL || flen < 3) { /* Lua's hash_of fails on it; nothing writes one */
            *err = ERR_PREFIX "a bucket holds a field shorter than 3 bytes";
            break;
        }
        if ((long long)(hash_of(fp) % (uint32_t)(2 * m)) != p) {
            moved[n_moved++] = RedisModule_CreateStringFromCallReply(f);
            moved[n_moved++] = RedisModule_CreateStringFromCallReply(v);
            fields[n_fields++] = RedisModule_CreateStringFromCallReply(f);
        }
    }
    if (all) RedisModule_FreeCallReply(all);
    if (!*err && n_fields > 0) {
        RedisModuleCallReply *t = RedisModule_Call(c->ctx, "PTTL", "s", from);
        long long left = t ? reply_ll(t) : -1, at;
        if (t) RedisModule_FreeCallReply(t);
        if (left < 0) left = c->ttl + c->slice_ms; /* never without an expiry */
        if (__builtin_add_overflow(now, left, &at)) at = LLONG_MAX;
        if (l && l->at > at) at = l->at;
        int ok = call_ok(err, RedisModule_Call(c->ctx, "HSET", "!sv", to, moved, n_moved)) &&
                 call_ok(err, RedisModule_Call(c->ctx, "PEXPIREAT", "!sl", to, at)) &&
                 (!l || call_ok(err, RedisModule_Call(c->ctx, "SETBIT", "!sll", l->name, n, 1LL))) &&
                 call_ok(err, RedisModule_Call(c->ctx, "HDEL", "!sv", from, fields, n_fields));
        if (ok && 2 * n_fields == total) {
            RedisModuleString *lk = fmt_str(c->ctx, "%.*sx:%lld", fmt_prefix_len(c), c->prefix,
                                            slice->id);
            RedisModuleCallReply *e = RedisModule_Call(c->ctx, "EXISTS", "s", lk);
            if (e && reply_ll(e) == 1)
                call_ok(err, RedisModule_Call(c->ctx, "SETBIT", "!sll", lk, p, 0LL));
            if (e) RedisModule_FreeCallReply(e);
            RedisModule_FreeString(c->ctx, lk);
        }
    }
    for (size_t j = 0; j < n_moved; j++) RedisModule_FreeString(c->ctx, moved[j]);
    for (size_t j = 0; j < n_fields; j++) RedisModule_FreeString(c->ctx, fields[j]);
    RedisModule_Free(moved);
    RedisModule_Free(fields);
    RedisModule_FreeString(c->ctx, from);
    RedisModule_FreeString(c->ctx, to);
    return *err == NULL;
}

/* grow: count `added` new marks in the current slice and split its buckets while
 * it holds more than BUCKET_FILL per bucket, at most MAX_SPLITS per call. Rare
 * (once per BUCKET_FILL new ids at most): through RedisModule_Call, as Lua. */
static void grow(Call *c, Slice *slice, long long added, long long now, Ledger *l,
                 const char **err) {
    RedisModuleString *field = fmt_str(c->ctx, "marks:%lld", slice->id);
    RedisModuleCallReply *r =
        call_checked(err, RedisModule_Call(c->ctx, "HINCRBY", "!ssl", c->meta, field, added));
    RedisModule_FreeString(c->ctx, field);
    if (!r) return;
    long long marks = reply_ll(r);
    RedisModule_FreeCallReply(r);
    long long n = slice->n, m = slice->m, splits = 0; /* n, m <= MAX_BUCKETS */
    while (marks > (long long)BUCKET_FILL * n && n < MAX_BUCKETS && splits < MAX_SPLITS) {
        if (!split_bucket(c, slice, n, m, now, l, err)) return;
        n += 1;
        splits += 1;
        if (n == 2 * m) m = 2 * m;
    }
    if (splits > 0) {
        RedisModuleString *g = fmt_str(c->ctx, "grown:%lld", slice->id);
        call_ok(err, RedisModule_Call(c->ctx, "HSET", "!ssl", c->meta, g, n));
        RedisModule_FreeString(c->ctx, g);
        slice->n = n;
        slice->m = m;
    }
}

/* epoch_differs: NULL when the member holds the epoch `expected` and is not
 * paused; else the reply that says why not. Key names and the reply binary-safe,
 * as Lua's `..`. */
static RedisModuleString *epoch_differs(Call *c, const char *expected, size_t exp_len) {
    RedisModuleString *name = concat(c->ctx, c->prefix, c->prefix_len, "epoch", 5);
    RedisModuleString *pname = concat(c->ctx, c->prefix, c->prefix_len, "paused", 6);
    RedisModuleKey *paused = RedisModule_OpenKey(c->ctx, pname, REDISMODULE_READ);
    int is_paused = RedisModule_KeyType(paused) == REDISMODULE_KEYTYPE_STRING; /* MGET: nil else */
    RedisModule_CloseKey(paused);
    RedisModule_FreeString(c->ctx, pname);
    RedisModuleString *out = NULL;
    RedisModuleKey *epoch = RedisModule_OpenKey(c->ctx, name, REDISMODULE_READ);
    size_t len = 0;
    const char *e = NULL;
    if (RedisModule_KeyType(epoch) == REDISMODULE_KEYTYPE_STRING)
        e = RedisModule_StringDMA(epoch, &len, REDISMODULE_READ);
    if (is_paused) {
        out = RedisModule_CreateString(c->ctx, "paused:", 7);
    } else if (e && len >= exp_len + 1 && memcmp(e, expected, exp_len) == 0 && e[exp_len] == ':') {
        out = NULL;
    } else {
        out = concat(c->ctx, "epoch:", 6, e ? e : "", e ? len : 0);
    }
    RedisModule_CloseKey(epoch);
    RedisModule_FreeString(c->ctx, name);
    return out;
}

/* Whether this server propagates writes at all (alsoPropagate's own test: AOF
 * on, or a master with a replication backlog or replicas). */
static int propagates(RedisModuleCtx *ctx) {
    int flags = RedisModule_GetContextFlags(ctx);
    if (flags & REDISMODULE_CTX_FLAGS_AOF) return 1;
    if (!(flags & REDISMODULE_CTX_FLAGS_MASTER)) return 1; /* cannot tell: replicate */
    RedisModuleServerInfoData *info = RedisModule_GetServerInfo(ctx, "replication");
    if (info == NULL) return 1;
    int err = 0;
    unsigned long long backlog =
        RedisModule_ServerInfoGetFieldUnsigned(info, "repl_backlog_active", &err);
    int out = err != 0 || backlog != 0;
    unsigned long long replicas =
        RedisModule_ServerInfoGetFieldUnsigned(info, "connected_slaves", &err);
    if (err != 0 || replicas != 0) out = 1;
    RedisModule_FreeServerInfo(ctx, info);
    return out;
}

/* An integer argument in [lo, hi]. */
static int arg_in(RedisModuleString *s, long long lo, long long hi, long long *out) {
    return RedisModule_StringToLongLong(s, out) == REDISMODULE_OK && *out >= lo && *out <= hi;
}

/* The arguments, checked: NULL, or the error reply's text. `*n` is the number of
 * owner tokens, each with a whole digest. */
static const char *parse_args(Call *c, RedisModuleString **argv, long long *len, size_t *n) {
    c->prefix = RedisModule_StringPtrLen(argv[2], &c->prefix_len);
    if (c->prefix_len > MAX_PREFIX_LEN) return ERR_PREFIX "prefix length out of range";
    if (!arg_in(argv[3], 1, MAX_SPAN_MS, &c->ttl)) return ERR_PREFIX "ttl out of range";
    if (!arg_in(argv[4], 1, MAX_SPAN_MS, &c->slice_ms)) return ERR_PREFIX "slice out of range";
    if (!arg_in(argv[5], 1, MAX_BUCKETS, &c->buckets)) return ERR_PREFIX "buckets out of range";
    if (!arg_in(argv[7], 3, MAX_DIGEST_LEN, len)) return ERR_PREFIX "digest length out of range";
    size_t digests_len, owners_len, need;
    RedisModule_StringPtrLen(argv[8], &digests_len);
    const char *owners = RedisModule_StringPtrLen(argv[9], &owners_len);
    /* gmatch('([^,]+),'): every non-empty run of non-commas followed by ',' */
    *n = 0;
    for (size_t k = 0, start = 0; k < owners_len; k++) {
        if (owners[k] == ',') {
            if (k > start) (*n)++;
            start = k + 1;
        }
    }
    if (__builtin_mul_overflow(*n, (size_t)*len, &need) || need > digests_len)
        return ERR_PREFIX "fewer digests than owners";
    return NULL;
}

static void reply_claims(RedisModuleCtx *ctx, Reply *out, size_t n) {
    RedisModule_ReplyWithArray(ctx, (long)n);
    for (size_t k = 0; k < n; k++) {
        if (out[k].mine)
            RedisModule_ReplyWithLongLong(ctx, 1);
        else
            RedisModule_ReplyWithString(ctx, out[k].value);
    }
}

/* DD.CLAIM: claim.lua */
static int ClaimCommand(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (argc != 10) return RedisModule_WrongArity(ctx);
    Call c = {.ctx = ctx, .meta = argv[1]};
    long long len;
    size_t n;
    const char *err = parse_args(&c, argv, &len, &n);
    if (err) return RedisModule_ReplyWithError(ctx, err);
    size_t exp_len, owners_len;
    const char *expected = RedisModule_StringPtrLen(argv[6], &exp_len);
    const char *digests = RedisModule_StringPtrLen(argv[8], NULL);
    const char *owners = RedisModule_StringPtrLen(argv[9], &owners_len);

    RedisModuleString *mismatch = epoch_differs(&c, expected, exp_len);
    if (mismatch) {
        RedisModule_ReplyWithString(ctx, mismatch);
        RedisModule_FreeString(ctx, mismatch);
        return REDISMODULE_OK;
    }
    c.propagate = propagates(ctx);
    Slice *slices = NULL;
    long long at = 0, now = 0;
    size_t n_slices = open_slice(&c, &slices, &at, &now, &err);
    if (err) {
        if (slices) RedisModule_Free(slices);
        return RedisModule_ReplyWithError(ctx, err);
    }
    Ledger ledger;
    if (!ledger_of(&c, &slices[0], at, &ledger, n, &err)) {
        ledger_close(&ledger);
        if (ledger.done) RedisModule_Free(ledger.done);
        RedisModule_FreeString(ctx, ledger.name);
        RedisModule_Free(slices);
        return RedisModule_ReplyWithError(ctx, err);
    }
    Reply *out = RedisModule_Calloc(n ? n : 1, sizeof(Reply));
    size_t i = 0;
    long long added = 0;
    for (size_t k = 0, start = 0; k < owners_len && !err; k++) {
        if (owners[k] != ',') continue;
        if (k > start) {
            RedisModuleString *digest =
                RedisModule_CreateString(ctx, digests + i * (size_t)len, (size_t)len);
            int a = 0;
            claim(&c, slices, n_slices, digest, owners + start, k - start, now, &ledger, &out[i],
                  &a, &err);
            RedisModule_FreeString(ctx, digest);
            added += a; /* <= n */
            i++;
        }
        start = k + 1;
    }
    ledger_close(&ledger);
    if (!err && added > 0) grow(&c, &slices[0], added, now, &ledger, &err);
    if (err)
        RedisModule_ReplyWithError(ctx, err);
    else
        reply_claims(ctx, out, n);
    for (size_t k = 0; k < n; k++)
        if (out[k].value) RedisModule_FreeString(ctx, out[k].value);
    RedisModule_Free(out);
    RedisModule_Free(ledger.done);
    RedisModule_FreeString(ctx, ledger.name);
    RedisModule_Free(slices);
    return REDISMODULE_OK;
}

/* INFO dedup: what the Lua claim's commands would show in INFO commandstats. */
static void InfoFunc(RedisModuleInfoCtx *ctx, int for_crash_report) {
    (void)for_crash_report;
    RedisModule_InfoAddSection(ctx, "claim");
    RedisModule_InfoAddFieldLongLong(ctx, "expiry_reads", expiry_reads);
}

int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    (void)argc;
    if (RedisModule_Init(ctx, "dedup", DD_CLAIM_VERSION, REDISMODULE_APIVER_1) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    /* One declared key, the slice meta (argument 1), as the script's KEYS[1]: it
     * routes the call; every other key it touches shares the meta's prefix. */
    if (RedisModule_CreateCommand(ctx, "dd.claim", ClaimCommand, "write deny-oom", 1, 1, 1) ==
        REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (RedisModule_RegisterInfoFunc(ctx, InfoFunc) == REDISMODULE_ERR) return REDISMODULE_ERR;
    return REDISMODULE_OK;
}
