"""A quorum member's URL: its scheme, its name in logs and labels, its masked form."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, UrlConstraints
from pydantic_core import MultiHostUrl

from gateway.masking import masked_text

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def _needs_a_scheme(value: Any) -> Any:
    """`127.0.0.1:6379` is the usual slip: said as such, with the URL to write, not as
    the URL parser's "relative URL without a base" (or `localhost` read as a scheme)."""
    if isinstance(value, str) and value.strip() and "://" not in value:
        shown = masked_text(f"redis://{value.strip()}").removeprefix("redis://")
        raise ValueError(
            f"{shown!r} has no scheme: write redis://{shown} (rediss:// for TLS, "
            "redis+cluster:// for a Redis Cluster)"
        )
    return value


MemberUrl = Annotated[
    MultiHostUrl,
    UrlConstraints(
        allowed_schemes=["redis", "rediss", *CLUSTER_SCHEMES], default_port=6379, host_required=True
    ),
    BeforeValidator(_needs_a_scheme),
]


def is_cluster(url: MultiHostUrl) -> bool:
    return url.scheme in CLUSTER_SCHEMES


def member_name(url: MultiHostUrl) -> str:
    """`host:port/db`, or `cluster:host:port` (the first seed) for a cluster: safe to
    log and to use as a metric label, never the password."""
    first = url.hosts()[0]
    where = f"{first['host']}:{first['port']}"
    return f"cluster:{where}" if is_cluster(url) else f"{where}{url.path or ''}"


def masked(url: MultiHostUrl | str) -> str:
    """The URL (or a message naming URLs) with every password, in a user part or a
    query parameter with a secret name (`?password=`, percent-encoded or not: redis-py
    decodes the names), replaced by `***`: how every printed or logged URL is shown
    (gateway/masking.py)."""
    return masked_text(str(url))


def check_member_url(url: MultiHostUrl) -> None:
    """Raise ValueError for what the URL type cannot say: a cluster has database 0 only."""
    if is_cluster(url) and (url.path or "/") not in ("/", "/0"):
        raise ValueError(f"{member_name(url)}: a Redis Cluster has database 0 only, got {url.path}")
    if not is_cluster(url) and len(url.hosts()) > 1:
        raise ValueError(f"{member_name(url)}: several hosts need the redis+cluster:// scheme")
