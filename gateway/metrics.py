"""Every Prometheus metric of the gateway, declared in one place.

Metrics are built against a registry passed in, so each test (and each gateway
in one process) gets its own. Names follow `dedup_gateway_<thing>_<unit>`.
The Grafana dashboard and the alert rules query exactly these names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "dedup_gateway"

# Redis script calls take ~1 ms for small batches, tens of ms for large ones.
_CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.records_in = Counter(
            f"{PREFIX}_records_in", "Raw records consumed", ["topic"], registry=r
        )
        self.forwarded = Counter(
            f"{PREFIX}_records_forwarded", "Records forwarded to the clean topic", registry=r
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
            "Latency of one script call to one Redis instance",
            ["redis", "script"],
            buckets=_CALL_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            f"{PREFIX}_redis_errors",
            "Failed or timed-out calls to one Redis instance",
            ["redis", "kind"],
            registry=r,
        )
        self.redis_up = Gauge(
            f"{PREFIX}_redis_up",
            "1 when the instance answered its last call",
            ["redis"],
            registry=r,
        )
        self.quorum_size = Gauge(
            f"{PREFIX}_quorum_size", "Instances needed for a majority (m)", registry=r
        )
        self.quorum_healthy = Gauge(
            f"{PREFIX}_quorum_healthy", "1 when at least m instances answer", registry=r
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
        self.consumer_lag = Gauge(
            f"{PREFIX}_consumer_lag_records",
            "High watermark minus position, per assigned raw partition",
            ["topic", "partition"],
            registry=r,
        )
        self.partitions_blocked = Gauge(
            f"{PREFIX}_partitions_blocked",
            "Raw partitions paused on an undecided vote (policy block)",
            registry=r,
        )
        self.ready = Gauge(f"{PREFIX}_ready", "1 when /readyz would answer 200", registry=r)
        # The failure loop (release / retry / dead-letter).
        self.releases = Counter(
            f"{PREFIX}_releases",
            "Release commands handled, by result (released, stale, no_quorum)",
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

    def handled(self) -> int:
        """Raw records the data path finished with: forwarded, dropped or quarantined."""
        quarantined = sum(
            sample.value
            for metric in self.quarantined.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
        return int(self.forwarded._value.get() + self.duplicates._value.get() + quarantined)
