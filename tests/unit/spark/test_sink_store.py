"""The sink's outcome store and markers, on small static DataFrames (no broker: the
records carry no dedup headers, so no release command is ever published)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession

from spark_sink import sink as sink_module
from spark_sink.files import CheckpointFiles
from spark_sink.handlers import Handler, passthrough
from spark_sink.sink import OUTCOMES_MARKER, BatchSink
from spark_sink.transforms import KAFKA_SCHEMA as SCHEMA
from spark_sink.transforms import parse_dedup_headers

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]


def records(spark: SparkSession, *offsets: int) -> DataFrame:
    when = datetime(2026, 1, 1)
    rows = [(None, b"v%d" % o, "clean", 0, o, when, 0, []) for o in offsets]
    return parse_dedup_headers(spark.createDataFrame(rows, SCHEMA))


class CountingHandler:
    """passthrough, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, df: DataFrame) -> DataFrame:
        self.calls += 1
        return passthrough(df)


def make_sink(tmp_path: Path, handler: Handler) -> BatchSink:
    return BatchSink(
        handler=handler,
        output_path=str(tmp_path / "out"),
        checkpoint_dir=f"file://{tmp_path / 'ck'}",
        failure_topic="unused",
        producer_config={},
    )


def written_offsets(spark: SparkSession, tmp_path: Path, batch_id: int) -> list[int]:
    out = spark.read.parquet(str(tmp_path / "out" / f"batch_id={batch_id}"))
    return sorted(r.offset for r in out.collect())


def test_a_rerun_reuses_the_stored_outcomes_without_calling_the_handler(spark, tmp_path):
    first, again = CountingHandler(), CountingHandler()
    make_sink(tmp_path, first)(records(spark, 1, 2, 3), 7)
    assert (tmp_path / "ck" / "outcomes" / "7" / OUTCOMES_MARKER).is_file()

    rerun = make_sink(tmp_path, again)
    rerun(records(spark, 3, 1, 2), 7)  # same records, any order
    assert (first.calls, again.calls, rerun.counts.outcomes_reused) == (1, 0, 1)
    assert (rerun.counts.written, rerun.counts.failed) == (3, 0)
    assert written_offsets(spark, tmp_path, 7) == [1, 2, 3]


def test_outcomes_of_other_input_or_with_a_cut_marker_are_not_reused(spark, tmp_path):
    make_sink(tmp_path, CountingHandler())(records(spark, 1, 2, 3), 7)

    other = CountingHandler()
    make_sink(tmp_path, other)(records(spark, 1, 2, 4), 7)  # e.g. a reset query reusing ids
    assert other.calls == 1
    assert written_offsets(spark, tmp_path, 7) == [1, 2, 4]

    # A crash while the marker was written: cut short on a file system without checksums
    # (HDFS shows a file while it is written), or failing its local .crc sidecar.
    marker = tmp_path / "ck" / "outcomes" / "7" / OUTCOMES_MARKER
    for keep_checksum in (False, True):
        text = marker.read_text()
        marker.write_text(text[:-3])
        if not keep_checksum:
            marker.with_name(f".{marker.name}.crc").unlink()
        cut = CountingHandler()
        make_sink(tmp_path, cut)(records(spark, 1, 2, 4), 7)
        assert (cut.calls, marker.read_text()) == (1, text)


def test_a_handler_that_keeps_no_record_stores_empty_outcomes_that_a_rerun_reuses(spark, tmp_path):
    first = make_sink(tmp_path, lambda df: passthrough(df).limit(0))
    first(records(spark, 1, 2), 0)
    assert (first.counts.records, first.counts.written, first.counts.failed) == (2, 0, 0)

    again = CountingHandler()
    rerun = make_sink(tmp_path, again)
    rerun(records(spark, 1, 2), 0)
    assert (again.calls, rerun.counts.outcomes_reused, rerun.counts.written) == (0, 1, 0)


def test_old_outcomes_and_markers_are_pruned(spark, tmp_path, monkeypatch):
    monkeypatch.setattr(sink_module, "MARKERS_KEPT", 2)
    sink = make_sink(tmp_path, CountingHandler())
    for batch_id in range(4):
        sink(records(spark, batch_id), batch_id)
    ck = tmp_path / "ck"
    assert sorted(p.name for p in (ck / "outcomes").iterdir()) == ["2", "3"]  # OUTCOMES_KEPT 1
    assert sorted(p.name for p in (ck / "releases").glob("*.done")) == [
        "1.done",
        "2.done",
        "3.done",
    ]


def test_checkpoint_files_use_hadoop_paths(spark, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a Python path call on a file: URI would land here
    files = CheckpointFiles(spark, f"file://{tmp_path / 'root'}/")
    assert files.read_text("a/b.txt") is None and files.names("a") == []
    files.write_text("a/b.txt", "one\ntwo")
    assert (tmp_path / "root" / "a" / "b.txt").read_text() == "one\ntwo"
    assert (files.read_text("a/b.txt"), files.names("a"), files.exists("a")) == (
        "one\ntwo",
        ["b.txt"],
        True,
    )
    files.delete("a")
    assert not (tmp_path / "root" / "a").exists()
    assert not (tmp_path / "file:").exists()
