"""Secrets kept out of what is printed or logged: one rule for every setting.

- `is_secret_name`: whether a setting's, a property's or a query parameter's name
  says its value is a secret (password, pass, secret, token, credential, jaas, a
  key such as `fs.s3a.secret.key` / `fs.s3a.access.key` ...), read as its reader
  reads it: percent-decoded, since redis-py decodes the query's names
  (`?pass%77ord=X` authenticates with X).
- `masked_text`: a URL, or a message with URLs in it, with the password of every
  user part and the value of every query parameter with a secret name as `***`.
- `masked_tree`: a table (`[spark] conf`, `handler_options`, `[kafka.client]`)
  with the values under secret names as `***`, at every depth, and its text
  values through `masked_text`.

check-config and the start-up line show settings through these
(gateway/config.py, `effective`), as do the messages that name a URL
(gateway/member_urls.py, `masked`).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote_plus

MASK = "***"

# Words that make a name secret wherever they stand in it ("sasl_password", "keyPassword").
_WORDS = ("password", "passwd", "passphrase", "secret", "token", "credential", "jaas")
# Words that do as whole words only ("pass", not "passthrough"): Azure's SAS too.
_WHOLE = frozenset({"pass", "pwd", "pw", "cred", "creds", "sas"})
# A name that ends in one of these points at a secret, it is not one: a path, an
# endpoint, a class (`ssl.key.location`, `sasl.oauthbearer.token.endpoint.url`,
# `fs.s3a.aws.credentials.provider`); a URL value is masked all the same.
_POINTERS = frozenset(
    {"url", "uri", "endpoint", "location", "path", "file", "type", "mechanism", "provider"}
)
# A key's value: `fs.s3a.access.key`, `apiKey`, Azure's `fs.azure.account.key.<account>...`,
# a PEM (`ssl.key.pem`).
_KEYS = ("account.key", "key.pem")


def is_secret_name(name: str) -> bool:
    """Whether `name` (percent-decoded, without case) names a secret (module docstring)."""
    text = name
    for _ in range(3):  # as decoded as any reader reads it
        decoded = unquote_plus(text)
        if decoded == text:
            break
        text = decoded
    text = text.lower()
    words = [w for w in re.split(r"[^a-z0-9]+", text) if w]
    if not words:
        return False
    if any(key in text for key in _KEYS):
        return True
    if words[-1] in _POINTERS:
        return False
    return (
        any(word in text for word in _WORDS)
        or any(word in _WHOLE for word in words)
        or words[-1].endswith("key")
    )


# A URL's scheme (or `//` alone) and authority: the hosts, each with its user part.
_AUTHORITY = re.compile(r"(?P<start>(?:[A-Za-z][A-Za-z0-9+.\-]*:)?//)(?P<authority>[^/?#\s'\"<>]*)")
# A query parameter (also after `;`, as JDBC URLs write them).
_PARAMETER = re.compile(r"(?P<start>[?&;])(?P<name>[^=&;#?\s'\"<>]+)=(?P<value>[^&;#\s'\"<>]*)")


def masked_text(text: str) -> str:
    """`text` with the password of every URL user part (`user:***@host`, each host of a
    multi-host URL; the last `@` ends the user part, as in urllib) and the value of
    every query parameter whose name is secret (`?password=***`) masked."""
    text = _AUTHORITY.sub(_masked_authority, text)
    return _PARAMETER.sub(_masked_parameter, text)


def _masked_authority(found: re.Match[str]) -> str:
    hosts = []
    for host in found["authority"].split(","):
        user_part, at, where = host.rpartition("@")
        user, colon, _ = user_part.partition(":")
        hosts.append(f"{user}:{MASK}@{where}" if at and colon else host)
    return found["start"] + ",".join(hosts)


def _masked_parameter(found: re.Match[str]) -> str:
    if not is_secret_name(found["name"]):
        return found[0]
    return f"{found['start']}{found['name']}={MASK}"


def masked_tree(data: Any) -> Any:
    """`data` (tables, lists, values) with every value under a secret name, the whole
    of it, as `***`, and every text through `masked_text`."""
    if isinstance(data, dict):
        return {
            name: MASK if is_secret_name(str(name)) else masked_tree(value)
            for name, value in data.items()
        }
    if isinstance(data, list | tuple):
        return [masked_tree(value) for value in data]
    if isinstance(data, str):
        return masked_text(data)
    return data
