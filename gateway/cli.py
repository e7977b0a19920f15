"""`dedup-gateway`: the command line, the product's public surface."""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import uvloop

from gateway.config import (
    CONFIG_ENV,
    ConfigError,
    Settings,
    config_path,
    effective,
    load_settings,
)
from gateway.errors import BrokerUnreachable
from gateway.logs import configure
from gateway.metrics import package_version
from gateway.service.signals import until_signalled
from gateway.settings_text import to_toml

logger = logging.getLogger("gateway")
GC_YOUNG = 20_000
# The exit code of a command that could not connect to the broker (or, `check-config
# --connect`, found anything unreachable); 2 is a bad setting, 1 "not done".
EXIT_UNREACHABLE = 3


def _settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config)
    configure(settings.log)
    if getattr(args, "quiet", False) and not args.verbose:
        # An operator command's output is its report: the service's INFO lines only with -v.
        logging.getLogger().setLevel(max(logging.WARNING, logging.getLogger().level))
    return settings


def configure_gc() -> None:
    """Garbage collection for a process that runs the data path.

    A batch in flight holds ~15 container objects per record (records,
    headers, tuples): with CPython's default threshold (700 net allocations)
    the collector runs every ~50 records and re-traverses the whole batch,
    and the full collections it triggers traverse the heap: a third of the
    process's CPU per record in the benchmark (bench/RESULTS.md). Collected
    garbage is rare here (the data path makes few reference cycles), so:
    collect the young generation every GC_YOUNG net allocations (a pass
    costs a few ms, inside the latency budget), and freeze what start-up
    allocated so that no pass traverses it again.
    """
    gc.freeze()
    gc.set_threshold(GC_YOUNG, 20, 20)


def cmd_run(args: argparse.Namespace) -> int:
    from gateway.service import workers

    settings = _settings(args)
    count = args.workers or settings.kafka.workers
    if count > 1:
        supervisor = workers.Supervisor(settings, count, args.config)

        async def supervise() -> None:
            stop = asyncio.Event()
            await until_signalled(supervisor.run(stop), stop)

        uvloop.run(supervise())
        return 1 if supervisor.failed else 0

    from gateway.service.app import Gateway

    if supervisor_pid := os.environ.get(workers.SUPERVISOR_ENV):
        workers.follow_supervisor(int(supervisor_pid))
    configure_gc()

    async def main() -> bool:
        stop = asyncio.Event()
        gateway = Gateway(settings, config=config_path(args.config))
        drain_s = settings.kafka.drain_timeout.total_seconds()
        return await until_signalled(gateway.run(stop), stop, drain_s)

    return 0 if uvloop.run(main()) else 1


def cmd_check_config(args: argparse.Namespace) -> int:
    """Validate the settings (the Spark job's `[spark]` too) and print them as the gateway
    would run, secrets masked; with --connect, reach every member and the broker instead."""
    settings = load_settings(args.config)  # [spark] too, as the Spark job reads it
    if args.connect:
        return _check_connect(args, settings)
    data = effective(settings)
    print(json.dumps(data, indent=2) if args.output == "json" else to_toml(data))
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    """The JSON Schema of the settings file: every section, `[spark]` as the Spark job
    reads it (editors and CI can validate a gateway.toml against it)."""
    from gateway.config import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _check_connect(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.ops import connect_check

    configure(settings.log)
    if not args.verbose:
        logging.getLogger().setLevel(logging.ERROR)  # the findings say what went wrong
    findings = uvloop.run(connect_check.check(settings))
    if args.output == "json":
        print(
            json.dumps(
                [
                    {"severity": f.severity.name, "where": f.where, "message": f.message}
                    for f in findings
                ],
                indent=2,
            )
        )
    else:
        print("\n".join(f.line() for f in findings))
    return connect_check.exit_code(findings)


def cmd_topics(args: argparse.Namespace) -> int:
    from gateway.ops import topics

    settings = _settings(args)
    specs = topics.needed_topics(settings, args.partitions)
    if not (args.create or args.check):
        if args.output == "json":
            print(json.dumps(topics.as_json(specs, None), indent=2))
        else:
            print(topics.render(specs, None))
        return 0
    return uvloop.run(_topics_on_broker(args, settings, specs))


async def _topics_on_broker(args: argparse.Namespace, settings: Settings, specs: list[Any]) -> int:
    from gateway.kafka.admin import admin_client, reaching_broker
    from gateway.ops import topics

    admin = admin_client(settings.kafka)
    try:
        async with reaching_broker(settings.kafka, verbose=args.verbose):
            await admin.start()
            existing = await topics.existing_topics(admin, [s.name for s in specs])
            created: list[topics.Created] = []
            if args.create:
                brokers = len((await admin.describe_cluster())["brokers"])
                replication = args.replication_factor or min(3, brokers)
                created = await topics.create_missing(
                    admin, specs, existing, replication, args.dry_run
                )
    finally:
        await admin.close()
    failed = [c for c in created if c.error]
    if args.output == "json":
        print(
            json.dumps(
                {
                    "topics": topics.as_json(specs, existing),
                    "dry_run": args.dry_run,
                    "created": [c.name for c in created if not c.error],
                    "failed": {c.name: c.error for c in failed},
                },
                indent=2,
            )
        )
    else:
        print(topics.render(specs, existing))
        verb = "would create" if args.dry_run else "created"
        for c in created:
            print(f"{c.name}: {c.error}" if c.error else f"{verb} {c.name}")
        if args.create and not created:
            print("every topic exists")
    missing = args.check and not args.create and len(existing) < len(specs)
    return 1 if failed or missing else 0


def _message_id(args: argparse.Namespace) -> bytes:
    """The id's exact bytes: --id-b64, --id-hex, or the text as given on the command line
    (os.fsencode gives back the argument's own bytes, even when they are not UTF-8)."""
    message_id: bytes = args.id_b64 or args.id_hex or os.fsencode(args.id)
    return message_id


def _confirm_unconditional_release(args: argparse.Namespace, message_id: bytes) -> int | None:
    """None to go ahead, else the exit code. Deleting a mark whoever holds it lets the
    next copy through even when another record owns the id: ask first."""
    if args.token is not None or args.dry_run or args.yes:
        return None
    shown = message_id.decode("utf-8", "backslashreplace")
    if not sys.stdin.isatty():
        print(
            f"dedup-gateway: release {shown!r} without --token deletes its mark whoever holds "
            "it; pass --yes to confirm (no terminal to ask on)",
            file=sys.stderr,
        )
        return 2
    answer = input(f"Delete the mark of {shown!r} on every member, whoever holds it? [y/N] ")
    if answer.strip().lower() in ("y", "yes"):
        return None
    print("not released")
    return 1


def cmd_operator(args: argparse.Namespace) -> int:
    from gateway.ops import inspect, pause, redrive, release

    settings = _settings(args)
    if args.command == "inspect":
        return uvloop.run(inspect.inspect(settings, _message_id(args), args.output))
    if args.command == "release":
        message_id = _message_id(args)
        refused = _confirm_unconditional_release(args, message_id)
        if refused is not None:
            return refused
        return uvloop.run(
            release.release(
                settings, message_id, args.token, dry_run=args.dry_run, output=args.output
            )
        )
    if args.command in ("pause", "resume"):
        paused = args.command == "pause"
        return uvloop.run(
            pause.set_paused(
                settings, args.member, paused, force=paused and args.force, output=args.output
            )
        )
    return uvloop.run(
        redrive.redrive(
            settings, args.limit, dry_run=args.dry_run, output=args.output, verbose=args.verbose
        )
    )


def cmd_rebuild(args: argparse.Namespace) -> int:
    from gateway.ops.rebuild import rebuild

    settings = _settings(args)
    return uvloop.run(
        rebuild(settings, args.member, source=args.source, dry_run=args.dry_run, output=args.output)
    )


def _id_b64(text: str) -> bytes:
    try:
        value = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise argparse.ArgumentTypeError(f"not base64: {text!r}") from None
    if not value:
        raise argparse.ArgumentTypeError("an empty id")
    return value


def _id_hex(text: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not hex: {text!r}") from None
    if not value:
        raise argparse.ArgumentTypeError("an empty id")
    return value


def _worker_count(text: str) -> int:
    count = int(text)
    if not 1 <= count <= 256:
        raise argparse.ArgumentTypeError(f"must be between 1 and 256, got {count}")
    return count


EXAMPLES = {
    "run": "example:\n  dedup-gateway run --config gateway.toml",
    "check-config": (
        "examples:\n  dedup-gateway check-config --config gateway.toml > effective.toml\n"
        "  dedup-gateway check-config --config gateway.toml --connect\n\n"
        "exit codes: 0 valid (with --connect: everything reached and fits), 1 warnings\n"
        "only (--connect: it runs, but a setting should change), 2 invalid settings\n"
        "(the line names the setting), 3 (--connect) an error: something unreachable,\n"
        "refused, missing or unsafe, named on its line"
    ),
    "config-schema": (
        "example:\n  dedup-gateway config-schema > gateway.schema.json\n\n"
        "prints the JSON Schema (draft 2020-12) of the settings file: every section and key,\n"
        "its type, bounds and default (durations as '500ms', '24h' or seconds)"
    ),
    "topics": (
        "examples:\n  dedup-gateway topics --config gateway.toml\n"
        "  dedup-gateway topics --config gateway.toml --create --dry-run\n"
        "  dedup-gateway topics --config gateway.toml --create --partitions 12\n\n"
        "exit codes: 0 done, 1 a topic could not be created (or, with --check, is missing),\n"
        "2 invalid settings, 3 (--create, --check) cannot connect to the broker\n"
        "([kafka] bootstrap_servers): one line on stderr"
    ),
    "inspect": (
        "example:\n  dedup-gateway inspect --config gateway.toml order-1234\n\n"
        "exit codes: 0 shown, 2 invalid settings, 3 ([delay] on) cannot connect to the\n"
        "broker to read the tiers ([kafka] bootstrap_servers): one line on stderr"
    ),
    "release": (
        "examples:\n  dedup-gateway release --config gateway.toml order-1234 --token TOKEN\n"
        "  dedup-gateway release --config gateway.toml --id-hex 6f72646572 --yes --dry-run"
    ),
    "redrive": (
        "example:\n  dedup-gateway redrive --config gateway.toml --limit 100 --dry-run\n\n"
        "progress on stderr: a bar on a terminal, else a JSON line every 10 s\n\n"
        "exit codes: 0 done, 1 a dead letter not redriven, 2 invalid settings, 3 cannot\n"
        "connect to the broker ([kafka] bootstrap_servers): one line on stderr"
    ),
    "pause": "example:\n  dedup-gateway pause --config gateway.toml redis-1.internal:6379/0",
    "resume": "example:\n  dedup-gateway resume --config gateway.toml redis-1.internal:6379/0",
    "rebuild": (
        "example:\n  dedup-gateway rebuild --config gateway.toml redis-1.internal:6379/0 "
        "--from redis-0.internal:6379/0\n\n"
        "progress on stderr: a bar on a terminal, else a JSON line every 10 s"
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedup-gateway", description="Crash-safe quorum dedup gateway between Kafka topics."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_text,
            epilog=EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    run = add("run", "run the gateway service")
    run.add_argument(
        "--workers", type=_worker_count, metavar="N",
        help="gateway processes under one supervisor (default: [kafka] workers, 1)",
    )  # fmt: skip
    run.set_defaults(func=cmd_run)
    check = add("check-config", "validate the settings and print them")
    check.add_argument(
        "--connect",
        action="store_true",
        help="reach every Redis member and the broker; one line per finding",
    )
    check.set_defaults(func=cmd_check_config)
    schema = add("config-schema", "print the JSON Schema of the settings file")
    schema.set_defaults(func=cmd_config_schema)
    topics = add("topics", "print the topics the settings need; create the missing ones")
    topics.add_argument("--create", action="store_true", help="create the missing topics")
    topics.add_argument(
        "--check",
        action="store_true",
        help="show which exist on the broker (exit 1 if any is missing)",
    )
    topics.add_argument(
        "--partitions",
        type=int,
        default=6,
        metavar="N",
        help="partitions of the raw, clean and delay topics (default 6)",
    )
    topics.add_argument(
        "--replication-factor",
        type=int,
        metavar="N",
        help="replicas per partition (default: 3, or fewer brokers)",
    )
    topics.set_defaults(func=cmd_topics)

    inspect_ = add("inspect", "show an id's mark on every Redis member")
    release = add("release", "release an id's mark by hand")
    release.add_argument("--token", help="only where the mark holds this dedup-token")
    release.add_argument("--yes", action="store_true", help="no --token: do not ask to confirm")
    for id_cmd in (inspect_, release):
        which = id_cmd.add_mutually_exclusive_group(required=True)
        which.add_argument("id", nargs="?", help="the message id, as text")
        which.add_argument("--id-b64", type=_id_b64, help="the message id's bytes, in base64")
        which.add_argument("--id-hex", type=_id_hex, help="the message id's bytes, in hex")
    redrive = add("redrive", "re-inject dead-lettered records into raw")
    redrive.add_argument("--limit", type=int, help="at most this many records")
    pause = add("pause", "stop counting one Redis member and sending it claims (maintenance)")
    pause.add_argument("--force", action="store_true", help="even if fewer than a majority remain")
    resume = add("resume", "count a paused Redis member again")
    for member_cmd in (pause, resume):
        member_cmd.add_argument("member", help="the member, as the gateway names it")
    for operator_cmd in (inspect_, release, redrive, pause, resume):
        operator_cmd.set_defaults(func=cmd_operator)

    rebuild = add("rebuild", "rebuild one Redis member's marks from the others")
    rebuild.add_argument("member", help="the member to rebuild, as the gateway names it")
    rebuild.add_argument("--from", dest="source", help="copy from this member only")
    rebuild.set_defaults(func=cmd_rebuild)

    for dry in (release, redrive, rebuild, topics):
        dry.add_argument("--dry-run", action="store_true", help="say what would happen only")
    for command in (run, check, topics, inspect_, release, redrive, rebuild, pause, resume):
        command.add_argument(
            "--config", type=Path, help=f"TOML settings file (default: ${CONFIG_ENV})"
        )
    for command in (check, topics, inspect_, release, redrive, rebuild, pause, resume):
        command.add_argument("--output", choices=("text", "json"), default="text")
        command.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            help="also the service's INFO log lines (warnings only without)",
        )
    for command in (topics, inspect_, release, redrive, rebuild, pause, resume):
        command.set_defaults(quiet=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"dedup-gateway: {exc}", file=sys.stderr)
        return 2
    except BrokerUnreachable as exc:
        print(f"dedup-gateway: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return code


if __name__ == "__main__":
    sys.exit(main())
