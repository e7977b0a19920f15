"""What the benchmark compares: the variants and how each one is built.

Every variant is the gateway's own process and data path (consumer, batches,
producer, commits); they differ only in how a record is judged new:
- `forwarder`: dedup switched off, no Redis call (the ceiling of this process);
- `gateway-N`: the product, one CLAIM script call per instance per batch, the
  N instances queried concurrently;
- `naive-3`: the patent as written (and Redpanda Connect's dedupe processor):
  one `SET key NX PX ttl` per message per instance, awaited one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.app import Gateway
from gateway.config import Settings
from gateway.quorum import Quorum
from gateway.vote import MINE, Reply

# What a naive claim reports for a key someone else set: any foreign owner makes it a duplicate.
TAKEN = "taken"


@dataclass(frozen=True)
class Variant:
    name: str
    redis: int  # instances the variant uses
    dedup: bool = True
    naive: bool = False


FORWARDER = Variant("forwarder", redis=1, dedup=False)
VARIANTS: tuple[Variant, ...] = (
    FORWARDER,
    Variant("gateway-1", redis=1),
    Variant("gateway-3", redis=3),
    Variant("gateway-5", redis=5),
    Variant("naive-3", redis=3, naive=True),
)


class NaiveQuorum(Quorum):
    """The patent's step 2: SETNX per message per instance, sequentially, no batching."""

    async def claim(self, digests: Sequence[bytes], owners: Sequence[str]) -> list[list[Reply]]:
        replies: list[list[Reply]] = [[] for _ in self.instances]
        for digest, owner in zip(digests, owners, strict=True):
            for inst, answers in zip(self.instances, replies, strict=True):
                key = self.prefix + digest  # a key per mark
                was_set = await inst.client.set(key, owner, nx=True, px=self.ttl_ms)
                answers.append(MINE if was_set else TAKEN)
        return replies


def build_gateway(variant: Variant, settings: Settings) -> Gateway:
    gateway = Gateway(settings)
    if variant.naive:
        gateway.quorum = NaiveQuorum(settings.redis, gateway.metrics)
    return gateway
