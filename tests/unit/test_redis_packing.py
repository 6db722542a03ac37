"""persistence/redis_packing.py: hiredis packs what redis-py's own packer packs."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection
from redis.exceptions import DataError

from persistence.redis_packing import packed_by_hiredis

CASES = [
    ("PING",),
    ("EVALSHA", "a" * 40, 2, "{c}:k1", b"{c}:k2", b"\x00\xff" * 300, 7, -1, 2.5, "é"),
    ("CONFIG GET", "maxmemory"),  # a first argument with a space is split
    (b"CLIENT KILL", b"TYPE", b"replica"),
    ("SET", "k", memoryview(b"view"), bytearray(b"array")),
    ("SET", "k", b"x" * 100_000),  # past redis-py's buffer cutoff: one piece here
    ("ZADD", "z", 1e-7, "m", 12345678901234567890, "n"),
]


@pytest.mark.parametrize("args", CASES, ids=range(len(CASES)))
def test_the_bytes_are_redis_pys(args: tuple[object, ...]) -> None:
    client = packed_by_hiredis(Redis())
    ours = client.connection_pool.connection_class()
    theirs = Connection()
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))
    many = [args, ("PING",), args]
    assert b"".join(ours.pack_commands(many)) == b"".join(theirs.pack_commands(many))


def test_a_value_it_cannot_pack_is_a_data_error() -> None:
    ours = packed_by_hiredis(Redis()).connection_pool.connection_class()
    with pytest.raises(DataError):
        ours.pack_command("SET", "k", object())


def test_the_connection_class_is_kept_and_wrapped_once() -> None:
    client = packed_by_hiredis(Redis(ssl=True))
    cls = client.connection_pool.connection_class
    assert issubclass(cls, SSLConnection) and cls is not SSLConnection
    assert packed_by_hiredis(client).connection_pool.connection_class is cls
    assert packed_by_hiredis(Redis(ssl=True)).connection_pool.connection_class is cls
