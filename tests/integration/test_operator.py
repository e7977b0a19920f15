"""Operator commands run as real CLI processes against the running system."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, cast

from devtools.harness import (
    Topics,
    counter_value,
    eventually,
    failure_command,
    make_settings,
    produce,
    redis_urls,
    running,
    write_toml,
)
from devtools.topics import committed_offsets, read_topic, wait_committed
from gateway.cli import main
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.ops.inspect import inspect
from gateway.ops.rebuild import rebuild
from gateway.quorum.quorum import Quorum

COPY = (b"k", b"{}", [("message-id", b"m-1")])


async def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gateway", *args, "--config", str(config)]
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=60)


async def test_inspect_shows_owner_and_ttl_and_release_lets_a_resend_through(
    broker, stack, tmp_path
):
    s = await stack(raw_partitions=1, clean_partitions=1)
    topics, servers, settings = s.topics, s.servers, s.settings
    config = write_toml(tmp_path / "g.toml", settings)
    async with running(settings) as gateway:
        await produce(broker, topics.raw, [COPY])
        (clean,) = await read_topic(broker, topics.clean, min_records=1)
        token = dict(clean.headers)["dedup-token"].decode()

        shown = await cli(config, "inspect", "m-1")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.count(token) == 3  # the owner on every member
        assert "absent" not in shown.stdout and shown.stdout.startswith("marks for id m-1")
        assert shown.stdout.splitlines()[1].split()[0] == "member"
        as_json = json.loads((await cli(config, "inspect", "m-1", "--output", "json")).stdout)
        members = [s.name_label for s in servers]
        assert [(m["member"], m["owner"]) for m in as_json["members"]] == [
            (name, token) for name in members
        ]
        # The former keys, kept for one release (CHANGELOG.md): the same entries.
        for old, new in zip(as_json["instances"], as_json["members"], strict=True):
            assert old.pop("instance") == new.pop("member") and old == new

        wrong = await cli(config, "release", "m-1", "--token", "123")
        assert wrong.returncode == 1 and "NOT released" in wrong.stdout
        dry = await cli(config, "release", "m-1", "--token", token, "--dry-run")
        assert dry.returncode == 0 and "would be released on 3 of 3" in dry.stdout
        assert (await cli(config, "inspect", "m-1")).stdout.count(token) == 3  # still held
        right = await cli(config, "release", "m-1", "--token", token, "--output", "json")
        released = json.loads(right.stdout)
        assert right.returncode == 0 and released["deleted"] == 3
        assert [m["member"] for m in released["members"]] == members
        assert released["instances"] == [
            {"instance": name, "result": "released"} for name in members
        ]
        # Asked again, for real or dry, every member says it released it before.
        for again in ([], ["--dry-run"]):
            repeat = await cli(config, "release", "m-1", "--token", token, *again)
            assert repeat.returncode == 0, repeat.stdout
            assert repeat.stdout.count("released before (from that token)") == 3, repeat.stdout

        await produce(broker, topics.raw, [COPY])
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(gateway.metrics.forwarded) == 2


async def test_redrive_reinjects_a_dead_letter_which_is_then_forwarded_again(
    broker, stack, tmp_path
):
    s = await stack(
        raw_partitions=1, clean_partitions=1,
        failures={"max_attempts": 1, "backoff_initial": "1ms"},
    )  # fmt: skip
    topics, settings = s.topics, s.settings
    config = write_toml(tmp_path / "g.toml", settings)
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [COPY])
        (clean,) = await read_topic(broker, topics.clean, min_records=1)
        await produce(broker, topics.failures, [failure_command(clean, "bad data")])
        await eventually(lambda: counter_value(m.dead_lettered) == 1)
        # Something else wrote to the dead-letter topic: not a record redrive can use.
        await produce(broker, topics.dead, [(b"k", b"{}", [])])
        # Its offset: after the dead letter, and its transaction's marker with exactly_once.
        stray = next(
            r for r in await read_topic(broker, topics.dead, min_records=2) if not r.headers
        )
        stray_ref = f"{topics.dead}/0/{stray.offset}"

        dry = await cli(config, "redrive", "--dry-run", "--output", "json")
        report = json.loads(dry.stdout)
        assert [r["id"] for r in report["redriven"]] == ["m-1"]
        assert [r["dead_letter"] for r in report["skipped"]] == [stray_ref]
        assert len(await read_topic(broker, topics.raw)) == 1  # a dry run changes nothing

        verbose = await cli(config, "redrive", "--dry-run", "-v")  # a line per record
        assert f"SKIPPED (no id) ({stray_ref} from ?)" in verbose.stdout
        assert "would redrive m-1" in verbose.stdout
        assert " INFO " in verbose.stderr

        result = await cli(config, "redrive")
        assert result.returncode == 1, result.stderr  # 1: something was skipped
        assert result.stdout.splitlines() == [
            "1 dead-lettered record(s) re-injected",
            "1 skipped: no dedup-id/dedup-source headers naming a raw topic",
        ]
        # Quiet: no service log lines; progress on stderr as JSON lines (no terminal).
        assert " INFO " not in result.stderr
        (last,) = [json.loads(line) for line in result.stderr.splitlines()]
        assert (last["progress"], last["done"], last["total"], last["eta_s"]) == (
            "redrive",
            2,
            2,
            0.0,
        )
        assert last["rate_per_s"] > 0
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(m.forwarded) == 2  # the re-injected copy is new again
        again = await cli(config, "redrive")  # progress was committed: nothing twice
        assert again.returncode == 0 and "0 dead-lettered record(s) re-injected" in again.stdout
    raw = await read_topic(broker, topics.raw)
    assert [dict(r.headers) for r in raw] == [{"message-id": b"m-1"}] * 2


async def test_inspect_and_release_take_an_id_that_is_not_utf8_as_base64_or_hex(
    broker, stack, tmp_path
):
    s = await stack(raw_partitions=1, clean_partitions=1, dedup={"id": "key"})
    topics, settings = s.topics, s.settings
    config = write_toml(tmp_path / "g.toml", settings)
    binary = b"\xff\xfe-bin"
    async with running(settings) as gateway:
        await produce(broker, topics.raw, [(binary, b"{}", [])])
        (clean,) = await read_topic(broker, topics.clean, min_records=1)
        token = dict(clean.headers)["dedup-token"].decode()

        shown = await cli(config, "inspect", "--id-b64", base64.b64encode(binary).decode())
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.count(token) == 3 and "\\xff\\xfe-bin" in shown.stdout
        released = await cli(config, "release", "--id-hex", binary.hex(), "--token", token)
        assert released.returncode == 0 and "released on 3 of 3" in released.stdout

        await produce(broker, topics.raw, [(binary, b"{}", [])])  # new again
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(gateway.metrics.forwarded) == 2


async def test_an_unconditional_release_needs_yes_without_a_terminal(broker, stack, tmp_path):
    s = await stack(raw_partitions=1, clean_partitions=1)
    topics, settings = s.topics, s.settings
    config = write_toml(tmp_path / "g.toml", settings)
    async with running(settings):
        await produce(broker, topics.raw, [COPY])
        await read_topic(broker, topics.clean, min_records=1)
        refused = await cli(config, "release", "m-1")  # stdin is not a terminal here
        assert refused.returncode == 2 and "pass --yes" in refused.stderr
        assert "absent" not in (await cli(config, "inspect", "m-1")).stdout
        done = await cli(config, "release", "m-1", "--yes")
        assert done.returncode == 0 and "released on 3 of 3" in done.stdout
        # A release leaves a tombstone naming the token it released (gateway/quorum/keys.py).
        assert (await cli(config, "inspect", "m-1")).stdout.count("released (was") == 3
        await produce(broker, topics.raw, [COPY])  # the next copy is new again
        assert len(await read_topic(broker, topics.clean, min_records=2)) == 2


def test_an_unconditional_release_confirmed_at_the_terminal_releases_the_mark(
    broker, redis_servers, names, tmp_path, monkeypatch, capsys
):
    settings = make_settings(broker, Topics(names), redis_urls(redis_servers(3)))
    config = write_toml(tmp_path / "g.toml", settings)
    digest = mark_digest(b"m-1")

    async def claim_then_inspect(claim: bool) -> list[str | None]:
        quorum = Quorum(settings.redis, Metrics())
        try:
            if claim:
                await quorum.claim([digest], ["42"])
            return [None if v is None else v.owner for v in await quorum.admin.inspect(digest)]
        finally:
            await quorum.close()

    assert asyncio.run(claim_then_inspect(True)) == ["42"] * 3

    class Terminal:
        def __init__(self, answer: str) -> None:
            self.answer = answer

        def isatty(self) -> bool:
            return True

        def readline(self) -> str:
            return self.answer

    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    assert main(["release", "m-1", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "whoever holds it? [y/N]" in out and "released on 3 of 3" in out
    assert asyncio.run(claim_then_inspect(False)) == ["-42"] * 3  # released from token 42


async def test_redrive_leaves_a_dead_letter_no_majority_released_and_redrives_it_once_later(
    broker, stack, tmp_path
):
    s = await stack(
        raw_partitions=1, clean_partitions=1,
        aof=True,  # restarted members keep their marks
        failures={"max_attempts": 1, "backoff_initial": "1ms"},
    )  # fmt: skip
    topics, servers, settings = s.topics, s.servers, s.settings
    config = write_toml(tmp_path / "g.toml", settings)
    redrive_group = f"{topics.group}.redrive"
    async with running(settings) as gateway:
        m = gateway.metrics
        await produce(broker, topics.raw, [COPY])
        (clean,) = await read_topic(broker, topics.clean, min_records=1)
        await produce(broker, topics.failures, [failure_command(clean, "bad data")])
        await eventually(lambda: counter_value(m.dead_lettered) == 1)

        for server in servers[1:]:
            server.stop()  # 2 of 3 members down: the dead-letter mark cannot be released
        stopped = await cli(config, "redrive", "--output", "json")
        assert stopped.returncode == 1, stopped.stderr
        report = json.loads(stopped.stdout)
        assert report["redriven"] == []
        (left,) = report["not_redriven"]
        assert (left["id"], left["dead_letter"], left["source"]) == (
            "m-1", f"{topics.dead}/0/0", f"{topics.raw}/0/0",
        )  # fmt: skip
        assert (left["deleted"], left["no_answer"]) == (1, 2)
        assert len(await read_topic(broker, topics.raw)) == 1  # not produced
        assert (await committed_offsets(broker, redrive_group, topics.dead))[0] == 0

        for server in servers[1:]:
            server.start()
        result = await cli(config, "redrive")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 dead-lettered record(s) re-injected" in result.stdout
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        assert counter_value(m.forwarded) == 2  # forwarded again, once
        assert counter_value(m.duplicates) == 0
        assert (await committed_offsets(broker, redrive_group, topics.dead))[0] == 1
    clean_copies = await read_topic(broker, topics.clean)
    assert [dict(c.headers)["dedup-source"] for c in clean_copies] == [
        f"{topics.raw}/0/0".encode(), f"{topics.raw}/0/1".encode(),
    ]  # fmt: skip


async def test_pause_is_refused_when_the_rest_are_no_majority_and_resume_counts_it_again(
    broker, redis_servers, names, tmp_path
):
    topics = Topics(names)
    servers = redis_servers(3)
    config = write_toml(tmp_path / "g.toml", make_settings(broker, topics, redis_urls(servers)))
    member, other = servers[0].name_label, servers[1].name_label
    paused = await cli(config, "pause", other)
    assert paused.returncode == 0 and f"{other}: paused" in paused.stdout
    refused = await cli(config, "pause", member, "--output", "json")
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["error"].startswith("refused: only 1 other members")
    assert (await cli(config, "pause", member, "--force")).returncode == 0
    quorum = Quorum(make_settings(broker, topics, redis_urls(servers)).redis, Metrics())
    try:
        await quorum.refresh_epochs()
        assert quorum.counted() == [False, False, True] and not quorum.healthy
        for name in (member, other):
            assert (await cli(config, "resume", name)).returncode == 0
        await quorum.refresh_epochs()
        assert quorum.counted() == [True, True, True] and quorum.healthy
    finally:
        await quorum.close()
    assert (await cli(config, "pause", "nowhere:1/0")).returncode == 2


async def test_operator_commands_wait_for_a_member_busy_past_the_data_paths_timeout(
    broker, redis_servers, names, capsys
):
    """A member the gateways keep busy answers an operator command late: the command
    waits for it (gateway/ops/command_quorum.py) instead of taking it for one that
    stopped answering (a rebuild failed so in a loaded CI run)."""
    servers = redis_servers(3)
    settings = make_settings(broker, Topics(names), redis_urls(servers))  # 300 ms timeout
    async with running(settings):  # the members get their epochs
        pass
    busy = servers[1]

    async def while_busy(command: Awaitable[int]) -> dict[str, Any]:
        capsys.readouterr()
        busy.pause()  # SIGSTOP: it answers nothing until resumed
        try:
            task = asyncio.ensure_future(command)
            await asyncio.sleep(1.0)  # the fault's length: over three data-path timeouts
            assert not task.done(), "the command did not wait for the busy member"
        finally:
            busy.resume()
        assert await task == 0
        return cast(dict[str, Any], json.loads(capsys.readouterr().out))

    looked = await while_busy(inspect(settings, b"m-1", "json"))
    assert [m["answered"] for m in looked["members"]] == [True, True, True]
    dry = await while_busy(rebuild(settings, servers[0].name_label, source=None,
                                   dry_run=True, output="json"))  # fmt: skip
    assert dry["error"] is None and dry["sources"] == [busy.name_label, servers[2].name_label]
