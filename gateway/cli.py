"""`dedup-gateway`: the command line, the product's public surface."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import uvloop

from gateway.config import ConfigError, Settings, load_settings
from gateway.logs import configure

logger = logging.getLogger("gateway")


def _settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config)
    configure(settings.log)
    return settings


async def _until_signalled(main: Coroutine[Any, Any, None], stop: asyncio.Event) -> None:
    """Run `main`; the first SIGINT/SIGTERM sets `stop`, a second one exits at once."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.error("second %s: exiting without draining", sig.name)
            os._exit(130)
        logger.info("%s: draining in-flight work, then stopping", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await main
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def cmd_run(args: argparse.Namespace) -> int:
    from gateway.app import Gateway

    settings = _settings(args)

    async def main() -> None:
        stop = asyncio.Event()
        await _until_signalled(Gateway(settings).run(stop), stop)

    uvloop.run(main())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(args)


def cmd_operator(args: argparse.Namespace) -> int:
    from gateway import operator_commands as commands

    settings = _settings(args)
    if args.command == "inspect":
        return uvloop.run(commands.inspect(settings, args.id))
    if args.command == "release":
        return uvloop.run(commands.release(settings, args.id, args.token))
    return uvloop.run(commands.redrive(settings, args.limit))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedup-gateway", description="Crash-safe quorum dedup gateway between Kafka topics."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the gateway service")
    run.add_argument("--config", type=Path, help="TOML settings file (env GATEWAY_* overrides)")
    run.set_defaults(func=cmd_run)

    inspect = sub.add_parser("inspect", help="show an id's mark on every Redis instance")
    inspect.add_argument("id", help="the message id")
    release = sub.add_parser("release", help="release an id's mark by hand")
    release.add_argument("id", help="the message id")
    release.add_argument("--token", help="only where the mark holds this dedup-token")
    redrive = sub.add_parser("redrive", help="re-inject dead-lettered records into raw")
    redrive.add_argument("--limit", type=int, help="at most this many records")
    for operator_cmd in (inspect, release, redrive):
        operator_cmd.add_argument("--config", type=Path, help="the gateway's TOML settings file")
        operator_cmd.set_defaults(func=cmd_operator)

    demo = sub.add_parser("demo", help="the whole pipeline on an embedded local stack")
    demo.add_argument("--records", type=int, default=200_000, help="raw records to generate")
    demo.add_argument("--duplicates", type=float, default=0.3, help="share of duplicates")
    demo.add_argument("--partitions", type=int, default=4, help="raw topic partitions")
    demo.add_argument("--no-spark", action="store_true", help="skip the Spark stage")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"dedup-gateway: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
