"""`dedup-gateway run --workers N`: N gateway processes on one host, one supervisor.

A gateway process is CPU-bound in Python and uses one core. With N > 1 the
command runs no data path itself: it starts N workers, each a plain
`dedup-gateway run` with the same configuration, all members of the one
consumer group, so Kafka spreads the raw partitions over them exactly as over
gateways on different hosts (every guarantee of the README holds unchanged).
The supervisor:

- restarts a worker that exits without being asked to (crash, OOM kill,
  SIGKILL), after a backoff that doubles with each quick death (1 s up to
  60 s), logged with the worker's index, pid and exit status;
- passes SIGTERM/SIGINT on to every worker; each drains (finishes, forwards
  and commits its batches in hand, leaves the group) and the supervisor exits
  when all have, with status 1 if any worker did not exit cleanly. A second
  signal makes the supervisor exit at once, and with it the workers;
- serves `/metrics`, `/healthz` and `/readyz` on `[metrics] host:port` for all
  workers: each worker writes its metrics to files in a private directory
  (prometheus-client's multiprocess mode) and the supervisor serves their
  sum (gauges: see `Metrics`), plus its own `worker_restarts` counter.
  `/readyz` is 200 when every worker runs and reports ready (`ready` has
  a `pid` label there, one series per worker). The workers' own
  endpoints listen on ephemeral loopback ports and need not be scraped.

Workers run in their own session, so a terminal's Ctrl-C reaches the
supervisor only (which passes it on once), and the kernel sends each worker
SIGTERM when the supervisor dies (PR_SET_PDEATHSIG): no worker outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from gateway.config import Settings
from gateway.metrics import MULTIPROC_ENV, PREFIX
from gateway.rules.backoff import backoff_delay
from gateway.service.health import HealthServer
from gateway.waits import wait_or_stop

logger = logging.getLogger(__name__)

SUPERVISOR_ENV = "DEDUP_GATEWAY_SUPERVISOR_PID"  # set in a worker: its supervisor's pid
RESTART_INITIAL_S = 1.0
RESTART_MAX_S = 60.0
STABLE_S = 60.0  # a worker that ran this long restarts after the initial backoff again
_PR_SET_PDEATHSIG = 1
_MMAP_HEADER_BYTES = 8  # a metrics file shorter than this is still being created


class SupervisorMetrics:
    """The supervisor's own metrics (`run --workers N`), served next to the workers'."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.worker_restarts = Counter(
            f"{PREFIX}_worker_restarts",
            "Worker processes restarted after they exited unasked",
            registry=registry,
        )


class WorkersCollector(MultiProcessCollector):
    """The workers' metric files, skipping one that a starting worker has created but
    not sized yet: prometheus-client reads such a file as corrupt and fails the whole
    scrape (prometheus/client_python#1199), and a worker killed in that moment would
    leave it behind for good."""

    def collect(self) -> list[Metric]:
        files = glob.glob(os.path.join(self._path, "*.db"))
        return self.merge([f for f in files if _sized(f)], accumulate=True)  # type: ignore[no-any-return, no-untyped-call]


def _sized(path: str) -> bool:
    try:
        return os.path.getsize(path) >= _MMAP_HEADER_BYTES
    except FileNotFoundError:  # a live gauge's file, removed by mark_process_dead
        return False


class Supervisor:
    """Runs `workers` gateway processes until `stop`; see the module docstring."""

    def __init__(self, settings: Settings, workers: int, config: Path | None) -> None:
        self.settings = settings
        self.workers = workers
        self.config = config
        self.failed = False  # a worker did not exit cleanly when asked to stop
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._metrics_dir = ""
        self._registry = CollectorRegistry()
        self.metrics = SupervisorMetrics(self._registry)

    def readiness(self) -> tuple[bool, str]:
        running = [p.pid for p in self._procs.values() if p.returncode is None]
        if len(running) < self.workers:
            return False, f"{len(running)} of {self.workers} workers running"
        for pid in running:  # a worker that has not reported yet is not ready either
            if self._registry.get_sample_value(f"{PREFIX}_ready", {"pid": str(pid)}) != 1:
                return False, f"worker pid {pid} is not ready (see its log)"
        return True, "ready"

    async def run(self, stop: asyncio.Event) -> None:
        self._metrics_dir = tempfile.mkdtemp(prefix="dedup-gateway-metrics-")
        WorkersCollector(self._registry, path=self._metrics_dir)  # type: ignore[no-untyped-call]
        health = HealthServer(
            self._registry, self.readiness, self.settings.metrics.host, self.settings.metrics.port
        )
        try:
            await health.start()
            logger.info(
                "supervising %d workers; metrics on %s:%d", self.workers, health.host, health.port
            )
            async with asyncio.TaskGroup() as tasks:
                for index in range(self.workers):
                    tasks.create_task(self._keep(index, stop))
        finally:
            await health.stop()
            shutil.rmtree(self._metrics_dir, ignore_errors=True)

    async def _keep(self, index: int, stop: asyncio.Event) -> None:
        """Keep worker `index` running until `stop`; then stop it and wait for its drain."""
        loop = asyncio.get_running_loop()
        quick_deaths = 0
        while not stop.is_set():
            proc = await self._spawn(index)
            self._procs[index] = proc
            started = loop.time()
            logger.info("worker %d started (pid %d)", index, proc.pid)
            exited = asyncio.ensure_future(proc.wait())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not exited.done():  # asked to stop: pass the signal on, wait for the drain
                proc.send_signal(signal.SIGTERM)
                code = await exited
                mark_process_dead(proc.pid, self._metrics_dir)  # type: ignore[no-untyped-call]
                # Killed by the SIGTERM itself: it came before the worker's handler was
                # installed, i.e. before its data path started: nothing was in flight.
                if code not in (0, -signal.SIGTERM):
                    self.failed = True
                    logger.error("worker %d (pid %d) stopped with status %d", index, proc.pid, code)
                return
            code = exited.result()
            mark_process_dead(proc.pid, self._metrics_dir)  # type: ignore[no-untyped-call]
            quick_deaths = 1 if loop.time() - started >= STABLE_S else quick_deaths + 1
            delay = backoff_delay(RESTART_INITIAL_S, RESTART_MAX_S, quick_deaths)
            logger.error(
                "worker %d (pid %d) exited with %s; restarting it in %.1fs",
                index, proc.pid, _status(code), delay,
            )  # fmt: skip
            self.metrics.worker_restarts.inc()
            await wait_or_stop(stop, delay)

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        argv = [sys.executable, "-m", "gateway", "run"]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        env = {
            **os.environ,
            "GATEWAY_KAFKA__WORKERS": "1",
            # The supervisor serves the metrics; a worker's own endpoint stays private.
            "GATEWAY_METRICS__HOST": "127.0.0.1",
            "GATEWAY_METRICS__PORT": "0",
            MULTIPROC_ENV: self._metrics_dir,
            SUPERVISOR_ENV: str(os.getpid()),
        }
        if (instance := self.settings.kafka.group_instance_id) is not None:
            # Static membership: one name per worker, the same for its restarts.
            env["GATEWAY_KAFKA__GROUP_INSTANCE_ID"] = f"{instance}-{index}"
        return await asyncio.create_subprocess_exec(*argv, env=env, start_new_session=True)


def follow_supervisor(supervisor_pid: int) -> None:
    """In a worker: get SIGTERM when the supervisor dies; exit now if it already has."""
    with contextlib.suppress(OSError, AttributeError):  # Linux only; elsewhere best effort
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor_pid:
        logger.error("supervisor (pid %d) is gone: not starting", supervisor_pid)
        sys.exit(1)


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
