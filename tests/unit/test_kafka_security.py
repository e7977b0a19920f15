"""Kafka security settings reach every aiokafka client the gateway builds
(no SASL/TLS listener runs on the test broker, so this checks the hand-over)."""

from __future__ import annotations

import ssl

from aiokafka import AIOKafkaConsumer

from gateway.app import build_producer, kafka_client_options
from gateway.config import load_settings


async def test_scram_over_tls_settings_are_handed_to_the_clients_and_the_password_stays_secret():
    kafka = load_settings(
        kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
               "sasl_username": "gateway", "sasl_password": "pw-123"},
    ).kafka  # fmt: skip
    options = kafka_client_options(kafka)
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
    options = kafka_client_options(load_settings().kafka)
    assert options["security_protocol"] == "PLAINTEXT"
    assert not {"sasl_mechanism", "ssl_context"} & options.keys()
