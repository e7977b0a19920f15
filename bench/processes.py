"""The gateway as a real process tree: `dedup-gateway run --workers N` (gateway-3xN).

The run's settings go into a TOML file; the processes are counted by scraping
the supervisor's `/metrics` (the workers' summed counters) every
`SCRAPE_EVERY_S`, and their CPU is the whole tree's (supervisor and live
workers), read from /proc. With one worker there is no supervisor: the
gateway process serves its own `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_EVERY_S = 0.02
REPO = Path(__file__).resolve().parents[1]


class ScrapedCounts:
    """The counters of the last scrape, summed over their labels."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def _get(self, name: str) -> int:
        return int(self.values.get(f"dedup_gateway_{name}_total", 0))

    def consumed(self) -> int:
        return self._get("records_in")

    def forwarded_total(self) -> int:
        return self._get("records_forwarded")

    def duplicates_total(self) -> int:
        return self._get("records_duplicate")

    def handled(self) -> int:
        return self.forwarded_total() + self.duplicates_total() + self._get("records_quarantined")

    def vote_wait_s(self) -> float:
        return self.values.get("dedup_gateway_vote_wait_seconds_total", 0.0)

    def update(self, text: str) -> None:
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        self.values = values


def write_config(path: Path, config: dict[str, dict[str, Any]]) -> Path:
    """Settings sections as TOML (strings, numbers, booleans and lists of strings:
    their JSON spelling is valid TOML)."""
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class GatewayProcesses:
    """`python -m gateway run --config FILE --workers N` as a benchmark subject."""

    def __init__(self, config: Path, workers: int, port: int, log: Path) -> None:
        self.config = config
        self.workers = workers
        self.port = port
        self.log = log
        self.metrics = ScrapedCounts()
        self._pid: int | None = None

    async def run(self, stop: asyncio.Event) -> None:
        with self.log.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "run", "--config", str(self.config),
                "--workers", str(self.workers),
                stdout=log, stderr=asyncio.subprocess.STDOUT, cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
        self._pid = proc.pid
        url = f"http://127.0.0.1:{self.port}/metrics"
        try:
            async with aiohttp.ClientSession() as http:
                while not stop.is_set():
                    if proc.returncode is not None:
                        raise RuntimeError(f"the gateway exited early: {self._log_tail()}")
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(url) as response:
                            self.metrics.update(await response.text())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), SCRAPE_EVERY_S)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)  # drain and commit, as in production
            code = await proc.wait()
        if code != 0:
            raise RuntimeError(f"the gateway stopped with status {code}: {self._log_tail()}")

    def cpu_s(self) -> float:
        """User + system CPU seconds of the supervisor and its live workers so far."""
        assert self._pid is not None, "not started"
        pids = [self._pid]
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{self._pid}/task/{self._pid}/children").read_text()
            pids += [int(p) for p in children.split()]
        return sum(process_cpu(pid) for pid in pids)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 once it is gone), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:  # exited meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
