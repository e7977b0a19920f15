"""`python -m bench.datapath` runs, checks its own counts and prints its figure."""

from __future__ import annotations

import re

import pytest

from bench import datapath


def test_the_data_path_benchmark_forwards_every_record_and_reports_its_cost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    datapath.main(["--records", "4000", "--batch", "1000", "--rounds", "2"])
    out = capsys.readouterr().out
    found = re.search(r"([0-9.]+) µs of CPU per record \(median of 2 rounds of 4,000", out)
    assert found is not None, out
    assert float(found.group(1)) > 0


def test_the_batches_hold_each_partitions_offsets_once_in_order() -> None:
    work = datapath.batches(4000, 1000)
    assert len(work) == 4
    for p in range(datapath.PARTITIONS):
        offsets = [r.offset for batch in work for tp, rs in batch.items() if tp.partition == p
                   for r in rs]  # fmt: skip
        assert offsets == list(range(1000))


def test_with_duplicates_the_vote_runs_and_its_counts_are_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One in five of each batch is held by another owner: 800 duplicates of 4,000,
    # checked by the benchmark itself (it raises on other counts).
    datapath.main(["--records", "4000", "--batch", "1000", "--rounds", "1", "--duplicates", "0.2"])
    out = capsys.readouterr().out
    assert "dedup on, 20% held by another owner" in out, out
