"""An operator command that cannot connect to the broker says so in one line naming
`[kafka] bootstrap_servers` and its address, exits 3 (its --help says so), and prints
no traceback. The broker address is a port bound here and never listened on: every
connection to it is refused, and nothing else can take the port meanwhile."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from gateway.cli import EXAMPLES, EXIT_UNREACHABLE, build_parser
from gateway.config import KafkaSettings
from gateway.errors import BrokerUnreachable
from gateway.kafka.admin import reaching_broker


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port that is bound (so no one else gets it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _config(tmp_path: Path, port: int, extra: str = "") -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f'[kafka]\nbootstrap_servers = "127.0.0.1:{port}"\n'
        f'[redis]\nnodes = ["redis://127.0.0.1:{port}/0"]\n{extra}'
    )
    return path


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *argv],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _expected(port: int) -> str:
    return (
        f'dedup-gateway: cannot connect to the broker: [kafka] bootstrap_servers = "127.0.0.1:'
        f'{port}" (127.0.0.1:{port}: [Errno 111] Connection refused)'
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["topics", "--create"],
        ["topics", "--create", "--dry-run"],
        ["topics", "--check"],
        ["topics", "--check", "--output", "json"],
        ["redrive", "--dry-run"],
        ["redrive"],
    ],
    ids=" ".join,
)
def test_a_command_that_cannot_connect_prints_one_line_and_exits_3(
    argv: list[str], tmp_path: Path, refused_port: int
) -> None:
    done = _run(*argv, "--config", str(_config(tmp_path, refused_port)))
    assert done.returncode == EXIT_UNREACHABLE == 3, done.stderr
    assert done.stderr == _expected(refused_port) + "\n"
    assert done.stdout == ""


def test_verbose_also_shows_the_clients_own_lines(tmp_path: Path, refused_port: int) -> None:
    done = _run("topics", "--create", "-v", "--config", str(_config(tmp_path, refused_port)))
    assert done.returncode == 3
    lines = done.stderr.splitlines()
    assert lines[-1] == _expected(refused_port)
    assert any(f'Unable connect to "127.0.0.1:{refused_port}"' in line for line in lines[:-1])
    assert "Traceback" not in done.stderr


def test_inspect_with_delay_tiers_says_why_it_cannot_read_them(
    tmp_path: Path, refused_port: int
) -> None:
    """inspect reads the tiers only with [delay] on; its marks table comes first."""
    config = _config(tmp_path, refused_port, "[delay]\nenabled = true\n")
    done = _run("inspect", "order-1", "--config", str(config))
    assert done.returncode == 3, done.stderr
    assert _expected(refused_port) in done.stderr.splitlines()
    assert "Traceback" not in done.stderr
    assert "NO ANSWER" in done.stdout  # the member (the same refused port) did not answer


def test_check_config_connect_names_the_setting_without_the_clients_log_line(
    tmp_path: Path, refused_port: int
) -> None:
    done = _run("check-config", "--connect", "--config", str(_config(tmp_path, refused_port)))
    assert done.returncode == 3
    (kafka,) = [line for line in done.stdout.splitlines() if line.startswith("ERROR kafka")]
    assert kafka == (
        f"ERROR kafka 127.0.0.1:{refused_port}: cannot connect to the broker ([kafka] "
        f"bootstrap_servers): 127.0.0.1:{refused_port}: [Errno 111] Connection refused"
    )
    assert done.stderr == ""


def test_the_help_documents_exit_code_3_for_every_command_that_reaches_the_broker() -> None:
    for command in ("topics", "redrive", "inspect", "check-config"):
        epilog = EXAMPLES[command]
        assert re.search(r"\b3 .*(cannot\s+connect|unreachable)", epilog, re.S), command
    build_parser()  # the epilogs are what --help prints


async def test_reaching_broker_turns_a_refused_bootstrap_into_one_error(
    refused_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{refused_port}")
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    caplog.set_level(logging.DEBUG, logger="aiokafka")
    try:
        with pytest.raises(BrokerUnreachable) as raised:
            async with reaching_broker(kafka):
                await admin.start()
    finally:
        await admin.close()
    assert raised.value.bootstrap_servers == kafka.bootstrap_servers
    # "Connection refused" under uvloop (the CLI's loop), "Connect call failed" under asyncio's.
    assert raised.value.reason.startswith(f"127.0.0.1:{refused_port}: [Errno 111] ")
    assert not [r for r in caplog.records if "Unable connect" in r.getMessage()]
    assert logging.getLogger("aiokafka").filters == []  # the filter is removed again
