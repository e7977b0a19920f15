"""Which topics count as tier topics left over from an earlier configuration."""

from __future__ import annotations

from gateway.config import load_settings
from gateway.delay.leftovers import read_clean_topics, tier_of, unnamed_tiers


def settings(**kafka: str):
    return load_settings(
        kafka={"bootstrap_servers": "127.0.0.1:9092", "raw_topics": ["raw"], **kafka},
        redis={"nodes": ["redis://127.0.0.1:6379/0"]},
        delay={"enabled": True, "tiers": ["1s", "1m"]},
    )


def test_a_tier_topic_is_named_by_its_clean_topic_and_the_canonical_label_of_its_delay():
    assert tier_of("clean.delay.16s") == ("clean", 16_000)
    assert tier_of("a.delay.b.delay.250ms") == ("a.delay.b", 250)
    assert tier_of("clean.delay.1h") == ("clean", 3_600_000)
    for not_a_tier in ("clean.delay.60s", "clean.delay.0s", "clean.delay.16", "clean.delays.1s",
                       "clean.delay.1s.x", ".delay.1s"):  # fmt: skip
        assert tier_of(not_a_tier) is None, not_a_tier


def test_unnamed_tiers_are_the_clean_topics_tiers_the_settings_do_not_list():
    topics = ["clean", "clean.delay.1s", "clean.delay.1m", "clean.delay.16s", "other.delay.4s",
              "clean.delay.60s"]  # fmt: skip
    assert unnamed_tiers(settings(), topics) == {"clean.delay.16s": 16_000}
    assert unnamed_tiers(settings(clean_topic="other"), topics) == {"other.delay.4s": 4000}


def test_the_clean_topics_read_are_those_of_other_tiers_the_group_committed_on():
    committed = ["clean.delay.1s", "old.delay.1s", "raw", "old.delay.60s"]
    assert read_clean_topics(settings(), committed) == {"old"}
