"""Summaries, targets and the three outputs: JSON, a PNG chart, the RESULTS.md table.

Every ratio compares two runs of the same round and duplicate share, and the
median over rounds is quoted; absolute rates are medians too.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from bench.delay import DelayRates
from bench.measure import FLOOR, LatencyRun, ThroughputRun
from bench.variants import CEILING, CLUSTER_MASTERS, FORWARDER, VARIANTS

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
# Spark's query progress phases (durationMs) quoted per batch in the spark table.
SPARK_PHASES = ("latestOffset", "queryPlanning", "walCommit", "addBatch", "commitOffsets",
                "triggerExecution")  # fmt: skip
TARGET_SHARE = 0.2
HALF_FORWARDER = "half forwarder max"  # the load named after the forwarder's maximum
# Variants also measured at half their own median maximum (bench/run.py, `_loads`).
HALF_OWN = ("gateway-3", "gateway-3-eos", "gateway-5")
# Exactly-once output against the same variant without it (bench/variants.py).
EOS, AT_LEAST_ONCE = "gateway-3-eos", "gateway-3"


def half_own(variant: str) -> str:
    """The load named after `variant`'s own maximum."""
    return f"half {variant} max"


NO_GOAL = "none (reported)"  # a target row that informs: no goal, never "missed"


@dataclass
class Results:
    runs: list[ThroughputRun]
    latencies: list[LatencyRun]
    options: dict[str, Any]
    machine: dict[str, Any] = field(default_factory=lambda: machine())
    delay: DelayRates | None = None  # scheduled delivery (bench/delay.py), when measured

    @property
    def all_correct(self) -> bool:
        delay_ok = self.delay is None or self.delay.release_correct
        return (
            all(r.correct for r in self.runs)
            and all(r.correct for r in self.latencies)
            and delay_ok
        )

    @property
    def shares(self) -> list[float]:
        return sorted({r.share for r in self.runs})

    @property
    def target_share(self) -> float:
        return TARGET_SHARE if TARGET_SHARE in self.shares else self.shares[0]

    @property
    def present(self) -> list[str]:
        """The gateway-side variants that ran, in the canonical order."""
        return [v.name for v in VARIANTS if v.kind != "spark" and self._ran(v.name)]

    @property
    def spark_present(self) -> list[str]:
        """The spark variants that ran (their own table: bench/spark.py)."""
        return [v.name for v in VARIANTS if v.kind == "spark" and self._ran(v.name)]

    def _ran(self, variant: str) -> bool:
        return any(r.variant == variant for r in self.runs)

    @property
    def spark_share(self) -> float | None:
        """The share the spark variants ran at (the targets' share, or the first)."""
        return next((r.share for r in self.runs if r.variant in self.spark_present), None)

    def spark_median(self, variant: str, key: str, per_row: bool = False) -> float:
        """Median over rounds of a spark run's `spark[key]` (per row read with `per_row`)."""
        share = self.spark_share
        return statistics.median(
            float(r.spark[key]) / (r.records if per_row else 1)
            for r in self.runs
            if r.variant == variant and r.share == share and r.spark is not None
        )

    def spark_summary(self) -> list[dict[str, Any]]:
        share = self.spark_share
        if share is None:
            return []
        rows = []
        for name in self.spark_present:
            runs = self.of(name, share)
            phases = {
                phase: statistics.median(
                    r.spark["phases_ms"].get(phase, 0.0) / r.spark["batches"]
                    for r in runs
                    if r.spark is not None
                )
                for phase in SPARK_PHASES
            }
            rows.append({
                "variant": name, "share": share, "rate": self.rate(name, share),
                "ratio_to_floor": self.ratio(name, "spark-floor", share),
                "ratio_to_gateway_3": self.ratio(name, "gateway-3", share),
                **{f"{key}_us_per_row": self.spark_median(name, key, per_row=True) * 1e6
                   for key in ("driver_cpu_s", "jvm_cpu_s", "workers_cpu_s")},
                "cpu_us_per_row": self.per_million(name, share, "gateway_cpu_s"),
                "batches": self.spark_median(name, "batches"),
                "batch_fixed_s": self.spark_median(name, "batch_fixed_s"),
                "phase_ms_per_batch": phases,
                "rounds": len(runs),
                "correct": all(r.correct for r in runs),
            })  # fmt: skip
        return rows

    def of(self, variant: str, share: float) -> list[ThroughputRun]:
        return [r for r in self.runs if r.variant == variant and r.share == share]

    def rate(self, variant: str, share: float) -> float:
        return statistics.median(r.rate for r in self.of(variant, share))

    def ratio(self, variant: str, baseline: str, share: float) -> float | None:
        """Median over rounds of variant/baseline, both from the same round."""
        return self._paired(variant, baseline, share, lambda r: r.rate)

    def cores_busy(self, run: ThroughputRun) -> float:
        """The share of the machine's cores `run` kept busy: the CPU of its gateway
        process(es), Redis instances and broker over its wall time."""
        cpu = run.gateway_cpu_s + run.redis_cpu_s + run.broker_cpu_s
        cores: int = self.machine["cores"]
        return cpu / (run.seconds * cores)

    def cores_allow(self, variant: str, baseline: str, share: float) -> float | None:
        """Median over rounds of the most variant/baseline could be on this machine:
        `variant`'s records/s had it kept every core busy at its CPU per record
        (gateway, Redis and broker, which share the cores here), against `baseline`'s
        records/s in the same round."""
        return self._paired(variant, baseline, share, lambda r: r.rate / self.cores_busy(r))

    def _paired(
        self, variant: str, baseline: str, share: float, value: Callable[[ThroughputRun], float]
    ) -> float | None:
        """Median over rounds of value(variant's run) / baseline's records/s, same round."""
        base = {r.round: r.rate for r in self.of(baseline, share)}
        pairs = [value(r) / base[r.round] for r in self.of(variant, share) if r.round in base]
        return statistics.median(pairs) if pairs else None

    def process_cpu_ratio(self, variant: str, baseline: str, share: float) -> float | None:
        """Median over rounds of variant's gateway-process CPU per record / baseline's,
        both from the same round."""
        base = {r.round: r.gateway_cpu_s / r.records for r in self.of(baseline, share)}
        pairs = [
            r.gateway_cpu_s / r.records / base[r.round]
            for r in self.of(variant, share)
            if base.get(r.round)
        ]
        return statistics.median(pairs) if pairs else None

    def cpu_split(self, variant: str, share: float) -> dict[str, Any] | None:
        """µs of CPU per record by process, medians over rounds: the gateway process,
        each Redis server, the broker, and all of them."""
        runs = self.of(variant, share)
        if not runs:
            return None
        servers = min(len(r.redis_cpu_each_s) for r in runs)

        def us(values: Iterable[float]) -> float:
            return statistics.median(values) * 1e6

        return {
            "variant": variant,
            "share": share,
            "gateway_us": us(r.gateway_cpu_s / r.records for r in runs),
            "redis_us": [us(r.redis_cpu_each_s[k] / r.records for r in runs)
                         for k in range(servers)],
            "broker_us": us(r.broker_cpu_s / r.records for r in runs),
            "total_us": us((r.gateway_cpu_s + r.redis_cpu_s + r.broker_cpu_s) / r.records
                           for r in runs),
        }  # fmt: skip

    def per_million(self, variant: str, share: float, attr: str) -> float:
        return statistics.median(
            float(getattr(r, attr)) / r.records * 1e6 for r in self.of(variant, share)
        )

    def redis_us_per_new_id(self, variant: str) -> tuple[str, float] | None:
        """(where, Redis CPU µs per new id per instance) at the target share, the
        duplicates' lookups charged to the new ids, and the fill it was measured at."""
        instances = int(variant.split("-")[1])
        share = self.target_share
        if not self.of(variant, share) or share >= 1:
            return None
        cost = self.per_million(variant, share, "redis_cpu_s") / instances / (1 - share)
        return f"per instance, {share:.0%} dups, {self.fill(variant)}", cost

    def fill(self, variant: str) -> str:
        """Where `variant`'s members stood: live slices searched and marks per bucket
        (bench/steady.py), from its runs at the target share."""
        runs = self.of(variant, self.target_share) or [r for r in self.runs if r.variant == variant]
        slices = max((r.live_slices for r in runs), default=0)
        per_bucket = statistics.median(r.marks_per_bucket for r in runs) if runs else 0.0
        if not slices:
            return "fill not recorded"
        marks = f"{per_bucket:.0f}" if per_bucket >= 10 else f"{per_bucket:.1f}"
        return f"{slices} live slice{'s' if slices > 1 else ''}, ~{marks} marks per bucket"

    def bytes_per_mark(self, variant: str) -> float | None:
        """Per standalone instance, median over instances and runs."""
        values = [b for r in self.runs if r.variant == variant for b in r.bytes_per_mark]
        return statistics.median(values) if values else None

    def cluster_bytes_per_mark(self, variant: str, clients: bool = False) -> float | None:
        """Per cluster member (growth summed over its masters), median over runs; with
        `clients`, only the part its client connections' buffers hold."""
        values = [
            b
            for r in self.runs
            if r.variant == variant
            for b in (r.cluster_client_bytes_per_mark if clients else r.cluster_bytes_per_mark)
        ]
        return statistics.median(values) if values else None

    def latency(self, variant: str, load: str) -> LatencyRun | None:
        return next((r for r in self.latencies if (r.variant, r.load) == (variant, load)), None)

    @property
    def loads(self) -> list[str]:
        return list(dict.fromkeys(r.load for r in self.latencies))

    def added(self, run: LatencyRun, p: int) -> float | None:
        """`run`'s percentile minus broker-floor's at the same load: what the variant adds."""
        floor = self.latency(FLOOR, run.load)
        return None if floor is None else run.percentile(p) - floor.percentile(p)

    def targets(self) -> list[dict[str, Any]]:
        """Measured against a goal; a row whose goal is NO_GOAL is reported, never missed.
        `cores allow`: for a ratio whose first variant's Redis instances share the
        machine's cores, the most it could be here (`cores_allow`)."""
        share = self.target_share
        rows: list[tuple[str, str, str, float | None, Callable[[float], bool | None]]] = [
            ("forwarder / client-ceiling", f"{share:.0%} dups", ">= 0.6",
             self.ratio(FORWARDER.name, CEILING.name, share), lambda v: v >= 0.6),
            ("forwarder / client-ceiling-headers", f"{share:.0%} dups", NO_GOAL,
             self.ratio(FORWARDER.name, "client-ceiling-headers", share), lambda v: None),
            ("gateway-3 / forwarder", f"{share:.0%} dups", ">= 0.75",
             self.ratio("gateway-3", FORWARDER.name, share), lambda v: v >= 0.75),
            ("gateway-5 / gateway-3", f"{share:.0%} dups", ">= 0.8",
             self.ratio("gateway-5", "gateway-3", share), lambda v: v >= 0.8),
            ("gateway-3 / naive-3", f"{share:.0%} dups", ">= 20",
             self.ratio("gateway-3", "naive-3", share), lambda v: v >= 20),
            ("gateway-3-cluster / gateway-3", f"{share:.0%} dups", NO_GOAL,
             self.ratio("gateway-3-cluster", "gateway-3", share), lambda v: None),
        ]  # fmt: skip
        rows.append(("gateway-3 process CPU per record / forwarder's", f"{share:.0%} dups",
                     "<= 1.25", self.process_cpu_ratio("gateway-3", FORWARDER.name, share),
                     lambda v: v <= 1.25))  # fmt: skip
        rows += [
            (f"{EOS} / {AT_LEAST_ONCE}", f"{share:.0%} dups", ">= 0.8",
             self.ratio(EOS, AT_LEAST_ONCE, share), lambda v: v >= 0.8),
            (f"{EOS} process CPU per record / {AT_LEAST_ONCE}'s", f"{share:.0%} dups", NO_GOAL,
             self.process_cpu_ratio(EOS, AT_LEAST_ONCE, share), lambda v: None),
        ]  # fmt: skip
        for load in self.loads:
            if (lat := self.latency("gateway-3", load)) is not None:
                rows.append(("gateway-3 p99 over broker-floor, ms", load, "<= 25",
                             self.added(lat, 99), lambda v: v <= 25))  # fmt: skip
            if (lat := self.latency(EOS, load)) is not None:
                rows.append((f"{EOS} p99 over broker-floor, ms (to the commit)", load, NO_GOAL,
                             self.added(lat, 99), lambda v: None))  # fmt: skip
        if (lat := self.latency("gateway-5", half_own("gateway-5"))) is not None:
            rows.append(("gateway-5 p99 over broker-floor, ms", lat.load, NO_GOAL,
                         self.added(lat, 99), lambda v: None))  # fmt: skip
        if (cost := self.redis_us_per_new_id("gateway-3")) is not None:
            rows.append(("Redis CPU per new id, µs", cost[0], "<= 4", cost[1],
                         lambda v: v <= 4))  # fmt: skip
        if (mark := self.bytes_per_mark("gateway-3")) is not None:
            rows.append(("Redis bytes per mark", f"per instance, {self.fill('gateway-3')}",
                         "<= 45", mark, lambda v: v <= 45))  # fmt: skip
        # The same on members that start empty with the default bucket count: how the
        # benchmark measured before it filled them (small buckets, one live slice).
        if (cost := self.redis_us_per_new_id("gateway-3-fresh")) is not None:
            rows.append(("Redis CPU per new id, gateway-3-fresh, µs", cost[0], NO_GOAL,
                         cost[1], lambda v: None))  # fmt: skip
        if (mark := self.bytes_per_mark("gateway-3-fresh")) is not None:
            rows.append(("Redis bytes per mark, gateway-3-fresh",
                         f"per instance, {self.fill('gateway-3-fresh')}", NO_GOAL, mark,
                         lambda v: None))  # fmt: skip
        if (mark := self.cluster_bytes_per_mark("gateway-3-cluster")) is not None:
            # Reported: the goal is per instance; a cluster member's masters each hold a
            # share of the buckets, few marks per bucket at this run's size.
            rows.append(("Redis bytes per mark, gateway-3-cluster",
                         f"cluster member ({CLUSTER_MASTERS} masters summed)", NO_GOAL, mark,
                         lambda v: None))  # fmt: skip
        if (spark := self.spark_share) is not None:
            where = f"{spark:.0%} dups"
            rows += [
                ("spark-job-eos / gateway-3", f"{where}, delivery dedup off", ">= 1.0",
                 self.ratio("spark-job-eos", "gateway-3", spark), lambda v: v >= 1.0),
                ("spark-job / gateway-3", f"{where}, delivery dedup on", ">= 0.6",
                 self.ratio("spark-job", "gateway-3", spark), lambda v: v >= 0.6),
                ("spark-job-redis / gateway-3", f"{where}, delivery dedup in Redis", ">= 0.6",
                 self.ratio("spark-job-redis", "gateway-3", spark), lambda v: v >= 0.6),
                ("spark-floor / gateway-3", where, ">= 2.0",
                 self.ratio("spark-floor", "gateway-3", spark), lambda v: v >= 2.0),
                ("spark-job / spark-floor", where, NO_GOAL,
                 self.ratio("spark-job", "spark-floor", spark), lambda v: None),
                ("spark-job-passthrough / spark-job", where, NO_GOAL,
                 self.ratio("spark-job-passthrough", "spark-job", spark), lambda v: None),
            ]  # fmt: skip
            fixed = (("spark-job-eos", "dedup off"), ("spark-job-redis", "dedup in Redis"),
                     ("spark-job", "dedup in the state store"))  # fmt: skip
            for job, dedup in fixed:
                if job in self.spark_present:
                    fixed_s = self.spark_median(job, "batch_fixed_s")
                    rows.append(("Spark fixed cost per micro-batch, s",
                                 f"{job}, 1-record batch, {dedup}", "<= 0.5", fixed_s,
                                 lambda v: v <= 0.5))  # fmt: skip
        bounded = (("gateway-3", FORWARDER.name), ("gateway-5", "gateway-3"),
                   (EOS, AT_LEAST_ONCE))  # fmt: skip
        allow = {f"{v} / {b}": self.cores_allow(v, b, share) for v, b in bounded}
        return [
            {"target": name, "where": where, "goal": goal, "measured": value, "met": met(value),
             "cores_allow": allow.get(name)}
            for name, where, goal, value, met in rows
            if value is not None
        ]  # fmt: skip

    def summary(self) -> list[dict[str, Any]]:
        rows = []
        for share in self.shares:
            for name in self.present:
                rows.append({
                    "variant": name, "share": share, "rate": self.rate(name, share),
                    "ratio_to_forwarder": self.ratio(name, FORWARDER.name, share),
                    "ratio_to_ceiling": self.ratio(name, CEILING.name, share),
                    "gateway_cpu_s_per_m": self.per_million(name, share, "gateway_cpu_s"),
                    "redis_cpu_s_per_m": self.per_million(name, share, "redis_cpu_s"),
                    "broker_cpu_s_per_m": self.per_million(name, share, "broker_cpu_s"),
                    "cores_busy": statistics.median(map(self.cores_busy, self.of(name, share))),
                    "vote_wait_share": statistics.median(
                        r.vote_wait_s / r.seconds for r in self.of(name, share)
                    ),
                    "rounds": len(self.of(name, share)),
                    "correct": all(r.correct for r in self.of(name, share)),
                })  # fmt: skip
        return rows

    def exactly_once(self) -> list[dict[str, Any]]:
        """Per share, gateway-3-eos against gateway-3 in the same rounds: the ratio of
        records/s (median, and each round's), CPU per record by process, the raw
        transactions (records per transaction, aborted), and whether every run's
        `read_committed` read of the clean topic held each id once."""
        rows = []
        for share in self.shares:
            eos, base = self.of(EOS, share), self.of(AT_LEAST_ONCE, share)
            if not eos or not base:
                continue
            by_round = {r.round: r.rate for r in base}
            rows.append({
                "share": share,
                "ratio": self.ratio(EOS, AT_LEAST_ONCE, share),
                "ratio_per_round": [r.rate / by_round[r.round] for r in eos
                                    if r.round in by_round],
                "rates": {EOS: self.rate(EOS, share),
                          AT_LEAST_ONCE: self.rate(AT_LEAST_ONCE, share)},
                "cpu_split": {name: self.cpu_split(name, share) for name in (EOS, AT_LEAST_ONCE)},
                "transactions": statistics.median(r.transactions for r in eos),
                "records_per_transaction": statistics.median(
                    r.records / r.transactions for r in eos if r.transactions
                ) if any(r.transactions for r in eos) else None,
                "aborted": sum(r.transactions_aborted for r in eos),
                # Per transaction, ms: open (begun to committed), and of it the closing
                # (the last copy acknowledged to committed: offsets, EndTxn); and the share
                # of the run's wall time a transaction was open.
                "open_ms": statistics.median(r.transaction_open_s / r.transactions * 1000
                                             for r in eos if r.transactions)
                if any(r.transactions for r in eos) else None,
                "closing_ms": statistics.median(r.transaction_closing_s / r.transactions * 1000
                                                for r in eos if r.transactions)
                if any(r.transactions for r in eos) else None,
                "open_share": statistics.median(r.transaction_open_s / r.seconds for r in eos),
                # gateway-3's counterpart of closing_ms: its offset commit, after the
                # batch's copies were acknowledged.
                "base_commit_ms": _per(base, "offset_commit_s", "offset_commits"),
                # A batch's copies sent until acknowledged (inside the transaction for eos).
                "forward_ms": _per(eos, "forward_s", "forwards"),
                "begin_ms": _per(eos, "transaction_begin_s", "transactions"),
                "base_forward_ms": _per(base, "forward_s", "forwards"),
                "committed_ids_once": all(r.committed_ids_once for r in eos),
            })  # fmt: skip
        return rows

    def as_dict(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "options": self.options,
            "summary": self.summary(),
            "exactly_once": self.exactly_once(),
            "spark": self.spark_summary(),
            "scaling": self.scaling(),
            "latency": [
                {
                    **r.as_dict(),
                    "p50_added_ms": self.added(r, 50),
                    "p99_added_ms": self.added(r, 99),
                }
                for r in self.latencies
            ],
            "bytes_per_mark": {name: self.bytes_per_mark(name) for name in self.present},
            "cluster_bytes_per_mark": {
                name: {"total": value, "clients": self.cluster_bytes_per_mark(name, clients=True)}
                for name in self.present
                if (value := self.cluster_bytes_per_mark(name)) is not None
            },
            "targets": self.targets(),
            "cpu_split": self.cpu_splits(),
            "delay": None
            if self.delay is None
            else {**asdict(self.delay), "ratios": self.delay.ratios},
            "runs": [r.as_dict() for r in self.runs],
        }

    def cpu_splits(self) -> list[dict[str, Any]]:
        """`cpu_split` of the forwarder and the product variants that ran, target share."""
        names = (FORWARDER.name, "gateway-3", EOS, "gateway-3-fresh", "gateway-5")
        splits = (self.cpu_split(n, self.target_share) for n in names if n in self.present)
        return [s for s in splits if s is not None]

    def scaling(self) -> dict[str, Any] | None:
        """gateway-3 as 2 worker processes against 1, in the same round."""
        share = self.target_share
        ratio = self.ratio("gateway-3x2", "gateway-3x1", share)
        if ratio is None:
            return None
        return {
            "share": share,
            "ratio": ratio,
            "rates": {n: self.rate(n, share) for n in ("gateway-3x1", "gateway-3x2")},
            "cpu_s_per_m": {
                n: self.per_million(n, share, "gateway_cpu_s")
                for n in ("gateway-3x1", "gateway-3x2")
            },
        }


def _per(runs: list[ThroughputRun], seconds: str, count: str) -> float | None:
    """Median over `runs` of `seconds` / `count` in ms (runs with a count only)."""
    values = [getattr(r, seconds) / getattr(r, count) * 1000 for r in runs if getattr(r, count)]
    return statistics.median(values) if values else None


def machine(load_at_start: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """The host, and its load average (1, 5, 15 minutes) now and at the run's start: other
    work on the machine shares its cores with the benchmark."""
    cpu = "unknown"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        if found := re.search(r"model name\s*:\s*(.+)", cpuinfo):
            cpu = found.group(1).strip()
    except OSError:
        pass
    redis = shutil.which("redis-server")
    redis_version = (
        subprocess.run([redis, "--version"], capture_output=True, text=True).stdout.split()[2]
        if redis
        else "absent"
    )
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis": redis_version.removeprefix("v="),
        "load_at_start": list(load_at_start) if load_at_start is not None else None,
        "load_at_end": list(os.getloadavg()),
    }


def write(results: Results, out: Path, results_md: Path | None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "results.json", out / "results.png"
    json_path.write_text(json.dumps(results.as_dict(), indent=2) + "\n")
    chart(results, png_path)
    paths = [json_path, png_path]
    if results_md is not None:
        update_markdown(results_md, markdown(results, png_path, results_md))
        paths.append(results_md)
    return paths


def chart(results: Results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = results.present
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(results.shares)
    for i, share in enumerate(results.shares):
        rates = [results.rate(n, share) / 1000 for n in names]
        xs = [x + i * width for x in range(len(names))]
        bars = left.bar(xs, rates, width, label=f"{share:.0%} duplicates")
        for bar, name in zip(bars, names, strict=True):
            ratio = results.ratio(name, FORWARDER.name, share)
            left.annotate(_fmt(ratio), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=7)  # fmt: skip
    left.set_xticks([x + width * (len(results.shares) - 1) / 2 for x in range(len(names))], names)
    left.set_ylabel("thousand records/s (median); label: ratio to forwarder")
    left.set_title("Throughput on a pre-filled raw topic")
    left.legend()
    if results.latencies:
        labels = [f"{r.variant}\n{r.load}" for r in results.latencies]
        xs = list(range(len(labels)))
        right.bar([x - 0.2 for x in xs], [r.percentile(50) for r in results.latencies], 0.4,
                  label="p50")  # fmt: skip
        right.bar([x + 0.2 for x in xs], [r.percentile(99) for r in results.latencies], 0.4,
                  label="p99")  # fmt: skip
        right.set_xticks(xs, labels, rotation=60, ha="right", fontsize=6)
        right.set_ylabel("ms, raw append to clean ack")
        right.set_title("End-to-end latency at the same offered loads")
        right.legend()
    fig.suptitle(f"dedup gateway benchmark, {results.machine['date']}, "
                 f"{results.machine['cores']} cores")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_line(m: dict[str, Any]) -> list[str]:
    """The machine's load average, where recorded: other work shares its cores."""
    if not m.get("load_at_end"):
        return []

    def avg(load: list[float]) -> str:
        return " / ".join(f"{v:.2f}" for v in load)

    start = f"{avg(m['load_at_start'])} at the start, " if m.get("load_at_start") else ""
    return [f"Load average (1 / 5 / 15 min): {start}{avg(m['load_at_end'])} at the end."]


def _fmt(value: float | None, digits: int = 2, missing: str = "n/a") -> str:
    return missing if value is None else f"{value:,.{digits}f}"


def _met(met: bool | None, yes: str, no: str) -> str:
    return "n/a" if met is None else yes if met else no


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def markdown(results: Results, png: Path, md_path: Path) -> str:
    m, o = results.machine, results.options
    lines = [
        f"Measured {m['date']} on {m['cores']} cores ({m['cpu']}), {m['platform']}, "
        f"Python {m['python']}, redis-server {m['redis']}, Apache Kafka broker (local stack).",
        *_load_line(m),
        f"{o['records']:,} records per run ({o['naive_records']:,} for naive-3), "
        f"{o['value_size']}-byte values, {o['partitions']} raw partitions, "
        f"{o['rounds']} rounds, medians quoted.",
        "",
        "**Targets**",
        "",
        *_table(
            ["target", "where", "goal", "measured", "met", "cores allow"],
            (
                [
                    t["target"],
                    t["where"],
                    t["goal"],
                    _fmt(t["measured"]),
                    _met(t["met"], "yes", "**no**"),
                    _fmt(t["cores_allow"], missing=""),
                ]
                for t in results.targets()
            ),
        ),
        "",
        "**Throughput** (records/s; ratios to forwarder and to client-ceiling in the same "
        "round; CPU seconds per million records: the benchmark process for in-process "
        "variants, the process tree for gateway-3xN; waits on votes: the share of the run "
        "the raw loop waited for votes, `dedup_gateway_vote_wait_seconds`, summed over "
        "workers; cores busy: gateway, Redis and broker CPU over the run's wall time and "
        f"the machine's {m['cores']} cores. `cores allow` in the targets: the ratio had "
        "its first variant kept every core busy at its CPU per record, against the "
        "second's records/s in the same round)",
        "",
        *_table(
            [
                "variant",
                "dups",
                "records/s",
                "x forwarder",
                "x ceiling",
                "gateway CPU s/M",
                "Redis CPU s/M (all instances, cluster masters included)",
                "broker CPU s/M",
                "cores busy",
                "waits on votes",
                "counts right",
            ],
            (
                [
                    s["variant"],
                    f"{s['share']:.0%}",
                    f"{s['rate']:,.0f}",
                    _fmt(s["ratio_to_forwarder"]),
                    _fmt(s["ratio_to_ceiling"]),
                    f"{s['gateway_cpu_s_per_m']:.1f}",
                    f"{s['redis_cpu_s_per_m']:.1f}",
                    f"{s['broker_cpu_s_per_m']:.1f}",
                    f"{s['cores_busy']:.0%}",
                    f"{s['vote_wait_share']:.0%}",
                    "yes" if s["correct"] else "**NO**",
                ]
                for s in results.summary()
            ),
        ),
    ]
    if splits := results.cpu_splits():
        lines += [
            "",
            f"**CPU per record by process** (µs, {results.target_share:.0%} dups, medians over "
            "rounds; Redis: each member's server, in the order of `[redis] nodes`)",
            "",
            *_table(
                ["variant", "gateway process", "Redis, each member", "broker", "all"],
                (
                    [s["variant"], f"{s['gateway_us']:.2f}",
                     " / ".join(f"{v:.2f}" for v in s["redis_us"]) or "-",
                     f"{s['broker_us']:.2f}", f"{s['total_us']:.2f}"]
                    for s in splits
                ),
            ),
        ]  # fmt: skip
    if spark_rows := results.spark_summary():
        lines += [
            "",
            f"**The Spark half** (bench/spark.py; on the clean topic gateway-3 wrote in the "
            "same round, spark-job-eos on gateway-3-eos's, "
            f"{spark_rows[0]['share']:.0%} dups, local[2], availableNow from a "
            "fresh checkpoint; records/s from the first batch with rows to the end of the "
            "last; CPU µs per row read: the Python driver, the JVM, the Python workers; "
            "fixed cost: a one-record batch's triggerExecution; phases: Spark's "
            "durationMs per batch, median over rounds)",
            "",
            *_table(
                ["variant", "records/s", "x spark-floor", "x gateway-3", "driver µs/row",
                 "JVM µs/row", "workers µs/row", "CPU µs/row", "batches",
                 "1-record batch s", "ms per batch: " + " / ".join(SPARK_PHASES),
                 "counts right"],
                (
                    [s["variant"], f"{s['rate']:,.0f}", _fmt(s["ratio_to_floor"]),
                     _fmt(s["ratio_to_gateway_3"]), f"{s['driver_cpu_s_us_per_row']:.1f}",
                     f"{s['jvm_cpu_s_us_per_row']:.1f}", f"{s['workers_cpu_s_us_per_row']:.1f}",
                     f"{s['cpu_us_per_row']:.1f}", f"{s['batches']:.0f}",
                     f"{s['batch_fixed_s']:.2f}",
                     " / ".join(f"{v:,.0f}" for v in s["phase_ms_per_batch"].values()),
                     "yes" if s["correct"] else "**NO**"]
                    for s in spark_rows
                ),
            ),
        ]  # fmt: skip
    if eos_rows := results.exactly_once():
        lines += [
            "",
            f'**Exactly-once output** ({EOS}: `[kafka] exactly_once = "on"`, each '
            f"raw batch's copies and offsets in one transaction; {AT_LEAST_ONCE} and every "
            'other variant "off"; same rounds; CPU µs per record: gateway process / '
            "Redis, all members / broker)",
            "",
        ]
        for e in eos_rows:
            cpu = [
                f"{name} {c['gateway_us']:.2f} / {sum(c['redis_us']):.2f} / {c['broker_us']:.2f}"
                for name, c in e["cpu_split"].items()
                if c is not None
            ]
            lines.append(
                f"- {e['share']:.0%} dups: {EOS} / {AT_LEAST_ONCE} = {_fmt(e['ratio'])} (rounds: "
                + ", ".join(f"{v:.2f}" for v in e["ratio_per_round"])
                + "); records/s "
                + ", ".join(f"{n} {v:,.0f}" for n, v in e["rates"].items())
                + f"; {e['transactions']:,.0f} transactions per run, "
                + f"{_fmt(e['records_per_transaction'], 0)} records each, "
                + f"{e['aborted']} aborted. Per batch, ms: {EOS}'s transaction open "
                + f"{_fmt(e['open_ms'], 1)} (begin_transaction {_fmt(e['begin_ms'], 1)}, "
                + "copies sent to acknowledged "
                + f"{_fmt(e['forward_ms'], 1)}, then offsets and EndTxn "
                + f"{_fmt(e['closing_ms'], 1)}); {AT_LEAST_ONCE}'s copies sent to acknowledged "
                + f"{_fmt(e['base_forward_ms'], 1)}, then its offset commit "
                + f"{_fmt(e['base_commit_ms'], 1)}. A transaction open "
                + f"{e['open_share']:.0%} of the run; CPU "
                + ", ".join(cpu)
                + "; each id once to a read_committed reader: "
                + ("yes" if e["committed_ids_once"] else "**no**")
            )
    if (scaling := results.scaling()) is not None:
        lines += [
            "",
            f"**Scaling over processes** (gateway-3 as `run --workers N`, "
            f"{scaling['share']:.0%} dups): 2 workers / 1 worker = {scaling['ratio']:.2f} "
            f"(same-round median); records/s "
            + ", ".join(f"{n} {v:,.0f}" for n, v in scaling["rates"].items())
            + "; CPU s/M (process tree) "
            + ", ".join(f"{n} {v:.1f}" for n, v in scaling["cpu_s_per_m"].items()),
        ]
    if results.latencies:
        eos_to_commit = (
            f", {EOS}'s to its transaction's commit"
            if any(r.variant == EOS for r in results.latencies)
            else ""
        )
        lines += [
            "",
            f"**Latency** at the same offered loads for every variant, "
            f"{results.target_share:.0%} duplicates, raw CreateTime to the clean record's broker "
            f"ack{eos_to_commit} ({o['latency_seconds']} s of load, "
            f"first {o['warmup_seconds']} s not counted); "
            "`+p50`/`+p99`: over broker-floor at the same load; cores busy: every process on "
            "the machine, the load generator's included, while the load ran",
            "",
            *_table(
                ["load", "variant", "offered records/s", "samples", "p50 ms", "p99 ms", "max ms",
                 "+p50 ms", "+p99 ms", "cores busy"],
                (
                    [
                        r.load,
                        r.variant,
                        f"{r.offered_rate:,.0f}",
                        f"{len(r.samples_ms):,}",
                        _fmt(r.percentile(50), 1),
                        _fmt(r.percentile(99), 1),
                        _fmt(max(r.samples_ms, default=0.0), 1),
                        _fmt(results.added(r, 50), 1),
                        _fmt(results.added(r, 99), 1),
                        f"{r.machine_busy:.0%}",
                    ]
                    for r in results.latencies
                ),
            ),
        ]  # fmt: skip
    marks = [(name, value) for name in results.present
             if (value := results.bytes_per_mark(name)) is not None]  # fmt: skip
    cluster_marks = [(name, value) for name in results.present
                     if (value := results.cluster_bytes_per_mark(name)) is not None]  # fmt: skip
    if results.delay is not None:
        d = results.delay
        lines += [
            "",
            f"**Scheduled delivery** (`bench/delay.py`, {d.records:,} records, 20% duplicates, "
            "one run): "
            + ", ".join(f"{name} {_fmt(value)}" for name, value in d.ratios.items())
            + "; every id released once and none early: "
            + ("yes" if d.release_correct else "**no**"),
        ]
    lines += [
        "",
        "**Redis memory per mark** (`used_memory` growth / distinct ids, per instance, median): "
        + ", ".join(f"{name} {_fmt(value, 1)} B" for name, value in marks)
        + (
            "; cluster member (growth summed over its masters / distinct ids, median; of it, "
            "its client connections' buffers, `mem_clients_normal`, a fixed cost): "
            + ", ".join(
                f"{name} {_fmt(value, 1)} B (clients "
                f"{_fmt(results.cluster_bytes_per_mark(name, clients=True), 1)} B)"
                for name, value in cluster_marks
            )
            if cluster_marks
            else ""
        ),
        "",
        f"![benchmark chart]({os.path.relpath(png, md_path.parent)})",
    ]
    return "\n".join(lines)


def update_markdown(path: Path, generated: str) -> None:
    """Replace the generated block between the markers; keep the text around it."""
    block = f"{BEGIN}\n{generated}\n{END}"
    text = path.read_text() if path.exists() else f"# Benchmark results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(head + block + tail)


def console_table(results: Results) -> Table:
    table = Table(title="benchmark: targets")
    for column in ("target", "where", "goal", "measured", "met", "cores allow"):
        table.add_column(column)
    for t in results.targets():
        table.add_row(t["target"], t["where"], t["goal"], _fmt(t["measured"]),
                      _met(t["met"], "[green]yes[/]", "[red]no[/]"),
                      _fmt(t["cores_allow"], missing=""))  # fmt: skip
    return table
