"""A closed connection is freed by its reference count, not by the cyclic collector.

The cyclic collector's full collections walk every object a broker holds: with
100,000 persistent sessions one took 3.6 s, a stall of every client, and what
it collected were mostly closed connections (the protocol, its MQTTConnection,
the transport, the decoder: each referring to the next and back). A fleet that
reconnects makes one such cycle per connection (BENCHMARKS.md, "The fleet's
churn and the collector").
"""

from __future__ import annotations

import asyncio
import gc

from broker.codec import encode
from broker.config import ListenerSettings, PersistenceSettings, Settings
from broker.packets import Connect, Disconnect
from edge.server import BrokerServer

# The objects of one connection (edge/server.py, broker/connection.py, broker/codec.py).
CONNECTION_TYPES = {"MQTTProtocol", "MQTTConnection", "PacketDecoder", "TCPTransport"}


def _garbage_types() -> set[str]:
    """The types of what only the cyclic collector can free now (nothing is freed)."""
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return {type(o).__name__ for o in gc.garbage}
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)


async def test_a_closed_connection_leaves_no_cycle_behind() -> None:
    server = BrokerServer(
        Settings(
            listener=ListenerSettings(host="127.0.0.1", port=0),
            persistence=PersistenceSettings(enabled=False),
        )
    )
    await server.start()
    try:
        gc.collect()
        for n, clean in enumerate((True, False, False)):  # a session kept across a reconnect
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(encode(Connect("device-1", protocol_level=4, clean_start=clean), 4))
            assert (await asyncio.wait_for(reader.readexactly(4), 5))[0] == 0x20, n
            if n == 1:
                writer.write(encode(Disconnect(), 4))  # the polite way
            writer.close()  # the others just go
            await writer.wait_closed()
            for _ in range(200):
                if not server._protocols:
                    break
                await asyncio.sleep(0.01)
            assert not server._protocols
            await asyncio.sleep(0.05)  # the transport's own close callbacks
            assert not (_garbage_types() & CONNECTION_TYPES), n
        assert "device-1" in server.broker.sessions  # what was kept is still there
    finally:
        await server.stop()
