"""`python -m spark_sink --config gateway.toml [--until-idle]`, also usable as a
spark-submit application file.

Every way it ends is one line on stderr and an exit code (docs/spark.md, "Exit codes"):
0 done (or, streaming, stopped by SIGTERM/SIGINT: the batch in flight runs again at
the next start); 1 the query failed; 2 a setting, named (a missing topic, a checkpoint
that is not this job's); 3 the broker or the dedup's Redis does not answer; 128 + the
signal (130, 143) for `--until-idle` stopped before it read the clean topic to its end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from types import FrameType

from gateway.config import ConfigError, LogSettings
from gateway.errors import BrokerUnreachable
from gateway.logs import configure
from spark_sink.config import load_sink_settings
from spark_sink.preflight import DedupRedisUnreachable

# The `spark` extra's modules the job imports (pyproject.toml).
SPARK_EXTRA = ("pyspark", "pyarrow", "confluent_kafka")
EXIT_FAILED, EXIT_CONFIG, EXIT_UNREACHABLE = 1, 2, 3  # as the gateway's commands (gateway/cli.py)
FAILED_MESSAGE_CHARS = 600


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


@contextmanager
def stop_on_signals() -> Iterator[tuple[threading.Event, list[int]]]:
    """An event set by the first SIGTERM or SIGINT (and the signals seen); a second
    one ends the process at once (the handlers go back to the defaults)."""
    stop, seen = threading.Event(), []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        stop.set()
        for sig in previous:
            signal.signal(sig, signal.SIG_DFL)

    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        yield stop, seen
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def failed_line(exc: BaseException) -> str:
    """The first line of what Spark (or py4j) says, never its JVM stack (the whole
    traceback is logged at DEBUG: `[log] level = "DEBUG"`)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = lines[0] if lines else type(exc).__name__
    if len(said) > FAILED_MESSAGE_CHARS:
        said = said[:FAILED_MESSAGE_CHARS] + "..."
    return f"the job failed: {said}; the batch in flight runs again at the next start"


def stopped_line(signum: int) -> str:
    return (
        f"spark_sink: {signal.Signals(signum).name}: stopped; the batch in flight runs "
        "again at the next start"
    )


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

    with stop_on_signals() as (stop, signals):
        try:
            if args.until_idle:
                print(json.dumps(asdict(job.run_until_idle(settings, stop=stop))))
            else:
                job.run_forever(settings, stop=stop)
        except job.Stopped:
            print(stopped_line(signals[0]), file=sys.stderr)
            return 128 + signals[0]
        except ConfigError as exc:  # a setting that only the started session can check
            print(f"spark_sink: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except (BrokerUnreachable, DedupRedisUnreachable) as exc:
            print(f"spark_sink: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except Exception as exc:  # the query failed: Spark's error, without its stacks
            logging.getLogger(__name__).debug("the job failed", exc_info=True)
            print(f"spark_sink: {failed_line(exc)}", file=sys.stderr)
            return EXIT_FAILED
    if signals:
        print(stopped_line(signals[0]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
