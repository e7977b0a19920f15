"""`[kafka]` settings as client options, for every Kafka client the project uses.

Side by side, so a security setting reaches all of them the same way:
- aiokafka (the gateway, the operator commands),
- librdkafka / confluent-kafka (the Spark job's Python source and its producer),
- the Java client (Spark's own `format("kafka")` connector, `kafka.`-prefixed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiokafka.admin.client
import aiokafka.client
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.protocol.metadata import MetadataRequest

from gateway import client_properties
from gateway.config import KafkaSettings
from gateway.kafka.oauth import token_provider
from gateway.kafka.transactions import TransactionalProducer, install_stable_offset_fetch

logger = logging.getLogger(__name__)

# Raw data is read with read_committed everywhere: records of aborted
# transactions are neither forwarded nor allowed to claim an id.
ISOLATION = "read_committed"


class NoAutoCreateMetadataRequest(MetadataRequest):  # type: ignore[misc]
    """A metadata request that never asks the broker to create the topics it names.

    aiokafka (0.14) has no option for it: its every MetadataRequest v4+ asks for
    auto-creation, and a broker with the default `auto.create.topics.enable=true`
    then creates a mistyped raw or clean topic with 1 partition (issue 58). A topic
    that does not exist stays missing, and start-up says so (gateway/service/topic_watch.py).
    """

    def __init__(
        self, topics: list[str] | None = None, allow_auto_topic_creation: bool | None = False
    ) -> None:
        super().__init__(topics, allow_auto_topic_creation)


def install_no_auto_create() -> None:
    """Every aiokafka client of this process, the admin's too, stops asking for
    auto-creation: the modules build their requests from these names."""
    aiokafka.client.MetadataRequest = NoAutoCreateMetadataRequest
    aiokafka.admin.client.MetadataRequest = NoAutoCreateMetadataRequest


install_no_auto_create()  # on import: no client of this process is built before it


def aiokafka_options(kafka: KafkaSettings) -> dict[str, Any]:
    """Connection and security options shared by every aiokafka client we build."""
    options: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap_servers,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.sasl_mechanism:
        options["sasl_mechanism"] = kafka.sasl_mechanism
        options["sasl_plain_username"] = kafka.sasl_username
        options["sasl_plain_password"] = (
            kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
        )
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        options["ssl_context"] = create_ssl_context(
            cafile=str(kafka.ssl_cafile) if kafka.ssl_cafile else None,
            certfile=str(kafka.ssl_certfile) if kafka.ssl_certfile else None,
            keyfile=str(kafka.ssl_keyfile) if kafka.ssl_keyfile else None,
        )
    # `[kafka.client]`: the properties aiokafka has an option for, and an OAUTHBEARER token.
    options |= client_properties.for_aiokafka(kafka.client)
    if (provider := token_provider(kafka.client)) is not None:
        options["sasl_oauth_token_provider"] = provider
    return options


def librdkafka_options(kafka: KafkaSettings) -> dict[str, str]:
    """librdkafka (confluent-kafka) connection and security options."""
    config = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "security.protocol": kafka.security_protocol.lower(),
    }
    if kafka.sasl_mechanism:
        config["sasl.mechanism"] = kafka.sasl_mechanism
    if kafka.sasl_username is not None:
        config["sasl.username"] = kafka.sasl_username
    if kafka.sasl_password is not None:
        config["sasl.password"] = kafka.sasl_password.get_secret_value()
    for key, path in (
        ("ssl.ca.location", kafka.ssl_cafile),
        ("ssl.certificate.location", kafka.ssl_certfile),
        ("ssl.key.location", kafka.ssl_keyfile),
    ):
        if path is not None:
            config[key] = str(path)
    return config | client_properties.for_family(kafka.client, "librdkafka")


def java_client_options(kafka: KafkaSettings) -> dict[str, str]:
    """Java client options (without the `kafka.` prefix Spark's connector wants).

    PEM files throughout (KIP-651): the CA as a PEM truststore, and the client
    certificate and key, when set, as a PEM keystore given by content.
    """
    options = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "security.protocol": kafka.security_protocol,
    }
    if kafka.sasl_mechanism:
        module = (
            "org.apache.kafka.common.security.plain.PlainLoginModule"
            if kafka.sasl_mechanism == "PLAIN"
            else "org.apache.kafka.common.security.scram.ScramLoginModule"
        )
        password = kafka.sasl_password.get_secret_value() if kafka.sasl_password else ""
        options["sasl.mechanism"] = kafka.sasl_mechanism
        user = jaas_quoted(kafka.sasl_username or "")
        options["sasl.jaas.config"] = (
            f"{module} required username={user} password={jaas_quoted(password)};"
        )
    if kafka.ssl_cafile is not None:
        options["ssl.truststore.type"] = "PEM"
        options["ssl.truststore.location"] = str(kafka.ssl_cafile)
    if kafka.ssl_certfile is not None and kafka.ssl_keyfile is not None:
        options["ssl.keystore.type"] = "PEM"
        options["ssl.keystore.certificate.chain"] = kafka.ssl_certfile.read_text()
        options["ssl.keystore.key"] = kafka.ssl_keyfile.read_text()
    return options | client_properties.for_family(kafka.client, "java")


def jaas_quoted(value: str) -> str:
    """`value` as a JAAS option's quoted string: Kafka's JaasConfig parser
    (java.io.StreamTokenizer) reads backslash escapes inside the quotes."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    # A raw line break would end the quoted string.
    return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r") + '"'


def build_producer(kafka: KafkaSettings) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        **aiokafka_options(kafka),
        acks="all",
        enable_idempotence=kafka.producer_idempotence,
        # The sink hands over whole per-partition batches: lingering could only
        # add latency, never batch more (bench/RESULTS.md, latency).
        linger_ms=0,
        # A batch is what the broker judges against its limit: never over it
        # (gateway/kafka/sink.py relies on this to judge sizes once per batch).
        max_batch_size=min(1_000_000, kafka.max_request_bytes),
        max_request_size=kafka.max_request_bytes,
    )


def build_transactional_producer(kafka: KafkaSettings, transactional_id: str) -> AIOKafkaProducer:
    """`build_producer`'s producer, writing in transactions that commit a consumer
    group's offsets under KIP-447 (gateway/kafka/transactions.py)."""
    return TransactionalProducer(
        **aiokafka_options(kafka),
        acks="all",
        enable_idempotence=True,
        transactional_id=transactional_id,
        transaction_timeout_ms=int(kafka.transaction_timeout.total_seconds() * 1000),
        linger_ms=0,
        max_batch_size=min(1_000_000, kafka.max_request_bytes),
        max_request_size=kafka.max_request_bytes,
    )


def build_consumer(kafka: KafkaSettings, group_id: str | None, **options: Any) -> AIOKafkaConsumer:
    """A consumer that commits by hand, reads committed data only, starts at the earliest;
    in a group, with `[kafka] session_timeout` (heartbeats every third of it), the
    static `group_instance_id` when set, and committed offsets read stable (a
    transaction still holding offsets for a partition is waited for)."""
    defaults: dict[str, Any] = {"auto_offset_reset": "earliest"}
    if group_id is not None:
        session_ms = int(kafka.session_timeout.total_seconds() * 1000)
        defaults |= {"session_timeout_ms": session_ms, "heartbeat_interval_ms": session_ms // 3}
        if kafka.group_instance_id is not None:
            defaults["group_instance_id"] = kafka.group_instance_id
        install_stable_offset_fetch()
    return AIOKafkaConsumer(
        **aiokafka_options(kafka),
        group_id=group_id,
        enable_auto_commit=False,
        isolation_level=ISOLATION,
        **(defaults | options),
    )


CLIENT_STOP_S = 15.0  # bounds leaving a group at stop (after the last commit)


T = TypeVar("T")


async def unless_stopped(fetch: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`fetch`'s result, or None when `stop` is set first (then `fetch` is cancelled).

    A group consumer's `getmany` waits, without a bound, for a group join to
    finish, and a broker may hold a JoinGroup back for long (a member that
    stopped answering is waited for until its session ends): a loop that
    fetches must still see `stop`. Cancelling is safe there: records are taken
    from the buffer only after the last await, so none is skipped. A result
    that is ready together with `stop` is returned, not dropped.
    """
    fetching = asyncio.ensure_future(fetch)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({fetching, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if fetching.done():
        return fetching.result()
    fetching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await fetching
    return None


async def stop_within(
    client: AIOKafkaConsumer | AIOKafkaProducer, seconds: float = CLIENT_STOP_S
) -> None:
    """Stop a client, but give up after `seconds`: a consumer's stop waits for a
    pending JoinGroup, which a broker may hold back for long. Everything that
    must be durable was acknowledged and committed before this is called."""
    try:
        await asyncio.wait_for(client.stop(), seconds)
        return
    except TimeoutError:
        logger.warning(
            "%s did not stop within %.0fs; closing its connections", type(client).__name__, seconds
        )
    except KafkaError as exc:
        # A producer's stop waits for its sender, which raises what ended it (chaos
        # seed 52304: EndTxn answered UnknownError to a transaction given up).
        logger.warning("%s stopped on %r; closing its connections", type(client).__name__, exc)
    # The stop never reached closing the connections (aiokafka's own last step,
    # through the client it keeps as `_client`).
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client._client.close(), 5)


async def stop_all_within(clients: list[AIOKafkaConsumer], seconds: float = CLIENT_STOP_S) -> None:
    """`stop_within` for every client at once: a stop that waits for a held join
    then costs `seconds` in all, not once per client."""
    await asyncio.gather(*(stop_within(client, seconds) for client in clients))


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, timeout_s: float = 10) -> list[int]:
    """The partition numbers of `topic`, refreshing metadata until it is known."""
    deadline = time.monotonic() + timeout_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return sorted(parts)
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {topic!r} has no partitions in metadata")
        await consumer._client.force_metadata_update()
        await asyncio.sleep(0.05)
