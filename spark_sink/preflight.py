"""What the job checks before its Spark session starts (a JVM, seconds), each failure one
line naming the setting: the broker answers within `BROKER_TIMEOUT_S`
(`[kafka] bootstrap_servers`), and whether the delivery dedup is needed
(`[spark] delivery_dedup`).

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

from gateway.errors import BrokerUnreachable
from gateway.kafka.transactions import transactions_unsupported
from gateway.ops.broker import reaching_broker
from gateway.ops.topics import admin_client
from spark_sink.config import SinkSettings

logger = logging.getLogger(__name__)

BROKER_TIMEOUT_S = 1.0


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


async def _check(settings: SinkSettings) -> str | None:
    """Reach the broker within `BROKER_TIMEOUT_S`; then, when `decide` needs it, why it
    lacks transactions (None: it has them, or nobody asked)."""
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
    logger.info("delivery dedup %s (%s)", "on" if decision.delivery_dedup else "off", decision.why)
    return decision
