"""Secrets never printed (gateway/masking.py): member URLs, `[spark] dedup_redis`,
`[spark] conf`, `[spark] handler_options` and `[kafka.client]`, in check-config's
output and wherever a URL is shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter
from redis.connection import parse_url

from gateway.cli import main
from gateway.member_urls import MemberUrl, masked

URL = TypeAdapter(MemberUrl)

SECRETS = [
    "url-secret", "query-secret", "encoded-secret", "spark-redis-secret", "spark-query-secret",
    "s3a-secret-key", "s3a-access-key", "session-token-secret", "jaas-secret", "azure-secret",
    "handler-secret", "nested-secret", "handler-url-secret", "conf-url-secret",
]  # fmt: skip

CONFIG = """
[kafka]
raw_topics = ["orders"]
[redis]
nodes = [
  "redis://:url-secret@127.0.0.1:1/0",
  "redis://127.0.0.1:2/0?password=query-secret",
  "redis://127.0.0.1:3/0?pass%77ord=encoded-secret",
]
[spark]
dedup_redis = "redis://gw:spark-redis-secret@127.0.0.1:4/0"
handler = "my.module:factory"
[spark.conf]
"spark.sql.shuffle.partitions" = "4"
"spark.hadoop.fs.s3a.secret.key" = "s3a-secret-key"
"spark.hadoop.fs.s3a.access.key" = "s3a-access-key"
"spark.hadoop.fs.s3a.session.token" = "session-token-secret"
"spark.driver.extraJavaOptions.jaas" = "jaas-secret"
"spark.hadoop.fs.azure.account.key.acct.dfs.core.windows.net" = "azure-secret"
"spark.hadoop.javax.jdo.option.ConnectionURL" = "jdbc:postgresql://h/db?user=u&password=conf-url-secret"
[spark.handler_options]
table = "orders"
api_token = "handler-secret"
database = { user = "u", password = "nested-secret" }
url = "postgresql://u:handler-url-secret@db:5432/orders"
"""


@pytest.mark.parametrize("output", ["json", "text"])
def test_check_config_prints_no_secret_of_any_section(tmp_path: Path, capsys, output) -> None:
    """Member URLs (the user part, `?password=`, a percent-encoded `?pass%77ord=`),
    `[spark] dedup_redis`, the secrets in `[spark] conf` and in `handler_options`."""
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG)
    assert main(["check-config", "--config", str(path), "--output", output]) == 0
    out = capsys.readouterr().out
    assert [s for s in SECRETS if s in out] == [], out
    # What is not secret is still shown.
    assert "127.0.0.1:3/0" in out and "spark.sql.shuffle.partitions" in out
    assert "orders" in out and "gw:***@127.0.0.1:4/0" in out
    if output == "json":
        spark = json.loads(out)["spark"]
        assert spark["conf"]["spark.sql.shuffle.partitions"] == "4"
        assert spark["conf"]["spark.hadoop.fs.s3a.secret.key"] == "***"
        assert spark["handler_options"]["database"] == {"user": "u", "password": "***"}
        assert spark["handler_options"]["url"] == "postgresql://u:***@db:5432/orders"


def test_check_config_output_with_masked_spark_secrets_loads_back(tmp_path: Path, capsys) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG)
    assert main(["check-config", "--config", str(path)]) == 0
    again = tmp_path / "again.toml"
    again.write_text(printed := capsys.readouterr().out)
    assert main(["check-config", "--config", str(again)]) == 0
    assert capsys.readouterr().out == printed


def test_a_percent_encoded_secret_query_name_is_masked_as_redis_py_reads_it() -> None:
    """redis-py decodes the query's names: `?pass%77ord=X` authenticates with X."""
    text = "redis://127.0.0.1:6379/0?pass%77ord=enc-s3cret&ssl_cert_reqs=none"
    assert parse_url(text)["password"] == "enc-s3cret"
    for url in (text, URL.validate_python(text)):
        shown = masked(url)
        assert "enc-s3cret" not in shown
        assert shown == "redis://127.0.0.1:6379/0?pass%77ord=***&ssl_cert_reqs=none"
    assert "x" not in masked("redis://h/0?%70%61%73%73%77%6f%72%64=x").split("?")[1]
    assert "x" not in masked("redis://h/0?a=1&pass+word=x").split("?")[1]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://gw:s3cret@r1:6380/2", "redis://gw:***@r1:6380/2"),
        ("redis://:p%40ss@r1/0", "redis://:***@r1/0"),
        ("redis://:p@ss@r1/0", "redis://:***@r1/0"),  # the last @ ends the user part
        ("rediss+cluster://:a@c1:1,:b@c2:2/0", "rediss+cluster://:***@c1:1,:***@c2:2/0"),
        ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://r1/0?Token=s3cret&db=2", "redis://r1/0?Token=***&db=2"),
        ("redis://gw@r1/0", "redis://gw@r1/0"),  # a user name alone is not a secret
    ],
)
def test_urls_are_shown_without_their_passwords(url: str, shown: str) -> None:
    assert masked(url) == shown


def test_a_url_inside_a_message_is_masked_too() -> None:
    message = "cannot reach redis://gw:s3cret@r1:6380/0?password=q (refused)"
    assert masked(message) == "cannot reach redis://gw:***@r1:6380/0?password=*** (refused)"


@pytest.mark.parametrize(
    "name",
    [
        "password", "Password", "sasl_password", "pass", "pass%77ord", "pass+word", "passwd",
        "secret", "spark.authenticate.secret", "spark.hadoop.fs.s3a.secret.key",
        "spark.hadoop.fs.s3a.access.key", "fs.s3a.session.token", "api_token", "apiKey",
        "credentials", "sasl.jaas.config", "spark.ssl.keyPassword",
        "fs.azure.account.key.acct.dfs.core.windows.net", "ssl.key.pem",
        "sasl.oauthbearer.token.command",
    ],
)  # fmt: skip
def test_secret_names(name: str) -> None:
    from gateway.masking import is_secret_name

    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "table", "weights", "spark.sql.shuffle.partitions", "ssl.key.location",
        "key.deserializer", "sasl.oauthbearer.token.endpoint.url", "passthrough", "db",
        "ssl_cert_reqs", "spark.hadoop.fs.s3a.aws.credentials.provider", "user",
    ],
)  # fmt: skip
def test_names_that_are_not_secret(name: str) -> None:
    from gateway.masking import is_secret_name

    assert not is_secret_name(name)


def test_a_table_is_masked_by_its_names_at_every_depth_and_its_urls() -> None:
    from gateway.masking import masked_tree

    table = {
        "table": "orders",
        "database": {"user": "u", "password": "p", "more": [{"token": "t"}]},
        "secret": {"whole": "subtree"},
        "dsn": "postgresql://u:pw@db/orders",
        "sizes": [1, 2],
        "flag": True,
    }
    assert masked_tree(table) == {
        "table": "orders",
        "database": {"user": "u", "password": "***", "more": [{"token": "***"}]},
        "secret": "***",
        "dsn": "postgresql://u:***@db/orders",
        "sizes": [1, 2],
        "flag": True,
    }
