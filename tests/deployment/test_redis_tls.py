"""`rediss://` with a private CA, as docs/operations.md and
deploy/k8s/components/example-secrets/secret.example.yaml describe it: real
TLS redis-server processes with a password, a gateway that dedups through
them, and one that does not trust their CA and so never serves."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devtools.harness import (
    Topics,
    counter_value,
    eventually,
    make_settings,
    produce,
    running,
)
from devtools.localstack import ManagedProcess, free_port, redis_server
from devtools.topics import wait_committed

PASSWORD = "tls-pw"


def make_ca_and_server_cert(folder: Path) -> dict[str, Path]:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it (openssl CLI)."""
    f = {name: folder / name for name in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt")}
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
         "-keyout", f["ca.key"], "-out", f["ca.crt"]],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", f["srv.key"], "-out", f["srv.csr"]],
        ["x509", "-req", "-in", f["srv.csr"], "-CA", f["ca.crt"], "-CAkey", f["ca.key"],
         "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", f["srv.crt"]],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
    return f


def tls_redis(folder: Path, name: str, certs: dict[str, Path]) -> ManagedProcess:
    """redis-server answering TLS only, on a free port, with a password."""
    port = free_port()
    server = redis_server(folder, name, port=port, password=PASSWORD)
    plain = server.argv.index("--port")
    server.argv[plain + 1] = "0"  # no plaintext listener
    server.argv += ["--tls-port", str(port), "--tls-auth-clients", "no",
                    "--tls-cert-file", str(certs["srv.crt"]),
                    "--tls-key-file", str(certs["srv.key"]),
                    "--tls-ca-cert-file", str(certs["ca.crt"])]  # fmt: skip
    return server


@pytest.fixture
def tls_servers(tmp_path: Path) -> Any:
    certs = make_ca_and_server_cert(tmp_path)
    servers = [tls_redis(tmp_path, f"tls-redis-{i}", certs) for i in range(3)]
    for server in servers:
        server.start()
    yield servers, certs["ca.crt"]
    for server in servers:
        server.stop()


async def test_the_gateway_dedups_over_rediss_with_a_private_ca_and_a_password(
    broker: str, tls_servers: Any, names: Callable[[str], str]
) -> None:
    servers, ca = tls_servers
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1, clean_partitions=1)
    urls = [f"rediss://:{PASSWORD}@127.0.0.1:{s.port}/0?ssl_ca_certs={ca}" for s in servers]
    message = [("message-id", b"tls-1")]
    async with running(make_settings(broker, topics, urls)) as gateway:
        await produce(broker, topics.raw, [(b"k", b"v", message), (b"k", b"v", message)])
        await wait_committed(broker, topics.group, topics.raw, {0: 2})
        m = gateway.metrics
        assert (counter_value(m.forwarded), counter_value(m.duplicates)) == (1, 1)


async def test_a_gateway_that_does_not_trust_the_ca_never_serves(
    broker: str, tls_servers: Any, names: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    servers, _ = tls_servers
    topics = Topics(names)
    await topics.create(broker, raw_partitions=1, clean_partitions=1)
    urls = [f"rediss://:{PASSWORD}@127.0.0.1:{s.port}/0" for s in servers]  # system CAs only
    async with running(make_settings(broker, topics, urls)) as gateway:
        await eventually(lambda: "certificate verify failed" in caplog.text, what="TLS refused")
        assert not gateway.partitions() and not gateway.readiness()[0]
    assert PASSWORD not in caplog.text
