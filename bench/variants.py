"""What the benchmark compares: the variants and how each one is built.

- `client-ceiling`: a bare aiokafka loop that re-produces records untouched
  (bench/ceiling.py): the most any aiokafka-based gateway can do here;
- `client-ceiling-headers` (opt-in, not in the default set): the same loop
  adding three headers the size of the gateway's `dedup-*` ones: what the
  clean-record contract alone costs the client and the broker;
- `forwarder`: the gateway's own process and data path (consumer, ids, tokens,
  headers, batches, producer, commits) with dedup switched off, no Redis call;
- `gateway-N`: the product, one CLAIM script call per instance per batch, the
  N instances queried concurrently; at-least-once output (`[kafka] exactly_once =
  "off"`, as every variant but gateway-3-eos: how every result before it was measured);
- `gateway-3-eos`: gateway-3 with exactly-once output (`exactly_once = "on"`): each
  raw batch's clean copies and its raw offsets in one Kafka transaction
  (gateway/kafka/exactly_once.py); its latency runs to the transaction's commit, when
  a `read_committed` reader can see the copies, and its clean topic is read back
  `read_committed` after each run (every id once);
- `gateway-3-fresh`: gateway-3 on members that start empty, with the default
  `[redis] buckets` (16,384: about a dozen marks per bucket at the benchmark's
  size, one live slice): how the benchmark measured before `--fill`; every
  other product variant runs on members filled to steady state first
  (`python -m bench --fill`, bench/steady.py);
- `naive-3`: the patent as written (and Redpanda Connect's dedupe processor):
  one `SET key NX PX ttl` per message per instance, awaited one after another;
- `gateway-3-lanes`: gateway-3 with two priority lanes (`[[lanes]]`): the
  benchmark's topic as the low lane under an empty high lane, so the lane
  scheduler (lag reads, pause checks) and the `dedup-lane` header run on
  every batch while nothing is held: what lanes cost;
- `gateway-3-cluster`: gateway-3 whose first member is a 3-master Redis
  Cluster (gateway/quorum/members.py: one script call per key group with records,
  `[redis] cluster_groups` of them) beside two standalone members: what a
  cluster member costs against a standalone one;
- `gateway-3x1`, `gateway-3x2`: gateway-3 as a real `dedup-gateway run
  --workers 1|2` process tree (bench/processes.py), counted through the
  supervisor's /metrics: how the gateway scales over cores;
- `spark-job`, `spark-floor` (and the opt-in `spark-job-passthrough`): the
  Spark half on the clean topic gateway-3 wrote in the same round, at the
  targets' duplicate share (bench/spark.py); the job with its delivery dedup, as
  `[spark] delivery_dedup = "auto"` runs it on an at-least-once clean topic;
- `spark-job-eos`: the job on the clean topic gateway-3-eos wrote (transactional,
  read `read_committed`), without the delivery dedup, as "auto" runs it there;
- `spark-job-redis`: spark-job with its delivery dedup in Redis
  (`[spark] dedup_redis`, a redis-server of its own) instead of a state store.

All but gateway-3xN and the spark variants run in the benchmark's own process
(same event loop, same measuring overhead), so their ratios compare like with like.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from bench.ceiling import ClientCeiling
from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.quorum.quorum import Quorum
from gateway.rules.vote import MINE, Reply
from gateway.service.app import Gateway

# What a naive claim reports for a key someone else set: any foreign owner makes it a duplicate.
TAKEN = "taken"


@dataclass(frozen=True)
class Variant:
    name: str
    redis: int  # quorum members the variant uses
    dedup: bool = True
    naive: bool = False
    kind: Literal["in-process", "ceiling", "processes", "spark"] = "in-process"
    workers: int = 1  # processes under the supervisor (kind "processes")
    lanes: bool = False  # the raw topic as the low lane under an empty high lane
    cluster: bool = False  # the first member is the stack's Redis Cluster (CLUSTER_MASTERS)
    headers: bool = False  # the ceiling adds three headers like the gateway's
    opt_in: bool = False  # run only when named in --variants
    fresh: bool = False  # members not filled first, default `[redis] buckets` (bench/steady.py)
    exactly_once: bool = False  # `[kafka] exactly_once` "on", else "off" (at-least-once)
    reads: str = "gateway-3"  # a spark variant: the gateway variant whose clean topic it reads
    delivery_dedup: bool = True  # a spark job variant: with the job's delivery dedup

    @property
    def fixed_load(self) -> bool:
        """Measured for latency at the common offered loads (naive-3 cannot carry
        them; the process variants' samples stay in their own processes)."""
        return self.kind not in ("processes", "spark") and not self.naive


# Masters of the cluster member the stack starts when a chosen variant has one.
CLUSTER_MASTERS = 3
CEILING = Variant("client-ceiling", redis=1, dedup=False, kind="ceiling")
FORWARDER = Variant("forwarder", redis=1, dedup=False)
VARIANTS: tuple[Variant, ...] = (
    CEILING,
    Variant(
        "client-ceiling-headers", redis=1, dedup=False, kind="ceiling", headers=True, opt_in=True
    ),
    FORWARDER,
    Variant("gateway-1", redis=1),
    Variant("gateway-3", redis=3),
    Variant("gateway-3-eos", redis=3, exactly_once=True),
    Variant("gateway-3-fresh", redis=3, fresh=True),
    Variant("gateway-5", redis=5),
    Variant("naive-3", redis=3, naive=True),
    Variant("gateway-3-lanes", redis=3, lanes=True),
    Variant("gateway-3-cluster", redis=3, cluster=True),
    Variant("gateway-3x1", redis=3, kind="processes", workers=1),
    Variant("gateway-3x2", redis=3, kind="processes", workers=2),
    # After gateway-3 in each round, on its clean topic (bench/spark.py).
    Variant("spark-job", redis=0, dedup=False, kind="spark"),
    Variant("spark-floor", redis=0, dedup=False, kind="spark"),
    Variant("spark-job-passthrough", redis=0, dedup=False, kind="spark", opt_in=True),
    Variant("spark-job-redis", redis=0, dedup=False, kind="spark"),
    Variant(
        "spark-job-eos",
        redis=0,
        dedup=False,
        kind="spark",
        reads="gateway-3-eos",
        delivery_dedup=False,
    ),
)


class Counts(Protocol):
    """What a run is measured by (the gateway's `Metrics` has these)."""

    def consumed(self) -> int: ...
    def handled(self) -> int: ...
    def forwarded_total(self) -> int: ...
    def duplicates_total(self) -> int: ...
    def vote_wait_s(self) -> float: ...


class Subject(Protocol):
    """Something the benchmark runs until it has handled a topic: a gateway, the ceiling,
    a process tree."""

    @property
    def metrics(self) -> Counts: ...
    async def run(self, stop: asyncio.Event) -> None: ...


class NaiveQuorum(Quorum):
    """The patent's step 2: SETNX per message per instance, sequentially, no batching."""

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        replies: list[list[Reply]] = [[] for _ in self.members]
        for digest, owner in zip(digests, owners, strict=True):
            for member, answers in zip(self.members, replies, strict=True):
                key = self.prefix + digest  # a key per mark
                was_set = await member.client.set(key, owner, nx=True, px=self.ttl_ms)
                answers.append(MINE if was_set else TAKEN)
        return replies


def build_subject(
    variant: Variant, settings: Settings, metrics: Metrics | None = None
) -> Gateway | ClientCeiling:
    """An in-process variant, counting into `metrics`."""
    metrics = metrics or Metrics()
    if variant.kind == "ceiling":
        return ClientCeiling(settings, metrics, headers=variant.headers)
    quorum = NaiveQuorum(settings.redis, metrics) if variant.naive else None
    return Gateway(settings, quorum=quorum, metrics=metrics)
