"""An APPLICATION session's owner number (persistence/application_feed.py, _LOAD_LUA)
against a real redis-server: a connection whose load was cut short by a restart of its
reader is not taken for an older one.

Seen once under CI's load (tests/faults/test_application_kafka_restart.py): a client
reconnecting after a Kafka restart got DISCONNECT 0x8E. A reader stopped while its load
script was in flight (a restart of the feed: a reconnect, a reset) had its INCR run in
Redis but its answer dropped, so the feed kept the number before it; its next progress
write was refused as an older owner's, and the feed disconnected its own client. Here
Redis is stopped (SIGSTOP) while the load is in flight and the feed restarted before it
answers: the INCR runs once Redis goes on, after the reader that sent it is gone."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from broker.config import ApplicationSettings
from broker.packets import ReasonCode
from persistence.application_feed import (
    DONE,
    AppKeys,
    ApplicationFeed,
    ApplicationSessions,
    app_keys,
)
from tests.integration.redis_servers import RedisServer


class Connection:
    def __init__(self) -> None:
        self.reasons: list[ReasonCode] = []

    def disconnect(self, reason: ReasonCode) -> None:
        self.reasons.append(reason)


class Outflow:
    """What the feed uses of its session's outflow: a client connected."""

    def __init__(self) -> None:
        self.connection = Connection()
        self.inflight: dict[int, object] = {}

    def pump(self) -> None:
        pass

    def resume(self) -> None:
        pass


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of this test's own: it is stopped (SIGSTOP) for a moment."""
    server = RedisServer()
    try:
        yield server
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@dataclass
class CutLoad:
    redis: aioredis.Redis
    apps: ApplicationSessions
    feed: ApplicationFeed
    outflow: Outflow
    keys: AppKeys


@pytest.fixture
async def cut_load(server: RedisServer) -> AsyncIterator[CutLoad]:
    """A connected client's feed, loaded once (owner 1); then Redis is stopped and the
    feed restarts: its new load script is sent and not answered."""
    redis = aioredis.Redis.from_url(server.url)
    # No Kafka: the reader's consumer fails and retries; the owner is Redis's alone.
    apps = ApplicationSessions(
        ApplicationSettings(client_ids=("^app-",)), redis, None, "127.0.0.1:1"
    )
    keys = app_keys("app-1")
    await redis.set(keys.generation, b"1")
    feed = ApplicationFeed("app-1", apps)
    outflow = Outflow()
    feed.outflow = outflow  # type: ignore[assignment]
    try:
        feed.restart()  # the client connects: its reader loads the session
        await wait_for(lambda: feed.owner == 1, 5, "the first load")
        os.kill(server.process.pid, signal.SIGSTOP)
        feed.restart()  # its load script is sent; Redis does not answer
        await wait_for(lambda: bool(feed._loads), 5, "the load sent")
        await asyncio.sleep(0.05)  # on its connection's socket (either way the INCR runs)
        yield CutLoad(redis, apps, feed, outflow, keys)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        feed.discard()
        await redis.aclose()


async def test_a_load_cut_short_by_a_restart_still_makes_the_feed_the_owner(
    server: RedisServer, cut_load: CutLoad
) -> None:
    feed, outflow = cut_load.feed, cut_load.outflow
    landed: list[bool] = []
    feed._asked.set("0:0", DONE)  # progress asked meanwhile (an acknowledgement)
    feed._asked.callbacks.append(lambda: landed.append(True))
    feed.restart()  # the reader in its load is stopped; a new one starts
    os.kill(server.process.pid, signal.SIGCONT)
    await wait_for(lambda: bool(landed or outflow.connection.reasons), 5, "the write")
    assert outflow.connection.reasons == []  # on the code before: [0x8E]
    assert landed == [True] and cut_load.apps.fenced == 0
    # the cut load's INCR, then the new one
    await wait_for_value(cut_load.redis, cut_load.keys.owner, b"3")
    await wait_for(lambda: feed.owner == 3, 5, "the feed owning the session")


async def test_a_reset_after_a_load_cut_short_is_not_refused(
    server: RedisServer, cut_load: CutLoad
) -> None:
    """The same cut load, then no new reader: the log went back, so the feed pauses and
    resets the progress with its owner number. The cut load's INCR ran: the reset must
    carry that number, or it is refused and the feed disconnects its own client."""
    feed, outflow, apps = cut_load.feed, cut_load.outflow, cut_load.apps
    apps.log_went_back(feed, 0)  # pauses the feed (its reader stops), then resets
    await asyncio.sleep(0.05)
    os.kill(server.process.pid, signal.SIGCONT)
    reread_or_refused = lambda: feed._reader is not None or bool(outflow.connection.reasons)  # noqa: E731
    await wait_for(reread_or_refused, 5, "the reset's outcome")
    assert outflow.connection.reasons == []  # on the code before: [0x8E]
    assert apps.fenced == 0 and apps.log_resets == 1
    await wait_for(lambda: feed.owner == 3, 5, "the reread's load")


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"no {what} within {timeout} s"
        await asyncio.sleep(0.01)


async def wait_for_value(redis: aioredis.Redis, key: str, value: bytes) -> None:
    for _ in range(500):
        if await redis.get(key) == value:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{key} is {await redis.get(key)!r}, not {value!r}")
