"""Owner tokens derived per partition batch are the one token definition: the same
value as `owner_token` for each record, 63-bit, distinct per offset and attempt."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.contract.tokens import owner_token, owner_tokens

offsets = st.lists(st.integers(0, 2**62), min_size=1, max_size=50, unique=True)


@given(st.text(min_size=1, max_size=20), st.integers(0, 10_000), offsets, st.integers(0, 20))
def test_batch_tokens_equal_the_single_definition_and_differ_per_offset(
    topic: str, partition: int, offs: list[int], attempt: int
) -> None:
    tokens = owner_tokens(topic, partition, offs, attempt)
    assert tokens == [owner_token(topic, partition, o, attempt) for o in offs]
    assert len(set(tokens)) == len(tokens)
    assert all(t.isdigit() and int(t) < 2**63 for t in tokens)
    assert not set(tokens) & set(owner_tokens(topic, partition, offs, attempt + 1))
