"""The assembled persistent path against real Redis and real Tansu, without sockets."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import Iterator

import pytest

from broker.config import PersistenceSettings, Settings
from broker.core import Broker
from broker.message import Delivery, Message
from persistence.runtime import DevicePersistence, open_persistence
from tests.integration.redis_servers import RedisServer
from tests.kafka_fixtures import bootstrap_of, start_tansu, stop_tansu


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


def _settings(redis_url: str, bootstrap: str, **persistence_settings: object) -> Settings:
    persistence = PersistenceSettings(
        redis_url=redis_url,
        kafka_bootstrap=bootstrap,
        partitions=3,
        **persistence_settings,  # type: ignore[arg-type]
    )
    return dataclasses.replace(Settings(), persistence=persistence)


async def _open(
    redis_url: str, bootstrap: str, **persistence_settings: object
) -> tuple[DevicePersistence, Broker]:
    settings = _settings(redis_url, bootstrap, **persistence_settings)
    persistence = await open_persistence(settings)
    broker = Broker(settings, persistent_path=persistence)
    await persistence.attach(broker)
    return persistence, broker


async def _durable_session(persistence: DevicePersistence, broker: Broker, client_id: str) -> None:
    """A persistent session as a disconnected client leaves it: saved in Redis."""
    session = broker.restore_session(client_id, 3600, [], None)
    saved: list[bool] = []
    persistence.save_session(session, saved.append)
    while not saved:
        await asyncio.sleep(0.01)
    assert saved == [True]


async def _publish(broker: Broker, client_id: str, payloads: list[bytes]) -> None:
    session = broker.sessions[client_id]
    results: list[bool] = []
    for payload in payloads:
        message = Message("devices/x", payload, 1, False)
        broker.dispatch([(session, Delivery(message, 1, False))], results.append)
    while len(results) < len(payloads):
        await asyncio.sleep(0.01)
    assert all(results)


async def _stored(persistence: DevicePersistence, client_id: str, count: int) -> list[bytes]:
    for _ in range(500):
        page = (await persistence.store.load_page(client_id, 0, 1000)).records
        if len(page) >= count:
            return [r.message.payload for r in page if r.message is not None]
        await asyncio.sleep(0.02)
    raise AssertionError(f"only {len(page)} of {count} messages stored")


async def test_a_new_kafka_incarnation_does_not_make_new_messages_look_stored(
    redis: RedisServer,
) -> None:
    """The embedded Kafka keeps nothing across restarts, so offsets start at 0 again.

    Messages stored before must stay, and messages produced into the new,
    empty topic must be stored too, not skipped as already-seen offsets.
    """
    first = start_tansu()
    try:
        persistence, broker = await _open(redis.url, bootstrap_of(first))
        await _durable_session(persistence, broker, "dev")
        await _publish(broker, "dev", [b"old-%d" % i for i in range(20)])
        await _stored(persistence, "dev", 20)
        await persistence.close()
    finally:
        stop_tansu(first)

    second = start_tansu()
    try:
        persistence, broker = await _open(redis.url, bootstrap_of(second))
        assert "dev" in broker.sessions, "the durable session is restored from Redis"
        await _publish(broker, "dev", [b"new-%d" % i for i in range(5)])
        payloads = await _stored(persistence, "dev", 25)
        await persistence.close()
    finally:
        stop_tansu(second)
    assert payloads == [b"old-%d" % i for i in range(20)] + [b"new-%d" % i for i in range(5)]


async def test_graceful_close_leaves_everything_acknowledged_in_redis(redis: RedisServer) -> None:
    """close() returns only after the consumer stored what Kafka acknowledged."""
    tansu = start_tansu()
    try:
        persistence, broker = await _open(redis.url, bootstrap_of(tansu))
        await _durable_session(persistence, broker, "dev")
        await _publish(broker, "dev", [b"m-%d" % i for i in range(300)])
        await persistence.close()
        check, _ = await _open(redis.url, bootstrap_of(tansu))
        try:
            page = (await check.store.load_page("dev", 0, 1000)).records
        finally:
            await check.close()
    finally:
        stop_tansu(tansu)
    assert [r.message.payload for r in page if r.message] == [b"m-%d" % i for i in range(300)]


async def test_a_publisher_hears_failure_within_the_timeout_while_kafka_is_frozen(
    redis: RedisServer,
) -> None:
    """Records queued behind a stuck request are bounded too: no publisher waits forever."""
    tansu = start_tansu()
    try:
        persistence, broker = await _open(
            redis.url, bootstrap_of(tansu), kafka_request_timeout_ms=1000
        )
        await _durable_session(persistence, broker, "dev")
        session = broker.sessions["dev"]
        os.kill(tansu.pid, signal.SIGSTOP)
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            answers: list[tuple[bool, float]] = []
            for i in range(50):
                message = Message("devices/x", b"%d" % i, 1, False)
                broker.dispatch(
                    [(session, Delivery(message, 1, False))],
                    lambda ok: answers.append((ok, loop.time() - started)),
                )
                await asyncio.sleep(0.01)
            while len(answers) < 50 and loop.time() - started < 10:
                await asyncio.sleep(0.05)
        finally:
            os.kill(tansu.pid, signal.SIGCONT)
        assert len(answers) == 50, "every publisher got an answer"
        assert not any(ok for ok, _ in answers), "no success while Kafka was frozen"
        # Measured here: ~1.55 s with the bound, ~3.0 s without it (aiokafka's own
        # expiry of queued batches). The bound: timeout + submit spread + slack.
        assert max(t for _, t in answers) < 1.0 + 0.5 + 0.8
        await persistence.close()
    finally:
        stop_tansu(tansu)
