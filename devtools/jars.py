"""The JVM engines the project runs, fetched from Maven Central by the machine's `mvn`.

Two sets, each resolved from a small POM in `scripts/jvm/` with its dependencies and
copied into a cache outside the work tree (`DEDUP_JAR_CACHE`, default
`~/.cache/dedup-gateway/jars`), one folder per version, so a second `make setup`
fetches nothing:

- Apache Kafka's broker (`kafka_2.13`), run as a one-node KRaft broker+controller by
  `devtools.localstack.kafka_broker`;
- Spark's own Kafka connector (`spark-sql-kafka-0-10`) for a given Spark version, which
  the Spark job puts on its classpath (`spark.jars`);
- a table format's jars (Delta Lake, Apache Iceberg) for a given Spark version, which
  the job puts there for `[spark] output_format` (`spark_sink.tables.TABLE_ARTIFACTS`).

    python -m devtools.jars kafka            # prints the folder, fetching it once
    python -m devtools.jars spark-kafka 4.2.0
    python -m devtools.jars delta 4.2.0
    python -m devtools.jars tables 4.2.0     # every table format with a build for it
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

POMS = Path(__file__).resolve().parent.parent / "scripts" / "jvm"
# The broker line the project is tested with; DEDUP_KAFKA_VERSION picks another
# (3.9.x, the last 3.x line, runs the same KRaft set-up).
KAFKA_VERSION = "4.1.1"
# What `--packages org.apache.spark:spark-sql-kafka-0-10_<scala>:<version>` adds to a
# Spark installation; the rest of its dependency tree (Hadoop, Scala, compression
# codecs) ships with Spark itself.
CONNECTOR_ARTIFACTS = (
    "spark-sql-kafka-0-10_{scala}",
    "spark-token-provider-kafka-0-10_{scala}",
    "kafka-clients",
    "commons-pool2",
)
FETCH_TIMEOUT_S = 900.0
READY = ".complete"  # written last: a folder without it is a fetch that did not finish


class JarFetchError(RuntimeError):
    """The jars could not be fetched (no `mvn`, no network, an unknown version)."""


def cache_root() -> Path:
    return Path(os.environ.get("DEDUP_JAR_CACHE", "~/.cache/dedup-gateway/jars")).expanduser()


def kafka_version() -> str:
    return os.environ.get("DEDUP_KAFKA_VERSION", KAFKA_VERSION)


def scala_binary(spark_version: str) -> str:
    """Spark 4 is built for Scala 2.13 only; pyspark 3.5 ships the 2.12 build."""
    return "2.12" if spark_version.startswith("3.") else "2.13"


def kafka_jars(version: str | None = None) -> Path:
    """The folder of Apache Kafka's broker jars (`java -cp '<folder>/*' kafka.Kafka`)."""
    version = version or kafka_version()
    return _fetched(f"kafka-{version}", "kafka.pom.xml", {"kafka.version": version}, ())


def spark_kafka_jars(spark_version: str) -> Path:
    """The folder of Spark's Kafka connector jars for `spark_version`."""
    scala = scala_binary(spark_version)
    include = tuple(name.format(scala=scala) for name in CONNECTOR_ARTIFACTS)
    props = {"spark.version": spark_version, "scala.binary": scala}
    return _fetched(f"spark-kafka-{spark_version}", "spark-kafka.pom.xml", props, include)


def table_jars(output_format: str, spark_version: str) -> Path:
    """The folder of `output_format`'s jars for `spark_version` ("delta" or "iceberg");
    the same folder as `spark_sink.tables.table_cache_folder`."""
    from spark_sink.tables import table_artifact

    artifact = table_artifact(output_format, spark_version)
    props = {
        "table.group": artifact.group,
        "table.artifact": artifact.artifact,
        "table.version": artifact.version,
    }
    name = f"{output_format}-{spark_version}"
    return _fetched(name, "spark-table.pom.xml", props, artifact.include)


def table_formats(spark_version: str) -> list[str]:
    """The table formats with a build for `spark_version`'s line."""
    from spark_sink.connector import spark_version as line
    from spark_sink.tables import TABLE_ARTIFACTS

    return sorted({fmt for fmt, spark in TABLE_ARTIFACTS if spark == line(spark_version)})


def cached(folder: Path) -> bool:
    return (folder / READY).is_file()


def connector_folder(spark_version: str) -> Path:
    """Where `spark_kafka_jars` keeps them, fetched or not (nothing is fetched)."""
    return cache_root() / f"spark-kafka-{spark_version}"


def _fetched(name: str, pom: str, props: dict[str, str], include: tuple[str, ...]) -> Path:
    dest = cache_root() / name
    if cached(dest):
        return dest
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarFetchError(f"`mvn` is not installed: it fetches {name} from Maven Central")
    shutil.rmtree(dest, ignore_errors=True)
    argv = [mvn, "-q", "-B", "-f", str(POMS / pom), "dependency:copy-dependencies",
            f"-DoutputDirectory={dest}", "-DincludeScope=runtime",
            *(f"-D{key}={value}" for key, value in props.items())]  # fmt: skip
    if include:
        argv.append("-DincludeArtifactIds=" + ",".join(include))
    print(f"jars: fetching {name} from Maven Central into {dest}", file=sys.stderr)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise JarFetchError(f"fetching {name} took over {FETCH_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0 or not any(dest.glob("*.jar")):
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise JarFetchError(f"mvn could not fetch {name} ({' '.join(argv[4:])}):\n{tail}")
    (dest / READY).write_text(" ".join(sorted(p.name for p in dest.glob("*.jar"))) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.jars",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("what", choices=["kafka", "spark-kafka", "delta", "iceberg", "tables"])
    parser.add_argument("version", nargs="?", help="default: the tested version")
    args = parser.parse_args(argv)
    try:
        if args.what == "kafka":
            folder = kafka_jars(args.version)
        elif args.what in ("delta", "iceberg"):
            folder = table_jars(args.what, args.version or _installed_pyspark())
        elif args.what == "tables":
            for output_format in table_formats(args.version or _installed_pyspark()):
                print(table_jars(output_format, args.version or _installed_pyspark()))
            return 0
        else:
            folder = spark_kafka_jars(args.version or _installed_pyspark())
    except (JarFetchError, ValueError) as exc:  # ValueError: ConfigError, no such build
        print(f"jars: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def _installed_pyspark() -> str:
    from importlib.metadata import version

    return version("pyspark")


if __name__ == "__main__":
    raise SystemExit(main())
