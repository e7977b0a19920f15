"""Start-up and `check-config --connect` against members that refuse their credentials
or are one redis-server (gateway/quorum/identity.py, `Quorum.wait_for_majority`)."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devtools.harness import (
    clean_ids,
    make_settings,
    produce,
    redis_urls,
    running,
    write_toml,
)
from devtools.topics import wait_committed
from gateway.config import load_settings
from gateway.contract.tokens import mark_digest
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from tests.integration.conftest import StackFactory
from tests.integration.test_bad_input import GOOD
from tests.integration.test_first_hour import run, write_config


async def test_a_wrong_password_on_one_member_of_three_serves_and_names_it(
    broker: str, stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A password rotated on one member: the restarted gateways stopped at start-up,
    while a member down was fine. Now they serve with the other two, an ERROR names
    the member, and /readyz (ready) names it too."""
    caplog.set_level(logging.INFO)
    s = await stack(raw_partitions=1, password="right-pw")
    topics, servers = s.topics, s.servers
    await produce(broker, topics.raw, [GOOD])
    urls = [f"redis://:{'wrong-pw' if i == 1 else 'right-pw'}@127.0.0.1:{server.port}/0"
            for i, server in enumerate(servers)]  # fmt: skip
    refused = servers[1].name_label
    async with running(make_settings(broker, topics, urls)) as gateway:
        await wait_committed(broker, topics.group, topics.raw, {0: 1})
        ready, why = gateway.readiness()
        assert ready and f"not answering: {refused} (auth)" in why, why
    assert set(await clean_ids(broker, topics.clean)) == {"m-1"}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and refused in r.message]
    assert errors and "refuses the URL's credentials" in errors[0].message
    assert "wrong-pw" not in caplog.text and "right-pw" not in caplog.text


async def test_wrong_passwords_on_a_majority_stop_start_up_naming_them(
    broker: str, stack: StackFactory, tmp_path: Path
) -> None:
    s = await stack(raw_partitions=1, password="right-pw")
    topics, servers = s.topics, s.servers
    urls = [f"redis://:{'right-pw' if i == 0 else 'wrong-pw'}@127.0.0.1:{server.port}/0"
            for i, server in enumerate(servers)]  # fmt: skip
    config = write_toml(tmp_path / "gateway.toml", make_settings(broker, topics, urls))
    started = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "gateway", "run", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr[-2000:]
    (last_line,) = started.stderr.strip().splitlines()[-1:]
    assert last_line.startswith("dedup-gateway: redis.nodes: credentials refused by ")
    assert servers[1].name_label in last_line and servers[2].name_label in last_line
    assert servers[0].name_label not in last_line  # the right one is not blamed
    assert "wrong-pw" not in started.stderr + started.stdout


async def test_three_databases_of_one_server_are_refused_at_start_up(
    broker: str, stack: StackFactory, tmp_path: Path
) -> None:
    s = await stack(members=1, raw_partitions=1)
    topics, (server,) = s.topics, s.servers
    urls = [f"redis://127.0.0.1:{server.port}/{db}" for db in range(3)]
    config = write_toml(tmp_path / "gateway.toml", make_settings(broker, topics, urls))
    started = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "gateway", "run", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr[-2000:]
    (last_line,) = started.stderr.strip().splitlines()[-1:]
    assert "are one redis-server (the same run_id)" in last_line, last_line
    assert f"127.0.0.1:{server.port}/2" in last_line


def test_connect_check_refuses_members_that_are_one_server(
    broker: str, names: Any, tmp_path: Path, redis_servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    one, other = redis_servers(2)
    urls = [f"redis://127.0.0.1:{one.port}/0", f"redis://127.0.0.1:{one.port}/1",
            f"redis://127.0.0.1:{other.port}/0"]  # fmt: skip
    config = write_config(tmp_path / "g.toml", broker, names("one"), urls)
    code, out = run(capsys, "check-config", "--config", str(config), "--connect")
    assert code == 3, out
    assert (
        f"ERROR redis: 127.0.0.1:{one.port}/0, 127.0.0.1:{one.port}/1 are one redis-server" in out
    ), out
    assert f"127.0.0.1:{other.port}/0 are" not in out


async def test_connect_check_warns_when_ttl_was_lowered(
    broker: str, names: Any, tmp_path: Path, redis_servers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = redis_servers(3)
    quorum = Quorum(load_settings(redis={"nodes": redis_urls(servers), "ttl": "60s"}).redis,
                    Metrics())  # fmt: skip
    try:
        await quorum.check()
        await quorum.claim([mark_digest(b"under-60s")], ["11"])
    finally:
        await quorum.close()
    config = write_config(tmp_path / "g.toml", broker, names("ttl"), redis_urls(servers))
    config.write_text(config.read_text().replace("[redis]\n", '[redis]\nttl = "10s"\n'))
    _, out = await asyncio.to_thread(run, capsys, "check-config", "--config", str(config),
                                     "--connect")  # fmt: skip
    warned = f"WARN  redis {servers[0].name_label}: [redis] ttl is 10s, lower than the 60s"
    assert warned in out, out
    config.write_text(config.read_text().replace('ttl = "10s"', 'ttl = "60s"'))
    _, out = await asyncio.to_thread(run, capsys, "check-config", "--config", str(config),
                                     "--connect")  # fmt: skip
    assert "lower than the" not in out
