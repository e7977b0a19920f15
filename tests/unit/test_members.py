"""Member URLs and a cluster member's key groups (gateway/quorum/members.py)."""

from __future__ import annotations

from collections import Counter

from pydantic import TypeAdapter

from gateway.contract.tokens import mark_digest
from gateway.member_urls import MemberUrl, masked, member_name
from gateway.quorum.members import group_of, groups_for, split

URL = TypeAdapter(MemberUrl)


def test_members_are_named_without_their_password() -> None:
    plain = URL.validate_python("redis://gw:s3cret@r1:6380/2")
    cluster = URL.validate_python("rediss+cluster://gw:s3cret@c1:7000,c2:7001?ssl_cert_reqs=none")
    assert member_name(plain) == "r1:6380/2"
    assert member_name(cluster) == "cluster:c1:7000"
    assert "s3cret" not in masked(plain) and "s3cret" not in masked(cluster)
    assert masked(cluster).startswith("rediss+cluster://gw:***@c1:7000,c2:7001")
    query = URL.validate_python("redis://r1:6380/0?password=q-s3cret&ssl_cert_reqs=none")
    assert masked(query) == "redis://r1:6380/0?password=***&ssl_cert_reqs=none"
    assert (
        masked("redis://gw:s3cret@r1:6380/0?Password=q") == "redis://gw:***@r1:6380/0?Password=***"
    )


def test_a_standalone_member_is_one_group_under_the_plain_prefix() -> None:
    (group,) = groups_for(b"dd:", (1000, 500, 64), 1)
    assert group.prefix == b"dd:" and group.meta == b"dd:slice"
    assert group.layout == (b"dd:", 1000, 500, 64)


def test_each_group_of_a_cluster_member_has_its_own_hash_tag() -> None:
    groups = groups_for(b"dd:", (1000, 500, 8), 16)
    assert [g.prefix for g in groups[:2]] == [b"dd:{0.16}", b"dd:{1.16}"]
    assert len({g.prefix for g in groups}) == 16
    # The tag names the count: a member whose count changed holds none of these keys.
    assert not {g.prefix for g in groups} & {g.prefix for g in groups_for(b"dd:", (), 32)}


def test_digests_spread_over_the_groups_and_split_keeps_their_order() -> None:
    digests = [mark_digest(f"id-{n}".encode()) for n in range(6400)]
    sizes = Counter(group_of(d, 64) for d in digests)
    assert len(sizes) == 64 and max(sizes.values()) < 2 * min(sizes.values())
    parts = split(digests, 64)
    assert sorted(k for part in parts for k in part[1]) == list(range(len(digests)))
    for group, positions in parts:
        assert positions == sorted(positions)
        assert all(group_of(digests[k], 64) == group for k in positions)
