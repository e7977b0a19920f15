"""`python -m bench.restart`: how long a killed gateway's partitions stand still when it
is started again at once, with static group membership (`[kafka] group_instance_id`)
and without.

For each mode and repetition, on one local stack (Apache Kafka, three redis-servers):

1. A raw topic of `--partitions` partitions under a steady load (`--rate` records/s,
   every id new; bench/loader.py in a thread), read by two gateway processes
   (`python -m gateway run --config ...`) in one group. `static`: each has its own
   `group_instance_id` (gw-a, gw-b); `dynamic`: neither has one. Both modes use the
   same `session_timeout` (`--session-timeout`) and `exactly_once` (`--exactly-once`).
2. Once each gateway holds partitions and every partition's committed offset has
   moved, and then `steady_s` and a random part of a heartbeat interval (a third of
   the session timeout: where in it the kill lands decides when a dynamic member's
   session expires) later, gateway A is SIGKILLed and started again at once with the
   same config.
3. Measured from the kill:
   - flow again: until the committed offset of every partition A held has passed
     where it stood when the group had assigned it again (the first assignment logged
     by either gateway after the kill; the group's offsets, polled every POLL_S; also
     per partition). Not where it stood at the kill: a transaction the killed process
     had already asked to commit may complete after it (`committed_after_kill`);
   - rejoined: until A's new process logged its first assignment;
   - moved: A's partitions that gateway B was assigned after the kill, and whether
     B took part in a rebalance at all (its log's `gateway.kafka.rebalance partitions
     assigned: [...]` lines).
4. The load stops; the gateways commit the raw topic to its end and stop (SIGTERM,
   exit 0); the clean topic, read `read_committed`, must hold every produced id, each
   once where exactly_once is on (the kill left no copy a committed reader sees).

Prints one line per run and a summary per mode; `--json` prints the runs as JSON,
`--out FILE` writes them there. Results: bench/RESULTS.md, "Static membership: a
gateway killed and started again at once".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import uvloop
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.loader import produce_at_rate
from devtools.harness import Topics, ids_of, make_settings, write_toml
from devtools.localstack import LocalStack, default_state_dir
from devtools.topics import read_topic, wait_committed
from gateway.config import parse_duration
from gateway.kafka.clients import partitions_of

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.1
MODES = ("static", "dynamic")
Mode = Literal["static", "dynamic"]
# The raw group's rebalance listener (gateway/kafka/rebalance.py); not the delay tiers'.
ASSIGNED = re.compile(r"gateway\.kafka\.rebalance partitions assigned: (\[.*\])")
PARTITION = re.compile(r"topic='([^']*)', partition=(\d+)")


@dataclass
class Options:
    repetitions: int = 3
    partitions: int = 4
    rate: float = 1000.0
    session_timeout: str = "10s"
    exactly_once: Literal["auto", "on", "off"] = "on"
    modes: list[str] = field(default_factory=lambda: list(MODES))
    timeout_s: float = 60.0  # the longest wait for the killed gateway's partitions
    steady_s: float = 2.0  # both gateways flowing this long before the kill


@dataclass
class Restart:
    """One kill and restart."""

    mode: str
    repetition: int
    killed_partitions: list[int]  # what gateway A held at the kill
    flow_again_s: float | None  # kill to every one of them committing again; None: timed out
    per_partition_s: dict[int, float]  # kill to each one's first commit past the kill
    rejoined_s: float | None  # kill to A's new process's first assignment
    moved: list[int]  # A's partitions that B was assigned after the kill
    # A's partitions whose committed offset moved between the kill and the first
    # assignment after it: a transaction the killed process had asked to commit
    committed_after_kill: list[int]
    other_rebalanced: bool  # B was assigned anew after the kill
    a_after: list[int]  # what A's new process holds at the end
    produced: int
    committed_to_end: bool
    clean_copies: int  # records on the clean topic, read read_committed
    clean_ids: int  # distinct ids among them
    every_id: bool  # every produced id is there
    each_once: bool  # ... once
    exit_codes: list[int]


def assignments(log: Path, raw: str, since: int = 0) -> list[list[int]]:
    """The raw topic's partitions in each `partitions assigned` line of `log`, from
    byte `since` on."""
    try:
        text = log.read_bytes()[since:].decode(errors="replace")
    except FileNotFoundError:
        return []
    return [
        sorted(int(p) for topic, p in PARTITION.findall(names) if topic == raw)
        for names in ASSIGNED.findall(text)
    ]


def start_gateway(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """`python -m gateway run --config FILE`, its output appended to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip


def stop_gateway(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # drains and commits, as in production
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -signal.SIGKILL


class Commits:
    """The group's committed offsets of the raw topic, read through one consumer that
    names the group but only `assign`s (it never joins it)."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self.topic = topic
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
        )
        self.tps: list[TopicPartition] = []

    async def start(self) -> None:
        await self.consumer.start()
        parts = await partitions_of(self.consumer, self.topic)
        self.tps = [TopicPartition(self.topic, p) for p in parts]
        self.consumer.assign(self.tps)

    async def read(self) -> dict[int, int]:
        return {tp.partition: (await self.consumer.committed(tp)) or 0 for tp in self.tps}

    async def end_offsets(self) -> dict[int, int]:
        ends = await self.consumer.end_offsets(self.tps)
        return {tp.partition: offset for tp, offset in ends.items()}

    async def stop(self) -> None:
        await self.consumer.stop()


async def poll_until(
    what: str, check: Callable[[], bool], procs: list[subprocess.Popen[bytes]], logs: list[Path],
    timeout_s: float,
) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not check():
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{what}: {log.name} exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s}s")
        await asyncio.sleep(POLL_S)


async def one_restart(
    stack: LocalStack, opts: Options, mode: Mode, repetition: int, work: Path
) -> Restart:
    tag = f"restart-{mode}-{repetition}"
    topics = Topics(lambda role: f"{tag}-{role}")
    await topics.create(stack.bootstrap, raw_partitions=opts.partitions, clean_partitions=4)
    names, logs, configs = ("gw-a", "gw-b"), [work / f"{tag}-a.log", work / f"{tag}-b.log"], []
    for name in names:
        kafka = {"session_timeout": opts.session_timeout, "exactly_once": opts.exactly_once}
        if mode == "static":
            kafka["group_instance_id"] = name
        settings = make_settings(stack.bootstrap, topics, stack.redis_urls[:3], kafka=kafka)
        configs.append(write_toml(work / f"{tag}-{name}.toml", settings))
    stop_load = threading.Event()
    load = asyncio.create_task(asyncio.to_thread(
        produce_at_rate, stack.bootstrap, topics.raw, opts.rate, float("inf"), 0.0, 200,
        repetition, stop_load, tag,
    ))  # fmt: skip
    commits = Commits(stack.bootstrap, topics.group, topics.raw)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await commits.start()
        procs += [start_gateway(c, log) for c, log in zip(configs, logs, strict=True)]
        return await _kill_and_restart(stack, opts, mode, repetition, tag, topics, configs,
                                       logs, procs, commits, load, stop_load)  # fmt: skip
    finally:
        stop_load.set()
        await asyncio.gather(load, return_exceptions=True)
        for proc in procs:
            stop_gateway(proc)  # those still running: an error
        await commits.stop()


async def _kill_and_restart(
    stack: LocalStack, opts: Options, mode: Mode, repetition: int, tag: str, topics: Topics,
    configs: list[Path], logs: list[Path], procs: list[subprocess.Popen[bytes]],
    commits: Commits, load: asyncio.Task[dict[str, int]], stop_load: threading.Event,
) -> Restart:  # fmt: skip
    everything = set(range(opts.partitions))
    try:

        def settled() -> bool:
            a, b = (assignments(log, topics.raw) for log in logs)
            return bool(a and b and a[-1] and b[-1]) and set(a[-1]) | set(b[-1]) == everything

        await poll_until("both gateways assigned", settled, procs, logs, 120)
        # Every partition committing: both flow.
        first = await commits.read()
        moving: set[int] = set()
        deadline = time.monotonic() + 60
        while moving != everything:
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions not committing: {everything - moving}")
            await asyncio.sleep(POLL_S)
            now = await commits.read()
            moving |= {p for p, offset in now.items() if offset > first[p]}
        heartbeat_s = parse_duration(opts.session_timeout).total_seconds() / 3
        phase = random.Random(f"{mode}-{repetition}").uniform(0, heartbeat_s)
        await asyncio.sleep(opts.steady_s + phase)
        killed = assignments(logs[0], topics.raw)[-1]
        b_since = logs[1].stat().st_size
        a_since = logs[0].stat().st_size
        killed_at = time.monotonic()
        procs[0].kill()
        procs[0].wait()
        procs[0] = start_gateway(configs[0], logs[0])
        at_kill = await commits.read()  # A is gone and its successor is still starting
        # The partitions flow again once an owner assigned after the kill commits past
        # where they stood at that assignment: a transaction the killed process had
        # already asked to commit may still complete after the kill (moving offsets
        # no one reads on from), and with `require_stable` the new owner waits for it.
        per_partition: dict[int, float] = {}
        rejoined: float | None = None
        reassigned: dict[int, int] | None = None  # the offsets at the first assignment
        while len(per_partition) < len(killed):
            elapsed = time.monotonic() - killed_at
            if elapsed > opts.timeout_s:
                break
            if rejoined is None and assignments(logs[0], topics.raw, a_since):
                rejoined = elapsed
            now = await commits.read()
            seen = time.monotonic() - killed_at
            if reassigned is None:
                if rejoined is not None or assignments(logs[1], topics.raw, b_since):
                    reassigned = now
            else:
                for p in killed:
                    if p not in per_partition and now[p] > reassigned[p]:
                        per_partition[p] = seen
            await asyncio.sleep(POLL_S)
        if rejoined is None:
            await poll_until(
                "the restarted gateway assigned",
                lambda: bool(assignments(logs[0], topics.raw, a_since)),
                procs, logs, opts.timeout_s,
            )  # fmt: skip
            rejoined = time.monotonic() - killed_at
        committed_late = sorted(
            p for p in killed if reassigned is not None and reassigned[p] > at_kill[p]
        )
        await asyncio.sleep(1.0)  # the load goes on past the recovery
    finally:
        stop_load.set()
        produced = (await load)["produced"]
    try:
        ends = await commits.end_offsets()
        committed_to_end = True
        try:
            await wait_committed(stack.bootstrap, topics.group, topics.raw, ends, timeout_s=90)
        except TimeoutError:
            committed_to_end = False
        b_after = assignments(logs[1], topics.raw, b_since)
        a_after = assignments(logs[0], topics.raw, a_since)
    finally:
        codes = [stop_gateway(proc) for proc in procs]
    records = await read_topic(stack.bootstrap, topics.clean, min_records=produced, timeout_s=120)
    seen_ids = ids_of(records)
    produced_ids = {f"{tag}-{n}" for n in range(produced)}
    return Restart(
        mode=mode, repetition=repetition, killed_partitions=killed,
        flow_again_s=max(per_partition.values()) if len(per_partition) == len(killed) else None,
        per_partition_s=per_partition, rejoined_s=rejoined,
        moved=sorted({p for assigned in b_after for p in assigned} & set(killed)),
        committed_after_kill=committed_late,
        other_rebalanced=bool(b_after), a_after=a_after[-1] if a_after else [],
        produced=produced, committed_to_end=committed_to_end, clean_copies=len(records),
        clean_ids=len(seen_ids), every_id=set(seen_ids) == produced_ids,
        each_once=set(seen_ids) == produced_ids and len(records) == produced, exit_codes=codes,
    )  # fmt: skip


async def measure(stack: LocalStack, opts: Options, work: Path) -> list[Restart]:
    """Every mode's repetitions, alternated (static, dynamic, static, ...); the gateways'
    configs and logs go into `work` (a folder that exists)."""
    runs = []
    for repetition in range(1, opts.repetitions + 1):
        for mode in opts.modes:
            run = await one_restart(stack, opts, mode, repetition, work)  # type: ignore[arg-type]
            print(line(run), flush=True)
            runs.append(run)
    return runs


def _s(value: float | None) -> str:
    return "timed out" if value is None else f"{value:.2f} s"


def line(run: Restart) -> str:
    per = ", ".join(f"{p}: {s:.2f}" for p, s in sorted(run.per_partition_s.items()))
    return (
        f"{run.mode} #{run.repetition}: killed A holding {run.killed_partitions}; flow again "
        f"after {_s(run.flow_again_s)} ({per}); A rejoined after {_s(run.rejoined_s)}; "
        f"B rebalanced: {'yes' if run.other_rebalanced else 'no'}, moved to B: "
        f"{run.moved or 'none'}; A holds {run.a_after}; committed after the kill: "
        f"{run.committed_after_kill or 'none'}; {run.produced:,} produced, "
        f"{run.clean_copies:,} clean copies of {run.clean_ids:,} ids, each once: "
        f"{'yes' if run.each_once else 'no'}; exits {run.exit_codes}"
    )


def summary(runs: list[Restart]) -> list[str]:
    lines = []
    for mode in dict.fromkeys(r.mode for r in runs):
        of = [r for r in runs if r.mode == mode]
        flows = [r.flow_again_s for r in of if r.flow_again_s is not None]
        moved = sum(bool(r.moved) for r in of)
        rebalanced = sum(r.other_rebalanced for r in of)
        median = f"median {statistics.median(flows):.2f} s, " if flows else ""
        span = f"{min(flows):.2f}-{max(flows):.2f} s" if flows else "none"
        lines.append(
            f"{mode}: flow again after {median}{span} ({len(flows)} of {len(of)} within the "
            f"timeout); partitions moved to the other gateway in {moved} of {len(of)}, "
            f"it rebalanced in {rebalanced} of {len(of)}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> tuple[Options, bool, Path | None]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.restart", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--repetitions", type=int, default=3, help="kills per mode")
    parser.add_argument("--partitions", type=int, default=4, help="raw topic partitions")
    parser.add_argument("--rate", type=float, default=1000.0, help="offered records/s")
    parser.add_argument("--session-timeout", default="10s", help="[kafka] session_timeout")
    parser.add_argument("--exactly-once", choices=["auto", "on", "off"], default="on",
                        help="[kafka] exactly_once of both gateways")  # fmt: skip
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="static: each its own group_instance_id; dynamic: none")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="longest wait, s, for the killed gateway's partitions")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the runs as JSON")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    if args.partitions < 2:
        parser.error("--partitions: 2 or more (one for each gateway at least)")
    opts = Options(
        repetitions=args.repetitions, partitions=args.partitions, rate=args.rate,
        session_timeout=args.session_timeout, exactly_once=args.exactly_once, modes=args.modes,
        timeout_s=args.timeout,
    )  # fmt: skip
    return opts, args.json, args.out


def main(argv: list[str] | None = None) -> int:
    opts, as_json, out = parse_args(argv)
    # The offsets reader asks for the group's coordinator before the gateways made the
    # group: aiokafka logs that at ERROR, and retries.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    state = default_state_dir() / "bench-restart"
    shutil.rmtree(state, ignore_errors=True)

    (state / "runs").mkdir(parents=True)

    async def run() -> list[Restart]:
        with LocalStack(state, redis_count=3) as stack:
            return await measure(stack, opts, state / "runs")

    runs = uvloop.run(run())
    for text in summary(runs):
        print(text)
    data = json.dumps({"options": asdict(opts), "runs": [asdict(r) for r in runs]}, indent=2)
    if as_json:
        print(data)
    if out is not None:
        out.write_text(data + "\n")
    good = all(r.committed_to_end and r.every_id and r.exit_codes == [0, 0] for r in runs)
    if opts.exactly_once == "on":
        good = good and all(r.each_once for r in runs)
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
