"""`python -m bench.host_units` on a real broker, three redis-servers and a real
`dedup-gateway run` process, small: every round measured new ids, the members' CPU
per new id and a SET NX on each, and the JSON holds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import host_units
from gateway.quorum.scripts import SLICES_BACK

pytestmark = pytest.mark.bench_run


def test_a_small_run_reports_redis_cpu_per_new_id_in_set_nx_units(tmp_path: Path) -> None:
    out = tmp_path / "hu.json"
    argv = ["--rate", "400", "--seconds", "4", "--warmup", "3", "--rounds", "1",
            "--set-nx", "4000", "--alone", "4000", "--paced", "2000",
            "--out", str(out)]  # fmt: skip
    assert host_units.main(argv) == 0
    runs = json.loads(out.read_text())["rounds"]
    assert [run["claim"] for run in runs] == ["lua", "module"]  # both paths, same round
    for run in runs:
        assert run["new_ids"] > 400 and run["records"] > run["new_ids"]  # 20% copies
        assert len(run["set_nx_us"]) == 3 and min(run["set_nx_us"]) > 0
        assert min(run["redis_us_per_new_id"]) > 0 and min(run["ratio"]) > 0
        assert min(run["ids_per_call"]) >= 1 and 0 < min(run["bytes_per_mark"]) < 200
        assert run["live_slices"] == SLICES_BACK + 1
        assert run["alone_us"] > 0 and run["alone_set_nx_us"] > 0 and run["alone_ratio"] > 0
        assert len(run["paced_set_nx_us"]) == 3 and min(run["paced_ratio"]) > 0
        assert run["commands_us"]  # where the first member's CPU went, by command
