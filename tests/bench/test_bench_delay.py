"""The scheduled-delivery benchmark's own correctness, not its speed: a small run
routes every record to a tier before the shared due time, releases each id once
after it, reports rates for all five runs, and windows emitted per window closed
without grace and with the default."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.delay import CLOSE_GRACES, measure
from devtools.localstack import LocalStack

pytestmark = pytest.mark.bench_run


async def test_a_small_delay_run_releases_every_id_once_and_reports_every_rate(
    tmp_path: Path,
) -> None:
    with LocalStack(tmp_path / "state", redis_count=3) as stack:
        rates = await measure(stack, records=2000)
    assert rates.release_correct
    assert 1000 < rates.unique < 2000  # 20% duplicates
    assert all(
        rate > 0
        for rate in (rates.forwarder, rates.gateway, rates.intake, rates.release, rates.coalesce)
    )
    assert set(rates.ratios) == {
        "gateway-3 / forwarder", "delay-intake / forwarder", "delay-release / forwarder",
        "coalesce-intake / forwarder",
    }  # fmt: skip
    assert [close.grace_s * 1000 for close in rates.closes] == list(CLOSE_GRACES)
    for close in rates.closes:
        # every window that took an update emitted at least once, each record decided
        assert 0 < close.windows <= close.emitted <= close.updates
        assert close.emitted_per_window >= 1
