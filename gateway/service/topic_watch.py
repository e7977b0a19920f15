"""Every topic the settings name exists: checked, never created (issue 58).

No client of the gateway asks the broker to create a topic
(gateway/kafka/clients.py, `install_no_auto_create`), so a mistyped raw or clean
topic stays missing instead of appearing with 1 partition on a broker with the
default `auto.create.topics.enable=true`. Start-up waits, unready, until every
raw, clean, failure, quarantine and dead-letter topic exists, /readyz and a
falling report saying which is missing, the nearest existing name, and the
command that creates them; it goes on by itself once they exist. While running,
the topics (the delay tiers too) are listed again every `CHECK_EVERY_S`: one
deleted holds /readyz at 503 the same way until it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from pathlib import Path

from aiokafka import AIOKafkaClient
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from gateway.config import KafkaSettings, Settings
from gateway.kafka.clients import aiokafka_options
from gateway.rules.missing_topics import missing_line
from gateway.rules.tiers import tier_topics
from gateway.waits import FallingReport, wait_or_stop

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 30.0  # while running: a listing of all topics' names, never creating one


def configured_topics(settings: Settings, tiers: bool = False) -> dict[str, str]:
    """name -> role of every topic `settings` name, in the order records flow;
    with `tiers`, the delay tier topics too (when `[delay]` is on)."""
    kafka = settings.kafka
    named: dict[str, str] = {}
    for lane in settings.lanes:
        for raw in lane.raw_topics:
            named.setdefault(raw, "raw")
    for lane in settings.lanes:
        named.setdefault(lane.clean_topic or kafka.clean_topic, "clean")
    if tiers and settings.delay.enabled:
        for tier in tier_topics(settings):
            named.setdefault(tier, "delay tier")
    named.setdefault(kafka.failure_topic, "failure")
    named.setdefault(kafka.quarantine_topic, "quarantine")
    named.setdefault(kafka.dead_letter_topic, "dead-letter")
    return named


class TopicWatch:
    """What /readyz says about the topics: `problem` is None while all exist."""

    def __init__(self, settings: Settings, config: Path | None = None) -> None:
        self.settings = settings
        self.config = config
        self.problem: str | None = None

    def judge(self, existing: Collection[str], tiers: bool) -> str | None:
        """`problem` for a listing of the broker's topic names (and log a change)."""
        needed = configured_topics(self.settings, tiers)
        missing = {name: role for name, role in needed.items() if name not in existing}
        problem = missing_line(missing, existing, self.config) if missing else None
        if problem is None and self.problem is not None:
            logger.info("every configured topic exists now")
        self.problem = problem
        return problem

    async def wait(self, kafka: KafkaSettings, stop: asyncio.Event, retry_s: float = 1.0) -> bool:
        """Return True once every topic but the delay tiers (start-up checks those on
        its own, gateway/service/app.py) exists; False at `stop`. Raises KafkaError or
        OSError when the broker stops answering."""
        report = FallingReport(retry_s)
        admin = AIOKafkaAdminClient(**aiokafka_options(kafka))
        try:
            await admin.start()
            while not stop.is_set():
                problem = self.judge(set(await admin.list_topics()), tiers=False)
                if problem is None:
                    return True
                if report.due():
                    logger.warning(
                        "%s; not ready, checking again every %gs (next report in %gs)",
                        problem, retry_s, report.every,
                    )  # fmt: skip
                await wait_or_stop(stop, retry_s)
            return False
        finally:
            await admin.close()

    async def watch(
        self, client: AIOKafkaClient, stop: asyncio.Event, every_s: float = CHECK_EVERY_S
    ) -> None:
        """Until `stop`: list the topics every `every_s` through `client` (all topics'
        metadata, which never creates one) and judge them, the tiers included."""
        while not await wait_or_stop(stop, every_s):
            try:
                cluster = await client.fetch_all_metadata()
            except KafkaError as exc:  # the loops report an unreachable broker
                logger.debug("listing the topics failed: %r", exc)
                continue
            before = self.problem
            problem = self.judge(cluster.topics(exclude_internal_topics=False), tiers=True)
            if problem is not None and problem != before:
                logger.warning("%s; not ready until it exists", problem)
