"""`python -m bench.restart` (bench/restart.py), small: one kill and restart per mode on
a real local stack. It checks what the script reports and the counts, not the times."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import restart
from devtools.localstack import LocalStack

pytestmark = pytest.mark.bench_run


async def test_a_kill_and_restart_per_mode_reports_its_partitions_and_loses_no_record(
    tmp_path: Path,
) -> None:
    opts = restart.Options(repetitions=1, rate=200, session_timeout="6s", timeout_s=60)
    work = tmp_path / "runs"
    work.mkdir()
    with LocalStack(tmp_path / "state", redis_count=3) as stack:
        runs = await restart.measure(stack, opts, work)
    assert [r.mode for r in runs] == ["static", "dynamic"]
    for run in runs:
        assert run.killed_partitions and set(run.killed_partitions) < {0, 1, 2, 3}, run
        assert run.flow_again_s is not None and run.flow_again_s > 0, run
        assert set(run.per_partition_s) == set(run.killed_partitions), run
        assert run.flow_again_s == max(run.per_partition_s.values())
        assert run.rejoined_s is not None and run.a_after, run
        assert set(run.moved) <= set(run.killed_partitions), run
        assert set(run.committed_after_kill) <= set(run.killed_partitions), run
        # The counts: everything produced was committed, and with exactly_once on (the
        # script's default) a read_committed reader sees each id once despite the kill.
        assert run.produced > 0 and run.committed_to_end, run
        assert run.every_id and run.each_once and run.clean_copies == run.produced, run
        assert run.exit_codes == [0, 0], run
    dynamic = runs[1]
    # A dynamic member that comes back is a new member: the other one rejoins the group.
    assert dynamic.other_rebalanced, dynamic
    assert (tmp_path / "runs" / "restart-static-1-a.log").exists()
    lines = restart.summary(runs)
    assert [line.split(":")[0] for line in lines] == ["static", "dynamic"]
    assert "flow again after median" in lines[0] and "of 1 within the timeout" in lines[1]


def test_the_command_line_names_each_setting_it_measures() -> None:
    opts, as_json, out = restart.parse_args(
        ["--repetitions", "5", "--modes", "dynamic", "--session-timeout", "30s",
         "--exactly-once", "off", "--out", "r.json"]
    )  # fmt: skip
    assert (opts.repetitions, opts.modes, opts.session_timeout, opts.exactly_once) == (
        5, ["dynamic"], "30s", "off",
    )  # fmt: skip
    assert not as_json and out == Path("r.json")
    with pytest.raises(SystemExit):
        restart.parse_args(["--partitions", "1"])
