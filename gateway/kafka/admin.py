"""The broker as an admin client sees it, for the operator commands and the Spark job's
pre-flight alike: an admin client for `[kafka]` (`admin_client`), a broker that cannot
be reached said in one line (`reaching_broker`), and whether the broker can give
exactly-once output (`transactions_unsupported`).

aiokafka raises `KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1,
<AddressFamily.AF_INET: 2>)]")` and logs, per address, an ERROR line with the
reason. `reaching_broker` turns both into one `BrokerUnreachable` naming the
setting to check, `[kafka] bootstrap_servers`, its value, and why each address
failed; the CLI prints it as its only line (gateway/cli.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from aiokafka import AIOKafkaClient
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError

from gateway.config import KafkaSettings
from gateway.errors import BrokerUnreachable
from gateway.kafka.clients import aiokafka_options


def admin_client(kafka: KafkaSettings) -> AIOKafkaAdminClient:
    options = aiokafka_options(kafka)
    # The admin client takes the connection options only (no producer/consumer ones).
    return AIOKafkaAdminClient(**options)


# aiokafka's client logs each failed bootstrap address under this name.
AIOKAFKA_LOGGER = "aiokafka"


class _Reasons(logging.Filter):
    """Keeps aiokafka's 'Unable connect to "h:p": reason' lines as reasons, and (unless
    `show`) keeps them off stderr: the one line says it all."""

    def __init__(self, show: bool) -> None:
        super().__init__()
        self.show = show
        self.reasons: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(("Unable connect to", "Unable to request metadata from")):
            reason = message.split(" to ", 1)[1].removeprefix("request metadata from ")
            self.reasons.append(reason.replace('"', ""))
            return self.show
        return True


def unreachable(kafka: KafkaSettings, reasons: list[str], error: Exception) -> BrokerUnreachable:
    why = "; ".join(dict.fromkeys(reasons)) or str(error).removeprefix("KafkaConnectionError: ")
    return BrokerUnreachable(kafka.bootstrap_servers, why)


@contextlib.asynccontextmanager
async def reaching_broker(kafka: KafkaSettings, *, verbose: bool = False) -> AsyncIterator[None]:
    """Run the block; a broker it cannot connect to raises `BrokerUnreachable` instead
    (aiokafka's per-address ERROR lines become its reasons, shown again with `verbose`)."""
    reasons = _Reasons(show=verbose)
    logger = logging.getLogger(AIOKAFKA_LOGGER)
    logger.addFilter(reasons)
    try:
        yield
    except KafkaConnectionError as exc:
        raise unreachable(kafka, reasons.reasons, exc) from None
    finally:
        logger.removeFilter(reasons)


INIT_PRODUCER_ID, TXN_OFFSET_COMMIT, OFFSET_FETCH = 22, 28, 9


async def transactions_unsupported(client: AIOKafkaClient) -> str | None:
    """Why the broker cannot give exactly-once output, or None when it can: it must
    know transactions (InitProducerId), TxnOffsetCommit v3 and OffsetFetch v7.
    `client`: a started client's (a producer's `client`, an admin's `_client`)."""
    brokers = sorted(broker.nodeId for broker in client.cluster.brokers())
    if not brokers:
        return "no broker in the cluster metadata"
    versions: dict[int, tuple[int, int]] = (await client._get_conn(brokers[0]))._versions
    needs = {INIT_PRODUCER_ID: (0, "transactions"), TXN_OFFSET_COMMIT: (3, "TxnOffsetCommit v3"),
             OFFSET_FETCH: (7, "OffsetFetch v7")}  # fmt: skip
    missing = [what for key, (least, what) in needs.items()
               if key not in versions or versions[key][1] < least]  # fmt: skip
    return f"the broker lacks {', '.join(missing)} (Kafka 2.5+ has them)" if missing else None
