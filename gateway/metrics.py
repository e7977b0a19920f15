"""Every Prometheus metric of the gateway, declared in one place.

Metrics are built against a registry passed in, so each test (and each gateway
in one process) gets its own. Names follow `dedup_gateway_<thing>_<unit>`.
The Grafana dashboard and the alert rules query exactly these names. The
registry also holds the process's CPU and memory (`process_*`) and the Python
version (`python_info`).

Labelled counters start at zero for every label value known at start
(`preinit`): an alert on `increase(...)` then sees the first event, which it
would miss if the series appeared with it.

Under `run --workers N` (gateway/service/workers.py) every worker writes its metrics
to files and the supervisor serves the sum: counters and histograms add up
(a restarted worker's predecessor keeps counting), and each gauge names how
the live workers' values combine (`multiprocess_mode`; ignored in one process).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from itertools import islice
from typing import Any, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from gateway.config import DedupSettings, Settings
from gateway.errors import (
    BAD_RECORD_REASONS,
    INVALID_COMMAND_REASONS,
    REDIS_ERROR_KINDS,
    RELEASE_RESULTS,
)
from gateway.member_urls import member_name

PREFIX = "dedup_gateway"
# Set in `run --workers N` workers (gateway/service/workers.py).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# The forward latency histogram observes every 16th forwarded record: a uniform
# sample (each record equally likely, whatever the batch sizes) at a 16th of
# the cost of an observation per record, which was ~4% of the data path's CPU.
LATENCY_SAMPLE_EVERY = 16
REREAD_REASONS = ("rebalance", "block")
UNDECIDED_ACTIONS: tuple[str, ...] = get_args(DedupSettings.model_fields["on_no_quorum"].annotation)

# Redis script calls take ~1 ms for small batches, tens of ms for large ones.
_CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TRANSACTIONAL_LOOPS = ("raw", "delay", "failures")  # the loops that write in transactions


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Gauge(
            f"{PREFIX}_build_info", "Always 1; the running version in a label", ["version"],
            registry=r,
        )  # fmt: skip
        self.build_info.labels(package_version()).set(1)
        self.records_in = Counter(
            f"{PREFIX}_records_in", "Raw records consumed", ["topic"], registry=r
        )
        self.forwarded = Counter(
            f"{PREFIX}_records_forwarded",
            "Records decided new and forwarded (to the clean topic, or a delay tier if not due)",
            registry=r,
        )
        self.duplicates = Counter(
            f"{PREFIX}_records_duplicate", "Records dropped as duplicates", registry=r
        )
        self.quarantined = Counter(
            f"{PREFIX}_records_quarantined",
            "Records set aside on the quarantine topic",
            ["reason"],
            registry=r,
        )
        self.undecided = Counter(
            f"{PREFIX}_votes_undecided",
            "Votes no majority decided, by the action taken",
            ["action"],
            registry=r,
        )
        self.repairs = Counter(
            f"{PREFIX}_marks_repaired", "Minority marks rewritten to the winner", registry=r
        )
        self.redis_call_seconds = Histogram(
            f"{PREFIX}_redis_call_seconds",
            "Latency of one script call to one quorum member",
            ["redis", "script"],
            buckets=_CALL_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            f"{PREFIX}_redis_errors",
            "Failed or timed-out calls to one quorum member",
            ["redis", "kind"],
            registry=r,
        )
        self.redis_up = Gauge(
            f"{PREFIX}_redis_up",
            "1 when the member answered its last call",
            ["redis"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.redis_recovering = Gauge(
            f"{PREFIX}_redis_recovering",
            "1 while the member's answers are not counted: it lost its marks (recovering) "
            "or its epoch is not known yet",
            ["redis"],
            registry=r,
        )
        self.redis_behind = Gauge(
            f"{PREFIX}_redis_behind",
            "1 while the member kept its data but missed marks (a stopped gateway run held "
            "them as fills, or this run dropped them): the gateways catch it up; 0 with "
            "redis_recovering 1 means it lost its data (`dedup-gateway rebuild`)",
            ["redis"],
            registry=r,
        )
        self.catchup_marks = Counter(
            f"{PREFIX}_catchup_marks",
            "Marks read from the counted members to catch a member up that is behind",
            ["redis"],
            registry=r,
        )
        self.catchup_running = Gauge(
            f"{PREFIX}_catchup_running",
            "1 while this gateway catches the member up (it holds the member's lease)",
            ["redis"],
            registry=r,
        )
        self.catchups = Counter(
            f"{PREFIX}_catchups",
            "Catch-ups of a member that was behind, by result (done, failed)",
            ["redis", "result"],
            registry=r,
        )
        self.redis_paused = Gauge(
            f"{PREFIX}_redis_paused",
            "1 while the member is paused by `dedup-gateway pause` (not counted)",
            ["redis"],
            registry=r,
        )
        self.redis_groups_down = Gauge(
            f"{PREFIX}_redis_groups_down",
            "Key groups of a Redis Cluster member whose last call got no answer",
            ["redis"],
            registry=r,
        )
        self.redis_marks_per_bucket = Gauge(
            f"{PREFIX}_redis_marks_per_bucket",
            "Marks per bucket of the member's current time slice (its buckets split to "
            "keep ~32: gateway/quorum/keys.py); read every [redis] ping_interval",
            ["redis"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.repair_backlog = Gauge(
            f"{PREFIX}_repair_backlog",
            "Marks waiting to be completed on a member that missed their vote",
            ["redis"],
            registry=r,
        )
        self.repairs_dropped = Counter(
            f"{PREFIX}_repairs_dropped",
            "Marks dropped from a member's full repair backlog (left on a bare majority)",
            ["redis"],
            registry=r,
        )
        self.repairs_lost_at_stop = Counter(
            f"{PREFIX}_repairs_lost_at_stop",
            "Queued fills a graceful stop could not send within its bound (the member "
            "stays noted as behind: not counted until rebuilt or 2 x ttl)",
            ["redis"],
            registry=r,
        )
        self.quorum_size = Gauge(
            f"{PREFIX}_quorum_size",
            "Members needed for a majority (m)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.quorum_healthy = Gauge(
            f"{PREFIX}_quorum_healthy",
            "1 when at least m members answer and are trusted (not recovering)",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.vote_wait = Counter(
            f"{PREFIX}_vote_wait_seconds",
            "Time the raw loop waited for a batch's vote (the next batch's claims already "
            "sent, where one was fetched): its rate is the share of time Redis round trips "
            "hold a gateway back",
            registry=r,
        )
        self.batch_seconds = Histogram(
            f"{PREFIX}_batch_seconds",
            "Time from fetch to commit for one batch",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.forward_latency = Histogram(
            f"{PREFIX}_forward_latency_seconds",
            "Raw record timestamp to the broker's acknowledgement of its clean copy",
            buckets=(0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                     30, 60, 300),
            registry=r,
        )  # fmt: skip
        self.batch_records = Histogram(
            f"{PREFIX}_batch_records",
            "Records per batch",
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2000, 5000),
            registry=r,
        )
        self.consumer_lag = _PartitionGauge(
            f"{PREFIX}_consumer_lag_records",
            "High watermark minus position, per assigned raw partition",
            ["topic", "partition"],
            registry=r,
            multiprocess_mode="livesum",  # one worker owns a partition at a time
        )
        # Coalescing windows (gateway/delay/coalescer.py).
        self.coalesce_updates = Counter(
            f"{PREFIX}_coalesce_updates",
            "Decided-new records written into their window's state",
            registry=r,
        )
        self.coalesce_windows_opened = Counter(
            f"{PREFIX}_coalesce_windows_opened",
            "Windows opened (a majority answered that the update opened it)",
            registry=r,
        )
        self.coalesce_merged = Counter(
            f"{PREFIX}_coalesce_merged",
            "Waiting records dropped at close: a newer version of the entity came in the window",
            registry=r,
        )
        self.coalesce_emitted = Counter(
            f"{PREFIX}_coalesce_windows_emitted",
            "Windows closed and their newest version forwarded",
            registry=r,
        )
        self.coalesce_lateness = Histogram(
            f"{PREFIX}_coalesce_emit_lateness_seconds",
            "A window's close (its end + grace) to the broker's acknowledgement of its clean "
            "record",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.coalesce_late = Counter(
            f"{PREFIX}_coalesce_late",
            "Updates taken after their window's close (its end + grace): not merged into "
            "what the close sent",
            registry=r,
        )
        self.coalesce_update_lateness = Histogram(
            f"{PREFIX}_coalesce_lateness_seconds",
            "How long after its window's close (its end + grace) a late update was taken",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 3600),
            registry=r,
        )
        # Priority lanes (gateway/raw/lanes.py).
        self.lane_lag = Gauge(
            f"{PREFIX}_lane_lag_records",
            "Records not yet read on a lane's raw topics, all partitions, group-wide",
            ["lane"],
            registry=r,
            multiprocess_mode="livemax",  # every worker sees the same group-wide lag
        )
        self.lane_paused = Gauge(
            f"{PREFIX}_lane_paused",
            "1 while this gateway holds a lane back for a higher one (workers: how many do)",
            ["lane"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.lane_starvation_releases = Counter(
            f"{PREFIX}_lane_starvation_releases",
            "Times a held lane was let through for one fetch after [[lanes]] max_starve",
            ["lane"],
            registry=r,
        )
        self.transactions_aborted = Counter(
            f"{PREFIX}_transactions_aborted",
            "Steps whose transaction aborted (exactly_once), by loop (raw, delay, failures): "
            "the group moved on, or the broker aborted it after transaction_timeout; read again",
            ["loop"],
            registry=r,
        )
        self.records_reread = Counter(
            f"{PREFIX}_records_reread",
            "Records fetched and left to be read again from the commits, by why: fetched "
            "before a rebalance's revoke, or past a block in the batch before",
            ["reason"],
            registry=r,
        )
        self.partitions_blocked = Gauge(
            f"{PREFIX}_partitions_blocked",
            "Raw partitions paused on an undecided vote (policy block)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.ready = Gauge(
            f"{PREFIX}_ready",
            "1 when /readyz would answer 200",
            registry=r,
            multiprocess_mode="liveall",  # per worker (label `pid`): the supervisor checks each
        )
        # A wrong `[dedup] id` quarantines every record (gateway/raw/quarantine.py).
        self.quarantine_share = Gauge(
            f"{PREFIX}_quarantine_share",
            "Share of the raw records consumed over [dedup] quarantine_alarm_window that "
            "were quarantined (0 with too few records to judge)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.quarantine_alarm = Gauge(
            f"{PREFIX}_quarantine_alarm",
            "1 while quarantine_share is above [dedup] quarantine_alarm_share: /readyz "
            "says degraded; check [dedup] id first",
            registry=r,
            multiprocess_mode="livemax",
        )
        # The failure loop (release / retry / dead-letter).
        self.releases = Counter(
            f"{PREFIX}_releases",
            "Failure commands handled, by result (released: release mode; handed_over: "
            "retry mode, the mark handed to the next attempt or a dead letter; stale: the "
            "token no longer holds, or the command was handled before; no_quorum)",
            ["result"],
            registry=r,
        )
        self.retries = Counter(
            f"{PREFIX}_retries",
            "Records forwarded again after a failure, by attempt number",
            ["attempt"],
            registry=r,
        )
        self.dead_lettered = Counter(
            f"{PREFIX}_records_dead_lettered",
            "Records sent to the dead-letter topic after max attempts",
            registry=r,
        )
        self.invalid_commands = Counter(
            f"{PREFIX}_invalid_commands",
            "Failure-topic commands skipped as invalid, by reason",
            ["reason"],
            registry=r,
        )
        # Scheduled delivery (gateway/delay/loop.py).
        self.delayed = Counter(
            f"{PREFIX}_records_delayed",
            "Records written to a delay tier (from the raw path or a larger tier), by tier",
            ["tier"],
            registry=r,
        )
        self.delay_backlog = Gauge(
            f"{PREFIX}_delay_backlog_records",
            "Tier records not yet moved on, per tier: data records read past the commit "
            "point, and the offsets not yet read up to the high watermark",
            ["tier"],
            registry=r,
        )
        self.delay_held = Gauge(
            f"{PREFIX}_delay_held_records",
            "Tier records held in memory in the last stretch before their next step",
            registry=r,
        )
        self.delay_lateness = Histogram(
            f"{PREFIX}_delay_lateness_seconds",
            "Due time to the broker's acknowledgement of the clean copy (delayed records)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )

        self._latency_phase = 0  # index of the next sampled record in the next batch

    def observe_forward_latency(self, now_ms: float, timestamps_ms: Sequence[int | None]) -> None:
        """Observe the age of every LATENCY_SAMPLE_EVERY-th forwarded record (counted
        across batches); `timestamps_ms` are the raw records' timestamps."""
        observe = self.forward_latency.observe
        for ts in islice(timestamps_ms, self._latency_phase, None, LATENCY_SAMPLE_EVERY):
            if ts is not None:
                observe((now_ms - ts) / 1000)
        self._latency_phase = (self._latency_phase - len(timestamps_ms)) % LATENCY_SAMPLE_EVERY

    def preinit(self, settings: Settings) -> None:
        """Start every labelled counter's known series at zero (reasons, actions,
        results, error kinds per quorum member, records in per raw topic)."""
        for topic in settings.kafka.raw_topics:
            self.records_in.labels(topic)
        for lane in settings.lanes:
            self.lane_lag.labels(lane.name).set(0)
            self.lane_paused.labels(lane.name).set(0)
            self.lane_starvation_releases.labels(lane.name)
        for reason in BAD_RECORD_REASONS:
            self.quarantined.labels(reason)
        for action in UNDECIDED_ACTIONS:
            self.undecided.labels(action)
        for why in REREAD_REASONS:
            self.records_reread.labels(why)
        for loop in TRANSACTIONAL_LOOPS:
            self.transactions_aborted.labels(loop)
        for result in RELEASE_RESULTS:
            self.releases.labels(result)
        for reason in INVALID_COMMAND_REASONS:
            self.invalid_commands.labels(reason)
        for node in settings.redis.nodes:
            for kind in REDIS_ERROR_KINDS:
                self.redis_errors.labels(member_name(node), kind)
            self.repairs_dropped.labels(member_name(node))
            self.repairs_lost_at_stop.labels(member_name(node))
            self.repair_backlog.labels(member_name(node)).set(0)
            self.redis_paused.labels(member_name(node)).set(0)
            self.redis_behind.labels(member_name(node)).set(0)
            self.catchup_marks.labels(member_name(node))
            self.catchup_running.labels(member_name(node)).set(0)
            for result in ("done", "failed"):
                self.catchups.labels(member_name(node), result)
            self.redis_groups_down.labels(member_name(node)).set(0)

    def handled(self) -> int:
        """Raw records the data path finished with: forwarded, dropped or quarantined."""
        return self.forwarded_total() + self.duplicates_total() + int(total(self.quarantined))

    def consumed(self) -> int:
        return int(total(self.records_in))

    def forwarded_total(self) -> int:
        return int(total(self.forwarded))

    def duplicates_total(self) -> int:
        return int(total(self.duplicates))

    def vote_wait_s(self) -> float:
        return float(total(self.vote_wait))


def package_version() -> str:
    """The installed dedup-gateway version (`--version`, `build_info`)."""
    try:
        return version("dedup-gateway")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


class _PartitionGauge(Gauge):
    """A gauge per partition. In multiprocess mode a child cannot be removed (its last
    value stays in the worker's file): it is zeroed instead, or a partition that
    moved to another worker would be counted twice."""

    def remove(self, *labelvalues: Any) -> None:
        if os.environ.get(MULTIPROC_ENV):
            self.labels(*labelvalues).set(0)
        else:
            super().remove(*labelvalues)


def total(counter: Counter, **labels: str) -> float:
    """A counter's value summed over the children matching `labels` (all when none)."""
    return sum(
        sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
        and all(sample.labels.get(k) == v for k, v in labels.items())
    )
