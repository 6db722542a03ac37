"""When a resumed durable session may give identifiers to its side feeds again
($ECQ queues, group queues: broker/outflow.py ``_take`` waits while the feed
says ``replaying``; persistence/store_feed.py).

The client may hold every message sent before, unacknowledged: those come
first in score order, each under its stored identifier. Until the pages read
show where they end, an identifier given to a side message could be one the
client still holds (tests/model/FINDINGS.md, finding 44: the model checker
found a queue entry under the identifier the client held for the first message
of the second page).
"""

from __future__ import annotations

import asyncio
import time

from broker.stats import BrokerStats
from persistence.format import Stage, StoredMessage, StoredRecord
from persistence.redis_store import Page
from persistence.store_feed import StoreFeed, StoreWriter


def _record(packet_id: int, sent: bool, stage: Stage = Stage.PUBLISH) -> StoredRecord:
    message = StoredMessage("t", b"m%d" % packet_id, 1, publish_time=time.time())
    return StoredRecord(packet_id, packet_id, stage, sent, message)


class Store:
    """Pages of a fixed backlog, as load_page.lua reads them (after a score)."""

    def __init__(self, records: list[StoredRecord]) -> None:
        self.records = records

    async def load_page(self, client_id: str, after_score: int = 0, limit: int = 100) -> Page:
        page = [r for r in self.records if r.score > after_score][:limit]
        return Page(page, self.records[-1].score if self.records else 0)


async def _replaying_after_each_page(records: list[StoredRecord], page_size: int) -> list[bool]:
    """``replaying`` after each page is read. Real classes around the feed, no fakes of
    them: the compiled StoreFeed checks its arguments' types (broker/compiled.py)."""
    store = Store(records)
    feed = StoreFeed("c", store, StoreWriter(store), page_size, BrokerStats(), time.monotonic)
    feed.restart()
    seen = []
    for _ in range(len(records) // page_size + 1):
        feed.take(100)  # hands over the page read before; the buffer empty: reads the next
        while feed._loading:
            await asyncio.sleep(0)
        seen.append(feed.replaying)
    return seen


def test_side_feeds_wait_while_the_pages_hold_only_what_was_sent_before() -> None:
    """Eight sent, pages of three: replaying through the first two pages (all sent)."""
    records = [_record(i, sent=i <= 8) for i in range(1, 11)]
    assert asyncio.run(_replaying_after_each_page(records, 3)) == [True, True, False, False]


def test_a_pubrel_stage_counts_as_held() -> None:
    records = [_record(1, sent=True), _record(2, sent=False, stage=Stage.PUBREL), _record(3, True)]
    records += [_record(4, sent=False)]
    assert asyncio.run(_replaying_after_each_page(records, 3)) == [True, False]


def test_a_short_page_ends_the_replay() -> None:
    records = [_record(i, sent=True) for i in range(1, 3)]
    assert asyncio.run(_replaying_after_each_page(records, 3)) == [False]
