"""One schedule against its own local stack: start, traffic and faults, settle, check.

The run starts its own Apache Kafka broker (stopping it harms no other test), three
quorum members (redis-server processes; member 0 a Redis Cluster of 3
masters with a replica each in `cluster` runs) and the gateways, all on free
loopback ports under `workdir`. Before each fault it waits for real progress: the raw group must
commit, on some partition, past the records produced before the previous fault
was injected. After the last fault it stops the traffic and waits until every raw
record and command is committed and every usable id resolved, or until
nothing moves any more; then SIGTERM, and the checker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import random
import re
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from devtools.chaos.checker import (
    STOP_DEADLINE_S,
    Observations,
    QuarantineCopy,
    SkippedCommand,
    Violation,
    answered_sigterm,
    check,
    stats,
)
from devtools.chaos.processes import GatewayProcess, GroupOffsets, gateway_toml
from devtools.chaos.schedule import (
    BROKER_FAULTS,
    GATEWAY_FAULTS,
    REDIS_FAULTS,
    TTL_AFTER_S,
    Fault,
    Schedule,
    Step,
)
from devtools.chaos.standin import SparkStandIn, fate
from devtools.chaos.timeline import Clock, StepRun, step_context
from devtools.chaos.traffic import Traffic
from devtools.harness import Topics
from devtools.localstack import (
    ManagedProcess,
    RedisClusterProcesses,
    kafka_broker,
    redis_cluster,
    redis_server,
)
from devtools.topics import create_topics, read_topic
from gateway.config import load_settings
from gateway.contract.records import H_ERROR, H_SOURCE
from gateway.metrics import Metrics
from gateway.ops.rebuild import kept_their_data, rebuild
from gateway.quorum.quorum import Quorum
from gateway.rules.tiers import tier_topics

PROGRESS_DEADLINE_S = 60.0  # before each fault, the group must commit something new
# No progress for this long: the operator looks (the quorum-lost alert) and follows
# the rebuild runbook if a majority of members lost their marks.
RUNBOOK_AFTER_S = 15.0
SETTLE_DEADLINE_S = 150.0  # after the last fault, everything must be resolved
STUCK_S = 60.0  # while settling: no offset, delivery or record moved this long (a killed
# member's session, 20 s in the retry schedule, plus a rebalance the broker holds back)
QUIET_S = 5.0  # settled but ids unresolved, and nothing came for this long: give up
MAX_RESTARTS = 10  # of gateways that exited unexpectedly, per run
OWN_KILL_WAIT_S = 30.0  # gateway-kill-acked: how long its fault point may take to come
TIER_PARTITIONS = 3  # delay runs: partitions of each tier topic
OLD_COPIES = 40  # delay runs: copies of ids claimed before the ttl was lowered, sent after it
ROLLING_READY_S = 60.0  # the config change waits this long for the restarted gateways


@dataclass
class Result:
    schedule: Schedule
    observations: Observations
    violations: list[Violation]
    stats: dict[str, int]
    timeline: list[str]
    seconds: float

    @property
    def failing(self) -> list[Violation]:
        return [v for v in self.violations if not v.tolerated]

    @property
    def passed(self) -> bool:
        return not self.failing

    def summary(self) -> str:
        s = self.stats
        verdict = "PASS" if self.passed else f"FAIL ({len(self.failing)} violations)"
        tolerated = len(self.violations) - len(self.failing)
        return (
            f"seed {self.schedule.config.seed}: {verdict}"
            + (f", {tolerated} tolerated beyond the guarantees" if tolerated else "")
            + f" in {self.seconds:.0f}s: {s['faults']} faults, {s['raw']} raw records "
            f"({s['usable_ids']} usable ids, {s['hostile']} hostile), "
            f"{s['deliveries']} clean deliveries ({s['repeats']} repeats), "
            f"{s['failures']} failed, {s['dead']} dead letters, "
            f"{s['quarantined']} quarantined; commands: {s['commands_sent']} sent, "
            f"{s['commands_duplicated']} twice, {s['commands_stale']} stale again, "
            f"{s['commands_reordered']} reordered, {s['commands_garbage']} garbage"
        )

    # The gateways' log lines about the raw records the failing violations name
    # (`log_evidence`): the stack, and its logs, are gone when the report is read.
    evidence: list[str] = field(default_factory=list)

    def report(self, limit: int = 8) -> str:
        """The seed, the schedule, the timeline and the violations, grouped by rule."""
        lines = [self.summary(), "", self.schedule.describe(), "", "timeline:"]
        lines += [f"  {line}" for line in self.timeline]
        by_rule: dict[str, list[Violation]] = defaultdict(list)
        for v in self.violations:
            by_rule[v.rule].append(v)
        for rule, found in sorted(by_rule.items()):
            tag = " (tolerated: beyond the guarantees)" if found[0].tolerated else ""
            lines += ["", f"rule {rule}: {len(found)} violation(s){tag}"]
            lines += [f"  - {v.message}" for v in found[:limit]]
            if len(found) > limit:
                lines.append(f"  ... and {len(found) - limit} more")
        if self.evidence:
            lines += ["", "gateway log lines about those records and their partitions:"]
            lines += [f"  {line}" for line in self.evidence]
        lines += ["", f"reproduce: {self.schedule.reproduce()}"]
        return "\n".join(lines)


class Run:
    """One schedule against its own local stack."""

    def __init__(self, schedule: Schedule, workdir: Path, log: Callable[[str], None]) -> None:
        self.schedule = schedule
        self.config = schedule.config
        self.workdir = workdir
        self.say = log
        self.clock = Clock()
        self.timeline: list[str] = []
        self.step_runs: list[StepRun] = []
        self.problems: list[Violation] = []
        self.unexpected_exits: list[str] = []
        self.restorations: dict[str, asyncio.Task[None]] = {}
        if workdir.exists() and any(workdir.iterdir()):
            raise ValueError(f"{workdir} is not empty: a run's logs must be its own")
        self.broker: ManagedProcess = kafka_broker(workdir)
        # Member 0 of a cluster run is the cluster: `self.redis[0]` is then not started.
        self.redis: list[ManagedProcess] = [redis_server(workdir, f"redis-{i}") for i in range(3)]
        self.cluster: RedisClusterProcesses | None = None
        self.gateways: list[GatewayProcess] = []
        seed = self.config.seed
        self.topics = Topics(lambda base: f"chaos-{seed}-{base}")
        # Delay runs: the settings file in force, the tier topics of the first one, the
        # gateways being restarted by the config change (not exits), and when it came
        # with the raw offsets committed then.
        self.toml = workdir / "gateway.toml"
        self.tiers: list[str] = []
        self.restarting: set[int] = set()
        self.change: tuple[float, dict[int, int] | None] | None = None
        self.urls: list[str] = []

    def event(self, text: str) -> None:
        line = f"t={self.clock.now():6.1f}s {text}"
        self.timeline.append(line)
        self.say(line)

    async def run(self) -> Result:
        started = time.monotonic()
        try:
            observations = await self._run()
        finally:
            await asyncio.to_thread(self._teardown)
        observations.tracebacks = self._tracebacks()
        observations.skipped_commands = self._skipped_commands()
        self._note_repeats(observations)
        violations = check(observations)
        failing = [v for v in violations if not v.tolerated]
        logs = {g.log.name: g.log.read_text(errors="replace") for g in self.gateways
                if failing and g.log.exists()}  # fmt: skip
        return Result(
            self.schedule,
            observations,
            violations,
            stats(observations),
            self.timeline,
            time.monotonic() - started,
            log_evidence(failing, self.topics.raw, logs),
        )

    async def _run(self) -> Observations:
        config, topics = self.config, self.topics
        await asyncio.to_thread(self.broker.start)
        for server in self.redis[1:] if config.cluster else self.redis:
            await asyncio.to_thread(server.start)
        if config.cluster:
            self.cluster = await asyncio.to_thread(
                redis_cluster, self.workdir, "redis-0", 3, "redis-server", 1
            )
        bootstrap = f"127.0.0.1:{self.broker.port}"
        toml = self.toml
        urls = [f"redis://127.0.0.1:{r.port}/0" for r in self.redis]
        if self.cluster is not None:
            urls[0] = self.cluster.url
        self.urls = urls
        toml.write_text(gateway_toml(config, bootstrap, topics, urls))
        self.tiers = tier_topics(load_settings(toml)) if config.delay else []
        await create_topics(
            bootstrap,
            {
                topics.raw: config.raw_partitions,
                topics.clean: config.clean_partitions,
                topics.failures: 2,
                topics.quarantine: 1,
                topics.dead: 1,
                **dict.fromkeys(self.tiers, TIER_PARTITIONS),
            },
        )
        self.gateways = [
            GatewayProcess(i, toml, self.workdir / f"g{i}.log") for i in range(config.gateways)
        ]
        for gateway in self.gateways:
            gateway.start("run start")
        self.event(
            f"stack up: broker :{self.broker.port}, redis "
            f"{[r.port for r in self.redis]}, {config.gateways} gateways"
            + (f", redis-0 the cluster {self.cluster.ports}" if self.cluster else "")
        )

        traffic = Traffic(config, bootstrap, topics.raw, self.clock)
        standin = SparkStandIn(config, bootstrap, topics, self.clock, traffic.released)
        offsets = GroupOffsets(bootstrap, topics, config)
        stop_traffic, stop_watch, stop_all = asyncio.Event(), asyncio.Event(), asyncio.Event()
        await traffic.start()
        await standin.start()
        await offsets.start()
        tasks = [
            asyncio.create_task(traffic.run(stop_traffic)),
            asyncio.create_task(standin.run(stop_all)),
            asyncio.create_task(self._watchdog(stop_watch)),
            asyncio.create_task(self._resender(traffic, standin, stop_all)),
        ]
        try:
            await self._faults(traffic, standin, offsets, tasks, toml)
            for task in list(self.restorations.values()):
                await task
            await self._runbook(self.toml)
            await self._old_copies(traffic)
            stop_traffic.set()
            await tasks[0]
            self.event(f"traffic stopped after {len(traffic.entries)} raw records; settling")
            await self._settle(traffic, standin, offsets, tasks)
            stop_watch.set()
            await tasks[2]
            exit_codes = await asyncio.to_thread(self._terminate_gateways)
            self.event(f"gateways stopped with SIGTERM: exit codes {exit_codes}")
            stop_all.set()
            for task in tasks:
                await task
            quarantine = await self._read_quarantine(bootstrap)
            highwater = await _highwaters(bootstrap, topics.raw, traffic.ends())
        finally:
            for event in (stop_traffic, stop_watch, stop_all):
                event.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await offsets.stop()
            await standin.stop()
            await traffic.stop()
        return Observations(
            config=config,
            entries=traffic.entries,
            deliveries=standin.deliveries,
            dead=standin.dead,
            quarantine=quarantine,
            step_runs=self.step_runs,
            raw_highwater=highwater,
            unexpected_exits=self.unexpected_exits,
            final_exit_codes=exit_codes,
            sent_commands=standin.sent,
            command_chaos=dict(standin.commands),
            problems=self.problems + [Violation(rule, text) for rule, text in standin.problems],
            raw_topic=topics.raw,
            hostile_commands=standin.hostile,
            wall0_ms=int(self.clock.wall0 * 1000),
        )

    def _check_tasks(self, tasks: list[asyncio.Task[None]]) -> None:
        """Surface a crash of the harness's own tasks at once."""
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                task.result()

    async def _faults(
        self,
        traffic: Traffic,
        standin: SparkStandIn,
        offsets: GroupOffsets,
        tasks: list[asyncio.Task[None]],
        toml: Path,
    ) -> None:
        """Each step: wait for progress made after the previous fault, the step's pause,
        inject. Progress is a commit past a record produced after the fault: the
        traffic's ends when it was injected (the commits just after it were mostly of
        batches decided before it, and counted as progress let the next fault land on
        a state that never moved: chaos seed 9101)."""
        mark: dict[int, int] = {}
        for step in self.schedule.steps:
            if await self._progress_since(mark, offsets, tasks, step, toml) is None:
                return
            await asyncio.sleep(step.pause_s)  # the schedule's own pause
            if step.fault is Fault.CONFIG_CHANGE:
                self.change = (self.clock.now(), await offsets.raw_committed())
            await self._inject(step, traffic, standin)
            mark = traffic.ends()

    async def _progress_since(
        self, mark: dict[int, int], offsets: GroupOffsets, tasks: list[asyncio.Task[None]],
        step: Step, toml: Path,
    ) -> int | None:  # fmt: skip
        """Wait until the raw group committed, on some partition, past `mark` (the
        records produced before the last fault); after RUNBOOK_AFTER_S without,
        follow the rebuild runbook once."""
        start = self.clock.now()
        deadline, looked = start + PROGRESS_DEADLINE_S, False
        while self.clock.now() < deadline:
            self._check_tasks(tasks)
            committed = await offsets.raw_committed()
            if committed is not None and progressed(committed, mark):
                return sum(committed.values())
            if not looked and self.clock.now() - start > RUNBOOK_AFTER_S:
                looked = True
                if await self._runbook(toml):
                    deadline = self.clock.now() + PROGRESS_DEADLINE_S
            await asyncio.sleep(0.2)
        self.problems.append(
            Violation(
                "stall",
                f"no raw offsets committed past the records produced before the last fault "
                f"for {PROGRESS_DEADLINE_S:.0f}s before {step} (produced then: "
                f"{sum(mark.values())}); remaining steps skipped",
            )
        )
        self.event(f"STALL before {step}")
        return None

    async def _inject(self, step: Step, traffic: Traffic, standin: SparkStandIn) -> None:
        fault = step.fault
        target = _target_name(step)
        if target is not None:
            await self._wait_restored(target)  # one fault at a time per process
        run = StepRun(step, self.clock.now())
        self.step_runs.append(run)
        self.event(f"inject {step}")
        if fault is Fault.GATEWAY_KILL_ACKED:
            gateway = self.gateways[step.target]
            await asyncio.to_thread(gateway.kill)
            gateway.start(str(step), fault=f"raw-acked:kill:{step.size}")
            self._restore_later(run, lambda: self._restart_after_own_kill(gateway, step))
        elif fault is Fault.GATEWAY_STOP_RETRY_ACKED:
            gateway = self.gateways[step.target]
            await asyncio.to_thread(gateway.kill)
            gateway.start(str(step), fault=f"retry-acked:stop:{step.size}")
            self._restore_later(run, lambda: self._resume_after_own_stop(gateway, step))
        elif fault in GATEWAY_FAULTS:
            gateway = self.gateways[step.target]
            if fault is Fault.GATEWAY_KILL:
                await asyncio.to_thread(gateway.kill)
                self._restore_later(run, lambda: gateway.start(str(step)))
            else:
                gateway.pause()
                self._restore_later(run, gateway.resume)
        elif fault in REDIS_FAULTS:
            server = self._redis_process(step)
            if fault is Fault.REDIS_STOP:
                server.pause()
                self._restore_later(run, server.resume)
            else:
                await asyncio.to_thread(server.kill)
                if fault is Fault.REDIS_RESTART_EMPTY:
                    await asyncio.to_thread(server.start)
                    run.ended = self.clock.now()
                else:
                    self._restore_later(run, server.start)
        elif fault is Fault.BROKER_STOP:
            self.broker.pause()
            self._restore_later(run, self.broker.resume)
        elif fault is Fault.BROKER_RESTART:
            await asyncio.to_thread(self.broker.kill)
            self._restore_later(run, self.broker.start)
        elif fault is Fault.HOSTILE_BURST:
            await traffic.burst(step.size)
            run.ended = self.clock.now()
        elif fault is Fault.HOSTILE_TIERS:
            await traffic.tier_burst(step.size, self.tiers, TIER_PARTITIONS)
            run.ended = self.clock.now()
        elif fault is Fault.HOSTILE_COMMANDS:
            await standin.hostile_commands(step.size)
            run.ended = self.clock.now()
        elif fault is Fault.CONFIG_CHANGE:
            await self._change_config(step)
            run.ended = self.clock.now()
        elif fault is Fault.MEMBER_HANDOVER:
            await self._handover(step)
            run.ended = self.clock.now()
        else:
            await standin.garbage(step.size)
            run.ended = self.clock.now()

    def _restart_after_own_kill(self, gateway: GatewayProcess, step: Step) -> None:
        """Once the gateway SIGKILLed itself at its fault point, start it as usual; one
        that did not get there (no batch of its own) is killed here instead."""
        assert gateway.proc is not None
        try:
            gateway.proc.wait(timeout=OWN_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            self.event(f"g{gateway.index} did not reach its fault point (step {step.index})")
            gateway.kill()
        gateway.start(f"after {step}")

    def _resume_after_own_stop(self, gateway: GatewayProcess, step: Step) -> None:
        """Once the gateway SIGSTOPped itself at its fault point, hold it `hold_s` (past
        its session: the group moves on) and SIGCONT it, a zombie in its retry's
        transaction. One that did not get there (no retry of its own) is restarted
        without the fault, which would otherwise stop it later with nobody to resume it."""
        assert gateway.proc is not None
        deadline = time.monotonic() + OWN_KILL_WAIT_S
        while not gateway.stopped() and gateway.exited() is None:
            if time.monotonic() > deadline:
                self.event(f"g{gateway.index} did not reach its fault point (step {step.index})")
                gateway.kill()
                gateway.start(f"after {step}")
                return
            time.sleep(0.05)
        self.event(f"g{gateway.index} stopped itself at its retry {step.size}")
        time.sleep(step.hold_s)
        gateway.resume()

    async def _change_config(self, step: Step) -> None:
        """Restart with the changed settings (docs/operations.md, "Changing the
        configuration safely"): every gateway SIGTERMed, waited for, started again."""
        for gateway in self.gateways:
            await self._wait_restored(f"g{gateway.index}")
        changed = self.workdir / "gateway-changed.toml"
        bootstrap = f"127.0.0.1:{self.broker.port}"
        changed.write_text(gateway_toml(self.config, bootstrap, self.topics, self.urls, True))
        self.toml = changed
        # All at once: stopped side by side, then started.
        self.restarting.update(g.index for g in self.gateways)
        for gateway in self.gateways:
            gateway.resume()
            gateway.signal(signal.SIGTERM)
        codes = await asyncio.gather(
            *(asyncio.to_thread(g.wait_exit, STOP_DEADLINE_S) for g in self.gateways)
        )
        for gateway, code in zip(self.gateways, codes, strict=True):
            if not answered_sigterm(code):
                self.problems.append(Violation(
                    "exit", f"g{gateway.index} answered the SIGTERM of [{step}] with exit code "
                    f"{code} (None: still running after {STOP_DEADLINE_S:.0f}s, killed)",
                ))  # fmt: skip
        for gateway in self.gateways:
            gateway.config = changed
            gateway.start(f"{step}: restarted with {changed.name}")
        self.restarting.clear()
        ready = await asyncio.gather(*(self._assigned(g, ROLLING_READY_S) for g in self.gateways))
        self.event(
            f"gateways restarted with {changed.name} (stop: exit codes {list(codes)}); raw "
            f"partitions assigned within {ROLLING_READY_S:.0f}s: {ready}"
        )

    async def _assigned(self, gateway: GatewayProcess, timeout_s: float) -> bool:
        """Whether the gateway's current incarnation logged a raw partition assignment
        within `timeout_s` (its readiness)."""
        deadline = self.clock.now() + timeout_s
        while self.clock.now() < deadline:
            text = gateway.log.read_text(errors="replace") if gateway.log.exists() else ""
            current = text.rsplit("=== chaos:", 1)[-1]
            if "INFO gateway.kafka.rebalance partitions assigned" in current:
                return True
            await asyncio.sleep(0.25)
        return False

    async def _handover(self, step: Step) -> None:
        """Two members one after the other, within the guarantees: every member counted
        first; member `target` hung while a gateway is SIGKILLed and restarted (it
        leaves a note that the member is behind), resumed and repaired (the runbook);
        only then member `second` restarted empty, and repaired too."""
        first, second = step.target, step.second
        gateway = self.gateways[step.size % len(self.gateways)]
        for name in (f"redis-{first}", f"redis-{second}", f"g{gateway.index}"):
            await self._wait_restored(name)
        await self._repair(range(3), f"before step {step.index}")
        hung = self._redis_process(step)
        hung.pause()
        self.event(f"redis-{first} hung")
        await asyncio.sleep(0.5)
        await asyncio.to_thread(gateway.kill)
        self.event(f"g{gateway.index} killed")
        await asyncio.sleep(step.hold_s)
        await asyncio.to_thread(gateway.start, str(step))
        await asyncio.sleep(1.0)
        hung.resume()
        self.event(f"redis-{first} resumed")
        await self._repair([first], f"step {step.index}")
        await asyncio.sleep(3.0)  # every gateway's next epoch read ([redis] ping_interval)
        emptied = self._redis_process(dataclasses.replace(step, target=second))
        await asyncio.to_thread(emptied.kill)
        await asyncio.to_thread(emptied.start)
        self.event(f"redis-{second} restarted empty")
        await asyncio.sleep(3.0)
        await self._repair([second], f"step {step.index}")

    async def _repair(self, members: Iterable[int], why: str) -> None:
        """The runbook for members up but not counted (restarted empty, or noted behind
        by a gateway run that stopped): `dedup-gateway rebuild` each (docs/operations.md)."""
        settings = load_settings(self.toml)
        wanted = list(members)
        deadline = self.clock.now() + 30
        while True:
            quorum = Quorum(settings.redis, Metrics())
            try:
                await quorum.refresh_epochs()
                found = [quorum.members[i] for i in wanted]
                state = [(m.name, m.up, m.trusted) for m in found]
            finally:
                await quorum.close()
            if all(up for _, up, _ in state) or self.clock.now() > deadline:
                break
            await asyncio.sleep(0.5)
        for name, up, trusted in state:
            if up and not trusted:
                with contextlib.redirect_stdout(None), contextlib.redirect_stderr(io.StringIO()):
                    code = await rebuild(settings, name, source=None, dry_run=False, output="json")
                self.event(f"runbook ({why}): `dedup-gateway rebuild {name}` exited {code}")
            elif not up:
                self.event(f"runbook ({why}): {name} does not answer")

    async def _old_copies(self, traffic: Traffic) -> None:
        """Delay runs: once the lowered ttl has passed since the config change, copies
        of ids claimed before it (committed then, under the old ttl): duplicates still."""
        if self.change is None:
            return
        at, committed = self.change
        if committed is None:
            return
        config = self.config
        ids = list(dict.fromkeys(
            e.message_id for e in traffic.entries
            if e.topic is None and e.expect == "usable" and e.message_id is not None
            and e.kind.split("-")[0] in ("new", "delayed") and e.offset < committed[e.partition]
            and fate(config.seed, e.message_id, config) == "ok"
        ))  # fmt: skip
        chosen = random.Random(f"{config.seed}:old").sample(ids, min(OLD_COPIES, len(ids)))
        wait = at + TTL_AFTER_S + 5 - self.clock.now()
        if wait > 0:
            self.event(f"old copies wait {wait:.0f}s for the lowered ttl to pass")
            await asyncio.sleep(wait)  # the ttl's length: part of what is tested
        await traffic.old_copies(chosen)
        self.event(f"sent {len(chosen)} copies of ids claimed before the ttl was lowered")

    async def _wait_restored(self, name: str) -> None:
        task = self.restorations.pop(name, None)
        if task is not None:
            await task

    def _restore_later(self, run: StepRun, restore: Callable[[], None]) -> None:
        name = _target_name(run.step)
        assert name is not None

        async def later() -> None:
            await asyncio.sleep(run.step.hold_s)  # the fault's duration: part of the schedule
            await asyncio.to_thread(restore)
            run.ended = self.clock.now()
            self.event(f"restored {name} (step {run.step.index})")

        self.restorations[name] = asyncio.create_task(later())

    async def _watchdog(self, stop: asyncio.Event) -> None:
        """A gateway that exits by itself is a violation; it is restarted (bounded) so
        the schedule goes on."""
        restarts = 0
        while not stop.is_set():
            for gateway in self.gateways:
                code = gateway.exited()
                name = f"g{gateway.index}"
                if code is None or code == -signal.SIGKILL or gateway.index in self.restarting:
                    continue  # running, or killed by the schedule (restarted by it too)
                after = step_context(self.step_runs, self.clock.now())
                self.unexpected_exits.append(
                    f"{name} exited with code {code} at t={self.clock.now():.1f}s {after}: "
                    f"{last_error(gateway.log)} [{gateway.log.name}]"
                )
                self.event(f"UNEXPECTED EXIT of {name} (code {code})")
                if restarts < MAX_RESTARTS:
                    restarts += 1
                    gateway.start(f"restarted by the watchdog after exit code {code}")
                else:
                    gateway.proc = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    async def _resender(self, traffic: Traffic, standin: SparkStandIn, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await traffic.resend_due(standin.resolved)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    async def _runbook(self, toml: Path) -> bool:
        """What the operator does once the faults are over (docs/operations.md,
        "Rebuild runbook"): while the trusted members are fewer than a majority but
        some are, rebuild members that lost their marks from them; when none is, but
        one kept its data and is not counted only because a stopped gateway run noted
        it behind, rebuild a majority from it (`--from`: the fills that run held are
        lost). Two members emptied at once (profile `beyond`) stop the pipeline until
        then, as the README says; the guarantees never need it. Whether it rebuilt any."""
        settings = load_settings(toml)
        quorum = Quorum(settings.redis, Metrics())
        try:
            await quorum.refresh_epochs()
            trusted = sum(1 for i in quorum.members if i.up and i.trusted)
            recovering = [i for i in quorum.members if i.up and not i.trusted]
            kept = kept_their_data(quorum.members)
        finally:
            await quorum.close()
        if trusted >= quorum.majority or not (trusted or kept):
            return False
        source = None if trusted else kept[0]
        targets = [i.name for i in recovering if i.name != source]
        for name in targets[: quorum.majority - trusted]:
            with contextlib.redirect_stdout(None):  # its report: the exit code says enough
                code = await rebuild(settings, name, source=source, dry_run=False, output="json")
            self.event(
                f"runbook: `dedup-gateway rebuild {name}"
                + (f" --from {source}" if source else "")
                + f"` exited {code}"
            )
        return True

    async def _settle(
        self,
        traffic: Traffic,
        standin: SparkStandIn,
        offsets: GroupOffsets,
        tasks: list[asyncio.Task[None]],
    ) -> None:
        """Wait until every raw record and command is handled and every usable id
        resolved, or until nothing moves any more (then the checker says what is missing)."""
        deadline = self.clock.now() + SETTLE_DEADLINE_S
        ends = traffic.ends()
        usable = {
            e.message_id
            for e in traffic.entries
            if e.expect == "usable" and e.message_id is not None
        }
        state = ""
        last: tuple[object, ...] = ()
        changed = self.clock.now()
        while self.clock.now() < deadline:
            self._check_tasks(tasks)
            raw = await offsets.raw_committed()
            cmds = await offsets.failures_committed()
            now = (raw, cmds, len(standin.deliveries), len(traffic.entries))
            if now != last:
                last, changed = now, self.clock.now()
            elif self.clock.now() - changed > STUCK_S:
                self.problems.append(
                    Violation("stall", f"nothing moved for {STUCK_S:.0f}s while settling: {state}")
                )
                self.event(f"STUCK: {state}")
                return
            raw_done = raw is not None and all(raw[p] >= end for p, end in ends.items())
            cmds_done = cmds is not None and all(
                cmds[p] >= end for p, end in standin.command_ends.items()
            )
            open_ids = sum(1 for i in usable if not standin.resolved(i))
            quiet = self.clock.now() - max(standin.last_activity, 0.0) > QUIET_S
            state = (
                f"raw committed {raw} of {ends}, commands committed {cmds} of "
                f"{standin.command_ends}, consumer caught up: {standin.caught_up}, "
                f"unresolved ids: {open_ids}"
            )
            # Delay runs: the last delayed or windowed record may still wait in a tier.
            released = time.time() * 1000 > traffic.last_release_ms + 2000
            if raw_done and cmds_done and standin.caught_up and released:
                if open_ids == 0:
                    self.event(f"settled: {state}")
                    return
                if quiet and not traffic.resends_pending():
                    self.event(f"quiescent with ids unresolved: {state}")
                    return
            await asyncio.sleep(0.25)
        self.problems.append(
            Violation(
                "stall",
                f"not settled within {SETTLE_DEADLINE_S:.0f}s after the last fault: {state}",
            )
        )
        self.event(f"SETTLE DEADLINE: {state}")

    def _terminate_gateways(self) -> dict[int, int | None]:
        for gateway in self.gateways:
            gateway.resume()
            gateway.signal(signal.SIGTERM)  # all at once: they drain side by side
        return {g.index: g.wait_exit(STOP_DEADLINE_S) for g in self.gateways}

    async def _read_quarantine(self, bootstrap: str) -> list[QuarantineCopy]:
        try:
            records = await read_topic(bootstrap, self.topics.quarantine, timeout_s=60)
        except (UnicodeDecodeError, ValueError, TimeoutError) as exc:
            self.problems.append(
                Violation(
                    "unreadable",
                    f"the quarantine topic cannot be read: {type(exc).__name__}: {exc}",
                )
            )
            return []
        return [
            QuarantineCopy(
                [v for k, v in r.headers if k == H_SOURCE],
                [v for k, v in r.headers if k == H_ERROR],
                (r.partition, r.offset),
            )
            for r in records
        ]

    def _redis_process(self, step: Step) -> ManagedProcess:
        """The process a Redis fault acts on: the member's, or one master of the
        cluster member (which one follows from the step; failovers move them)."""
        if self.cluster is None or step.target != 0:
            return self.redis[step.target]
        masters = self.cluster.masters()
        node = self.cluster.node(masters[step.index % len(masters)])
        self.event(f"{step.fault} acts on the cluster master :{node.port}")
        return node

    def _teardown(self) -> None:
        for gateway in self.gateways:
            gateway.kill()
        for server in self.redis:
            server.stop()
        if self.cluster is not None:
            self.cluster.stop()
        self.broker.stop()

    def _skipped_commands(self) -> list[SkippedCommand]:
        """The gateways' "invalid failure command ... skipped" log lines."""
        found = []
        for gateway in self.gateways:
            if not gateway.log.exists():
                continue
            for line in gateway.log.read_text(errors="replace").splitlines():
                if not (match := _SKIPPED.match(line)):
                    continue
                stamp, ref, detail = match[1], match[2], match[4]
                if ref is None:  # "skipped: <ref>: <detail>", from the retry itself
                    ref, _, detail = detail.partition(": ")
                wall = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.append(SkippedCommand(self.clock.of_wall(wall), gateway.index, ref, detail))
        return found

    def _note_repeats(self, observations: Observations) -> None:
        """Every repeated delivery (a token read before), one line each, into
        repeats.txt of the run's directory (kept with --keep): the id, its token and
        attempt, where it came from and when, and the fault steps around it."""
        lines = [
            f"t={d.at:.1f}s id {d.message_id!r} token {d.token} attempt {d.attempt} raw "
            f"{d.source[0]}/{d.source[1]} clean {d.clean[0]}/{d.clean[1]} "
            f"{step_context(observations.step_runs, d.at)}"
            for d in observations.deliveries
            if d.outcome == "repeat"
        ]
        (self.workdir / "repeats.txt").write_text("".join(f"{line}\n" for line in lines))

    def _tracebacks(self) -> list[str]:
        """One line per traceback in the gateways' logs (exception groups included):
        which gateway and incarnation, the exception, where in the log."""
        found = []
        for gateway in self.gateways:
            if not gateway.log.exists():
                continue
            lines = gateway.log.read_text(errors="replace").splitlines()
            incarnation = ""
            skip_to = 0
            for i, line in enumerate(lines):
                if line.startswith("=== chaos:"):
                    incarnation = line.removeprefix("=== chaos: ")
                if i < skip_to or "Traceback (most recent call last)" not in line:
                    continue
                end, error = traceback_error(lines, i)
                said = lines[i - 1].strip() if i > 0 else ""  # the log line that raised it
                found.append(
                    f"g{gateway.index} ({incarnation}): {error} [{gateway.log.name}:{end + 1}]"
                    f" after: {said[:300]}"
                )
                skip_to = end + 1  # the nested tracebacks of one group count once
        return found


def progressed(committed: dict[int, int], mark: dict[int, int]) -> bool:
    """Whether some partition's commit passed its `mark` (the next offset produced
    before the last fault): a record produced after the fault was decided."""
    return any(offset > mark.get(p, 0) for p, offset in committed.items())


async def _highwaters(bootstrap: str, topic: str, ends: dict[int, int]) -> dict[int, int | None]:
    """Each partition's high watermark from a fetch at the ledger's end (never from
    ListOffsets, wrong on the test broker), so records the ledger does not know show."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = {TopicPartition(topic, p): end for p, end in ends.items()}
        consumer.assign(list(tps))
        for tp, end in tps.items():
            consumer.seek(tp, end)
        highs: dict[int, int | None] = {}
        with contextlib.suppress(TimeoutError, UnicodeDecodeError, ValueError):
            async with asyncio.timeout(10):
                while len(highs) < len(tps):
                    await consumer.getmany(timeout_ms=200)
                    for tp in tps:
                        if consumer.highwater(tp) is not None:
                            highs[tp.partition] = consumer.highwater(tp)
        return {p: highs.get(p) for p in ends}
    finally:
        await consumer.stop()


def _target_name(step: Step) -> str | None:
    """The process a fault acts on, as the timeline names it."""
    if step.fault in GATEWAY_FAULTS:
        return f"g{step.target}"
    if step.fault in REDIS_FAULTS:
        return f"redis-{step.target}"
    return "broker" if step.fault in BROKER_FAULTS else None


_SKIPPED = re.compile(
    r"^(\S+ \S+) WARNING gateway\.failures(?:\.loop)? invalid failure command"
    r"(?: at (\S+))? skipped(?: \((\w+)\))?: (.*)$"
)


def traceback_error(lines: list[str], start: int) -> tuple[int, str]:
    """The exception of the traceback beginning at lines[start] (it ends at the next
    log record): its line index and text. For a chain, the last one raised (any
    name: aiokafka's ProducerFenced too); for a group (its lines all indented), the
    first exception in it."""
    stop = next(
        (j for j in range(start + 1, len(lines)) if _LOG_RECORD.match(lines[j])), len(lines)
    )
    block = range(start + 1, stop)
    closing = [j for j in block if lines[j][:1].strip() and not lines[j].startswith(_NOT_THE_ERROR)]
    if closing:
        return closing[-1], lines[closing[-1]].strip()
    for j in block:
        if match := _ERROR_LINE.match(lines[j]):
            return j, match[1]
    return start, lines[start].strip()


_NOT_THE_ERROR = ("Traceback", "During handling", "The above exception", "+", "|")
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:")
_ERROR_LINE = re.compile(r"^[\s|]*((?!ExceptionGroup)[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*)$")


_RAW_RECORD = re.compile(r"\braw (\d+)/(\d+)\b")  # how violations name a raw record


def log_evidence(
    violations: list[Violation], raw_topic: str, logs: dict[str, str], limit: int = 40
) -> list[str]:
    """The log lines (`logs`: name to text) naming a raw record that `violations`
    name (at most three records), with the lines that assign or revoke its partition
    and each incarnation's start: which gateway handled it, and what it did."""
    records = list(dict.fromkeys(
        (int(p), int(o)) for v in violations for p, o in _RAW_RECORD.findall(v.message)
    ))[:3]  # fmt: skip
    if not records:
        return []
    named = re.compile("|".join(re.escape(f"{raw_topic}/{p}/{o}") + r"(?!\d)" for p, o in records))
    partitions = [f"TopicPartition(topic='{raw_topic}', partition={p})" for p, _ in records]
    found = []
    for name, text in logs.items():
        for number, line in enumerate(text.splitlines(), 1):
            moved = "partitions " in line and any(p in line for p in partitions)
            if line.startswith("=== chaos:") or moved or named.search(line):
                found.append(f"{name}:{number}: {line[:400]}")
    if len(found) > limit:
        found = [*found[:limit], f"... and {len(found) - limit} more"]
    return found


def last_error(path: Path) -> str:
    """The last exception line of a log (inside exception groups too), or its last line."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for line in reversed(lines[-400:]):
        if match := _ERROR_LINE.match(line):
            return match[1]
    return lines[-1] if lines else "(empty log)"


async def run_schedule(
    schedule: Schedule, workdir: Path, log: Callable[[str], None] | None = None
) -> Result:
    """Run `schedule` against a fresh local stack under `workdir`; the checker's verdict."""
    return await Run(schedule, workdir, log or (lambda _line: None)).run()
