"""What the job checks before its Spark session starts (a JVM, seconds), each failure one
line naming the setting: the broker answers within `BROKER_TIMEOUT_S`
(`[kafka] bootstrap_servers`); the clean topic it reads and the failure topic it writes
exist and the job's user may use them (`[kafka] clean_topic`, `failure_topic`: a typo
is said with the nearest existing name, and no topic is ever created), and whether the
delivery dedup is needed (`[spark] delivery_dedup`); when it runs against Redis
(`[spark] dedup_redis`), that the server answers within `REDIS_TIMEOUT_S` and accepts
the claim command (Redis 7.0+).

The delivery dedup drops a clean record whose `dedup-token` the job has seen: a repeat
of one delivery. Under `read_committed` the gateway's transactional paths never show
one (an aborted transaction's copies are never read), so `auto` turns it off when every
path into the clean topic is transactional: `[kafka] exactly_once` resolves on (as the
gateway decides it: "on", or "auto" on a broker with transactions, asked the gateway's
way, `transactions_unsupported`) and no path the gateway runs at-least-once into the
clean topic is on (`[failures] mode = "retry"`: a retry after a crash of the failure
loop can come twice; `[delay]` and `[coalesce]`: a tier move replayed after a restart
repeats its record under the same token; docs/guarantees.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass

import redis
from aiokafka.admin import AIOKafkaAdminClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from gateway.config import ConfigError
from gateway.errors import BrokerUnreachable, GatewayError
from gateway.kafka.admin import admin_client, reaching_broker, transactions_unsupported
from gateway.member_urls import masked
from gateway.rules.missing_topics import create_hint, did_you_mean
from spark_sink.config import DEDUP_REDIS_KEY_PREFIX as KEY_PREFIX
from spark_sink.config import DEDUP_REDIS_SETTING as SETTING
from spark_sink.config import SinkSettings

logger = logging.getLogger(__name__)

BROKER_TIMEOUT_S = 1.0
REDIS_TIMEOUT_S = 1.0
# The key the Redis check claims (and lets expire at once): the claim command the job runs.
REDIS_PROBE_KEY = f"{KEY_PREFIX}preflight"


class DedupRedisUnreachable(GatewayError):
    """No answer from the delivery dedup's Redis (`[spark] dedup_redis`) at start."""

    retriable = True

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(
            f'cannot connect to the delivery dedup\'s Redis: {SETTING} = "{masked(url)}" ({reason})'
        )


@dataclass(frozen=True)
class Decision:
    """Whether the job runs the delivery dedup, and why (one line for the log)."""

    delivery_dedup: bool
    why: str


def at_least_once_paths(settings: SinkSettings) -> list[str]:
    """The gateway's settings (in this TOML) under which a clean record can come twice
    under one token even with exactly-once output."""
    paths = []
    if settings.failures.mode == "retry":
        paths.append('[failures] mode = "retry"')
    if settings.delay.enabled:
        paths.append("[delay] enabled")
    if settings.coalesce.enabled:
        paths.append("[coalesce] enabled")
    return paths


def decide(settings: SinkSettings, no_transactions: str | None) -> Decision:
    """`[spark] delivery_dedup` resolved; `no_transactions`: why the broker cannot give
    exactly-once output (`transactions_unsupported`), None when it can."""
    mode, exactly_once = settings.spark.delivery_dedup, settings.kafka.exactly_once
    if mode != "auto":
        return Decision(mode == "on", f'spark.delivery_dedup = "{mode}"')
    if exactly_once == "off":
        return Decision(True, 'auto: [kafka] exactly_once = "off" (at-least-once clean topic)')
    if exactly_once == "auto" and no_transactions is not None:
        return Decision(True, f"auto: the gateway writes at-least-once here ({no_transactions})")
    paths = at_least_once_paths(settings)
    if paths:
        return Decision(True, f"auto: at-least-once paths into the clean topic: {', '.join(paths)}")
    return Decision(False, "auto: every path into the clean topic is transactional")


TOPIC_AUTHORIZATION_FAILED = 29  # Kafka's error code


async def check_topics(admin: AIOKafkaAdminClient, settings: SinkSettings) -> None:
    """ConfigError, one line, when the clean or the failure topic does not exist or the
    job's user may not describe it. A topic the user may not describe is not listed
    either, so those not listed are asked for by name (never created: no client of this
    process asks for auto-creation, gateway/kafka/clients.py)."""
    kafka = settings.kafka
    wanted = {"kafka.clean_topic": kafka.clean_topic, "kafka.failure_topic": kafka.failure_topic}
    listed = await admin.list_topics()
    absent = sorted({name for name in wanted.values() if name not in listed})
    if not absent:
        return
    denied = {
        d["topic"]
        for d in await admin.describe_topics(absent)
        if d["error_code"] == TOPIC_AUTHORIZATION_FAILED
    }
    problems = []
    for setting, name in wanted.items():
        if name in denied:
            problems.append(
                f'{setting} = "{name}": not authorised (the job\'s user needs Describe and '
                f"{'Read' if setting == 'kafka.clean_topic' else 'Write'} on it)"
            )
        elif name in absent:
            problems.append(
                f'{setting} = "{name}": the topic does not exist{did_you_mean(name, listed)}'
            )
    hint = f"; {create_hint(settings.source_file)}" if set(absent) - denied else ""
    raise ConfigError("; ".join(problems) + hint)


async def _check(settings: SinkSettings) -> str | None:
    """Reach the broker within `BROKER_TIMEOUT_S`; check the topics (`check_topics`);
    then, when `decide` needs it, why it lacks transactions (None: it has them, or
    nobody asked)."""
    kafka = settings.kafka
    admin = admin_client(kafka)
    try:
        async with reaching_broker(kafka):
            try:
                await asyncio.wait_for(admin.start(), BROKER_TIMEOUT_S)
            except TimeoutError:
                raise BrokerUnreachable(
                    kafka.bootstrap_servers, f"no answer within {BROKER_TIMEOUT_S:g} s"
                ) from None
        await check_topics(admin, settings)
        asks = settings.spark.delivery_dedup == "auto" and kafka.exactly_once == "auto"
        return await transactions_unsupported(admin._client) if asks else None
    finally:
        await admin.close()


def preflight(settings: SinkSettings) -> Decision:
    """Raise `BrokerUnreachable` (one line naming `[kafka] bootstrap_servers`) when the
    broker does not answer within `BROKER_TIMEOUT_S`; else whether to run the delivery
    dedup (logged)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no event loop in this thread
        no_transactions = asyncio.run(_check(settings))
    else:  # called from async code (an embedding service, a test): a loop of its own
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            no_transactions = pool.submit(asyncio.run, _check(settings)).result()
    decision = decide(settings, no_transactions)
    url = settings.spark.dedup_redis
    if decision.delivery_dedup and url:
        check_dedup_redis(url)
    where = f", tokens in Redis {masked(url)}" if decision.delivery_dedup and url else ""
    logger.info(
        "delivery dedup %s (%s%s)", "on" if decision.delivery_dedup else "off", decision.why, where
    )
    return decision


def check_dedup_redis(url: str) -> None:
    """Run the dedup's claim command once on `REDIS_PROBE_KEY` (expiring in 1 ms):
    `DedupRedisUnreachable` when the server does not answer within `REDIS_TIMEOUT_S`
    or refuses the credentials; `ConfigError` when it refuses the command (a server
    before 7.0 rejects NX with GET; an ACL without SET on `dedup-spark:*`)."""
    client = redis.Redis.from_url(
        url,
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),  # one try: the timeout is the check's whole budget
    )
    try:
        client.execute_command("SET", REDIS_PROBE_KEY, "preflight", "NX", "GET", "PX", 1)  # type: ignore[no-untyped-call]
    except redis.ResponseError as exc:
        raise ConfigError(
            f'{SETTING} = "{masked(url)}" refuses SET ... NX GET PX ({exc}): the '
            f"delivery dedup needs Redis 7.0 or later and SET on keys {KEY_PREFIX}*"
        ) from None
    except redis.RedisError as exc:  # no connection, no answer in time, not a Redis server
        raise DedupRedisUnreachable(url, f"{type(exc).__name__}: {exc}") from None
    finally:
        client.close()
