"""A bad setting stops start-up with one line naming it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import ConfigError, effective, load_settings
from gateway.member_urls import member_name

BAD = [
    ({"redis": {"nodes": ["redis://a:1/0", "redis://b:1/0"]}}, "redis.nodes", "odd number"),
    ({"dedup": {"id": "uuid"}}, "dedup.id", "unknown id strategy"),
    ({"redis": {"ttl": "forever"}}, "redis.ttl", "duration"),
    ({"redis": {"ttl": "0s"}}, "redis.ttl", "between 1s"),
    ({"redis": {"nodes": ["http://a:1"]}}, "redis.nodes.0", "scheme"),
    ({"redis": {"nodes": ["redis://h:notaport/0"]}}, "redis.nodes.0", "port"),
    ({"kafka": {"bootstrap_servers": "nohostport"}}, "kafka.bootstrap_servers", "host:port"),
    ({"dedup": {"on_no_quorum": "maybe"}}, "dedup.on_no_quorum", "block"),
]


@pytest.mark.parametrize(("sections", "setting", "hint"), BAD)
def test_invalid_setting_is_rejected_with_its_name(sections, setting, hint):
    with pytest.raises(ConfigError) as err:
        load_settings(**sections)
    assert f"invalid setting {setting}:" in str(err.value)
    assert hint in str(err.value)
    assert "\n" not in str(err.value)


def test_toml_file_then_environment_override(tmp_path: Path, monkeypatch):
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[kafka]\nraw_topics = ["orders"]\n[redis]\nnodes = ["redis://h1:7000/0"]\nttl = "12h"\n'
    )
    monkeypatch.setenv("GATEWAY_REDIS__TTL", "90m")
    settings = load_settings(path)
    assert settings.kafka.raw_topics == ["orders"]
    assert settings.redis.ttl == timedelta(minutes=90)
    assert settings.quorum == 1


def test_cli_prints_one_line_and_exits_2_on_bad_config(tmp_path: Path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('[redis]\nnodes = ["redis://a:1", "redis://b:2"]\n')
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dedup-gateway: invalid setting redis.nodes:")
    assert "\n" not in err


def test_a_member_url_without_a_scheme_says_so_once_per_member_with_the_url_to_write(
    tmp_path: Path, capsys
):
    """`127.0.0.1:6379` is read by the URL parser as a relative URL and `localhost:6380/0`
    as the scheme `localhost`: each is said as a missing scheme, password masked."""
    path = tmp_path / "g.toml"
    path.write_text(
        '[redis]\nnodes = ["127.0.0.1:6379", "u:s3cret@localhost:6380/0", "redis://c:1/0"]\n'
    )
    assert main(["check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err == (
        "dedup-gateway: invalid setting redis.nodes.0: '127.0.0.1:6379' has no scheme: "
        "write redis://127.0.0.1:6379 (rediss:// for TLS, redis+cluster:// for a Redis "
        "Cluster); invalid setting redis.nodes.1: 'u:***@localhost:6380/0' has no scheme: "
        "write redis://u:***@localhost:6380/0 (rediss:// for TLS, redis+cluster:// for a "
        "Redis Cluster)"
    )
    assert "relative URL" not in err and "s3cret" not in err


def test_missing_config_file_is_named(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_redis_password_never_appears_in_the_loggable_name():
    settings = load_settings(redis={"nodes": ["redis://user:s3cret@db:6380/2"]})
    assert member_name(settings.redis.nodes[0]) == "db:6380/2"


def test_a_cluster_member_url_is_checked_at_start() -> None:
    settings = load_settings(
        redis={"nodes": ["redis+cluster://u:pw@h1:7000,h2:7001", "redis://a/0", "redis://b/0"]}
    )
    assert member_name(settings.redis.nodes[0]) == "cluster:h1:7000"
    assert "pw" not in effective(settings)["redis"]["nodes"][0]
    for bad, says in [
        (["redis+cluster://h1:7000/2", "redis://a/0", "redis://b/0"], "database 0 only"),
        (["redis://h1:7000,h2:7000", "redis://a/0", "redis://b/0"], r"redis\+cluster://"),
        (["redis+cluster://h1:7000", "redis+cluster://h1:7000,h2:1", "redis://b/0"], "twice"),
        (["memcached://h1:7000"], "redis.nodes"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_settings(redis={"nodes": bad})
    with pytest.raises(ConfigError, match="key_prefix"):
        load_settings(redis={"key_prefix": "dd{x}:"})
