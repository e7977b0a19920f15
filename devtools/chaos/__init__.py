"""Randomized fault schedules against a real local stack, and the checker that judges them.

A seed becomes a run configuration (2 or 3 gateways, failure mode, id strategy,
session timeout) and a schedule of faults (`schedule`). A run (`runner`) starts
its own Apache Kafka broker, three quorum members (redis-server processes; member 0
a Redis Cluster of 3 masters with a replica each in `cluster` runs) and the
gateways as real processes in one group, produces raw traffic with hostile records in it
(`traffic`), injects the faults while playing the Spark job's side of the
contract on the clean topic (`standin`), lets everything settle, stops the
gateways with SIGTERM and hands what it saw to the checker (`checker`). Each
guarantee is one rule:

- `lost`: every raw record with a usable id has its id processed successfully
  or dead-lettered; a record the README leaves open (too large, a header name
  that is not UTF-8) is forwarded or quarantined;
- `quarantine`: every unusable record is on the quarantine topic with its
  coordinates (one `dedup-source`) and reason (`dedup-error`), usable ones never;
- `twice`: no id is processed successfully twice;
- `repeats`: a record the raw path forwarded straight to the clean topic is never
  delivered again (the gateways run `exactly_once` on; the stand-in reads
  `read_committed`); repeated retries (the failure loop is at-least-once) and
  delayed deliveries moved out of their tier's offset order stay within
  `max_batch_records` per raw partition per gateway kill;
- `dead-letter`: only ids that always fail are dead-lettered, at `max_attempts`;
- `command-invalid`: a command the job sent for a record it failed is never
  skipped as invalid (from the gateways' logs: the id may still come through when
  a rebalance replays the command, which hides the loss this rule catches);
- `contract`: a clean record carries one `dedup-id`/`-token`/`-source`, naming a
  raw record with that id and value;
- `exit`, `traceback`: no gateway exits but by the schedule (SIGKILL) or the
  final SIGTERM (code 0, within the deployments' 60 s grace period), and no
  gateway log holds a traceback;
- `early`, `window`, `command-hostile` (delay runs, `RunConfig.delay`): no clean
  record before it was due (its delay, or its coalescing window's close); of
  each window on the clean topic, every newer version of it came too; every
  failure command with hostile headers is skipped as invalid;
- `stall`: progress resumes before each fault and the run settles in time;
  `ledger`, `unreadable`: the harness saw the whole run.

Delay runs (`--delay yes`, or 4 seeds in 10) turn on `[delay]` and `[coalesce]`,
add delayed, windowed and clock-skewed records, hostile records on the tier topics
and the failure topic, a rolling restart into changed settings and a member
handover (docs/chaos.md).

The seed fixes the schedule (faults, targets, durations, pauses), the traffic,
which ids fail, and the command chaos. Process timing is not fixed by it, so a
failing seed may take a few runs to fail again; the report names the rule, the
id and the step of the schedule around it, and the command that reruns it.

Long runs: `python -m devtools.chaos --seed S --minutes M` (`make chaos`).
"""

from devtools.chaos.checker import Observations, Violation, check
from devtools.chaos.runner import Result, run_schedule
from devtools.chaos.schedule import Fault, Schedule, Step, make_schedule

__all__ = [
    "Fault",
    "Observations",
    "Result",
    "Schedule",
    "Step",
    "Violation",
    "check",
    "make_schedule",
    "run_schedule",
]
