"""The broker's Redis clients after a restart of redis-server (persistence/redis_security.py).

Every connection in a pool is closed by the server that goes; the restarted one
must get each of the next commands on a new connection, none of them failing. A
CI run saw the broker's /ready answer 200, then 503 ("redis unreachable") on the
next probe, with Redis long back: redis-py's pool skips its check of a closed
connection while its maintenance notifications are "auto" (their default), so
every pooled connection failed one command after the restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from persistence.redis_security import redis_client
from persistence.redis_store import RedisMessageStore
from tests.faults.conftest import RedisProcess

CONNECTIONS = 8


@pytest.fixture
def redis_process(tmp_path: Path):  # type: ignore[no-untyped-def]
    server = RedisProcess(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


async def _fill_pool(client: object) -> None:
    """Take CONNECTIONS connections from ``client``'s pool at once, give them back."""
    pool = client.connection_pool  # type: ignore[attr-defined]
    taken = [await pool.get_connection() for _ in range(CONNECTIONS)]
    for connection in taken:
        await pool.release(connection)


async def _after_a_restart(client: object, redis_process: RedisProcess) -> list[object]:
    await _fill_pool(client)
    redis_process.stop()
    await asyncio.sleep(0.2)  # the loop hears every connection closed
    redis_process.start()
    pings = [client.ping() for _ in range(CONNECTIONS)]  # type: ignore[attr-defined]
    return await asyncio.gather(*pings, return_exceptions=True)


async def test_the_stores_pool_serves_every_command_after_a_redis_restart(
    redis_process: RedisProcess,
) -> None:
    store = RedisMessageStore.from_url(redis_process.url)
    try:
        answers = await _after_a_restart(store.redis, redis_process)
        assert answers == [True] * CONNECTIONS, answers
        await store.ping()
    finally:
        await store.aclose()


async def test_the_cluster_links_client_serves_every_command_after_a_redis_restart(
    redis_process: RedisProcess,
) -> None:
    client = redis_client(redis_process.url, {})
    try:
        answers = await _after_a_restart(client, redis_process)
        assert answers == [True] * CONNECTIONS, answers
    finally:
        await client.aclose()
