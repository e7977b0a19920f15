"""The delivery dedup against Redis (`[spark] dedup_redis`): no state store in the query.

Spark's `dropDuplicatesWithinWatermark` scans every key of its state to evict, each
micro-batch, so its fixed cost grows with the keys it holds (docs/spark-performance.md).
Here the tokens live in Redis, where they expire on their own, and the query has no
stateful operator. `spark_sink.preflight` checks the server before the session starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pandas as pd
import redis
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.functions import pandas_udf

from gateway.member_urls import masked
from spark_sink.config import DEDUP_REDIS_KEY_PREFIX as KEY_PREFIX
from spark_sink.config import DEDUP_REDIS_SETTING as SETTING
from spark_sink.transforms import PROCESSED_AT, batch_time, delivery_key

# Seconds: a server that does not answer fails the batch instead of hanging it
# (redis-py retries a lost connection a few times first; a repeated SET is harmless).
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0

_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def client(url: str) -> redis.Redis:
    """This process's client for `url` (one per URL per Python worker, reused across
    batches and tasks: Spark reuses its Python workers)."""
    with _clients_lock:
        found = _clients.get(url)
        if found is None:
            found = redis.Redis.from_url(
                url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S
            )
            _clients[url] = found
        return found


class DedupRedisError(RuntimeError):
    """The delivery dedup's Redis failed mid-run: the batch fails, Spark re-runs it later."""


def claim(
    url: str, window_ms: int, names: list[bytes], values: list[bytes]
) -> list[bool]:  # fmt: skip
    """Claim each key `names[i]` for `values[i]` (`SET NX GET PX window_ms`, pipelined,
    no transaction): True where the row is kept (the key was free, or holds its own
    value already), False where another value claimed it first.

    The commands are written in Redis's protocol here and sent in one write on one of
    the client's connections: redis-py's pipeline packs each command apart, about 3 x
    the CPU per row. A lost connection is tried once more on a new one (a claim sent
    twice answers the same: the second finds the row's own value)."""
    if not names:
        return []
    payload = pack_claims(names, values, window_ms)
    pool = client(url).connection_pool
    for attempt in (1, 2):
        try:
            replies = _send(pool, payload, len(names))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if attempt == 2:
                raise failed(url, exc) from exc
        except redis.RedisError as exc:  # an error reply
            raise failed(url, exc) from exc
        else:
            kept = zip(replies, values, strict=True)
            return [reply is None or reply == value for reply, value in kept]
    raise AssertionError("unreachable")


def pack_claims(names: list[bytes], values: list[bytes], window_ms: int) -> bytes:
    """`SET name value NX GET PX window_ms` for each pair, in Redis's protocol: the bytes
    redis-py's `pack_commands` gives (tests/unit/spark/test_redis_dedup_pack.py), at
    about a tenth of its CPU per command."""
    px = str(window_ms).encode()
    tail = b"\r\n$2\r\nNX\r\n$3\r\nGET\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(px), px)
    return b"".join(
        [
            b"*7\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b%b"
            % (len(name), name, len(value), value, tail)
            for name, value in zip(names, values, strict=True)
        ]
    )


def _send(pool: redis.ConnectionPool, payload: bytes, commands: int) -> list[bytes | None]:
    """Write `payload` on a connection of `pool` and read its `commands` replies; a
    connection that failed, or whose replies are not all read, is closed."""
    connection: Any = pool.get_connection()  # redis-py leaves its methods untyped
    try:
        connection.send_packed_command([payload])
        return [connection.read_response() for _ in range(commands)]
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


def failed(url: str, exc: Exception) -> DedupRedisError:
    """The error a batch fails with when the dedup's Redis does: names the setting."""
    return DedupRedisError(
        f'the delivery dedup\'s Redis failed: {SETTING} = "{masked(url)}" '
        f"({type(exc).__name__}: {exc}); the batch fails and is re-run"
    )


def claims_column(url: str, window: timedelta) -> Column:
    """A boolean column: whether the row's delivery claim holds (`claim`), computed by a
    vectorised UDF over two binary columns the JVM builds, the key
    (`dedup-spark:<topic>:<delivery_key()>:<attempt>`) and the row's own value
    (`<partition>:<offset>`): building them in pandas, on object columns, cost the
    Python workers more than the claims did."""
    window_ms = max(1, round(window.total_seconds() * 1000))

    def claimed(names: pd.Series, values: pd.Series) -> pd.Series:
        return pd.Series(claim(url, window_ms, names.tolist(), values.tolist()), dtype=bool)

    udf: Callable[..., Column] = pandas_udf(claimed, "boolean")  # type: ignore[call-overload]
    name = F.concat(
        F.lit(KEY_PREFIX), F.col("topic"), F.lit(":"), delivery_key(), F.lit(":"),
        F.col("dedup_attempt").cast("string"),
    )  # fmt: skip
    value = F.concat(F.col("partition").cast("string"), F.lit(":"), F.col("offset").cast("string"))
    return udf(name.cast("binary"), value.cast("binary"))


def drop_duplicate_deliveries_redis(records: DataFrame, window: timedelta, url: str) -> DataFrame:
    """Keep the first delivery of each source record and attempt seen within `window`,
    the tokens held in the Redis at `url` (`[spark] dedup_redis`) instead of Spark's
    state store; what `transforms.drop_duplicate_deliveries` keeps, row for row.

    Each row's delivery is its clean topic, `delivery_key()` and `dedup_attempt` (the
    state-store path's key). It is claimed with one command,
    `SET dedup-spark:<topic>:<key>:<attempt> "<partition>:<offset>" NX GET PX <window ms>`
    (Redis 7.0 or later accepts NX with GET), and the row is kept when the reply is nil
    (the first claim) or its own `"<partition>:<offset>"` (the same clean record seen
    again: a re-run batch, a retried task, a second evaluation of the plan, a second job
    reading the topic); it is dropped when the key holds another record's coordinates
    (another delivery of the same source record and attempt claimed it, in an earlier
    batch or earlier in this one: within one partition, in offset order). So a re-run
    batch keeps exactly the rows it kept the first time, with no batch id, however often
    Spark evaluates the plan; the sink's re-run fingerprint (`spark_sink.sink`) holds.

    The claims run in a pandas UDF over the key and value only (built in the JVM),
    pipelined per Arrow batch through one `redis.Redis` client per Python worker process
    (`client`); the rows are then filtered on its result. Keys expire on their own (PX =
    the window), so nothing grows in the query or its checkpoint; the window runs from a key's first
    claim in processing time, as the state store's does from its batch.

    A Redis failure mid-run raises `DedupRedisError` (naming the setting) in the task:
    the batch fails before anything is written, and Spark runs it again on restart.
    If Redis loses keys (a restart without persistence, an `allkeys-*` eviction policy),
    a repeat from the gateway's crash window can get through within the window; a first
    delivery is never dropped. `processed_at` (`batch_time`) is added as on the other
    paths. Needs no streaming DataFrame: it works on a batch too.
    """
    return records.withColumn(PROCESSED_AT, batch_time()).where(claims_column(url, window))
