"""The gateways of a chaos run as real processes, their settings file, and the
committed offsets of their groups (read without joining them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from devtools.chaos.schedule import (
    ENTITY_HEADER,
    GRACE_MS,
    MAX_DELAY_S,
    TIERS,
    TTL_AFTER_S,
    TTL_BEFORE,
    WINDOW_MS,
    RunConfig,
)
from devtools.harness import Topics

REPO_ROOT = Path(__file__).resolve().parents[2]


class GatewayProcess:
    """`python -m gateway run` of this checkout, in its own session (signals stay ours)."""

    def __init__(self, index: int, config: Path, log: Path) -> None:
        self.index = index
        self.config = config
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.incarnations = 0

    def start(self, note: str, fault: str = "") -> None:
        """Start it; `fault`: a DEDUP_GATEWAY_FAULT for this incarnation (gateway/faults.py)."""
        self.incarnations += 1
        with self.log.open("ab") as out:
            out.write(
                f"=== chaos: g{self.index} incarnation {self.incarnations}: {note}\n".encode()
            )
            out.flush()
            env = {
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
                ),
                "DEDUP_GATEWAY_FAULT": fault,
            }
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "run", "--config", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
            )

    def exited(self) -> int | None:
        """The exit code, when the process ended (by itself or by us)."""
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stopped(self) -> bool:
        """Whether it is stopped (SIGSTOP: by the schedule, or at its own fault point)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with open(f"/proc/{self.proc.pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] == "T"
        except OSError:
            return False

    def wait_exit(self, timeout_s: float) -> int | None:
        """After SIGTERM (one only: a second one exits without draining): the exit
        code, or None if it had to be killed."""
        if self.proc is None:
            return 0
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._dump_stacks()
            self.kill()
            return None

    def _dump_stacks(self) -> None:
        """Append where a gateway that would not stop is stuck (py-spy, a dev tool) to its log."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGUSR1)  # the gateway logs its asyncio tasks' stacks
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)
        py_spy = Path(sys.executable).with_name("py-spy")
        try:
            dump = subprocess.run(
                [str(py_spy), "dump", "--pid", str(self.proc.pid)],
                capture_output=True, timeout=30, check=False,
            )  # fmt: skip
            text = dump.stdout + dump.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"py-spy dump failed: {exc!r}\n".encode()
        with self.log.open("ab") as out:
            out.write(f"=== chaos: g{self.index} did not stop; its stacks:\n".encode() + text)


def gateway_toml(
    config: RunConfig, bootstrap: str, topics: Topics, redis: list[str], changed: bool = False
) -> str:
    """The gateways' settings file (the product's public API, written out in full).
    Delay runs add [delay] and [coalesce]; `changed`: as the config change leaves them
    (the largest tier removed, coalescing off, `[redis] ttl` lowered)."""
    nodes = ", ".join(f'"{url}"' for url in redis)
    return _base_toml(config, bootstrap, topics, nodes, changed) + (
        _delay_toml(changed) if config.delay else ""
    )


def _delay_toml(changed: bool) -> str:
    tiers = ", ".join(f'"{t}"' for t in (TIERS[:-1] if changed else TIERS))
    return f"""
[delay]
enabled = true
tiers = [{tiers}]
max_delay = "{MAX_DELAY_S}s"

[coalesce]
enabled = {"false" if changed else "true"}
key = "header:{ENTITY_HEADER}"
mode = "fixed"
window = "{WINDOW_MS}ms"
grace = "{GRACE_MS}ms"
"""


def _base_toml(config: RunConfig, bootstrap: str, topics: Topics, nodes: str, changed: bool) -> str:
    ttl = f'ttl = "{TTL_AFTER_S}s"' if changed else f'ttl = "{TTL_BEFORE}"'
    ttl = ttl if config.delay else ""
    return f"""\
[kafka]
bootstrap_servers = "{bootstrap}"
raw_topics = ["{topics.raw}"]
clean_topic = "{topics.clean}"
failure_topic = "{topics.failures}"
quarantine_topic = "{topics.quarantine}"
dead_letter_topic = "{topics.dead}"
group_id = "{topics.group}"
max_batch_records = {config.max_batch_records}
session_timeout = "{int(config.session_timeout_s * 1000)}ms"
exactly_once = "on"

[redis]
nodes = [{nodes}]
timeout = "300ms"
{ttl}

[dedup]
id = "{config.id_spec}"
on_no_quorum = "block"
max_id_bytes = {config.max_id_bytes}
retry_backoff_initial = "50ms"
retry_backoff_max = "500ms"

[failures]
mode = "{config.mode}"
max_attempts = {config.max_attempts}
backoff_initial = "50ms"
backoff_max = "500ms"

[metrics]
host = "127.0.0.1"
port = 0
"""


class GroupOffsets:
    """Committed offsets of the gateways' two groups, read without joining them."""

    def __init__(self, bootstrap: str, topics: Topics, config: RunConfig) -> None:
        def consumer(group: str) -> AIOKafkaConsumer:
            return AIOKafkaConsumer(
                bootstrap_servers=bootstrap,
                group_id=group,
                enable_auto_commit=False,
                request_timeout_ms=60_000,
            )

        self.raw = consumer(topics.group)
        self.failures = consumer(f"{topics.group}.failures")
        self.raw_tps = [TopicPartition(topics.raw, p) for p in range(config.raw_partitions)]
        self.failure_tps = [TopicPartition(topics.failures, p) for p in range(2)]

    async def start(self) -> None:
        await self.raw.start()
        await self.failures.start()
        self.raw.assign(self.raw_tps)
        self.failures.assign(self.failure_tps)

    async def stop(self) -> None:
        await self.raw.stop()
        await self.failures.stop()

    async def raw_committed(self) -> dict[int, int] | None:
        return await self._committed(self.raw, self.raw_tps)

    async def failures_committed(self) -> dict[int, int] | None:
        return await self._committed(self.failures, self.failure_tps)

    @staticmethod
    async def _committed(
        consumer: AIOKafkaConsumer, tps: list[TopicPartition]
    ) -> dict[int, int] | None:
        """None when the broker does not answer in time (it may be stopped)."""
        try:
            async with asyncio.timeout(5):
                return {tp.partition: (await consumer.committed(tp)) or 0 for tp in tps}
        except (TimeoutError, KafkaError):
            return None
