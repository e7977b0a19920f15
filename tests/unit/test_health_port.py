"""The health endpoint's port taken (or not this host's): start-up stops with one line
naming `[metrics] port`, not a traceback (a gateway under test died so when another
process held its port)."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import ConfigError
from gateway.service.health import HealthServer


async def test_a_port_in_use_is_a_config_error_naming_the_setting() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        server = HealthServer(CollectorRegistry(), lambda: (True, ""), "127.0.0.1", port)
        with pytest.raises(ConfigError, match=rf"metrics.port: cannot listen on 127.0.0.1:{port}"):
            await server.start()
    await server.stop()  # nothing left to clean up: start cleaned up after itself
