"""The sink's murmur2 partitions exactly as aiokafka's (and so the Java client's)."""

from __future__ import annotations

from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from gateway.kafka.sink import murmur2


@given(st.binary(max_size=300))
def test_murmur2_matches_aiokafka_for_any_key(key: bytes) -> None:
    assert murmur2(key) == aiokafka_murmur2(key)
