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
import functools
import logging
import signal
import time
from collections.abc import Callable
from typing import cast

from broker.config import Settings
from broker.connection import MQTTConnection
from broker.core import Broker
from broker.limits import TokenBucket, source_key
from broker.packets import ReasonCode
from edge.listeners import Framing, ListenerSpec, authentication_configured, listener_specs
from edge.websocket import CLOSE_POLICY_VIOLATION, OriginPolicy, WebSocketServer, WsState
from edge.websocket import Closed as WsClosed
from edge.websocket import Data as WsData

log = logging.getLogger("devicemq.server")
_auth_log = logging.getLogger("devicemq.auth")  # SIGHUP reloads the auth files

TICK_INTERVAL = 0.5  # seconds between keep-alive / expiry sweeps
SHUTDOWN_GRACE = 5.0  # seconds to let clients read their DISCONNECT


class MQTTProtocol(asyncio.Protocol):
    """MQTT straight on a TCP or TLS byte stream (listeners ``listener`` and ``tls``)."""

    def __init__(self, server: BrokerServer, listener: str = "listener") -> None:
        self.server = server
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.conn: MQTTConnection | None = None
        self.congested_since: float | None = None  # loop time pause_writing came

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        mqtt = self.server.broker.settings.mqtt
        if len(self.server._protocols) >= mqtt.max_connections:
            # Refused before a byte is read: no MQTT state, nothing to answer.
            self.server.broker.stats.reject("max_connections")
            self.transport.abort()
            return
        high = mqtt.write_buffer_high_water
        self.transport.set_write_buffer_limits(high=high, low=high // 4)
        peer = transport.get_extra_info("peername")
        label = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        address = str(peer[0]) if isinstance(peer, tuple) else label
        self.conn = MQTTConnection(
            self.server.broker,
            label,
            self.server.schedule_flush,
            self._input_flow,
            source=source_key(address),
            address=address,
        )
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            # asyncio calls connection_made after the TLS handshake: the certificate is known.
            # {} means one was not asked for or not verified; the auth layer wants None then.
            self.conn.peer_certificate = ssl_object.getpeercert() or None
        self.server.attach(self.conn, self)

    def data_received(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.receive_data(data)

    def write(self, data: bytes) -> None:
        """Bytes from the connection's output buffer onto the wire (framed, for WebSockets)."""
        assert self.transport is not None
        self.transport.write(data)

    def close_transport(self) -> None:
        assert self.transport is not None
        self.transport.close()

    def eof_received(self) -> bool:
        return False  # half-closed MQTT makes no sense: close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self.conn
        if conn is not None:
            conn.connection_lost()
            self.server.forget(conn)
        # The connection holds this protocol (its input-flow callback) and the
        # transport holds it too: let go of both, so that a closed connection is
        # freed at once, not left to the cyclic collector, whose full collections
        # walk every client's objects (a fleet reconnecting: BENCHMARKS.md, "The
        # fleet's churn and the collector").
        self.conn = None
        self.transport = None

    def _input_flow(self, go_on: bool) -> None:
        """The connection owes too many acknowledgements (False), or no longer (True)."""
        transport, conn = self.transport, self.conn
        if transport is None or conn is None or transport.is_closing():
            return
        if not go_on:
            transport.pause_reading()
        elif not conn.congested:
            transport.resume_reading()

    def pause_writing(self) -> None:
        if self.conn is None or self.transport is None:
            return
        self.conn.congested = True
        self.congested_since = asyncio.get_running_loop().time()
        self.server.congested.add(self)
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.conn is None or self.transport is None:
            return
        self.conn.congested = False
        self.congested_since = None
        self.server.congested.discard(self)
        if not self.transport.is_closing() and not self.conn.input_paused:
            self.transport.resume_reading()
        session = self.conn.session
        if session is not None:
            session.outflow.pump()
            self.server.broker.resume_retained(session)


class WebSocketProtocol(MQTTProtocol):
    """MQTT inside binary WebSocket frames (listeners ``websocket`` and ``websocket_tls``).

    The sans-IO :class:`~edge.websocket.WebSocketServer` does the HTTP
    upgrade and the framing; the MQTT bytes it yields feed the same
    :class:`MQTTConnection` as a plain socket's.
    """

    def __init__(self, server: BrokerServer, listener: str = "websocket") -> None:
        super().__init__(server, listener)
        self.ws = WebSocketServer(server.origins)
        # websocket.max_frame_rate: frames cost per frame, whatever they carry, so
        # a peer sending tiny frames is charged for them and closed when over.
        rate = server.settings.websocket.max_frame_rate
        self.frame_bucket = TokenBucket(rate, time.monotonic()) if rate > 0 else None

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        transport = self.transport
        if conn is None or transport is None:
            return
        ws = self.ws
        bucket = self.frame_bucket
        if bucket is None:
            events = ws.receive_data(data)
        else:
            before = ws.frames
            events = ws.receive_data(data, max(0, int(bucket.available(time.monotonic()))))
            bucket.spend(ws.frames - before)
        for event in events:
            if isinstance(event, WsData):
                conn.receive_data(event.data)
            elif isinstance(event, WsClosed):
                if event.by_peer:
                    log.debug("websocket %s closed: %s %s", conn.peer, event.code, event.reason)
                else:
                    log.info("websocket %s failed: %s %s", conn.peer, event.code, event.reason)
                    if event.code == CLOSE_POLICY_VIOLATION:
                        failed = "frame_rate"
                    elif event.code == 403:
                        failed = "origin"
                    elif ws.path is not None:
                        failed = "protocol_error"
                    else:
                        failed = "handshake"
                    self.server.broker.stats.reject(f"websocket_{failed}")
                conn.connection_lost()  # no DISCONNECT came: the will is due
        out = self.ws.data_to_send()
        if out:
            transport.write(out)
        if self.ws.state is WsState.CLOSED and not transport.is_closing():
            transport.close()

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.ws.send_data(data)
        out = self.ws.data_to_send()
        if out:
            self.transport.write(out)

    def close_transport(self) -> None:
        assert self.transport is not None
        self.ws.close()
        out = self.ws.data_to_send()
        if out:
            self.transport.write(out)
        self.transport.close()


class BrokerServer:
    def __init__(self, settings: Settings, broker: Broker | None = None) -> None:
        self.settings = settings
        self.broker = broker or Broker(settings)
        self._protocols: dict[MQTTConnection, MQTTProtocol] = {}
        # Connections whose transport asked to pause writing: the slow-consumer sweep
        # looks at these only, not at every connection.
        self.congested: set[MQTTProtocol] = set()
        self._dirty: list[MQTTConnection] = []
        self._servers: list[asyncio.Server] = []
        self.ports: dict[str, int] = {}  # listener name -> bound port (useful with port 0)
        self._ticker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hard_limit = settings.mqtt.write_buffer_hard_limit
        self.origins = OriginPolicy.from_setting(
            settings.websocket.allowed_origins, not authentication_configured(settings)
        )

    @property
    def port(self) -> int:
        """The port of the first listener (plain TCP unless it is disabled)."""
        return next(iter(self.ports.values()))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.broker.call_soon = self._loop.call_soon  # long work goes a chunk per iteration
        specs = listener_specs(self.settings)  # ConfigError before any socket is bound
        timeout = self.settings.mqtt.connect_timeout
        try:
            for spec in specs:
                protocol = WebSocketProtocol if spec.framing is Framing.WEBSOCKET else MQTTProtocol
                server = await self._loop.create_server(
                    functools.partial(protocol, self, spec.name),
                    spec.host,
                    spec.port,
                    reuse_address=True,
                    reuse_port=self.settings.cluster.share_ports,
                    backlog=1024,
                    ssl=spec.ssl,
                    ssl_handshake_timeout=timeout if spec.ssl is not None else None,
                )
                self._servers.append(server)
                self.ports[spec.name] = int(server.sockets[0].getsockname()[1])
                log.info(
                    "devicemq listening on %s://%s:%d (%s)",
                    spec.scheme,
                    spec.host,
                    self.ports[spec.name],
                    spec.name,
                )
        except BaseException:
            for server in self._servers:
                server.close()
            raise
        self._say_where(specs)
        auth = self.settings.auth
        if auth.password_file or auth.acl_file or auth.chain_members:
            reload_on_sighup(
                lambda: self.broker.auth.maybe_reload(force=True),
                lambda: self.broker.acl.maybe_reload(force=True),
            )
        self._ticker = asyncio.create_task(self._tick_forever())

    def _say_where(self, specs: list[ListenerSpec]) -> None:
        """One clear line when a listener's address was chosen for lack of one."""
        sections = {
            "listener": self.settings.listener.host,
            "tls": self.settings.tls.host,
            "websocket": self.settings.websocket.host,
            "websocket_tls": self.settings.websocket_tls.host,
        }
        chosen = [spec.name for spec in specs if not sections[spec.name]]
        if not chosen:
            return
        if authentication_configured(self.settings):
            log.info(
                "listening on every interface: authentication is configured "
                "(set %s to choose the address)",
                ", ".join(f"{name}.host" for name in chosen),
            )
        else:
            log.warning(
                "no authentication configured: listening on 127.0.0.1 only, like Mosquitto 2; "
                "set auth.password_file to accept clients from the network, or set %s "
                "explicitly (SECURITY.md)",
                " / ".join(f"{name}.host" for name in chosen),
            )

    async def stop(self) -> None:
        """Stop accepting, tell every client the server is going away, flush, close."""
        for server in self._servers:
            server.close()
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
        for server in self._servers:
            await server.wait_closed()
        log.info("devicemq stopped")

    def attach(self, conn: MQTTConnection, protocol: MQTTProtocol) -> None:
        self._protocols[conn] = protocol

    def forget(self, conn: MQTTConnection) -> None:
        protocol = self._protocols.pop(conn, None)
        if protocol is not None:
            self.congested.discard(protocol)

    def schedule_flush(self, conn: MQTTConnection) -> None:
        """Called by a connection whose output buffer just became non-empty (or that closes)."""
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
                protocol.write(data)
                if protocol.transport.get_write_buffer_size() > self._hard_limit:
                    self._slow_consumer(protocol, "over mqtt.write_buffer_hard_limit")
                    continue
            if conn.close_requested:
                protocol.close_transport()

    def _slow_consumer(self, protocol: MQTTProtocol, why: str) -> None:
        """Drop a client that does not read: abort, as its buffer will not drain for a close."""
        conn = protocol.conn
        assert conn is not None and protocol.transport is not None
        log.warning(
            "client %s (%s) disconnected as a slow consumer: %s", conn.client_id, conn.peer, why
        )
        self.broker.stats.reject("slow_consumer")
        conn.close(publish_will=True)
        protocol.transport.abort()

    def _check_slow_consumers(self) -> None:
        assert self._loop is not None
        deadline = self._loop.time() - self.settings.mqtt.slow_consumer_timeout
        for protocol in list(self.congested):
            since = protocol.congested_since
            if since is not None and since < deadline and protocol.transport is not None:
                self._slow_consumer(protocol, "congested for mqtt.slow_consumer_timeout")

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL)
            try:
                self.broker.tick()
                self._check_slow_consumers()
                # The password and ACL files are looked at here, at the edge (at most
                # one stat() a second each), never on the PUBLISH path.
                self.broker.auth.maybe_reload()
                self.broker.acl.maybe_reload()
            except Exception:  # a bug in one sweep must not stop the next
                log.exception("periodic sweep failed")


def reload_on_sighup(*reloaders: Callable[[], None]) -> bool:
    """Run ``reloaders`` on SIGHUP (event-loop signal handler); False if not possible.

    Called when the broker is built inside a running event loop on the main
    thread (``devicemq run``); elsewhere (tests, threads) it does nothing.
    """
    if not hasattr(signal, "SIGHUP"):
        return False
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False

    def on_sighup() -> None:
        _auth_log.info("SIGHUP: reloading the password and ACL files")
        for reload in reloaders:
            try:
                reload()
            except Exception:
                _auth_log.exception("reload failed")

    try:
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
        return False
    return True
