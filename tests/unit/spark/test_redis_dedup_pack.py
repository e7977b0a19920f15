"""The delivery dedup's claims, packed by hand (spark_sink.redis_dedup.pack_claims), are
byte for byte what redis-py packs for the same commands."""

from __future__ import annotations

from redis.connection import Connection

from spark_sink.redis_dedup import pack_claims


def test_the_hand_packed_claims_are_what_redis_py_packs() -> None:
    names = [b"dedup-spark:clean:token:ab12:1", 'dedup-spark:c:source:{"id":"é"}:2'.encode(), b""]
    values = [b"0:17", b"12:1234567890", b"3:0"]
    expected = b"".join(
        Connection().pack_commands(
            [("SET", n, v, "NX", "GET", "PX", 600_000) for n, v in zip(names, values, strict=True)]
        )
    )
    assert pack_claims(names, values, 600_000) == expected
