"""`[kafka.client]` properties reach every Kafka client that knows them, OAUTHBEARER
gets its token through them, and JAAS values are escaped (no SASL listener runs on
the test broker, so this checks the hand-over, as test_kafka_security.py does)."""

from __future__ import annotations

import sys

import pytest
from aiokafka import AIOKafkaConsumer

from gateway.config import ConfigError, load_settings
from gateway.kafka.clients import (
    aiokafka_options,
    build_producer,
    java_client_options,
    librdkafka_options,
)
from gateway.kafka.oauth import CommandToken, FileToken, StaticToken, TokenError


def kafka_with(client: dict[str, object], **kafka: object):
    return load_settings(kafka={"client": client, **kafka}).kafka


def test_plain_names_reach_aiokafka_where_it_has_the_option_and_both_spark_clients():
    kafka = kafka_with({"client.id": "gw-1", "request.timeout.ms": 45000,
                        "socket.keepalive.enable": True})  # fmt: skip
    options = aiokafka_options(kafka)
    assert (options["client_id"], options["request_timeout_ms"]) == ("gw-1", 45000)
    assert "socket.keepalive.enable" not in str(options)
    rdkafka, java = librdkafka_options(kafka), java_client_options(kafka)
    for spark_client in (rdkafka, java):
        assert spark_client["client.id"] == "gw-1"
        assert spark_client["request.timeout.ms"] == "45000"
        assert spark_client["socket.keepalive.enable"] == "true"


def test_a_family_prefix_sends_a_property_to_that_client_family_only():
    kafka = kafka_with({"librdkafka.sasl.oauthbearer.method": "oidc",
                        "java.sasl.login.callback.handler.class": "x.Handler"})  # fmt: skip
    rdkafka, java = librdkafka_options(kafka), java_client_options(kafka)
    assert rdkafka["sasl.oauthbearer.method"] == "oidc"
    assert "sasl.login.callback.handler.class" not in rdkafka
    assert java["sasl.login.callback.handler.class"] == "x.Handler"
    assert "sasl.oauthbearer.method" not in java
    assert not {k for k in aiokafka_options(kafka) if "oauth" in k or "login" in k}


@pytest.mark.parametrize(
    ("client", "named"),
    [
        ({"bootstrap.servers": "h:9092"}, "kafka.bootstrap_servers"),
        ({"java.sasl.password": "p"}, "kafka.sasl_password"),
        ({"sasl.mechanism": "OAUTHBEARER"}, "exactly one token source"),
        ({"sasl.mechanism": "KERBEROS"}, "expected one of"),
        ({"sasl.oauthbearer.token": "t"}, "needs 'sasl.mechanism' = 'OAUTHBEARER'"),
        ({"request.timeout.ms": "soon"}, "whole number of milliseconds"),
    ],
)
def test_a_property_that_cannot_be_used_stops_start_up_naming_it(client, named):
    with pytest.raises(ConfigError, match="kafka") as refused:
        kafka_with(client)
    assert named in str(refused.value)


def test_sasl_mechanism_in_both_places_is_refused():
    with pytest.raises(ConfigError, match=r"kafka\.sasl_mechanism is set already"):
        kafka_with({"sasl.mechanism": "GSSAPI"}, sasl_mechanism="PLAIN")


async def test_oauthbearer_with_a_static_token_builds_aiokafka_clients_and_is_masked():
    kafka = kafka_with({"sasl.mechanism": "OAUTHBEARER", "sasl.oauthbearer.token": "tok-123"},
                       security_protocol="SASL_SSL")  # fmt: skip
    options = aiokafka_options(kafka)
    assert options["sasl_mechanism"] == "OAUTHBEARER"
    assert await options["sasl_oauth_token_provider"].token() == "tok-123"
    # The token sources are the gateway's own: librdkafka and Java would refuse them.
    assert not any("token" in k for k in librdkafka_options(kafka))
    assert not any("token" in k for k in java_client_options(kafka))
    # aiokafka checks that OAUTHBEARER comes with a provider when a client is built.
    producer = build_producer(kafka)
    consumer = AIOKafkaConsumer(**options, group_id="g")
    try:
        assert producer.client._sasl_mechanism == "OAUTHBEARER"
    finally:
        await producer.stop()
        await consumer.stop()
    from gateway.config import effective

    shown = effective(load_settings(kafka=kafka.model_dump()))
    assert shown["kafka"]["client"]["sasl.oauthbearer.token"] == "***"


async def test_a_file_token_is_read_at_each_handshake(tmp_path):
    path = tmp_path / "token"
    path.write_text("first\n")
    provider = FileToken(path)
    assert await provider.token() == "first"
    path.write_text("rotated")
    assert await provider.token() == "rotated"
    path.write_text("")
    with pytest.raises(TokenError, match="is empty"):
        await provider.token()


async def test_a_command_token_is_the_commands_output_and_a_failure_names_it():
    ok = CommandToken(f"{sys.executable} -c 'print(\"from-command\")'")
    assert await ok.token() == "from-command"
    failing = CommandToken(f"{sys.executable} -c 'import sys; sys.exit(\"no creds s3cret\")'")
    with pytest.raises(TokenError, match="exited 1 with an error") as raised:
        await failing.token()
    assert "s3cret" not in str(raised.value)  # its stderr may echo the credential
    assert await StaticToken("s").token() == "s"


@pytest.mark.parametrize("password", ['pa"ss', "back\\slash", 'both\\"', "line\nbreak"])
def test_a_jaas_password_is_escaped_so_the_java_parser_reads_it_back(password):
    kafka = load_settings(
        kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
               "sasl_username": 'u"1', "sasl_password": password},
    ).kafka  # fmt: skip
    line = java_client_options(kafka)["sasl.jaas.config"]
    assert line.startswith("org.apache.kafka.common.security.scram.ScramLoginModule required ")
    assert "\n" not in line
    assert parse_jaas_options(line) == {"username": 'u"1', "password": password}


def parse_jaas_options(line: str) -> dict[str, str]:
    """The options of one JAAS entry, read as java.io.StreamTokenizer does (quoted
    strings with backslash escapes), independent of how the line was built."""
    body = line.split(" required ", 1)[1]
    assert body.endswith(";")
    options, i = {}, 0
    while body[i] != ";":
        eq = body.index("=", i)
        name = body[i:eq].strip()
        assert body[eq + 1] == '"'
        j, value = eq + 2, []
        escapes = {"n": "\n", "r": "\r", "t": "\t"}
        while body[j] != '"':
            if body[j] == "\\":
                j += 1
                value.append(escapes.get(body[j], body[j]))
            else:
                value.append(body[j])
            j += 1
        options[name] = "".join(value)
        i = j + 1
        while body[i] == " ":
            i += 1
    return options


def test_the_documented_oauthbearer_example_loads_and_reaches_the_clients(tmp_path):
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    block = next(b for b in re.findall(r"```toml\n(.*?)```", page, re.S) if "OAUTHBEARER" in b)
    (tmp_path / "gateway.toml").write_text(block)
    kafka = load_settings(tmp_path / "gateway.toml").kafka
    assert aiokafka_options(kafka)["sasl_mechanism"] == "OAUTHBEARER"
    java = java_client_options(kafka)
    assert java["sasl.login.callback.handler.class"].endswith("OAuthBearerLoginCallbackHandler")
    assert "sasl.login.callback.handler.class" not in librdkafka_options(kafka)
