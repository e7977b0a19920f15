"""`python -m spark_sink --config gateway.toml [--until-idle]`, also usable as a
spark-submit application file."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from gateway.config import ConfigError, LogSettings
from gateway.logs import configure
from spark_sink.config import load_sink_settings
from spark_sink.job import run_forever, run_until_idle


def configure_logging(settings: LogSettings) -> None:
    """The `[log]` section, as the gateway applies it; py4j's per-call INFO lines are noise."""
    configure(settings)
    logging.getLogger("py4j").setLevel(max(logging.WARNING, logging.getLogger().level))


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
        return 2
    configure_logging(settings.log)
    try:
        if args.until_idle:
            print(json.dumps(asdict(run_until_idle(settings))))
        else:
            run_forever(settings)
    except ConfigError as exc:  # a setting that only the started session can check
        print(f"spark_sink: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
