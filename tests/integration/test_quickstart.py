"""docs/quickstart.md, run as written: its config, every shell block in order, and
the output it shows, against the session's broker and three real redis-servers.

What the test changes, and only that: the addresses (`localhost:9092`, the
Redis ports, the metrics port, added as a `[metrics]` table) and the topic and
group names (suffixed, as the broker is shared). `pip install .` runs with
`--target` into a temporary folder and `--no-deps` (so it leaves the test's
environment alone; the build backend comes from the package index); the other
commands run in bash with the project's environment first on PATH.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from devtools.harness import eventually, redis_urls
from devtools.localstack import free_port

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "quickstart.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)
REDIS_PORTS = ("6379", "6380", "6381")
DEFAULT_TOPICS = {
    "failure_topic": "dedup-failures",
    "quarantine_topic": "dedup-quarantine",
    "dead_letter_topic": "dedup-dead-letter",
}


def blocks() -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in BLOCK.finditer(QUICKSTART.read_text())]


def normalized(text: str) -> list[str]:
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()]


def test_the_quickstart_blocks_are_a_config_commands_and_their_output():
    kinds = [kind for kind, _ in blocks()]
    assert kinds.count("toml") == 1 and kinds.count("sh") >= 8
    assert set(kinds) == {"toml", "sh", "text"}
    assert kinds[0] == "sh" and blocks()[0][1].strip() == "pip install ."


async def test_the_quickstart_runs_as_written(broker, redis_servers, tmp_path):
    servers = redis_servers(3)
    metrics_port = free_port()
    suffix = "-" + uuid.uuid4().hex[:8]
    swaps = {"localhost:9092": broker, "localhost:9108": f"127.0.0.1:{metrics_port}"}
    for port, url in zip(REDIS_PORTS, redis_urls(servers), strict=True):
        swaps[f"localhost:{port}"] = url.removeprefix("redis://").removesuffix("/0")
    for name in ("orders", *DEFAULT_TOPICS.values()):
        swaps[name] = name + suffix

    def swapped(text: str) -> str:
        for old, new in swaps.items():
            text = text.replace(old, new)
        return text

    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    gateway: subprocess.Popen[bytes] | None = None
    last: subprocess.CompletedProcess[str] | None = None
    try:
        for kind, text in blocks():
            if kind == "toml":
                # The default names of these three, given so that they are suffixed too.
                named = "".join(f'{key} = "{value}"\n' for key, value in DEFAULT_TOPICS.items())
                config = swapped(text.replace("[kafka]\n", "[kafka]\n" + named, 1))
                config += f'\n[metrics]\nhost = "127.0.0.1"\nport = {metrics_port}\n'
                (tmp_path / "gateway.toml").write_text(config)
            elif kind == "text":
                assert last is not None
                await _shows(last, normalized(swapped(text)))
            elif text.strip() == "pip install .":
                last = _pip_install(tmp_path)
            elif text.startswith("dedup-gateway run"):
                gateway = _start(swapped(text), tmp_path, env)
                last = None
            else:
                last = await _bash(swapped(text), tmp_path, env)
                if text.startswith("curl"):
                    continue  # the gateway may still be starting: its output is waited for
                if "--connect" not in text:
                    assert last.returncode == 0, (text, last.stdout, last.stderr)
                else:  # fresh redis-servers have no maxmemory: the WARN the doc shows
                    assert last.returncode == 1, last.stdout
        assert gateway is not None and gateway.poll() is None, "the gateway stopped"
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(30)


def _start(script: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The service, in the background, its log beside the config."""
    with (cwd / "gateway.log").open("wb") as log:
        return subprocess.Popen(
            ["bash", "-c", script], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
        )


async def _bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, ["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


async def _shows(ran: subprocess.CompletedProcess[str], expected: list[str]) -> None:
    """Every line the doc shows is in the command's output. A command that reads the
    running gateway (curl) is run again until it does: records take a moment to flow."""
    command = ran.args[2]
    if not command.startswith("curl"):
        assert set(expected) <= set(normalized(ran.stdout)), ran.stdout
        return
    outputs: list[str] = []

    def shown() -> bool:
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                timeout=10)  # fmt: skip
        outputs.append(result.stdout)
        return set(expected) <= set(normalized(result.stdout))

    await eventually(shown, timeout_s=60, what=f"{expected} from {command}")


def _pip_install(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`pip install .` in a copy of what the package is built from: a build in the
    checkout itself would leave its build/ folder there."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for part in ("pyproject.toml", "README.md", "gateway", "spark_sink"):
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy
        copy(REPO / part, checkout / part)
    target = tmp_path / "installed"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
         str(target), "."],
        cwd=checkout, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (target / "bin" / "dedup-gateway").is_file()
    assert (target / "gateway" / "cli.py").is_file()
    return result
