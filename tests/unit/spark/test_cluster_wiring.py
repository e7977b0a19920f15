"""What build_session does for a cluster: which Python the workers run, the code
shipped to executors, and the start-up check of the Python source's planner."""

from __future__ import annotations

import os
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import ConfigError
from spark_sink.checkpoint import local_checkpoint
from spark_sink.config import DEFAULT_HANDLER, load_sink_settings
from spark_sink.job import check_planner_python
from spark_sink.session import choose_worker_python, ship_code


def test_the_default_handler_passes_every_record():
    assert DEFAULT_HANDLER == "spark_sink.handlers:passthrough"


@pytest.mark.parametrize(
    ("checkpoint_dir", "local"),
    [("var/ck", True), ("/data/ck", True), ("file:///data/ck", True),
     ("hdfs://nn:8020/ck", False), ("s3a://bucket/ck", False)],
)  # fmt: skip
def test_only_a_local_checkpoint_gets_the_file_system_based_checkpoint_manager(
    checkpoint_dir, local
):
    assert local_checkpoint(load_sink_settings(spark={"checkpoint_dir": checkpoint_dir})) is local


def test_workers_run_the_configured_python_else_an_inherited_one_else_this_one(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    choose_worker_python(load_sink_settings())
    assert os.environ["PYSPARK_PYTHON"] == sys.executable
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/venv/bin/python")  # as spark-submit sets it
    choose_worker_python(load_sink_settings())
    assert os.environ["PYSPARK_PYTHON"] == "/opt/venv/bin/python"
    conf = {"conf": {"spark.pyspark.python": "./environment/bin/python"}}
    choose_worker_python(load_sink_settings(spark=conf))
    assert os.environ["PYSPARK_PYTHON"] == "./environment/bin/python"


@pytest.fixture
def python_exec(spark) -> Iterator[object]:
    """Set the session's worker Python for one test (restored after)."""
    context = spark.sparkContext
    saved = context.pythonExec

    def set_to(value: str) -> None:
        context.pythonExec = value

    yield set_to
    context.pythonExec = saved


def test_a_relative_worker_python_missing_beside_the_driver_stops_start_up_naming_it(
    spark, python_exec, tmp_path: Path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    python_exec("./environment/bin/python")
    with pytest.raises(ConfigError, match=r"spark\.pyspark\.python = './environment/bin/python'"):
        check_planner_python(spark, load_sink_settings(spark={"source": "python"}))
    # The native source plans nothing in Python on the driver.
    check_planner_python(spark, load_sink_settings(spark={"source": "native"}))
    # Unpacked beside the driver, as docs/spark-cluster.md says.
    (tmp_path / "environment" / "bin").mkdir(parents=True)
    (tmp_path / "environment" / "bin" / "python").symlink_to(sys.executable)
    check_planner_python(spark, load_sink_settings(spark={"source": "python"}))


def test_the_shipped_zip_holds_both_packages(spark):
    path = ship_code(spark)
    names = set(zipfile.ZipFile(path).namelist())
    assert {"spark_sink/job.py", "spark_sink/kafka_source.py", "gateway/config.py"} <= names
    assert not [n for n in names if "__pycache__" in n]
