"""Which Kafka source the job runs, and how it gets Spark's connector: the jars `make
setup` caches, `--packages` coordinates per Spark line, the one-line stop when
neither source can run, and the restart kept for Spark 4.1's connector bug."""

from __future__ import annotations

from pathlib import Path

import pyspark
import pytest
from pyspark.errors import StreamingQueryException

from devtools import jars
from gateway.config import ConfigError
from spark_sink import connector, job, session
from spark_sink.config import load_sink_settings
from tests.integration.spark.session import python_source_test

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]


@pytest.fixture
def jar_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DEDUP_JAR_CACHE", str(tmp_path / "jars"))
    return tmp_path / "jars"


def fetched(cache: Path, version: str, complete: bool = True) -> list[str]:
    """A cached fetch of the connector for `version`, as devtools.jars leaves it."""
    folder = cache / f"spark-kafka-{version}"
    folder.mkdir(parents=True)
    names = [f"spark-sql-kafka-0-10_2.13-{version}.jar", "kafka-clients-3.9.2.jar"]
    for name in names:
        (folder / name).write_bytes(b"")
    if complete:
        (folder / ".complete").write_text(" ".join(names))
    return sorted(str(folder / name) for name in names)


@pytest.mark.parametrize("cache", [None, "/srv/jars"])
def test_the_job_looks_where_make_setup_fetches(cache, monkeypatch):
    if cache is None:
        monkeypatch.delenv("DEDUP_JAR_CACHE", raising=False)
    else:
        monkeypatch.setenv("DEDUP_JAR_CACHE", cache)
    for version in ("3.5.7", "4.2.0"):
        assert connector.connector_cache_folder(version) == jars.connector_folder(version)
    assert connector.connector_cache_folder() == jars.connector_folder(pyspark.__version__)
    assert connector.JAR_CACHE_READY == jars.READY


@pytest.mark.parametrize(
    ("version", "coordinates"),
    [("3.5.7", "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.7"),
     ("4.0.1", "org.apache.spark:spark-sql-kafka-0-10_2.13:4.0.1"),
     ("4.2.0", "org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0")],
)  # fmt: skip
def test_packages_coordinates_follow_the_spark_line(version, coordinates):
    assert connector.connector_coordinates(version) == coordinates
    assert connector.scala_binary(version) == jars.scala_binary(version)


def test_a_whole_cached_fetch_goes_on_spark_jars_after_the_users_own(jar_cache):
    cached = fetched(jar_cache, pyspark.__version__)
    assert connector.connector_jars_conf(load_sink_settings()) == {"spark.jars": ",".join(cached)}
    own = {"conf": {"spark.jars": "/opt/hadoop-aws.jar"}}
    assert connector.connector_jars_conf(load_sink_settings(spark=own)) == {
        "spark.jars": ",".join(["/opt/hadoop-aws.jar", *cached])
    }


@pytest.mark.parametrize(
    "spark",
    [{"source": "python"},
     {"conf": {"spark.jars.packages": "org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0"}},
     {"conf": {"spark.jars": "/opt/jars/spark-sql-kafka-0-10_2.13-4.2.0.jar"}}],
)  # fmt: skip
def test_no_cached_jars_when_the_config_names_a_connector_or_the_python_source(jar_cache, spark):
    fetched(jar_cache, pyspark.__version__)
    assert connector.connector_jars_conf(load_sink_settings(spark=spark)) == {}


def test_nothing_from_a_fetch_that_did_not_finish_or_of_another_version(jar_cache):
    fetched(jar_cache, pyspark.__version__, complete=False)
    fetched(jar_cache, "1.0.0")
    assert connector.connector_jars_conf(load_sink_settings()) == {}


def test_native_without_a_connector_stops_before_the_session_naming_the_setting(
    jar_cache, monkeypatch
):
    """No JVM is started to find out: nothing in [spark.conf], make setup's cache or
    Spark's own jars holds the connector."""
    monkeypatch.setenv("SPARK_HOME", str(jar_cache / "spark-home"))
    monkeypatch.setattr(connector, "jvm_started", lambda: False)
    coordinates = connector.connector_coordinates()
    missing = connector.native_connector_missing(load_sink_settings(spark={"source": "native"}))
    assert missing is not None and "\n" not in missing
    assert f'"spark.jars.packages" = "{coordinates}"' in missing
    assert f"--packages {coordinates}" in missing
    with pytest.raises(ConfigError, match=r'spark\.source = "native"'):
        job.before_session(load_sink_settings(spark={"source": "native"}))
    packages = {"source": "native", "conf": {"spark.jars.packages": coordinates}}
    assert connector.native_connector_missing(load_sink_settings(spark=packages)) is None
    assert connector.native_connector_missing(load_sink_settings(spark={"source": "auto"})) is None
    (jar_cache / "spark-home" / "jars").mkdir(parents=True)
    jar = jar_cache / "spark-home" / "jars" / f"spark-sql-kafka-0-10_2.13-{pyspark.__version__}.jar"
    jar.write_bytes(b"")
    assert (
        connector.native_connector_missing(load_sink_settings(spark={"source": "native"})) is None
    )
    jar.unlink()
    fetched(jar_cache, pyspark.__version__)
    assert (
        connector.native_connector_missing(load_sink_settings(spark={"source": "native"})) is None
    )


@pytest.mark.parametrize(
    ("version", "package"),
    [("3.5.7", "org.apache.spark.sql.execution.streaming"),
     ("4.0.1", "org.apache.spark.sql.execution.streaming"),
     ("4.1.1", "org.apache.spark.sql.execution.streaming.checkpointing"),
     ("4.2.0", "org.apache.spark.sql.execution.streaming.checkpointing")],
)  # fmt: skip
def test_the_local_checkpoint_manager_is_named_as_each_spark_has_it(version, package):
    (name,) = session.local_checkpoint_conf(version).values()
    assert name == f"{package}.FileSystemBasedCheckpointFileManager"


def test_the_local_checkpoint_manager_of_this_spark_exists(spark):
    (name,) = session.local_checkpoint_conf().values()
    assert spark._jvm.java.lang.Class.forName(name).getSimpleName() == name.rsplit(".", 1)[1]


def test_auto_finds_the_connector_the_session_has_and_native_accepts_it(spark):
    assert connector.connector_version(spark) == spark.version
    for source in ("auto", "native"):
        assert (
            connector.choose_source(spark, load_sink_settings(spark={"source": source})) == "kafka"
        )


@python_source_test
def test_python_is_chosen_when_asked_or_when_auto_finds_no_connector(spark, monkeypatch):
    assert (
        connector.choose_source(spark, load_sink_settings(spark={"source": "python"})) == "python"
    )
    monkeypatch.setattr(connector, "connector_version", lambda spark: None)
    assert connector.choose_source(spark, load_sink_settings()) == "python"


def test_without_the_connector_or_the_python_api_start_up_stops_naming_the_fix(spark, monkeypatch):
    monkeypatch.setattr(connector, "connector_version", lambda spark: None)
    monkeypatch.setattr(connector, "python_source_missing", lambda: "no Data Source API here")
    coordinates = connector.connector_coordinates(spark.version)
    with pytest.raises(ConfigError) as raised:
        connector.choose_source(spark, load_sink_settings())
    message = str(raised.value)
    assert "\n" not in message
    assert f"--packages {coordinates}" in message and "spark.jars.packages" in message
    with pytest.raises(ConfigError, match=r'spark\.source = "native".*--packages'):
        connector.choose_source(spark, load_sink_settings(spark={"source": "native"}))
    with pytest.raises(ConfigError, match=r'spark\.source = "python": no Data Source API'):
        connector.choose_source(spark, load_sink_settings(spark={"source": "python"}))


def test_a_connector_of_another_spark_line_stops_start_up(spark, monkeypatch):
    monkeypatch.setattr(connector, "connector_version", lambda spark: "3.4.1")
    with pytest.raises(ConfigError, match=r"connector on the classpath is 3\.4\.1"):
        connector.choose_source(spark, load_sink_settings())


def test_a_query_failing_otherwise_is_not_taken_for_the_connectors_progress_bug(spark, tmp_path):
    """The restart after SPARK-55271 (Spark 4.1's connector) is for that failure only."""

    def fails(batch: object, batch_id: int) -> None:
        raise RuntimeError("the handler's own failure")

    query = (
        spark.readStream.format("rate").load().writeStream.foreachBatch(fails)
        .option("checkpointLocation", str(tmp_path / "ck")).start()
    )  # fmt: skip
    with pytest.raises(StreamingQueryException, match="the handler's own failure"):
        query.awaitTermination()
    query.stop()
    assert not connector.connector_progress_bug(query)
