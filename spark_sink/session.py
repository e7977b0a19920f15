"""The Spark session the job builds: its configuration (the job's defaults, then
`[spark.conf]`; the cached connector's jars; the shipped log4j2 configuration; the
driver on loopback in local mode), the Python its workers run, and the job's code
shipped to a cluster's executors."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

from pyspark import SparkFiles
from pyspark.sql import SparkSession

import gateway
import spark_sink
from spark_sink.checkpoint import local_checkpoint
from spark_sink.config import SinkSettings
from spark_sink.connector import connector_jars_conf, jvm_started, spark_version
from spark_sink.tables import table_conf

# A stateful query plans one state store per shuffle partition: Spark's 200 is
# far too many for one small topic. After each batch with data Spark would run one
# without, only to expire the delivery dedup's state (0.5-0.8 s measured here): the
# next batch with data expires it as well. PySpark's DataFrame debugging records the
# Python call site of every DataFrame and column function, several py4j round trips
# each (0.1 s of a one-record batch here); without it an analysis error names the
# failing expression but not the Python line. Set spark.conf to override any of them.
DEFAULT_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
    "spark.python.sql.dataFrameDebugging.enabled": "false",
}
# Spark's default checkpoint file manager renames through Hadoop's FileContext, which on
# a local file system without Hadoop's native library forks `readlink` for every rename
# (32 of the 58 processes a one-record batch forked here). FileSystem.rename is atomic
# on a local disk, so a local checkpoint_dir uses the FileSystem-based manager, whose
# package Spark 4.1 moved (`local_checkpoint_conf`).
CHECKPOINT_MANAGER = "FileSystemBasedCheckpointFileManager"
CHECKPOINT_MANAGER_PACKAGE = "org.apache.spark.sql.execution.streaming.checkpointing"
CHECKPOINT_MANAGER_PACKAGE_BEFORE_4_1 = "org.apache.spark.sql.execution.streaming"
# The driver's log4j2 configuration for a JVM the job starts itself: Spark's and the
# Kafka client's INFO lines off stderr, WARN and above kept (`session_conf`).
LOG4J2_CONF = Path(__file__).with_name("log4j2.properties")
DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
# In local mode (the default master) the driver listens on loopback unless
# `[spark.conf]` says otherwise: its block manager and RPC ports serve no other host.
LOOPBACK_CONF = {"spark.driver.bindAddress": "127.0.0.1", "spark.driver.host": "127.0.0.1"}


def local_checkpoint_conf(version: str | None = None) -> dict[str, str]:
    """The FileSystem-based checkpoint manager, named as Spark `version` has it."""
    package = (
        CHECKPOINT_MANAGER_PACKAGE
        if spark_version(version) >= (4, 1)
        else CHECKPOINT_MANAGER_PACKAGE_BEFORE_4_1
    )
    return {"spark.sql.streaming.checkpointFileManagerClass": f"{package}.{CHECKPOINT_MANAGER}"}


def build_session(settings: SinkSettings) -> SparkSession:
    """The SparkSession for the job (reused if one is already active).

    On a cluster (any master but local) the driver's `spark_sink` and `gateway`
    packages are shipped to the executors (`ship_code`), so they run the driver's
    code whatever their Python environment holds."""
    options = {"spark.app.name": settings.spark.app_name}
    if settings.spark.master:
        options["spark.master"] = settings.spark.master
    choose_worker_python(settings)
    options |= session_conf(settings, sys.stderr.isatty())
    launch_jvm_apart(options)
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    if not (session.sparkContext.master or "local").startswith("local"):
        ship_code(session)
    return session


def launch_jvm_apart(options: dict[str, str]) -> None:
    """Start the driver's JVM as PySpark would (`launch_gateway`, with `options` as the
    SparkConf), but in a session of its own, unless a JVM runs already (spark-submit
    started this file in one, or a session was built before). A signal to the job's
    process group (what `timeout`, systemd and a terminal's Ctrl-C send) then reaches
    the Python driver alone, which stops the query and then the JVM, in order: sent to
    the JVM too, it died under the running query (76 lines of py4j traceback). The JVM
    still ends with the driver: PySpark's gateway server exits when its stdin closes."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if jvm_started() or SparkContext._gateway is not None:
        return
    conf = SparkConf(loadDefaults=False)
    for key, value in options.items():
        conf.set(key, value)
    gateway_ = launch_gateway(conf, popen_kwargs={"start_new_session": True})  # type: ignore[no-untyped-call]
    SparkContext._gateway, SparkContext._jvm = gateway_, gateway_.jvm


def session_conf(settings: SinkSettings, terminal: bool) -> dict[str, str]:
    """The Spark configuration of a session the job builds: `DEFAULT_CONF`, then
    `[spark.conf]`; for a JVM not started yet, the cached connector's jars and the
    shipped log4j2 configuration (`LOG4J2_CONF`, unless `[spark.conf]`'s driver Java
    options name one); the driver on loopback in local mode (`LOOPBACK_CONF`); no
    progress bars unless stderr is a `terminal`."""
    conf = {**DEFAULT_CONF, **(local_checkpoint_conf() if local_checkpoint(settings) else {})}
    if not terminal:
        conf["spark.ui.showConsoleProgress"] = "false"
    if not jvm_started() and (settings.spark.master or "local").startswith("local"):
        conf.update(LOOPBACK_CONF)  # a JVM of our own, in local mode (spark-submit's: its own)
    conf.update(settings.spark.conf)
    if not jvm_started():
        conf.update(connector_jars_conf(settings))
    conf.update(table_conf(settings, conf))  # Delta's static settings, the format's jars
    if not jvm_started():
        options = conf.get(DRIVER_JAVA_OPTIONS, "")
        if "log4j2.configurationFile" not in options:
            ours = f"-Dlog4j2.configurationFile={LOG4J2_CONF}"
            conf[DRIVER_JAVA_OPTIONS] = f"{ours} {options}".strip()
    return conf


def choose_worker_python(settings: SinkSettings) -> None:
    """The Python that Spark's Python workers run (executors, and on the driver the
    Python source's planner): `spark.conf."spark.pyspark.python"` when set, else an
    inherited PYSPARK_PYTHON (spark-submit sets it from that conf), else this
    interpreter, which has this package and pyarrow (not the first `python3` on
    PATH). PySpark reads only the environment variable, once, when the
    SparkContext starts."""
    configured = settings.spark.conf.get("spark.pyspark.python")
    if configured:
        os.environ["PYSPARK_PYTHON"] = configured
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def ship_code(spark: SparkSession) -> str:
    """Zip this process's `spark_sink` and `gateway` packages and put the zip on every
    executor's PYTHONPATH (SparkContext.addPyFile); returns its path.

    Executors unpickle the Python source's reader and the sink's functions by
    module name: without this they fail with "No module named 'spark_sink'"
    unless their environment has the package (and then maybe another version).
    The zip lives in the driver's SparkFiles folder, which Spark deletes at stop."""
    folder = os.path.join(SparkFiles.getRootDirectory(), "spark-sink-code")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "spark_sink_code.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for package in (spark_sink, gateway):
            root = os.path.dirname(os.path.abspath(package.__file__ or ""))
            for here, dirs, files in os.walk(root):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                for name in files:
                    full = os.path.join(here, name)
                    archive.write(full, os.path.relpath(full, os.path.dirname(root)))
    spark.sparkContext.addPyFile(path)
    return path
