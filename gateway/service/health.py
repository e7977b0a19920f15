"""HTTP endpoints next to the data path: /metrics, /healthz, /readyz."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.errors import ConfigError


class HealthServer:
    """`/healthz`: the process is alive. `/readyz`: `is_ready()` says so (else 503)."""

    def __init__(
        self, registry: CollectorRegistry, is_ready: Callable[[], tuple[bool, str]],
        host: str, port: int,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.is_ready = is_ready
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:  # in use, or not an address of this host: one line, exit 2
            await self._runner.cleanup()
            raise ConfigError(
                f"metrics.port: cannot listen on {self.host}:{self.port} ({exc.strerror or exc});"
                " choose a free port ([metrics] port, GATEWAY_METRICS__PORT)"
            ) from exc
        if self.port == 0:  # an ephemeral port was asked for: record the real one
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _: web.Request) -> web.Response:
        ready, why = self.is_ready()
        return web.Response(text=f"{why}\n", status=200 if ready else 503)
