"""The raw path's copies through scheduled delivery: a decided-new row not yet due goes
to a delay tier (gateway/delay/router.py), and with coalescing every row waits there
for its window's close (gateway/delay/coalescer.py). It matches the raw pipeline's
`Routes` (gateway/raw/routes.py); the composition root picks it when `[delay]` is on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence

from gateway.contract.records import OutRow, Record
from gateway.delay.coalescer import Coalescer
from gateway.delay.router import Router
from gateway.kafka.sink import Sink


class Scheduled:
    """Rows are routed when the batch is sent, not at the vote's end: what is due is
    judged as late as it can be, and a window's update is written in fetch order."""

    def __init__(
        self, sink: Sink, clean_topic: str, router: Router, coalescer: Coalescer | None = None
    ) -> None:
        self.sink = sink
        self.clean_topic = clean_topic
        self.router = router
        self.coalescer = coalescer

    def checked(self, extract: Callable[[Record], bytes]) -> Callable[[Record], bytes]:
        """Bad delay headers, and (coalescing) a record without a key, are bad input."""
        extract = self.router.checked(extract)
        return extract if self.coalescer is None else self.coalescer.checked(extract)

    async def ready(
        self, clean: Sequence[OutRow], lanes: Mapping[str, Sequence[OutRow]]
    ) -> Callable[[], Awaitable[list[int | None]]]:
        async def send() -> list[int | None]:
            if self.coalescer is not None:
                updated = await self.coalescer.update(clean)
                rows = [row for row, _ in updated]
                forward, delayed = self.router.route(rows, [close for _, close in updated])
            else:
                forward, delayed = self.router.route(clean)
            await asyncio.gather(
                self.sink.deliver(self.clean_topic, forward),
                *(self.sink.deliver(tier, rows) for tier, rows in delayed.items()),
                *(self.sink.deliver(topic, rows) for topic, rows in lanes.items()),
            )
            return [row[2] for row in forward] + [row[2] for rows in lanes.values() for row in rows]

        return send
