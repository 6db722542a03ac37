"""Commands packed by hiredis, in C, on the broker's asyncio Redis connections.

redis-py's blocking client packs commands with hiredis when it is installed; its
asyncio client packs them in Python, one argument at a time (redis 5 to 8). A
save wave is one script call with thousands of arguments (persistence/redis_store.py),
so packing was 8% of the broker's CPU at 4,000 persistent devices; hiredis packs
the same bytes about 6x faster. Without ``hiredis.pack_command`` the clients are
left as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import DataError

_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _pack
except ImportError:  # hiredis is an extra of redis: absent, redis-py packs
    _pack = None

Client = TypeVar("Client", Redis, RedisCluster)


class _HiredisPacking:
    """Mixed in before a redis-py asyncio connection class."""

    def pack_command(self, *args: Any) -> list[bytes]:
        # As redis-py's own packers: a first argument with spaces is split
        # ("CONFIG GET"), and a value hiredis cannot pack is redis-py's DataError.
        first = args[0]
        if (" " in first) if isinstance(first, str) else (b" " in first):
            args = (*first.split(), *args[1:])
        try:
            return [_pack(args)]  # type: ignore[misc]  # set: see packed_by_hiredis
        except TypeError:  # a buffer hiredis does not take, or a value nothing packs
            args = tuple(
                bytes(arg) if isinstance(arg, (bytearray, memoryview)) else arg for arg in args
            )
        try:
            return [_pack(args)]  # type: ignore[misc]
        except TypeError as error:
            raise DataError(str(error)) from error


_PACKING: dict[type, type] = {}


def _packing(connection_class: type) -> type:
    if issubclass(connection_class, _HiredisPacking):
        return connection_class
    found = _PACKING.get(connection_class)
    if found is None:
        found = type(connection_class.__name__, (_HiredisPacking, connection_class), {})
        _PACKING[connection_class] = found
    return found


def packed_by_hiredis(client: Client) -> Client:
    """``client``, made before it connected, with connections that pack with hiredis."""
    if _pack is None:
        return client
    if isinstance(client, RedisCluster):
        # Every node, those found later too, is made with these keyword arguments.
        shared = client.nodes_manager.connection_kwargs
        shared["connection_class"] = _packing(shared["connection_class"])
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = _packing(node.connection_class)
    else:
        pool = client.connection_pool
        pool.connection_class = _packing(pool.connection_class)
    return client
