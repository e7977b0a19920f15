"""A quorum member's URL: its scheme, its name in logs and labels, its masked form."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import UrlConstraints
from pydantic_core import MultiHostUrl

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


MemberUrl = Annotated[
    MultiHostUrl,
    UrlConstraints(
        allowed_schemes=["redis", "rediss", *CLUSTER_SCHEMES], default_port=6379, host_required=True
    ),
]


def is_cluster(url: MultiHostUrl) -> bool:
    return url.scheme in CLUSTER_SCHEMES


def member_name(url: MultiHostUrl) -> str:
    """`host:port/db`, or `cluster:host:port` (the first seed) for a cluster: safe to
    log and to use as a metric label, never the password."""
    first = url.hosts()[0]
    where = f"{first['host']}:{first['port']}"
    return f"cluster:{where}" if is_cluster(url) else f"{where}{url.path or ''}"


# Query parameters that carry a secret: redis-py authenticates with `?password=`.
_SECRET_QUERY = re.compile(r"(?i)([?&][^=&#]*(?:password|secret|token)[^=&#]*=)[^&#]*")


def masked(url: MultiHostUrl | str) -> str:
    """The URL with its password, in the user part or the query (`?password=`),
    replaced by `***`: how every printed or logged URL is shown."""
    text = str(url)
    if not isinstance(url, str):
        for host in url.hosts():
            if host["password"]:
                text = text.replace(f":{host['password']}@", ":***@", 1)
    else:
        text = re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", text)
    return _SECRET_QUERY.sub(r"\1***", text)


def check_member_url(url: MultiHostUrl) -> None:
    """Raise ValueError for what the URL type cannot say: a cluster has database 0 only."""
    if is_cluster(url) and (url.path or "/") not in ("/", "/0"):
        raise ValueError(f"{member_name(url)}: a Redis Cluster has database 0 only, got {url.path}")
    if not is_cluster(url) and len(url.hosts()) > 1:
        raise ValueError(f"{member_name(url)}: several hosts need the redis+cluster:// scheme")
