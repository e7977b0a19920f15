"""Kafka security settings reach every Kafka client the project builds
(no SASL/TLS listener runs on the test broker, so this checks the hand-over)."""

from __future__ import annotations

import ssl

from aiokafka import AIOKafkaConsumer

from gateway.config import load_settings
from gateway.kafka.clients import (
    aiokafka_options,
    build_producer,
    java_client_options,
    librdkafka_options,
)


async def test_scram_over_tls_settings_are_handed_to_the_clients_and_the_password_stays_secret():
    kafka = load_settings(
        kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
               "sasl_username": "gateway", "sasl_password": "pw-123"},
    ).kafka  # fmt: skip
    options = aiokafka_options(kafka)
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["sasl_plain_username"] == "gateway"
    assert options["sasl_plain_password"] == "pw-123"
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    assert options["ssl_context"].verify_mode is ssl.CERT_REQUIRED
    assert "pw-123" not in repr(kafka) and "pw-123" not in str(kafka.model_dump())
    # aiokafka validates these combinations when a client is built.
    producer = build_producer(kafka)
    consumer = AIOKafkaConsumer(**options, group_id="g")
    try:
        assert producer.client._sasl_mechanism == "SCRAM-SHA-512"
        assert consumer._client._security_protocol == "SASL_SSL"
    finally:
        await producer.stop()
        await consumer.stop()


def test_plaintext_has_no_sasl_or_tls_options():
    options = aiokafka_options(load_settings().kafka)
    assert options["security_protocol"] == "PLAINTEXT"
    assert not {"sasl_mechanism", "ssl_context"} & options.keys()


def test_a_client_certificate_reaches_all_three_kafka_clients(tmp_path):
    """Mutual TLS: aiokafka, librdkafka (the Spark job's Python source) and the Java
    client (Spark's own connector) all get the CA, the certificate and the key."""
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "client.pem", "client.key"))
    ca.write_text("CA")
    cert.write_text("-----BEGIN CERTIFICATE-----\nC\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nK\n-----END PRIVATE KEY-----\n")
    kafka = load_settings(
        kafka={"security_protocol": "SSL", "ssl_cafile": str(ca), "ssl_certfile": str(cert),
               "ssl_keyfile": str(key)},
    ).kafka  # fmt: skip
    rdkafka = librdkafka_options(kafka)
    assert (rdkafka["ssl.ca.location"], rdkafka["ssl.certificate.location"],
            rdkafka["ssl.key.location"]) == (str(ca), str(cert), str(key))  # fmt: skip
    java = java_client_options(kafka)
    assert java["security.protocol"] == "SSL"
    assert java["ssl.truststore.type"] == "PEM" and java["ssl.truststore.location"] == str(ca)
    assert java["ssl.keystore.type"] == "PEM"
    assert java["ssl.keystore.certificate.chain"] == cert.read_text()
    assert java["ssl.keystore.key"] == key.read_text()


def test_sasl_reaches_the_java_client_as_a_jaas_line():
    kafka = load_settings(
        kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN",
               "sasl_username": "u", "sasl_password": "p"},
    ).kafka  # fmt: skip
    java = java_client_options(kafka)
    assert java["sasl.mechanism"] == "PLAIN"
    assert java["sasl.jaas.config"] == (
        'org.apache.kafka.common.security.plain.PlainLoginModule required username="u" '
        'password="p";'
    )
