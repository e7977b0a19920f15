"""`python -m spark_sink --config gateway.toml [--until-idle]`, also usable as a
spark-submit application file."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

from gateway.config import ConfigError, LogSettings
from gateway.errors import BrokerUnreachable
from gateway.logs import configure
from spark_sink.config import load_sink_settings
from spark_sink.preflight import DedupRedisUnreachable

# The `spark` extra's modules the job imports (pyproject.toml).
SPARK_EXTRA = ("pyspark", "pyarrow", "confluent_kafka")
EXIT_CONFIG, EXIT_UNREACHABLE = 2, 3  # as the gateway's commands (gateway/cli.py)


def configure_logging(settings: LogSettings) -> None:
    """The `[log]` section, as the gateway applies it; py4j's per-call INFO lines are noise."""
    configure(settings)
    logging.getLogger("py4j").setLevel(max(logging.WARNING, logging.getLogger().level))


def missing_runtime() -> str | None:
    """What this Python lacks to run the job (one line), or None: the `spark` extra's
    modules, and a Java runtime unless spark-submit started the JVM already."""
    missing = [name for name in SPARK_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed: install dedup-gateway[spark] and a Java "
            "runtime (17 or 21)"
        )
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # spark-submit runs this file in its JVM
        return None
    java_home = os.environ.get("JAVA_HOME")
    if java_home and not Path(java_home, "bin", "java").exists():
        return f"JAVA_HOME={java_home} has no bin/java: point it at a Java runtime (17 or 21)"
    if not java_home and shutil.which("java") is None:
        return "no Java runtime (java on PATH or JAVA_HOME): install one (17 or 21)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spark_sink", description=__doc__)
    parser.add_argument(
        "--config", type=Path, help="the gateway's TOML file ([kafka], [spark], [log])"
    )
    parser.add_argument(
        "--until-idle",
        action="store_true",
        help="process what the clean topic holds now, print the counts as JSON, and exit",
    )
    args = parser.parse_args(argv)
    try:
        settings = load_sink_settings(args.config)
    except ConfigError as exc:
        print(f"spark_sink: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if (missing := missing_runtime()) is not None:
        print(f"spark_sink: {missing}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.log)
    from spark_sink import job  # pyspark: only once it is known to be there

    try:
        if args.until_idle:
            print(json.dumps(asdict(job.run_until_idle(settings))))
        else:
            job.run_forever(settings)
    except ConfigError as exc:  # a setting that only the started session can check
        print(f"spark_sink: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (BrokerUnreachable, DedupRedisUnreachable) as exc:
        print(f"spark_sink: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
