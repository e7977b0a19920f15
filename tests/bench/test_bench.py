"""The benchmark's own correctness, not its speed: a small run of every variant
on a real local stack must forward and drop exactly what the generated traffic
implies, and write its JSON, chart and table; the report pairs ratios by round.
The spark variants read gateway-3's clean topic of the same round (bench/spark.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import measure, report, run
from bench.measure import FLOOR, ThroughputRun
from bench.processes import ScrapedCounts
from bench.steady import SIZING_FILL
from bench.variants import VARIANTS
from gateway.quorum.scripts import SLICES_BACK

# The in-process and process variants; the spark ones have their own test (a Spark session).
GATEWAY_SIDE = [v.name for v in VARIANTS if not v.opt_in and v.kind != "spark"]
SPARK_SIDE = [v.name for v in VARIANTS if not v.opt_in and v.kind == "spark"]


pytestmark = pytest.mark.bench_run


def test_a_small_run_of_every_variant_counts_exactly_the_generated_duplicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEDUP_STATE_DIR", str(tmp_path / "state"))
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Benchmark results\n\nkept text\n")
    code = run.main([
        "--records", "2000", "--naive-records", "300", "--shares", "0", "0.5",
        "--rounds", "1", "--latency-seconds", "2", "--warmup-seconds", "0.5",
        "--latency-rates", "500", "--delay-records", "0",
        "--out", str(tmp_path / "out"), "--results-md", str(results_md),
        "--variants", *GATEWAY_SIDE,
    ])  # fmt: skip
    assert code == 0  # 1 when any run's counts differ from the traffic

    written = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = written["runs"]
    assert {(r["variant"], r["share"]) for r in runs} == {
        (name, share) for name in GATEWAY_SIDE for share in (0.0, 0.5)
    }
    by_name = {v.name: v for v in VARIANTS}
    for r in runs:
        assert r["correct"], r
        assert r["forwarded"] + r["duplicates"] == r["records"]
        if r["share"] == 0.5 and r["variant"] not in ("forwarder", "client-ceiling"):
            assert r["duplicates"] > 0.3 * r["records"], r
        # The raw loop's wait for votes is read (no upper bound: a wait that began
        # before the clock started ends inside the run). Only in process: workers
        # may vote on all 2,000 records before a scrape shows the first one, so the
        # /metrics path is checked below, on a scrape's text.
        if r["variant"].startswith("gateway-3") and by_name[r["variant"]].kind == "in-process":
            assert r["vote_wait_s"] > 0, r
        if r["variant"] == "client-ceiling":
            assert r["vote_wait_s"] == 0, r
    # Every variant that can carry them, and the floor, at each of the same loads.
    latency = {(lat["variant"], lat["load"]) for lat in written["latency"]}
    own = {report.half_own(name): name for name in report.HALF_OWN}
    assert latency == {
        (name, load)
        for name in [v.name for v in VARIANTS if v.fixed_load and not v.opt_in] + [FLOOR]
        for load in ("500/s", report.HALF_FORWARDER)
    } | {(name, load) for load, name in own.items()} | {(FLOOR, load) for load in own}
    # gateway-3 and gateway-5 at half their own maximum, split by process.
    (half,) = [t for t in written["targets"] if t["where"] == report.half_own("gateway-3")]
    assert half["goal"] == "<= 25" and half["measured"] is not None
    splits = {s["variant"]: s for s in written["cpu_split"]}
    assert len(splits["gateway-5"]["redis_us"]) == 5 and min(splits["gateway-5"]["redis_us"]) > 0
    assert splits["forwarder"]["gateway_us"] > 0
    # The broker's CPU is counted in 10 ms ticks (/proc): one small run may see none.
    assert sum(s["broker_us"] for s in splits.values()) > 0
    (process,) = [t for t in written["targets"] if t["goal"] == "<= 1.25"]
    assert process["measured"] > 0
    assert all(lat["correct"] and lat["samples"] > 0 for lat in written["latency"])
    assert all(lat["p99_added_ms"] is not None for lat in written["latency"])
    assert written["scaling"]["ratio"] > 0  # gateway-3x2 against gateway-3x1
    # The cluster member's marks: on its masters, none on the stack's other servers.
    assert written["cluster_bytes_per_mark"]["gateway-3-cluster"]["total"] > 0
    cluster_runs = [r for r in runs if r["variant"] == "gateway-3-cluster"]
    assert all(len(r["cluster_bytes_per_mark"]) == 1 for r in cluster_runs)
    assert all(len(r["cluster_client_bytes_per_mark"]) == 1 for r in cluster_runs)
    assert all(len(r["bytes_per_mark"]) == 2 for r in cluster_runs)  # the standalone two
    (bounded,) = [t for t in written["targets"] if t["target"] == "gateway-3 / forwarder"]
    assert bounded["cores_allow"] > 0
    (ratio,) = [t for t in written["targets"] if t["target"] == "gateway-3-cluster / gateway-3"]
    assert ratio["measured"] > 0 and ratio["met"] is None  # reported, no goal
    assert (tmp_path / "out" / "results.png").stat().st_size > 10_000
    text = results_md.read_text()
    assert "kept text" in text and "| forwarder / client-ceiling |" in text
    assert "cores busy" in text and "cores allow" in text
    assert "| gateway-3 p99 over broker-floor, ms | 500/s |" in text
    assert "| gateway-3-cluster / gateway-3 |" in text and "cluster member (" in text
    # The product ran on members filled to steady state (--fill, default SIZING_FILL:
    # a new id searched in SLICES_BACK + 1 slices); gateway-3-fresh on empty ones.
    for r in runs:
        if r["variant"] in ("gateway-3", "gateway-5", "gateway-3x1"):
            assert r["live_slices"] == SLICES_BACK + 1, r
            assert abs(r["marks_per_bucket"] - SIZING_FILL) < 1, r
        if r["variant"] in ("gateway-3-fresh", "gateway-3-cluster"):
            assert r["live_slices"] == 1 and r["marks_per_bucket"] < 1, r
    assert f"{SLICES_BACK + 1} live slices, ~{SIZING_FILL} marks per bucket | <= 4 |" in text
    assert "| Redis CPU per new id, gateway-3-fresh, µs | per instance, 0% dups, 1 live" in text
    # Exactly-once output: gateway-3-eos wrote its copies in transactions, none aborted, and
    # a read_committed reader saw each id once; gateway-3 (at-least-once) wrote none.
    for r in runs:
        if r["variant"] == "gateway-3-eos":
            assert r["transactions"] > 0 and r["transactions_aborted"] == 0, r
            assert r["committed_ids_once"] is True, r
        else:
            assert r["transactions"] == 0 and r["committed_ids_once"] is None, r
        if r["variant"] == "gateway-3":  # its batches forwarded and offsets committed, timed
            assert r["offset_commits"] > 0 and r["offset_commit_s"] > 0, r
        if r["variant"] in ("gateway-3", "gateway-3-eos", "forwarder"):
            assert r["forwards"] > 0 and r["forward_s"] > 0, r
    assert [e["share"] for e in written["exactly_once"]] == [0.0, 0.5]
    for e in written["exactly_once"]:
        assert e["ratio"] > 0 and e["committed_ids_once"], e
        assert e["open_ms"] >= e["begin_ms"] + e["forward_ms"] + e["closing_ms"] > 0, e
        assert e["base_commit_ms"] > 0 and e["base_forward_ms"] > 0, e
    (eos,) = [t for t in written["targets"] if t["target"] == "gateway-3-eos / gateway-3"]
    assert eos["goal"] == ">= 0.8" and eos["measured"] > 0 and eos["cores_allow"] > 0
    eos_latency = [t for t in written["targets"] if t["target"].startswith("gateway-3-eos p99")]
    assert {t["where"] for t in eos_latency} == {
        "500/s",
        report.HALF_FORWARDER,
        report.half_own("gateway-3-eos"),
    }
    assert "**Exactly-once output**" in text and "| gateway-3-eos / gateway-3 |" in text


def test_the_spark_variants_read_gateway_3s_clean_topic_of_the_round_and_write_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each spark variant read every row its gateway variant wrote in its round (gateway-3;
    spark-job-eos: gateway-3-eos) and the record of the one-record batch before it; the
    job wrote each once and failed none."""
    monkeypatch.setenv("DEDUP_STATE_DIR", str(tmp_path / "state"))
    code = run.main([
        "--records", "2000", "--shares", "0.2", "--rounds", "1", "--latency-seconds", "0",
        "--delay-records", "0", "--out", str(tmp_path / "out"),
        "--results-md", str(tmp_path / "RESULTS.md"),
        "--variants", "gateway-3", "gateway-3-eos", *SPARK_SIDE,
    ])  # fmt: skip
    assert code == 0
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    text = (tmp_path / "RESULTS.md").read_text()
    gateways = {r["variant"]: r for r in written["runs"] if r["variant"].startswith("gateway-")}
    spark = {r["variant"]: r for r in written["runs"] if r["variant"].startswith("spark-")}
    by_name = {v.name: v for v in VARIANTS}
    assert set(spark) == set(SPARK_SIDE) == {
        "spark-job", "spark-floor", "spark-job-eos", "spark-job-redis"
    }  # fmt: skip
    for r in spark.values():
        assert r["correct"] and r["forwarded"] == r["records"] == r["expected_forwarded"], r
        reads = by_name[r["variant"]].reads
        read = gateways[reads]
        # Each spark variant's one-record batch adds a record to the topic it reads.
        one_record_batches = sum(1 for v in SPARK_SIDE if by_name[v].reads == reads)
        assert read["forwarded"] <= r["records"] <= read["forwarded"] + one_record_batches, r
        assert r["spark"]["jvm_cpu_s"] > 0 and r["spark"]["workers_cpu_s"] > 0, r
        assert r["spark"]["batch_fixed_s"] > 0 and r["spark"]["batches"] >= 1, r
        assert r["spark"]["phases_ms"]["addBatch"] > 0, r
    assert spark["spark-job"]["spark"]["failed"] == 0  # valid orders: nothing released
    targets = {t["target"]: t for t in written["targets"]}
    for name in ("spark-job / spark-floor", "spark-floor / gateway-3", "spark-job / gateway-3",
                 "spark-job-eos / gateway-3", "spark-job-redis / gateway-3"):  # fmt: skip
        assert targets[name]["measured"] > 0, name
    fixed = [t for t in written["targets"] if t["target"] == "Spark fixed cost per micro-batch, s"]
    assert [t["where"].split(",")[0] for t in fixed] == [
        "spark-job-eos", "spark-job-redis", "spark-job"
    ] and all(t["measured"] > 0 for t in fixed), fixed  # fmt: skip
    (job,) = [s for s in written["spark"] if s["variant"] == "spark-job"]
    assert job["cpu_us_per_row"] == pytest.approx(
        job["driver_cpu_s_us_per_row"] + job["jvm_cpu_s_us_per_row"]
        + job["workers_cpu_s_us_per_row"]
    )  # fmt: skip
    assert "**The Spark half**" in text and "| spark-job / spark-floor |" in text


def _run(variant: str, round_no: int, seconds: float) -> ThroughputRun:
    return ThroughputRun(
        variant=variant, share=0.2, round=round_no, records=1000, seconds=seconds,
        gateway_cpu_s=1, redis_cpu_s=1, broker_cpu_s=1, vote_wait_s=0, forwarded=800,
        duplicates=200,
        expected_forwarded=800, expected_duplicates=200,
    )  # fmt: skip


def test_ratios_compare_runs_of_the_same_round_and_quote_the_median() -> None:
    # Round 2 ran on a slower machine moment for both: its ratio is still 0.5.
    runs = [_run("forwarder", 1, 1.0), _run("gateway-3", 1, 2.0),
            _run("forwarder", 2, 4.0), _run("gateway-3", 2, 8.0),
            _run("forwarder", 3, 1.0), _run("gateway-3", 3, 4.0)]  # fmt: skip
    results = report.Results(runs=runs, latencies=[], options={})
    assert results.ratio("gateway-3", "forwarder", 0.2) == 0.5
    (target,) = [t for t in results.targets() if t["target"] == "gateway-3 / forwarder"]
    assert target["measured"] == 0.5 and target["met"] is False


def test_what_the_cores_allow_is_a_rate_with_every_core_busy_against_the_baseline() -> None:
    # gateway-3 used 3 CPU seconds (gateway, Redis, broker: 1 each) per 1,000 records: on
    # 2 cores busy throughout that is 666.7 records/s, whatever its wall time was.
    runs = [_run("forwarder", 1, 1.0), _run("gateway-3", 1, 2.0),
            _run("forwarder", 2, 2.0), _run("gateway-3", 2, 4.0),
            _run("forwarder", 3, 1.0), _run("gateway-3", 3, 3.0)]  # fmt: skip
    results = report.Results(runs=runs, latencies=[], options={}, machine={"cores": 2})
    assert [results.cores_busy(r) for r in runs[1::2]] == [0.75, 0.375, 0.5]
    (target,) = [t for t in results.targets() if t["target"] == "gateway-3 / forwarder"]
    # Same-round pairs: 666.7 / 1000, 666.7 / 500, 666.7 / 1000; the median.
    assert target["cores_allow"] == pytest.approx(2 / 3)
    assert target["measured"] == 0.5  # measured stays measured: the bound only explains it


def test_eos_latency_runs_to_the_commit_and_drops_an_aborted_transactions_copies() -> None:
    metrics = measure.RecordingMetrics()
    metrics.recorder.from_time = 0
    metrics.observe_forward_latency(1_000_010, [1_000_000])  # acknowledged, no transactions
    metrics.at_commit = True
    metrics.observe_forward_latency(1_000_010, [1_000_000, None])
    assert metrics.recorder.samples_ms == [10.0] and metrics.pending == [1_000_000]
    metrics.transaction_ended(True, now_ms=1_000_050)  # committed 50 ms after the raw record
    metrics.observe_forward_latency(1_000_060, [1_000_040])
    metrics.transaction_ended(False)  # aborted: its records are read and forwarded again
    assert metrics.recorder.samples_ms == [10.0, 50.0] and metrics.pending == []


def test_a_scrape_of_the_workers_metrics_gives_their_summed_wait_for_votes() -> None:
    counts = ScrapedCounts()
    counts.update(
        "# HELP dedup_gateway_vote_wait_seconds_total Seconds the raw loop waited for votes.\n"
        "# TYPE dedup_gateway_vote_wait_seconds_total counter\n"
        'dedup_gateway_vote_wait_seconds_total{worker="0"} 0.25\n'
        'dedup_gateway_vote_wait_seconds_total{worker="1"} 0.5\n'
        "# TYPE dedup_gateway_records_in_total counter\n"
        "dedup_gateway_records_in_total 7.0\n"
    )
    assert counts.vote_wait_s() == 0.75
    assert counts.consumed() == 7
