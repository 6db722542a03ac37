"""persistence/coalescing.py: one write in flight, asks coalesced, what is left retried."""

from __future__ import annotations

import asyncio

import pytest

from persistence.coalescing import CoalescingWriter, Retry


def newer_wins(older: dict[str, int], newer: dict[str, int]) -> dict[str, int]:
    return {**older, **newer}


class Recorder:
    """A write that waits for the test's go and answers what the test says is left."""

    def __init__(self) -> None:
        self.batches: list[dict[str, int]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.go = asyncio.Event()
        self.left: list[dict[str, int]] = []
        self.fail: BaseException | None = None

    async def write(self, batch: dict[str, int]) -> dict[str, int]:
        self.batches.append(batch)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.go.wait()
            if self.fail is not None:
                raise self.fail
            return self.left.pop(0) if self.left else {}
        finally:
            self.in_flight -= 1


async def test_asks_during_a_write_go_together_into_the_next() -> None:
    rec = Recorder()
    writer = CoalescingWriter(rec.write, newer_wins, dict, Retry("t"))
    writer.add({"a": 1})
    await asyncio.sleep(0)
    writer.add({"b": 1})
    writer.add({"b": 2, "c": 1})
    rec.go.set()
    await writer.drain()
    assert rec.batches == [{"a": 1}, {"b": 2, "c": 1}]
    assert rec.most_in_flight == 1
    assert writer.pending == {}


async def test_what_is_left_is_retried_after_the_delay_newer_asks_winning() -> None:
    rec = Recorder()
    rec.left = [{"a": 1, "b": 1}]
    writer = CoalescingWriter(rec.write, newer_wins, dict, Retry("t", first=0.01))
    writer.add({"a": 1, "b": 1})
    await asyncio.sleep(0)
    writer.add({"b": 2})
    rec.go.set()
    await writer.drain()
    assert rec.batches == [{"a": 1, "b": 1}, {"a": 1, "b": 2}]


async def test_an_error_reaches_drain_and_the_writer_starts_again_on_the_next_ask() -> None:
    rec = Recorder()
    rec.fail = RuntimeError("down")
    writer = CoalescingWriter(rec.write, newer_wins, dict, Retry("t"))
    writer.add({"a": 1})
    rec.go.set()
    with pytest.raises(RuntimeError):
        await writer.drain()
    rec.fail = None
    writer.add({"b": 1})
    await writer.drain()
    assert rec.batches == [{"a": 1}, {"b": 1}]


async def test_waits_grow_after_failures_in_a_row_and_start_over_after_a_success() -> None:
    retry = Retry("t", first=0.001, most=0.004)
    delays = []
    for _ in range(4):
        delays.append(retry._delay)
        await retry.wait()
    retry.succeeded()
    assert delays == [0.001, 0.002, 0.004, 0.004]
    assert retry._delay == 0.001
    assert retry.retries == 4


async def test_a_limit_drops_the_oldest_and_counts_them_given_up() -> None:
    """While a write is under way (Redis away), what waits stays bounded."""
    rec = Recorder()
    retry = Retry("t")
    writer: CoalescingWriter[list[int]] = CoalescingWriter(
        rec.write,  # type: ignore[arg-type]
        lambda older, newer: older + newer,
        list,
        retry,
        limit=3,
        trim=lambda batch, n: batch[-n:],
    )
    writer.add([1])
    await asyncio.sleep(0)
    for item in range(2, 7):
        writer.add([item])
    assert writer.pending == [4, 5, 6]
    assert retry.given_up == 2
    rec.go.set()
    await writer.drain()
    assert rec.batches == [[1], [4, 5, 6]]
