"""`python -m devtools.chaos`: seeded schedules one after another, for a while.

Seeds S, S+1, ... until `--minutes` pass (or `--schedules` ran). Each failing
schedule's report (seed, schedule, timeline, violations by rule, the command
that reruns it) is printed and written next to its logs; passing runs' logs are
removed unless `--keep`. Exit code 1 when any schedule failed.
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import random
import re
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

from devtools.chaos.checker import Violation
from devtools.chaos.runner import Result, run_schedule
from devtools.chaos.schedule import Profile, make_schedule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.chaos",
        description="Run seeded random fault schedules against a local stack and check them.",
    )
    parser.add_argument("--seed", type=int, default=1, help="first seed; then seed+1, ...")
    parser.add_argument("--minutes", type=float, default=10.0, help="stop starting schedules after")
    parser.add_argument("--schedules", type=int, default=0, help="at most this many (0: no limit)")
    parser.add_argument(
        "--schedule-seconds",
        type=float,
        default=90.0,
        help="faults per schedule, in seconds of schedule",
    )
    parser.add_argument(
        "--profile",
        choices=("guaranteed", "beyond", "mixed"),
        default="mixed",
        help="mixed: one schedule in four goes beyond the guarantees",
    )
    parser.add_argument("--mode", choices=("retry", "release"), help="force the failure mode")
    parser.add_argument("--session", type=float, help="force the gateways' session timeout (s)")
    parser.add_argument(
        "--cluster", choices=("yes", "no"),
        help="force member 0 to be a Redis Cluster, or not (else the seed decides)",
    )  # fmt: skip
    parser.add_argument(
        "--delay", choices=("yes", "no"),
        help="force delay runs ([delay] tiers, [coalesce], skewed clocks, hostile tier "
        "records and commands, a config change, a member handover), or not (else the seed)",
    )  # fmt: skip
    parser.add_argument("--gateways", type=int, choices=(1, 2, 3), help="force the gateways")
    parser.add_argument("--rate", type=int, help="raw records per second (default 300)")
    parser.add_argument("--exclude", default="", help="comma-separated fault or record kinds")
    parser.add_argument("--workdir", type=Path, default=Path(".state/chaos"))
    parser.add_argument("--keep", action="store_true", help="keep the logs of passing runs")
    parser.add_argument("--verbose", action="store_true", help="print the timeline as it happens")
    args = parser.parse_args(argv)

    exclude = [k for k in args.exclude.split(",") if k]
    started = time.monotonic()
    results: list[Result] = []
    seed = args.seed
    while (time.monotonic() - started) / 60 < args.minutes and (
        not args.schedules or len(results) < args.schedules
    ):
        profile: Profile
        if args.profile == "mixed":
            profile = "beyond" if random.Random(f"{seed}:profile").random() < 0.25 else "guaranteed"
        else:
            profile = args.profile
        cluster = None if args.cluster is None else args.cluster == "yes"
        delay = None if args.delay is None else args.delay == "yes"
        schedule = make_schedule(
            seed, args.schedule_seconds, profile, args.mode, exclude, args.session, cluster,
            delay, args.gateways, args.rate,
        )  # fmt: skip
        print(schedule.describe(), flush=True)
        workdir = args.workdir.resolve() / f"seed-{seed}"
        shutil.rmtree(workdir, ignore_errors=True)
        say = (lambda line: print(f"  {line}", flush=True)) if args.verbose else (lambda _: None)
        result = asyncio.run(run_schedule(schedule, workdir, say))
        results.append(result)
        print(result.summary(), flush=True)
        if result.violations:
            report = result.report()
            (workdir / "report.txt").write_text(report + "\n")
            # What the checker saw, to check it again (pickle.load) after changing a rule.
            (workdir / "observations.pickle").write_bytes(pickle.dumps(result.observations))
            print(report, flush=True)
            print(f"logs: {workdir}", flush=True)
        elif not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        seed += 1

    failing = [r for r in results if not r.passed]
    print(
        f"\n{len(results)} schedules in {(time.monotonic() - started) / 60:.1f} min: "
        f"{sum(r.stats['faults'] for r in results)} faults injected, "
        f"{sum(r.stats['raw'] for r in results)} raw records and "
        f"{sum(r.stats['deliveries'] for r in results)} clean deliveries checked; "
        f"{len(failing)} failing"
    )
    found: dict[str, list[int]] = defaultdict(list)
    for r in results:
        for what in sorted({_signature(v) for v in r.violations}):
            found[what].append(r.schedule.config.seed)
    for what, seeds in sorted(found.items()):
        print(f"  {what}: seeds {seeds}")
    return 1 if failing else 0


_GATEWAY_ERROR = re.compile(r"\]?: ([A-Za-z_.]*(Error|Exception)\b[^\[]{0,80})")
_RECORD_KIND = re.compile(r"^(\S+) record raw ")


def _signature(violation: Violation) -> str:
    """What a violation is about, to group the findings of many schedules: the rule,
    and the gateway's exception or the kind of record where the message names one."""
    what = violation.rule + (" (tolerated)" if violation.tolerated else "")
    if match := _GATEWAY_ERROR.search(violation.message):
        return f"{what}: {match[1].strip()}"
    if match := _RECORD_KIND.match(violation.message):
        return f"{what}: {match[1]} records"
    if violation.message.startswith("id ") and "(fate " in violation.message:
        return f"{what}: ids of fate {violation.message.split('(fate ', 1)[1].split(')')[0]}"
    return what


if __name__ == "__main__":
    sys.exit(main())
