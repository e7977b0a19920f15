"""`[kafka.client]`: raw Kafka client properties, handed to every client that knows them.

Names are the librdkafka / Java client ones (`client.id`, `request.timeout.ms`,
`sasl.mechanism`, ...). Where a property goes:
- a plain name goes to the Spark job's clients (librdkafka and the Java client,
  whose names agree for these) and, when aiokafka has the option
  (`AIOKAFKA_NAMES`), to the gateway's clients too;
- `librdkafka.NAME` or `java.NAME` goes to that client family only, without the
  prefix (the families differ, e.g. for OAUTHBEARER: librdkafka's
  `sasl.oauthbearer.method`, the Java client's `sasl.login.callback.handler.class`);
- `sasl.oauthbearer.token`, `.token.file`, `.token.command` are the gateway's own:
  where its aiokafka clients get an OAUTHBEARER token (gateway/kafka/oauth.py), for
  `sasl.mechanism = "OAUTHBEARER"`; the Spark job's clients fetch their own
  tokens through their family's settings.
What `[kafka]` already sets (bootstrap servers, security protocol, the SASL user
and password, TLS files) cannot be set here too: one place per setting.
"""

from __future__ import annotations

from typing import Any

from gateway.masking import MASK, is_secret_name, masked_tree

ClientValue = str | int | float | bool

# librdkafka/Java name -> aiokafka keyword, for the options every aiokafka client takes.
AIOKAFKA_NAMES = {
    "client.id": "client_id",
    "request.timeout.ms": "request_timeout_ms",
    "metadata.max.age.ms": "metadata_max_age_ms",
    "retry.backoff.ms": "retry_backoff_ms",
    "connections.max.idle.ms": "connections_max_idle_ms",
    "api.version": "api_version",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.kerberos.service.name": "sasl_kerberos_service_name",
}
FAMILIES = ("librdkafka", "java")
TOKEN_STATIC = "sasl.oauthbearer.token"
TOKEN_FILE = "sasl.oauthbearer.token.file"
TOKEN_COMMAND = "sasl.oauthbearer.token.command"
TOKEN_KEYS = (TOKEN_STATIC, TOKEN_FILE, TOKEN_COMMAND)
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER")
# Set in [kafka] (the value there reaches every client already).
RESERVED = {
    "bootstrap.servers": "bootstrap_servers",
    "security.protocol": "security_protocol",
    "sasl.username": "sasl_username",
    "sasl.password": "sasl_password",
    "sasl.jaas.config": "sasl_username and sasl_password",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
}


def check(properties: dict[str, ClientValue], sasl_mechanism: str | None) -> None:
    """Raise ValueError naming the first property that cannot be used."""
    for name, value in properties.items():
        family, _, bare = name.partition(".")
        bare = bare if family in FAMILIES else name
        if bare in RESERVED:
            raise ValueError(f"{name!r}: set kafka.{RESERVED[bare]} instead")
        if bare == "sasl.mechanism" and sasl_mechanism is not None:
            raise ValueError(f"{name!r}: kafka.sasl_mechanism is set already")
        if name in AIOKAFKA_NAMES and name.endswith(".ms") and not _is_int(value):
            raise ValueError(f"{name!r}: expected a whole number of milliseconds, got {value!r}")
    mechanism = properties.get("sasl.mechanism")
    if mechanism is not None and mechanism not in MECHANISMS:
        raise ValueError(f"'sasl.mechanism': expected one of {', '.join(MECHANISMS)}")
    sources = [key for key in TOKEN_KEYS if key in properties]
    if mechanism == "OAUTHBEARER" and len(sources) != 1:
        raise ValueError(
            "'sasl.mechanism' OAUTHBEARER needs exactly one token source for the gateway: "
            + ", ".join(repr(k) for k in TOKEN_KEYS)
        )
    if sources and mechanism != "OAUTHBEARER":
        raise ValueError(f"{sources[0]!r} needs 'sasl.mechanism' = 'OAUTHBEARER'")


def _is_int(value: ClientValue) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value.isdigit()
    )


def for_aiokafka(properties: dict[str, ClientValue]) -> dict[str, Any]:
    """The aiokafka keywords for the plain names it knows (the token provider apart)."""
    options: dict[str, Any] = {}
    for name, keyword in AIOKAFKA_NAMES.items():
        if name in properties:
            value = properties[name]
            options[keyword] = int(value) if name.endswith(".ms") else str(value)
    return options


def not_for_aiokafka(properties: dict[str, ClientValue]) -> list[str]:
    """The plain names the gateway's aiokafka clients have no option for."""
    return [
        name
        for name in properties
        if name not in AIOKAFKA_NAMES
        and name not in TOKEN_KEYS
        and name.partition(".")[0] not in FAMILIES
    ]


def for_family(properties: dict[str, ClientValue], family: str) -> dict[str, str]:
    """The properties for one client family (`librdkafka` or `java`), as strings."""
    out: dict[str, str] = {}
    for name, value in properties.items():
        head, _, bare = name.partition(".")
        if name in TOKEN_KEYS or (head in FAMILIES and head != family):
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out[bare if head == family else name] = text
    return out


def masked(properties: dict[str, ClientValue]) -> dict[str, ClientValue]:
    """The table with secret values shown as `***` (check-config, logs); the token
    command too: its arguments may carry a credential."""
    return {
        name: MASK
        if name in (TOKEN_STATIC, TOKEN_COMMAND) or is_secret_name(name)
        else masked_tree(value)
        for name, value in properties.items()
    }
