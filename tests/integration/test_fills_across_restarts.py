"""Fills survive a gateway stop (gateway/quorum/behind.py), with the gateway run as a
real process: member C misses a claim (paused: `dedup-gateway pause`), the gateway
restarts (SIGTERM, or SIGKILL) before C is resumed, A restarts empty, and a copy of the id arrives
from another partition. Without the note that C is behind, the new gateway counts
C (which lacks the id) and B, ties 1:1 and forwards the copy; with it, C is not
counted until the gateway caught it up (gateway/quorum/catchup.py: the stopped
run's note went stale) or `dedup-gateway rebuild` completed it, and the copy is a
duplicate."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devtools.harness import Topics, clean_ids, produce, write_toml
from devtools.localstack import free_port
from devtools.topics import committed_offsets, wait_committed
from gateway.config import load_settings
from gateway.contract.tokens import owner_token
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from tests.integration.conftest import StackFactory
from tests.integration.test_epochs import restart_empty


def start(config: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "run", "--config", str(config)],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "GATEWAY_METRICS__PORT": str(port)},
        )  # fmt: skip


def text(log: Path) -> str:
    return log.read_text()


async def readyz(port: int) -> tuple[int, str]:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/readyz") as r,
        ):
            return r.status, await r.text()
    except aiohttp.ClientError:
        return 0, ""


async def wait_for(what: str, condition: Callable[[int, str], bool], port: int, log: Path) -> str:
    """Poll /readyz until `condition(status, body)`; fail with the gateway's log tail."""
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        status, body = await readyz(port)
        if condition(status, body):
            return body
        assert asyncio.get_running_loop().time() < deadline, (
            f"not within 60s: {what} (last /readyz {status} {body!r})\n{text(log)[-3000:]}"
        )
        await asyncio.sleep(0.05)


async def decided_or_blocked(broker: str, topics: Topics, partition: int, log: Path) -> None:
    """Until the record at offset 0 of `partition` is committed (decided) or the
    gateway logs that it blocked there (no majority counted)."""
    blocked = f"partition={partition}) blocked at offset 0: no majority decided"
    deadline = asyncio.get_running_loop().time() + 60
    while blocked not in text(log):
        if (await committed_offsets(broker, topics.group, topics.raw)).get(partition, 0) >= 1:
            return
        assert asyncio.get_running_loop().time() < deadline, text(log)[-3000:]
        await asyncio.sleep(0.05)


async def cli(config: Path, *args: str, expect: int = 0) -> str:
    """`dedup-gateway VERB --config FILE ARGS`, which must exit `expect`; its output."""
    verb = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", args[0], "--config", str(config), *args[1:],
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(verb.communicate(), 120)
    assert verb.returncode == expect, output.decode()
    return output.decode()


def record(message_id: str) -> list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]:
    return [(None, b"{}", [("message-id", message_id.encode())])]


@contextlib.asynccontextmanager
async def c_noted_behind(
    broker: str, stack: StackFactory, tmp_path: Path, stop: signal.Signals
) -> AsyncIterator[Scene]:
    """C misses X (paused), the gateway that holds its fill stops with `stop`, a new
    gateway starts and C is resumed: it lacks X and a stopped run's note says so."""
    s = await stack()
    topics, (a, b, c) = s.topics, s.servers
    config = write_toml(tmp_path / "gateway.toml", s.settings)
    config.write_text(config.read_text().replace("[redis]\n", '[redis]\nping_interval = "200ms"\n'))
    # The copy comes from a partition whose token is smaller: it would win a 1:1 tie.
    first_at, copy_at = sorted(range(4), key=lambda p: int(owner_token(topics.raw, p, 1)))[::-1][:2]
    port, log = free_port(), tmp_path / "gateway.log"
    gateway = start(config, port, log)
    try:
        await produce(broker, topics.raw, record("warm-up"), partition=first_at)  # offset 0
        await wait_committed(broker, topics.group, topics.raw, {first_at: 1})
        await cli(config, "pause", c.name_label)  # C gets no claim: X is decided by A and B
        await produce(broker, topics.raw, record("X"), partition=first_at)  # offset 1
        await wait_committed(broker, topics.group, topics.raw, {first_at: 2})

        gateway.send_signal(stop)
        assert gateway.wait(timeout=60) in (0, -signal.SIGKILL)
        if stop == signal.SIGTERM:  # it tried to send them first: C is paused, so it said so
            assert f"fill(s) for Redis member {c.name_label} not sent" in text(log)
        gateway = start(config, port, log)
        await cli(config, "resume", c.name_label)  # C lacks X
        await wait_for("the new gateway ready", lambda s, _: s == 200, port, log)
        yield Scene(topics, config, port, log, (a, b, c), first_at, copy_at)
    finally:
        gateway.terminate()
        gateway.wait(timeout=60)


@dataclass
class Scene:
    topics: Topics
    config: Path
    port: int
    log: Path
    members: tuple[Any, Any, Any]
    first_at: int  # X's partition
    copy_at: int  # the copy's: its token is smaller


async def empty(scene: Scene, *members: Any) -> None:
    """Restart `members` empty; until the gateway logs that each lost its data."""
    for member in members:
        restart_empty(member)
    for member in members:
        lost = (f"Redis member {member.name_label} lost its data",
                f"{member.name_label} is recovering")  # fmt: skip
        await wait_for(f"{member.name_label} recovering",
                       lambda *_, lost=lost: any(w in text(scene.log) for w in lost),
                       scene.port, scene.log)  # fmt: skip


async def note_behind(config: Path, member: str) -> None:
    """What a gateway run that holds fills for `member` writes on the others, then
    stops without sending them (gateway/quorum/behind.py)."""
    quorum = Quorum(load_settings(config).redis, Metrics())
    try:
        await quorum.refresh_epochs()
        await quorum.behind.note([i for i in quorum.members if i.name == member])
    finally:
        await quorum.close()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_marks_a_paused_member_missed_are_not_lost_across_a_gateway_restart(
    broker: str, stack: StackFactory, tmp_path: Path, stop: signal.Signals
) -> None:
    """No operator command: the new gateway does not count C while the stopped run's
    note stands, then catches C up from B (gateway/quorum/catchup.py) once that note
    is stale; the copy is a duplicate and a fresh id goes through."""
    async with c_noted_behind(broker, stack, tmp_path, stop) as scene:
        a, _, c = scene.members
        await empty(scene, a)
        await produce(broker, scene.topics.raw, record("X") + record("Z"), partition=scene.copy_at)
        await caught_up(scene, c)
        await wait_committed(
            broker, scene.topics.group, scene.topics.raw, {scene.first_at: 2, scene.copy_at: 2}
        )
        assert await clean_ids(broker, scene.topics.clean) == {"warm-up": 1, "X": 1, "Z": 1}


async def caught_up(scene: Scene, member: Any) -> None:
    """Until the gateway logs that it caught `member` up; /readyz named it behind before."""
    done = f"Redis member {member.name_label} caught up"
    behind = f"behind (missed some marks: the gateways catch them up): {member.name_label}"
    bodies: list[str] = []

    def seen(_: int, body: str) -> bool:
        bodies.append(body)
        return done in text(scene.log)

    await wait_for(f"{member.name_label} caught up", seen, scene.port, scene.log)
    assert any(behind in body for body in bodies), bodies[:3]


async def test_the_hidden_restart_probe_heals_without_an_operator(
    broker: str, stack: StackFactory, tmp_path: Path
) -> None:
    """The issue's probe: three members; C hangs (SIGSTOP) while X is decided, the gateway
    holding C's fill is SIGKILLed, C resumes, another member (A) restarts empty, the
    gateway starts again. No id under two tokens, none lost, and fresh records are
    forwarded once the gateway caught C up, with no operator command."""
    s = await stack()
    topics, (a, b, c) = s.topics, s.servers
    config = write_toml(tmp_path / "gateway.toml", s.settings)
    config.write_text(config.read_text().replace("[redis]\n", '[redis]\nping_interval = "200ms"\n'))
    first_at, copy_at = sorted(range(4), key=lambda p: int(owner_token(topics.raw, p, 1)))[::-1][:2]
    port, log = free_port(), tmp_path / "gateway.log"
    gateway = start(config, port, log)
    try:
        await produce(broker, topics.raw, record("warm-up"), partition=first_at)
        await wait_committed(broker, topics.group, topics.raw, {first_at: 1})
        c.pause()  # hung: its claims time out, X is decided by A and B, C's fill is queued
        try:
            await produce(broker, topics.raw, record("X"), partition=first_at)
            await wait_committed(broker, topics.group, topics.raw, {first_at: 2})
            gateway.send_signal(signal.SIGKILL)
            gateway.wait(timeout=60)
        finally:
            c.resume()
        restart_empty(a)
        gateway = start(config, port, log)
        scene = Scene(topics, config, port, log, (a, b, c), first_at, copy_at)
        await produce(broker, topics.raw, record("X") + record("fresh-1"), partition=copy_at)
        await caught_up(scene, c)
        await produce(broker, topics.raw, record("fresh-2"), partition=first_at)
        await wait_committed(broker, topics.group, topics.raw, {first_at: 3, copy_at: 2})
        assert await clean_ids(broker, topics.clean) == {
            "warm-up": 1, "X": 1, "fresh-1": 1, "fresh-2": 1,
        }  # fmt: skip
    finally:
        gateway.terminate()
        gateway.wait(timeout=60)


async def test_with_the_others_emptied_the_member_noted_behind_is_the_rebuild_source(
    broker: str, stack: StackFactory, tmp_path: Path
) -> None:
    """docs/operations.md, "Rebuild runbook": no member is counted (A and B emptied,
    C noted behind): `rebuild` names C, and a majority rebuilt from it resumes."""
    async with c_noted_behind(broker, stack, tmp_path, signal.SIGKILL) as scene:
        a, b, c = scene.members
        await empty(scene, a, b)
        # The stopped run's notes were on A and B and went with their data; a run that
        # noted C again (every half ttl while C lags) and stopped leaves them there.
        await note_behind(scene.config, c.name_label)
        await produce(broker, scene.topics.raw, record("Y"), partition=scene.copy_at)
        await decided_or_blocked(broker, scene.topics, scene.copy_at, scene.log)
        refused = await cli(scene.config, "rebuild", a.name_label, expect=1)
        assert f"--from {c.name_label}" in refused, refused
        for emptied in (a, b):
            await cli(scene.config, "rebuild", emptied.name_label, "--from", c.name_label)
        await wait_committed(broker, scene.topics.group, scene.topics.raw, {scene.copy_at: 1})
        # C's marks as they are: warm-up and Y, not X (its fill died with the run).
        await produce(broker, scene.topics.raw, record("warm-up"), partition=scene.copy_at)
        await wait_committed(broker, scene.topics.group, scene.topics.raw, {scene.copy_at: 2})
        assert await clean_ids(broker, scene.topics.clean) == {"warm-up": 1, "X": 1, "Y": 1}
        await cli(scene.config, "rebuild", c.name_label)  # forgets the notes: C counted again
        counted = f"Redis member {c.name_label}: no gateway run holds fills for it any more"
        await wait_for("C counted again", lambda *_: counted in text(scene.log),
                       scene.port, scene.log)  # fmt: skip
