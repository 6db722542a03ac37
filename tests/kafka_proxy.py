"""A Kafka-protocol proxy for tests: it can run a step of the test's own just
before it passes a chosen answer on, so a race in a client's sequence of
requests happens at the one moment the test needs, every time.

Kafka frames are a 4-byte big-endian size and the payload; a request starts
with its API key (int16), version (int16) and correlation id (int32), an answer
with the correlation id. Start the Kafka advertising the proxy's port
(``start_tansu(advertise=...)``) so clients use it after their bootstrap too.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable

HOST = "127.0.0.1"
DELETE_TOPICS = 20  # API key

Before = Callable[[int], Awaitable[None]]  # api key of the answer about to be passed on


class KafkaProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.before_answer: Before | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, port: int) -> None:
        self._server = await asyncio.start_server(self._connection, HOST, port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _connection(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            kafka_r, kafka_w = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        asked: dict[int, int] = {}  # correlation id -> api key
        up = asyncio.ensure_future(self._requests(client_r, kafka_w, asked))
        try:
            await self._answers(kafka_r, client_w, asked)
        finally:
            up.cancel()
            for writer in (client_w, kafka_w):
                with contextlib.suppress(Exception):
                    writer.close()
            self._tasks.discard(task)

    @staticmethod
    async def _frame(reader: asyncio.StreamReader) -> bytes | None:
        try:
            head = await reader.readexactly(4)
            return head + await reader.readexactly(struct.unpack(">i", head)[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    async def _requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, asked: dict[int, int]
    ) -> None:
        while (frame := await self._frame(reader)) is not None:
            api_key, _version, correlation = struct.unpack(">hhi", frame[4:12])
            asked[correlation] = api_key
            writer.write(frame)
            await writer.drain()
        writer.close()

    async def _answers(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, asked: dict[int, int]
    ) -> None:
        while (frame := await self._frame(reader)) is not None:
            (correlation,) = struct.unpack(">i", frame[4:8])
            api_key = asked.pop(correlation, -1)
            if self.before_answer is not None:
                await self.before_answer(api_key)
            writer.write(frame)
            await writer.drain()
