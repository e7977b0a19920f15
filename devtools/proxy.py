"""A TCP proxy on a free loopback port, for network faults in tests.

`pause()` stops forwarding bytes in both directions while every connection
stays open (a stalled network: the peers see no error, only silence, and TCP
back-pressure holds what they keep sending); `resume()` carries on where it
stopped, nothing lost. New connections are accepted while paused, and stall
like the others.

    proxy = TcpProxy("127.0.0.1", broker_port)
    port = await proxy.start()
    ...
    proxy.pause(); ...; proxy.resume()
    await proxy.stop()

For a Kafka broker, clients connect to the listener the broker advertises in
its metadata, not to the bootstrap address: the broker must advertise the
proxy's port (`devtools.localstack.kafka_broker(advertised_port=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from devtools.localstack import free_port, kafka_broker

CHUNK = 65_536


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.host = host
        self.port = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._connections: set[asyncio.Task[Any]] = set()  # one per client connection
        self._pipes: set[asyncio.Task[None]] = set()  # two per connection, one each way

    @property
    def paused(self) -> bool:
        return not self._flowing.is_set()

    async def start(self) -> int:
        """Listen on a free port of `host`; returns the port."""
        self._server = await asyncio.start_server(self._connect, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def pause(self) -> None:
        """Stop forwarding bytes both ways; connections stay open."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def stop(self) -> None:
        """Close the listener and every connection; safe to call twice."""
        self._flowing.set()
        server, self._server = self._server, None
        if server is not None:
            server.close()
        # Ending the pipes lets each connection close itself (a cancelled
        # connection task would be reported by asyncio's stream protocol).
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _connect(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        writers = [client_w]
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
            writers.append(server_w)
            if self._server is None:
                return  # stopped meanwhile
            pipes = [
                asyncio.create_task(self._pipe(client_r, server_w)),
                asyncio.create_task(self._pipe(server_r, client_w)),
            ]
            self._pipes.update(pipes)
            try:
                # Either side closing (or stop) ends the connection.
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
                self._pipes.difference_update(pipes)
        except OSError:
            pass  # the target refused or reset: the client sees its connection close
        finally:
            self._connections.discard(task)
            for writer in writers:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while True:
                await self._flowing.wait()  # paused: read nothing, so nothing moves
                data = await reader.read(CHUNK)
                if not data:
                    return
                await self._flowing.wait()  # paused mid-chunk: hold it until resumed
                writer.write(data)
                await writer.drain()


@contextlib.asynccontextmanager
async def proxied(state_dir: Path) -> AsyncIterator[tuple[str, TcpProxy]]:
    """A broker of its own whose clients all go through a TcpProxy: it advertises the
    proxy's port, so pausing the proxy stalls every connection, not just the bootstrap."""
    port = free_port()
    proxy = TcpProxy("127.0.0.1", port)
    proxy_port = await proxy.start()
    server = kafka_broker(state_dir, port=port, advertised_port=proxy_port)
    await asyncio.to_thread(server.start)
    try:
        yield f"127.0.0.1:{proxy_port}", proxy
    finally:
        await proxy.stop()
        server.stop()
