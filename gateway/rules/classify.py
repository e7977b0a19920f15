"""Classify a voted batch: what is forwarded, dropped, quarantined or held, per partition."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import Literal, cast

from aiokafka import TopicPartition

from gateway.contract.records import (
    H_UNCERTAIN,
    Headers,
    OutRow,
    Record,
    clean_rows,
)
from gateway.errors import BadRecord
from gateway.rules.vote import Outcome

Policy = Literal["block", "forward", "drop"]


@dataclass(slots=True)
class PartitionBatch:
    """One partition's records of a batch as parallel lists: no object per record."""

    records: Sequence[Record]
    ids: list[bytes | BadRecord]  # per record: its id, or why it has none
    tokens: list[str]  # per record: its owner token
    bad: int  # records without an id
    outcomes: Sequence[Outcome | None] = ()  # per record, from the vote; None: no id
    extra: Headers = ()  # headers every clean copy gains (`dedup-lane`)
    to: str | None = None  # its lane's own clean topic; None: `[kafka] clean_topic`


@dataclass
class Decided:
    """A classified batch: what to forward, set aside, commit and block."""

    forward: list[OutRow] = field(default_factory=list)  # to `[kafka] clean_topic`
    forward_to: dict[str, list[OutRow]] = field(default_factory=dict)  # to a lane's own topic
    quarantine: list[tuple[Record, BadRecord]] = field(default_factory=list)
    commits: dict[TopicPartition, int] = field(default_factory=dict)  # next offset to read
    blocked: dict[TopicPartition, int] = field(default_factory=dict)  # rewind here, pause
    duplicates: int = 0
    undecided: dict[str, int] = field(default_factory=dict)  # by action taken


def classify(batch: Mapping[TopicPartition, PartitionBatch], policy: Policy) -> Decided:
    """What to do with each voted record (pure: no I/O).

    Records are taken in partition order; under `block`, a partition stops at
    its first undecided record, which is where it will be rewound, and nothing
    after it is forwarded or committed. Per partition the work is done on
    whole lists (counts, masks, one comprehension for the clean copies).
    """
    decided = Decided()
    forward, undecided = Outcome.FORWARD, Outcome.UNDECIDED
    for tp, part in batch.items():
        records, ids, tokens, outcomes = part.records, part.ids, part.tokens, part.outcomes
        stuck = undecided in outcomes
        if stuck and policy == "block":
            end = outcomes.index(undecided)
            decided.blocked[tp] = records[end].offset
            decided.undecided[policy] = decided.undecided.get(policy, 0) + 1
            records, ids, tokens, outcomes = records[:end], ids[:end], tokens[:end], outcomes[:end]
            stuck = False
        if not records:
            continue
        decided.commits[tp] = records[-1].offset + 1
        target = decided.forward if part.to is None else decided.forward_to.setdefault(part.to, [])
        decided.duplicates += outcomes.count(Outcome.DUPLICATE)
        if part.bad:
            decided.quarantine += [
                (rec, i) for rec, i in zip(records, ids, strict=True) if isinstance(i, BadRecord)
            ]
        if not stuck:
            keep = [o is forward for o in outcomes]
            kept_ids = cast(Iterable[bytes], compress(ids, keep))  # forwarded: they have ids
            target += clean_rows(
                list(compress(records, keep)), kept_ids, compress(tokens, keep), part.extra
            )
            continue
        decided.undecided[policy] = decided.undecided.get(policy, 0) + outcomes.count(undecided)
        # Rare (no majority, policy forward/drop): record by record, keeping their order.
        for rec, i, token, outcome in zip(records, ids, tokens, outcomes, strict=True):
            if not isinstance(i, BadRecord) and (
                outcome is forward or (outcome is undecided and policy == "forward")
            ):
                extra = [(H_UNCERTAIN, b"1")] if outcome is undecided else []
                target += clean_rows([rec], [i], [token], [*part.extra, *extra])
    return decided
