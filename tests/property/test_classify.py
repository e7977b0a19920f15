"""`classify` works on whole lists per partition; it must decide exactly what the
record-by-record rule says, for any mix of outcomes, bad records and policies."""

from __future__ import annotations

from typing import get_args

from aiokafka import ConsumerRecord, TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from gateway.contract.records import H_UNCERTAIN
from gateway.contract.tokens import owner_tokens
from gateway.errors import BadRecord
from gateway.rules.classify import Decided, PartitionBatch, Policy, classify
from gateway.rules.vote import Outcome

BAD = "bad"
kinds = st.sampled_from([Outcome.FORWARD, Outcome.DUPLICATE, Outcome.UNDECIDED, BAD])


def record(tp: TopicPartition, offset: int, stale_header: bool) -> ConsumerRecord[bytes, bytes]:
    headers = [("trace", b"t")] + ([("dedup-id", b"forged")] if stale_header else [])
    key = None if offset % 3 == 0 else b"k%d" % offset
    return ConsumerRecord(
        tp.topic, tp.partition, offset, 1000 + offset, 0, key, b"v", None, 2, 1, tuple(headers)
    )


def reference(parts: dict[TopicPartition, PartitionBatch], policy: Policy) -> Decided:
    """The rule, one record at a time (as the data path did before it went bulk)."""
    decided = Decided()
    for tp, part in parts.items():
        next_offset = None
        for rec, i, token, outcome in zip(
            part.records, part.ids, part.tokens, part.outcomes, strict=True
        ):
            if isinstance(i, BadRecord):
                decided.quarantine.append((rec, i))
            elif outcome is Outcome.FORWARD or (
                outcome is Outcome.UNDECIDED and policy == "forward"
            ):
                # The contract spelled out: raw headers minus any forged dedup-*, then ours.
                headers = [h for h in rec.headers if not h[0].startswith("dedup-")]
                headers += [
                    ("dedup-id", i),
                    ("dedup-source", f"raw/{tp.partition}/{rec.offset}".encode()),
                    ("dedup-token", token.encode()),
                ]
                if outcome is Outcome.UNDECIDED:
                    headers.append((H_UNCERTAIN, b"1"))
                decided.forward.append((rec.key, rec.value, rec.timestamp, headers, rec.partition))
            elif outcome is Outcome.DUPLICATE:
                decided.duplicates += 1
            if outcome is Outcome.UNDECIDED:
                decided.undecided[policy] = decided.undecided.get(policy, 0) + 1
                if policy == "block":
                    decided.blocked[tp] = rec.offset
                    break
            next_offset = rec.offset + 1
        if next_offset is not None:
            decided.commits[tp] = next_offset
    return decided


@given(
    st.lists(st.lists(st.tuples(kinds, st.booleans()), min_size=1, max_size=12), max_size=4),
    st.sampled_from(get_args(Policy)),
)
def test_bulk_classify_decides_as_the_record_by_record_rule(
    partitions: list[list[tuple[object, bool]]], policy: Policy
) -> None:
    parts: dict[TopicPartition, PartitionBatch] = {}
    for p, spec in enumerate(partitions):
        tp = TopicPartition("raw", p)
        records = [record(tp, 40 + n, stale) for n, (_, stale) in enumerate(spec)]
        ids: list[bytes | BadRecord] = [
            BadRecord("missing_header", "none") if kind == BAD else b"id-%d-%d" % (p, n)
            for n, (kind, _) in enumerate(spec)
        ]
        outcomes = [None if kind == BAD else kind for kind, _ in spec]
        tokens = owner_tokens(tp.topic, tp.partition, [r.offset for r in records])
        bad = sum(kind == BAD for kind, _ in spec)
        parts[tp] = PartitionBatch(records, ids, tokens, bad, outcomes)  # type: ignore[arg-type]

    assert classify(parts, policy) == reference(parts, policy)
