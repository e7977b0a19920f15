"""The Spark job as a new user runs it, `python -m spark_sink`, making the usual
mistakes: each ends in one line that names the setting or says what happens next,
with a documented exit code (docs/spark.md, "Exit codes"), and no Java or Python
stack. A mistyped topic is never created (the broker under test creates topics on
request, as a default broker does)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devtools.topics import create_topics
from tests.integration.spark.session import Clean, produce, source_token
from tests.integration.test_topic_typos import listed_topics

pytestmark = [pytest.mark.spark]

# A cold `python -m spark_sink` on this machine takes 20-25 s to its first batch.
RUN_TIMEOUT_S = 240


def write_config(
    path: Path, broker: str, clean: str, failures: str, checkpoint: Path | None = None
) -> Path:
    checkpoint = checkpoint or path.parent / "checkpoint"
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{broker}"\nclean_topic = "{clean}"\n'
        f'failure_topic = "{failures}"\n[spark]\nmaster = "local[1]"\n'
        f'checkpoint_dir = "{checkpoint}"\noutput_path = "{path.parent / "output"}"\n'
        '[spark.conf]\n"spark.ui.enabled" = "false"\n'
    )
    return path


def start(config: Path, *args: str) -> subprocess.Popen[str]:
    """The job in a process group of its own, as a shell, `timeout` or systemd start it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    return subprocess.Popen(
        [sys.executable, "-m", "spark_sink", "--config", str(config), *args],
        cwd=config.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job did not end within {RUN_TIMEOUT_S} s: {err[-4000:]}")
    return proc.returncode, out, err


def assert_no_stack(err: str) -> None:
    assert "Traceback" not in err, err[-6000:]
    assert not [line for line in err.splitlines() if line.startswith("\tat ")], err[-6000:]
    assert "py4j" not in err.lower(), err[-6000:]


def job_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("spark_sink: ")]


def test_a_mistyped_clean_topic_is_one_line_with_the_nearest_name_and_never_created(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    clean, failures = names("orders-clean"), names("failures")
    asyncio.run(create_topics(broker, {clean: 1, failures: 1}))
    typo = clean.replace("orders-clean", "orders-clen")
    config = write_config(tmp_path / "gateway.toml", broker, typo, failures)
    code, _out, err = finish(start(config, "--until-idle"))
    assert code == 2, err[-4000:]
    assert_no_stack(err)
    assert job_lines(err) == [
        f'spark_sink: kafka.clean_topic = "{typo}": the topic does not exist (did you mean '
        f"'{clean}'?); create it: dedup-gateway topics --create --config {config}"
    ], err
    assert typo not in asyncio.run(listed_topics(broker)), "the job created the mistyped topic"


def test_a_missing_failure_topic_is_named_too_before_the_session_starts(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    clean, failures = names("clean"), names("failures")
    asyncio.run(create_topics(broker, {clean: 1}))
    config = write_config(tmp_path / "gateway.toml", broker, clean, failures)
    code, _out, err = finish(start(config))
    assert code == 2, err[-4000:]
    assert_no_stack(err)
    (line,) = job_lines(err)
    assert line.startswith(f'spark_sink: kafka.failure_topic = "{failures}": the topic does')
    assert "Spark" not in err, "it stops before a Spark session starts"
    assert failures not in asyncio.run(listed_topics(broker))


def test_a_checkpoint_dir_that_is_a_file_is_one_line_naming_the_setting(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    clean, failures = names("clean"), names("failures")
    asyncio.run(create_topics(broker, {clean: 1, failures: 1}))
    checkpoint = tmp_path / "checkpoint"
    checkpoint.write_text("not a folder\n")
    config = write_config(tmp_path / "gateway.toml", broker, clean, failures, checkpoint)
    code, _out, err = finish(start(config, "--until-idle"))
    assert code == 2, err[-4000:]
    assert_no_stack(err)
    (line,) = job_lines(err)
    assert line.startswith(f'spark_sink: spark.checkpoint_dir = "{checkpoint}": '), line


def test_another_queries_checkpoint_is_one_line_naming_the_setting(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    """A checkpoint_dir left by a run on another clean topic: Spark refuses to resume
    it; the job says which setting and what to do, in one line."""
    first, second, failures = names("clean"), names("other"), names("failures")
    asyncio.run(create_topics(broker, {first: 1, second: 1, failures: 1}))
    for topic in (first, second):
        produce(broker, topic, [Clean(id="a", value=b"x", partition=0,
                                      token=source_token(0, 0), source="raw/0/0")])  # fmt: skip
    config = write_config(tmp_path / "gateway.toml", broker, first, failures)
    code, _out, err = finish(start(config, "--until-idle"))
    assert code == 0, err[-4000:]
    write_config(config, broker, second, failures)
    code, _out, err = finish(start(config, "--until-idle"))
    assert code == 2, err[-4000:]
    assert_no_stack(err)
    (line,) = job_lines(err)
    assert line.startswith(f'spark_sink: spark.checkpoint_dir = "{tmp_path / "checkpoint"}": ')


def test_sigterm_to_the_process_group_stops_the_stream_in_one_line_and_exit_0(
    broker: str, names: Callable[[str], str], tmp_path: Path
) -> None:
    """What `timeout`, systemd and Ctrl-C in a terminal do: the signal reaches every
    process of the group. The driver stops the query, then Spark, and says what
    happens to the batch in flight."""
    clean, failures = names("clean"), names("failures")
    asyncio.run(create_topics(broker, {clean: 1, failures: 1}))
    produce(broker, clean, [Clean(id="a", value=b"x", partition=0, token=source_token(0, 0),
                                  source="raw/0/0")])  # fmt: skip
    config = write_config(tmp_path / "gateway.toml", broker, clean, failures)
    proc = start(config)
    output = tmp_path / "output"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    # The stream runs: its first batch is out.
    while not list(output.glob("batch_id=*")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no batch was written"
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-4000:]
    os.killpg(proc.pid, signal.SIGTERM)
    code, _out, err = finish(proc)
    assert code == 0, err[-4000:]
    assert_no_stack(err)
    assert job_lines(err) == [
        "spark_sink: SIGTERM: stopped; the batch in flight runs again at the next start"
    ], err[-4000:]
