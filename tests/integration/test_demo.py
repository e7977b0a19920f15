"""`make demo` (`python -m devtools.demo`), small: the README's first command runs the
whole pipeline on the embedded stack and says what ran."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from devtools.jars import KAFKA_VERSION
from tests.deployment.conftest import REPO


@pytest.mark.spark
def test_the_demo_runs_the_pipeline_and_names_the_broker_and_the_spark_source(tmp_path):
    env = {**os.environ, "DEDUP_STATE_DIR": str(tmp_path), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "devtools.demo", "--records", "3000", "--partitions", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"Apache Kafka {KAFKA_VERSION} (KRaft), exactly-once output on" in out
    assert "Spark's Kafka connector" in out
    assert "spark: rows/s" in out and "ratio spark job / gateway" in out
    assert out.count("yes") >= 2  # each id once through the gateway and in Spark's output
