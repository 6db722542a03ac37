"""The asyncio edge: sockets in, the sans-IO core in the middle, sockets out.

Each socket gets an :class:`MQTTProtocol` (``asyncio.Protocol``, not
streams: no per-read coroutine). Output is coalesced: a connection that has
packets to send is queued once, and one ``transport.write`` per connection
per event-loop iteration carries everything it accumulated. Back-pressure:
when a transport's buffer passes the high-water mark its connection is
marked congested (QoS 0 is dropped, QoS 1/2 waits in the session queue) and
reading from that socket pauses until the buffer drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, cast

from broker.config import Settings
from broker.connection import MQTTConnection
from broker.core import Broker
from broker.packets import ReasonCode

if TYPE_CHECKING:
    from broker.metrics import MetricsServer

log = logging.getLogger("devicemq.server")

TICK_INTERVAL = 0.5  # seconds between keep-alive / expiry sweeps
SHUTDOWN_GRACE = 5.0  # seconds to let clients read their DISCONNECT


class MQTTProtocol(asyncio.Protocol):
    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.conn: MQTTConnection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        high = self.server.broker.settings.mqtt.write_buffer_high_water
        self.transport.set_write_buffer_limits(high=high, low=high // 4)
        peer = transport.get_extra_info("peername")
        label = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.conn = MQTTConnection(self.server.broker, label, self.server.schedule_flush)
        self.server.attach(self.conn, self)

    def data_received(self, data: bytes) -> None:
        assert self.conn is not None
        self.conn.receive_data(data)

    def eof_received(self) -> bool:
        return False  # half-closed MQTT makes no sense: close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self.conn
        if conn is not None:
            conn.connection_lost()
            self.server.forget(conn)

    def pause_writing(self) -> None:
        assert self.conn is not None and self.transport is not None
        self.conn.congested = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        assert self.conn is not None and self.transport is not None
        self.conn.congested = False
        if not self.transport.is_closing():
            self.transport.resume_reading()
        session = self.conn.session
        if session is not None:
            session.outbox.pump()


class BrokerServer:
    def __init__(self, settings: Settings, broker: Broker | None = None) -> None:
        self.settings = settings
        self.broker = broker or Broker(settings)
        self._protocols: dict[MQTTConnection, MQTTProtocol] = {}
        self._dirty: list[MQTTConnection] = []
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        listener = self.settings.listener
        self._server = await self._loop.create_server(
            lambda: MQTTProtocol(self),
            listener.host,
            listener.port,
            reuse_address=True,
            backlog=1024,
        )
        self._ticker = asyncio.create_task(self._tick_forever())
        log.info("devicemq listening on %s:%d", listener.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, tell every client the server is going away, flush, close."""
        if self._server is not None:
            self._server.close()
        if self._ticker is not None:
            self._ticker.cancel()
        for conn in list(self._protocols):
            conn.disconnect(ReasonCode.SERVER_SHUTTING_DOWN)
        self._flush()
        deadline = asyncio.get_running_loop().time() + SHUTDOWN_GRACE
        while self._protocols and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for protocol in list(self._protocols.values()):
            if protocol.transport is not None:
                protocol.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        log.info("devicemq stopped")

    def attach(self, conn: MQTTConnection, protocol: MQTTProtocol) -> None:
        self._protocols[conn] = protocol

    def forget(self, conn: MQTTConnection) -> None:
        self._protocols.pop(conn, None)

    def schedule_flush(self, conn: MQTTConnection) -> None:
        """Called by a connection whose outbox just became non-empty (or that closes)."""
        if not self._dirty:
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        self._dirty.append(conn)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, []
        protocols = self._protocols
        for conn in dirty:
            protocol = protocols.get(conn)
            if protocol is None or protocol.transport is None:
                continue
            data = conn.data_to_send()
            if data:
                protocol.transport.write(data)
            if conn.close_requested:
                protocol.transport.close()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL)
            try:
                self.broker.tick()
            except Exception:  # a bug in one sweep must not stop the next
                log.exception("periodic sweep failed")


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """Run a broker until ``stop`` is set, then drain and close.

    With persistence enabled, Redis and Kafka (embedded if not configured)
    are connected and saved sessions restored before the listener opens; on
    the way out, clients are disconnected first so nothing new arrives, then
    the persistent path drains into Redis. With ``metrics.enabled`` the
    metrics server answers from the start (/health 200, /ready 503 until the
    listener opens) to the end.
    """
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    metrics: MetricsServer | None = None
    if settings.metrics.enabled:
        from broker.metrics import MetricsServer

        metrics = MetricsServer(settings.metrics)
        await metrics.start()
    try:
        await _serve(settings, stop, metrics)
    finally:
        if metrics is not None:
            await metrics.stop()


async def _serve(settings: Settings, stop: asyncio.Event, metrics: MetricsServer | None) -> None:
    persistence = None
    if settings.persistence.enabled:
        from persistence.runtime import open_persistence

        persistence = await open_persistence(settings)
    broker = Broker(settings, persistent_path=persistence)
    try:
        if persistence is not None:
            await persistence.attach(broker)
        server = BrokerServer(settings, broker)
        await server.start()
        if metrics is not None:
            metrics.attach(broker, persistence)
        try:
            await stop.wait()
        finally:
            if metrics is not None:
                metrics.stopping = True  # /ready: 503 while draining
            await server.stop()
    finally:
        if persistence is not None:
            await persistence.close()


def run(settings: Settings) -> None:
    """Blocking entry point of ``devicemq run``: serve until SIGTERM or SIGINT."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every platform we ship
        runner = asyncio.run
    else:
        runner = uvloop.run

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    with contextlib.suppress(KeyboardInterrupt):
        runner(main())
