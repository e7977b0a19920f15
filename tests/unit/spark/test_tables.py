"""The table formats' settings, jars and start-up checks (spark_sink/tables.py), with no
Spark session: `[spark] output_format`, the jars `make setup` caches per format and
Spark version, the one-line stop when they are missing, and Delta's static settings."""

from __future__ import annotations

from pathlib import Path

import pyspark
import pytest

from gateway.config import ConfigError
from spark_sink import job, session, tables
from spark_sink.config import load_sink_settings
from spark_sink.connector import spark_version
from spark_sink.sink import BatchSink

pytestmark = [pytest.mark.spark, pytest.mark.spark_compat]


@pytest.fixture
def jar_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DEDUP_JAR_CACHE", str(tmp_path / "jars"))
    monkeypatch.setattr(tables, "jvm_started", lambda: False)
    return tmp_path / "jars"


def fetched(cache: Path, output_format: str) -> str:
    folder = cache / f"{output_format}-{pyspark.__version__}"
    folder.mkdir(parents=True)
    (folder / "format.jar").write_bytes(b"")
    (folder / ".complete").write_text("format.jar\n")
    return str(folder / "format.jar")


def test_parquet_is_the_default_and_an_unknown_format_names_the_setting():
    settings = load_sink_settings()
    assert settings.spark.output_format == "parquet"
    assert tables.sink_class(settings) is BatchSink
    assert tables.table_jars_missing(settings) is None
    assert tables.table_conf(settings, {}) == {}
    with pytest.raises(ConfigError, match="output_format"):
        load_sink_settings(spark={"output_format": "orc"})


delta_here = pytest.mark.skipif(
    ("delta", spark_version()) not in tables.TABLE_ARTIFACTS,
    reason=f"no Delta build for Spark {pyspark.__version__}",
)


@delta_here
def test_a_format_without_its_jars_stops_before_the_session_in_one_line(jar_cache):
    settings = load_sink_settings(spark={"output_format": "delta"})
    coordinates = tables.table_artifact("delta").coordinates
    missing = tables.table_jars_missing(settings)
    assert missing is not None and "\n" not in missing
    assert '[spark] output_format = "delta"' in missing
    assert f'"spark.jars.packages" = "{coordinates}"' in missing
    with pytest.raises(ConfigError, match=r'output_format = "delta" needs io\.delta:'):
        job.before_session(settings)
    packages = {"output_format": "delta", "conf": {"spark.jars.packages": coordinates}}
    assert tables.table_jars_missing(load_sink_settings(spark=packages)) is None
    fetched(jar_cache, "delta")
    assert tables.table_jars_missing(settings) is None


@delta_here
def test_the_chosen_formats_jars_and_deltas_settings_join_the_jobs_conf(jar_cache):
    jar = fetched(jar_cache, "delta")
    settings = load_sink_settings(
        spark={"output_format": "delta", "conf": {"spark.sql.extensions": "my.Extension"}}
    )
    conf = session.session_conf(settings, terminal=False)
    assert jar in conf["spark.jars"].split(",")
    assert conf["spark.sql.extensions"] == "my.Extension,io.delta.sql.DeltaSparkSessionExtension"
    assert (
        conf["spark.sql.catalog.spark_catalog"]
        == tables.DELTA_CONF["spark.sql.catalog.spark_catalog"]
    )
    assert tables.sink_class(settings) is tables.DeltaSink
    # Parquet: neither the jars nor Delta's settings.
    parquet = session.session_conf(load_sink_settings(), terminal=False)
    assert jar not in parquet.get("spark.jars", "")
    assert "spark.sql.extensions" not in parquet


def test_a_spark_line_without_a_build_of_the_format_names_the_tested_lines():
    with pytest.raises(ConfigError, match=r'output_format = "iceberg": no tested iceberg build'):
        tables.table_artifact("iceberg", "4.2.0")
    assert tables.table_artifact("delta", "4.2.0").coordinates == "io.delta:delta-spark_2.13:4.1.0"


def test_the_query_id_is_stable_per_checkpoint():
    assert tables.query_id("/a/checkpoint") == tables.query_id("/a/checkpoint/")
    assert tables.query_id("/a/checkpoint") != tables.query_id("/b/checkpoint")
