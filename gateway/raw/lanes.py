"""Priority lanes: lower lanes wait while a higher lane has a backlog (RMQ's priority type).

A lane is a set of raw topics with a priority (`[[lanes]]`; without them,
`[kafka] raw_topics` is one lane). Before each fetch the raw loop asks which
lanes to hold: a lane is held while a lane of higher priority has more than
that lane's `lag_threshold` records not yet read, counted over every partition
of its topics in the whole group, so a gateway that owns only low-lane
partitions holds them too. Holding is `consumer.pause` of the lane's
partitions: nothing is read or committed past them, so a held lane loses
nothing and moves with a rebalance as usual.

A lane held for its `max_starve` is let through (a starvation release) until a
batch brought records of it or STARVE_WINDOW_S passed; then it is held again if
a higher lane still presses.

Lag of a partition: for this gateway's own, the fetch-response high watermark
(or the end offset, whichever is higher) minus the position; for the others,
the end offset (ListOffsets) minus the group's committed offset, refreshed
every LAG_EVERY_S. Until the first read, only the top lanes run (a group join
can finish before it). On a raw topic with transactions the end offset is the
last stable offset (the consumers read `read_committed`).

Dedup is across lanes (one quorum): of two copies, the one voted first wins,
normally the higher lane's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.raw.blocking import BlockedPartitions
from gateway.rules.lanes import plan
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)

LAG_EVERY_S = 1.0  # how often the group-wide lag of every lane is read
STARVE_WINDOW_S = 1.0  # longest a starvation release lasts without bringing a batch


class LaneScheduler:
    """Pauses and resumes the raw consumer's partitions by lane; reads the lanes' lag."""

    def __init__(self, settings: Settings, blocked: BlockedPartitions, metrics: Metrics) -> None:
        self.lanes = sorted(settings.lanes, key=lambda lane: -lane.priority)
        self.lane_of = {topic: lane.name for lane in self.lanes for topic in lane.raw_topics}
        self.blocked = blocked
        self.metrics = metrics
        # Nothing to schedule unless two lanes differ in priority.
        self.active = len({lane.priority for lane in self.lanes}) > 1
        self.lag: dict[str, int] = {lane.name: 0 for lane in self.lanes}
        self.held: set[str] = set()
        self.held_since: dict[str, float] = {}
        self.releasing: dict[str, float] = {}  # starved lane -> end of its release
        self.paused: set[TopicPartition] = set()  # what this scheduler paused
        # Until the lag is first read, only the top lanes run: a group join can finish
        # (and a fetch bring records) before that read does.
        self.lag_known = False

    def apply(self, consumer: AIOKafkaConsumer) -> list[TopicPartition]:
        """Before a fetch: pause the held lanes' partitions, resume the rest it paused
        (a partition blocked on an undecided vote stays paused until its backoff ends).

        Returns the partitions of lanes in a starvation release, to be fetched first:
        aiokafka hands out buffered records in fetch order, so a higher lane's large
        buffer would otherwise keep a released lane waiting until it is drained.
        """
        if not self.active:
            return []
        now = time.monotonic()
        for name, until in list(self.releasing.items()):
            if now >= until:
                del self.releasing[name]
        if self.lag_known:
            hold, starved = plan(self.lanes, self.lag, self.held_since, now)
        else:
            top = self.lanes[0].priority
            hold, starved = {lane.name for lane in self.lanes if lane.priority < top}, set()
        for name in starved:
            self.releasing[name] = now + STARVE_WINDOW_S
            self.held_since.pop(name, None)
            self.metrics.lane_starvation_releases.labels(name).inc()
            logger.info("lane %s let through for one fetch: held back for its max_starve", name)
        hold -= self.releasing.keys()
        for name in hold:
            self.held_since.setdefault(name, now)
        for name in set(self.held_since) - hold - starved:
            del self.held_since[name]
        if hold != self.held:
            logger.info("lanes held: %s (lag %s)", sorted(hold) or "none", self.lag)
            for lane in self.lanes:
                self.metrics.lane_paused.labels(lane.name).set(1 if lane.name in hold else 0)
            self.held = hold
        assigned = consumer.assignment()
        pause = {tp for tp in assigned if self.lane_of.get(tp.topic) in hold}
        resume = [
            tp for tp in self.paused - pause if tp in assigned and not self.blocked.holding(tp, now)
        ]
        if pause:
            consumer.pause(*pause)
        if resume:
            consumer.resume(*resume)
        self.paused = pause
        return [
            tp
            for tp in assigned
            if self.lane_of.get(tp.topic) in self.releasing and not self.blocked.holding(tp, now)
        ]

    def fetched(self, partitions: Iterable[TopicPartition]) -> None:
        """A batch brought records of these partitions: a starved lane's release has done."""
        for tp in partitions:
            self.releasing.pop(self.lane_of.get(tp.topic, ""), None)

    async def run(self, consumer: AIOKafkaConsumer, stop: asyncio.Event) -> None:
        """Read every lane's group-wide lag every LAG_EVERY_S until `stop`."""
        while self.active and not stop.is_set():
            await wait_or_stop(stop, LAG_EVERY_S)
            try:
                await self.read_lag(consumer)
            except (KafkaError, OSError, TimeoutError) as exc:
                logger.warning("lane lag not read (%r): keeping the last values", exc)

    async def first_read(self, consumer: AIOKafkaConsumer) -> None:
        """The lag before the first fetch (metadata refreshed first); a failure only logs."""
        try:
            await consumer.topics()  # fetches the topics' metadata: their partitions
            await self.read_lag(consumer)
        except (KafkaError, OSError, TimeoutError) as exc:
            logger.warning("lane lag not read at start (%r): every lane runs until it is", exc)
            self.lag_known = True

    async def read_lag(self, consumer: AIOKafkaConsumer) -> None:
        partitions = [
            TopicPartition(topic, p)
            for topic in self.lane_of
            for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        if not partitions:
            return
        ends = await consumer.end_offsets(partitions)
        assigned = consumer.assignment()
        others = [tp for tp in partitions if tp not in assigned]
        committed = await asyncio.gather(*(consumer.committed(tp) for tp in others))
        starts = await consumer.beginning_offsets(
            [tp for tp, c in zip(others, committed, strict=True) if c is None]
        ) if None in committed else {}  # fmt: skip
        lag = dict.fromkeys(self.lag, 0)
        for tp, offset in zip(others, committed, strict=True):
            read = offset if offset is not None else starts[tp]
            lag[self.lane_of[tp.topic]] += max(0, ends[tp] - read)
        for tp in partitions:
            if tp in assigned:
                high = max(consumer.highwater(tp) or 0, ends[tp])
                lag[self.lane_of[tp.topic]] += max(0, high - await consumer.position(tp))
        self.lag = lag
        self.lag_known = True
        for name, records in lag.items():
            self.metrics.lane_lag.labels(name).set(records)
