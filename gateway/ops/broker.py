"""An operator command that cannot reach the broker says so in one line and exits 3.

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

from aiokafka.errors import KafkaConnectionError

from gateway.config import KafkaSettings
from gateway.errors import BrokerUnreachable

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
