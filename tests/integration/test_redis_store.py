"""RedisMessageStore against a real redis-server and a real 3-master Redis Cluster.

Every test taking ``store`` runs twice: ``[single]`` and ``[cluster]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import time
import uuid
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ResponseError

from persistence.format import (
    SessionState,
    Stage,
    StoredMessage,
    StoredRecord,
    SubscriptionState,
    client_keys,
    decode_record,
    encode_message,
)
from persistence.redis_store import (
    DURABLE,
    LOST,
    NOT_YET,
    Assigned,
    ClientBatch,
    LostWrites,
    RedisMessageStore,
    too_old_redis,
)
from persistence.session_store import SessionStateStore
from tests.integration.redis_servers import RedisServer
from tests.kafka_fixtures import freeze


def msg(i: int, **kw: object) -> StoredMessage:
    fields: dict[str, object] = {
        "topic": f"t/{i}",
        "payload": str(i).encode(),
        "qos": 1,
        "producer": 1,
        "seq": i + 1,
    }
    fields.update(kw)
    return StoredMessage(**fields)  # type: ignore[arg-type]


def msgs(first: int, count: int, **kw: object) -> list[StoredMessage]:
    return [msg(i, **kw) for i in range(first, first + count)]


def kept(*messages: StoredMessage) -> list[StoredMessage]:
    """The messages as the store gives them back: producer, seq and generation name a
    record only until it is stored (persistence/format.py, version 3)."""
    return [dataclasses.replace(m, producer=0, seq=0, generation=0) for m in messages]


async def all_records(store: RedisMessageStore, cid: str, page: int = 1000) -> list[StoredRecord]:
    out: list[StoredRecord] = []
    after = 0
    while True:
        recs = (await store.load_page(cid, after, page)).records
        if not recs:
            return out
        out += recs
        after = recs[-1].score


async def cmd(store: RedisMessageStore, *args: Any) -> Any:
    return await store.redis.execute_command(*args)


async def entry_ttl(store: RedisMessageStore, cid: str, packet_id: int) -> int:
    """A stored message's time left in ms, as PTTL tells a key's: -2 not stored, -1 no
    deadline of its own (in flight: it lives as long as the values hash)."""
    entry = await cmd(store, "HGET", client_keys(cid).values, packet_id)
    if entry is None:
        return -2
    (deadline,) = struct.unpack_from(">d", entry)
    if deadline == 0:
        return -1
    seconds, micros = await cmd(store, "TIME")
    return int(deadline - (int(seconds) * 1000 + int(micros) // 1000))


# --------------------------------------------------------------- pure parts


def test_encoding_round_trip_keeps_every_mqtt5_field() -> None:
    m = StoredMessage(
        topic="a/ü/b",
        payload=b"\x00\xffpayload",
        qos=2,
        retain=True,
        payload_format_indicator=1,
        content_type="application/json",
        response_topic="reply/here",
        correlation_data=b"\x01\x02",
        user_properties=(("k", "v"), ("k", "v2"), ("ä", "")),
        subscription_identifiers=(7, 268435455),
        publish_time=1700000000.25,
        expiry=1700000100.5,
        producer=7,
        seq=123456789012,
        generation=1_700_000_000_000_123,
    )
    rec = decode_record(9, 42, encode_message(m))
    assert rec.message == m
    assert (rec.packet_id, rec.score, rec.stage, rec.sent) == (9, 42, Stage.PUBLISH, False)
    assert decode_record(1, 1, encode_message(m, sent=True)).sent
    bare = StoredMessage(topic="t", payload=b"", qos=0)
    assert decode_record(1, 1, encode_message(bare)).message == bare


def test_keys_share_one_slot_and_odd_ids_stay_distinct() -> None:
    ids = ["plain", "a}b", "}starts", "", "x{y}z", "%7D", "a%7Db", "%", "ü-dev"]
    seen = set()
    for cid in ids:
        keys = client_keys(cid)
        slots = {key_slot(k.encode()) for k in (*keys, keys.message(65535))}  # old strings too
        assert len(slots) == 1, cid
        seen.add(keys.messages)
    assert len(seen) == len(ids)
    assert client_keys("dev1").messages == "{dev1}_messages"
    assert client_keys("dev1").message(7) == "{dev1}_messages_7"


# --------------------------------------------------------------- save and load


async def test_save_then_load_round_trip(store: RedisMessageStore, cid: str) -> None:
    batch = msgs(0, 5, qos=2, user_properties=(("a", "b"),), subscription_identifiers=(3,))
    res = await store.save_batch(cid, batch, partition=0)
    assert res.assigned == [Assigned(i, i) for i in range(1, 6)]
    assert (res.saved, res.duplicates, res.expired, res.trimmed) == (5, 0, 0, 0)
    recs = (await store.load_page(cid, 0, 100)).records
    assert [r.message for r in recs] == kept(*batch)
    assert [(r.packet_id, r.score, r.stage, r.sent) for r in recs] == [
        (i, i, Stage.PUBLISH, False) for i in range(1, 6)
    ]
    assert await store.pending_count(cid) == 5
    # entries carry the default TTL (7 days) as their deadline
    ttl = await entry_ttl(store, cid, 1)
    assert (7 * 86400 - 5) * 1000 < ttl <= 7 * 86400 * 1000


async def test_packet_ids_wrap_past_65535_without_gap_reuse_or_zero(
    store: RedisMessageStore, cid: str
) -> None:
    seen: list[int] = []
    scores: list[int] = []
    offset = 0
    while offset < 70_000:
        res = await store.save_batch(cid, msgs(offset, 1000), partition=0)
        ids = [a.packet_id for a in res.assigned if a]
        seen += ids
        scores += [a.score for a in res.assigned if a]
        assert res.trimmed == 0
        assert await store.ack_many(cid, ids) == len(ids)
        offset += 1000
    expected = list(range(1, 65536)) + list(range(1, 70_000 - 65535 + 1))
    assert seen == expected
    assert 0 not in seen
    assert scores == list(range(1, 70_001))
    assert await store.pending_count(cid) == 0


async def test_wrap_skips_an_id_still_stored_never_overwrites_it(
    store: RedisMessageStore, cid: str
) -> None:
    # id 1 stays unacknowledged while 65534 newer messages come and go.
    first = await store.save_batch(cid, [msg(0, topic="old")], partition=0)
    assert first.assigned == [Assigned(1, 1)]
    offset = 1
    while offset < 65535:
        n = min(2000, 65535 - offset)
        res = await store.save_batch(cid, msgs(offset, n), partition=0, limit=65535)
        await store.ack_many(cid, [a.packet_id for a in res.assigned if a])
        offset += n
    assert (await cmd(store, "GET", client_keys(cid).last_score)) == b"65535"  # id 65535
    res = await store.save_batch(cid, msgs(offset, 2), partition=0, limit=65535)
    # id 1 (score 65536) is skipped: the score moves on, the id is not reused
    assert res.assigned == [Assigned(2, 65537), Assigned(3, 65538)]
    recs = (await store.load_page(cid, 0, 10)).records
    assert [(r.packet_id, r.message.topic) for r in recs if r.message] == [
        (1, "old"),
        (2, f"t/{offset}"),
        (3, f"t/{offset + 1}"),
    ]


async def test_score_keeps_growing_after_the_set_empties(
    store: RedisMessageStore, cid: str
) -> None:
    res = await store.save_batch(cid, msgs(0, 3), partition=0)
    assert await store.ack_many(cid, [1, 2, 3]) == 3
    assert await store.pending_count(cid) == 0
    assert await cmd(store, "EXISTS", client_keys(cid).messages) == 0
    res = await store.save_batch(cid, msgs(3, 2), partition=0)
    assert res.assigned == [Assigned(4, 4), Assigned(5, 5)]
    assert not await store.ack(cid, 1)  # already gone


async def test_trim_to_limit_removes_the_oldest_and_counts_them(
    store: RedisMessageStore, cid: str
) -> None:
    res = await store.save_batch(cid, msgs(0, 8), partition=0, limit=5)
    assert res.trimmed_ids == [1, 2, 3]
    assert res.trimmed == 3
    assert res.saved == 8
    recs = (await store.load_page(cid, 0, 100)).records
    assert [r.packet_id for r in recs] == [4, 5, 6, 7, 8]
    for pid in (1, 2, 3):
        assert await entry_ttl(store, cid, pid) == -2
    # a second batch trims exactly what it needs, oldest first
    res = await store.save_batch(cid, msgs(8, 2), partition=0, limit=5)
    assert res.trimmed_ids == [4, 5]
    assert await store.pending_count(cid) == 5
    # a store-wide limit applies when none is given
    small = RedisMessageStore(store.redis, limit=3)
    res = await small.save_batch(cid, msgs(10, 1), partition=0)
    assert res.trimmed_ids == [6, 7, 8]
    assert await store.pending_count(cid) == 3


async def test_message_expiry_drops_the_ref_lazily_on_load(
    store: RedisMessageStore, cid: str
) -> None:
    now = time.time()
    batch = [msg(0), msg(1, expiry=now + 1), msg(2)]
    res = await store.save_batch(cid, batch, partition=0)
    pttl = await entry_ttl(store, cid, 2)
    assert 0 < pttl <= 1000
    await asyncio.sleep(1.2)
    assert await store.pending_count(cid) == 3  # the ref is still there
    recs = (await store.load_page(cid, 0, 2)).records  # page of 2 filled past the dropped one
    assert [r.packet_id for r in recs] == [1, 3]
    assert await store.pending_count(cid) == 2
    assert res.assigned[1] == Assigned(2, 2)


async def test_already_expired_message_is_not_stored_but_its_offset_counts(
    store: RedisMessageStore, cid: str
) -> None:
    res = await store.save_batch(cid, [msg(0, expiry=time.time() - 1), msg(1)], partition=0)
    assert res.assigned == [None, Assigned(1, 1)]
    assert (res.expired, res.saved) == (1, 1)
    again = await store.save_batch(cid, [msg(0), msg(1)], partition=0)
    assert again.duplicates == 2


async def test_pubrel_rewrite_lives_with_the_client_keys(
    store: RedisMessageStore, cid: str
) -> None:
    """Without a session (orphaned data) the PUBREL stage lives as long as the values
    hash, which expires with the client's other keys."""
    await store.save_batch(cid, [msg(0, qos=2, expiry=time.time() + 1), msg(1, qos=2)], 0)
    assert await entry_ttl(store, cid, 1) > 0
    assert await store.mark_pubrel(cid, 1)
    assert await entry_ttl(store, cid, 1) == -1
    assert 0 < await cmd(store, "PTTL", client_keys(cid).values) <= 7 * 86400 * 1000
    recs = (await store.load_page(cid, 0, 10)).records
    assert (recs[0].packet_id, recs[0].stage, recs[0].sent, recs[0].message) == (
        1,
        Stage.PUBREL,
        True,
        None,
    )
    assert recs[1].stage is Stage.PUBLISH
    # nothing to rewrite: not resurrected
    assert await store.ack(cid, 1)
    assert not await store.mark_pubrel(cid, 1)
    assert await entry_ttl(store, cid, 1) == -2


async def test_a_sent_message_and_its_pubrel_stage_outlive_the_message_expiry(
    store: RedisMessageStore, cid: str
) -> None:
    """Finding 4 of the persistent path: once sent, a message (and later its PUBREL
    stage) lives as long as the session, so PUBREL is re-sent on reconnect
    (MQTT-4.4.0-1) whatever the message's expiry; never sent, it expires."""
    await store.save_session(cid, SessionState(None, time.time()))  # connected
    expires = time.time() + 1
    await store.save_batch(cid, [msg(0, qos=2, expiry=expires), msg(1, qos=1, expiry=expires)], 0)
    assert await store.mark_sent(cid, [1]) == [1]
    assert await entry_ttl(store, cid, 1) == -1
    assert await cmd(store, "PTTL", client_keys(cid).values) == -1
    assert await store.mark_pubrel(cid, 1)
    await asyncio.sleep(1.2)
    recs = (await store.load_page(cid, 0, 10)).records
    assert [(r.packet_id, r.stage) for r in recs] == [(1, Stage.PUBREL)]  # 2 expired unsent
    # disconnected: sent messages expire with the session, not before
    await store.save_session(cid, SessionState(60, time.time()), ttl=60)
    assert await entry_ttl(store, cid, 1) == -1
    ttl = await cmd(store, "PTTL", client_keys(cid).values)
    assert 59_000 < ttl <= 60_000
    await store.expire_session(cid, 30)
    assert 29_000 < await cmd(store, "PTTL", client_keys(cid).values) <= 30_000


async def test_mark_sent_sets_dup_and_creates_nothing(store: RedisMessageStore, cid: str) -> None:
    """Marked, a message loses its own deadline and lives as long as the values hash
    (orphaned data still expires with it); a message no longer stored is not
    recreated, and its ref goes."""
    await store.save_batch(cid, [msg(0, expiry=time.time() + 60), msg(1), msg(2)], 0)
    assert 0 < await entry_ttl(store, cid, 1) <= 60_000
    assert await store.mark_sent(cid, [1, 3, 99]) == [1, 3]
    assert await entry_ttl(store, cid, 1) == -1
    assert await cmd(store, "PTTL", client_keys(cid).values) > 0
    recs = (await store.load_page(cid, 0, 10)).records
    assert [r.sent for r in recs] == [True, False, True]
    expiry = recs[0].message.expiry  # type: ignore[union-attr]
    assert [r.message for r in recs] == kept(msg(0, expiry=expiry), msg(1), msg(2))
    assert await entry_ttl(store, cid, 99) == -2
    await cmd(store, "HDEL", client_keys(cid).values, 2)  # expired, or trimmed
    assert await store.mark_sent(cid, [2]) == []
    assert await store.pending_count(cid) == 2


async def test_the_redis_is_new_enough_for_the_scripts(store: RedisMessageStore) -> None:
    """The scripts need Redis 6.2 (ZMSCORE, ZRANGE BYSCORE): a Redis (every node of
    a cluster) is asked at start; an older one is named in a clear error."""
    await store.check_version()  # this machine's Redis 7, the bundled 6.2, a cluster
    info = await store.redis_info("server")
    nodes = [info] if "redis_version" in info else list(info.values())
    assert len(nodes) == (3 if isinstance(store.redis, RedisCluster) else 1)  # every node
    assert too_old_redis({"redis_version": "7.0.15"}) is None
    assert too_old_redis({"redis_version": "6.0.16"}) == "6.0.16"
    by_node = {
        "127.0.0.1:7000": {"redis_version": "7.2.4"},
        "127.0.0.1:7001": {"redis_version": "6.0.9"},
    }
    assert too_old_redis(by_node) == "6.0.9"


async def test_a_redis_user_without_info_is_not_asked_its_version(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL user may be refused INFO (it is in @dangerous): the version is then not
    checked, a warning says so, and the broker starts as before (the review)."""
    name = f"noinfo-{uuid.uuid4().hex[:8]}"
    admin = RedisMessageStore.from_url(redis_server.url)
    await cmd(admin, "ACL", "SETUSER", name, "on", ">secret", "~*", "+@all", "-info")
    user = RedisMessageStore.from_url(redis_server.url.replace("://", f"://{name}:secret@", 1))
    try:
        with caplog.at_level("WARNING", logger="devicemq.persistence"):
            await user.check_version()
        assert "version not checked" in caplog.text
    finally:
        await cmd(admin, "ACL", "DELUSER", name)
        await user.aclose()
        await admin.aclose()


async def test_a_save_that_fails_part_way_keeps_what_it_stored_whole(
    store: RedisMessageStore, cid: str
) -> None:
    """save_batch.lua writes a client's newest entry at the end of its save (with the
    byte count, in one HSET); should the save fail after storing it (here the second
    message's duplicate check meets a key of the wrong type), the entry is written
    then: no ref without its message (the review of the tenth fleet round)."""
    keys = client_keys(cid)
    await cmd(store, "SET", keys.seen, "not-a-hash")
    with pytest.raises(ResponseError):
        await store.save_batch(cid, [msg(0, producer=0), msg(1, producer=7)], partition=0)
    records = await all_records(store, cid)
    assert [(r.packet_id, r.message) for r in records] == [(1, kept(msg(0, producer=0))[0])]


async def counted_bytes_hold(store: RedisMessageStore, cid: str) -> bool:
    """Field 'b' of the values hash is the size of the values the hash holds."""
    fields = await cmd(store, "HGETALL", client_keys(cid).values)
    held = sum(len(v) - 8 for k, v in fields.items() if k != b"b")
    return int(fields.get(b"b", 0)) == held


async def test_marks_and_acks_of_many_ids_in_one_call_keep_each_ids_rules(
    store: RedisMessageStore, cid: str
) -> None:
    """mark_sent.lua and ack.lua take the ids of a call a chunk at a time (a few
    variadic commands per 500 ids, not a few per id: BENCHMARKS.md, "The fleet,
    tenth round"). Each id still gets the rules it had one at a time: an expired
    entry goes (once, its bytes once), an id now another message's is left alone,
    an id given twice is marked twice and removed once, the byte count holds."""
    keys = client_keys(cid)
    await store.save_batch(cid, msgs(0, 1200, payload=b"p" * 40), partition=0, limit=2000)
    for expired in (7, 600):  # deadline passed (1 ms after the epoch), never sent
        entry = await cmd(store, "HGET", keys.values, expired)
        await cmd(store, "HSET", keys.values, expired, struct.pack(">d", 1) + entry[8:])
    ids = [9, 7, *range(1, 1201)]  # 9 and 7 twice in the first chunk
    scores = [5000 if i == 12 else i for i in ids]  # id 12 read with another score
    marked = await store.mark_sent(cid, ids, scores)
    assert marked == [i for i in ids if i not in (7, 600, 12)]
    assert await store.pending_count(cid) == 1198  # the two expired went
    assert await counted_bytes_hold(store, cid)
    records = {r.packet_id: r for r in await all_records(store, cid)}
    assert not records[12].sent and records[13].sent
    # Acks: id 12 with a stale score is left alone, id 9 twice is removed once.
    acked = [9] + [i for i in range(1, 1101) if i not in (7, 600)]
    acked_scores = [5000 if i == 12 else i for i in acked]
    assert await store.ack_many(cid, acked, acked_scores) == 1097
    assert sorted(r.packet_id for r in await all_records(store, cid)) == [12, *range(1101, 1201)]
    assert await counted_bytes_hold(store, cid)
    # The last refs acknowledged: nothing of the client's messages is left.
    assert await store.ack_many(cid, [12, *range(1101, 1201)]) == 101
    assert await cmd(store, "EXISTS", keys.messages, keys.values) == 0


async def test_trim_never_removes_a_sent_message(store: RedisMessageStore, cid: str) -> None:
    """Finding 1 of the persistent path: a trim that freed an in-flight message's
    packet id let a new message take it, and the client's PUBACK for the old
    one deleted the new one."""
    await store.save_batch(cid, msgs(0, 3), partition=0, limit=3)
    assert await store.mark_sent(cid, [1]) == [1]
    res = await store.save_batch(cid, msgs(3, 3), partition=0, limit=3)
    assert res.trimmed_ids == [2, 3, 4]
    assert [r.packet_id for r in await all_records(store, cid)] == [1, 5, 6]
    # every stored message in flight: the new one does not fit
    assert await store.mark_sent(cid, [5, 6]) == [5, 6]
    res = await store.save_batch(cid, msgs(6, 1), partition=0, limit=3)
    assert (res.assigned, res.unstored, res.trimmed, res.saved) == ([None], [0], 1, 0)
    assert [r.packet_id for r in await all_records(store, cid)] == [1, 5, 6]


async def test_an_id_in_flight_is_skipped_when_scores_wrap_past_it(
    store: RedisMessageStore, cid: str
) -> None:
    """With 65,535 newer messages trimmed past it, id 1 (sent, unacknowledged) is
    still taken: the score whose id would be 1 is skipped."""
    await store.save_batch(cid, msgs(0, 1, topic="old"), partition=0, limit=100)
    assert await store.mark_sent(cid, [1]) == [1]
    offset = 1
    while offset < 65_537:
        n = min(5_000, 65_537 - offset)
        await store.save_batch(cid, msgs(offset, n), partition=0, limit=100)
        offset += n
    recs = await all_records(store, cid)
    assert recs[0].packet_id == 1 and recs[0].message.topic == "old"  # type: ignore[union-attr]
    assert len({r.packet_id for r in recs}) == len(recs) == 100
    assert recs[-1].score == 65_538  # score 65_536 (id 1) was skipped


async def test_a_page_tells_the_score_counter(store: RedisMessageStore, cid: str) -> None:
    """A short page carries the counter: the reader continues from it (finding 5:
    a live message after an empty replay was taken for a gap and re-read)."""
    await store.save_batch(cid, msgs(0, 3), partition=0)
    await store.ack_many(cid, [1, 2, 3])
    page = await store.load_page(cid, 0, 10)
    assert (page.records, page.last_score) == ([], 3)


async def test_premarked_messages_are_stored_marked_sent(
    store: RedisMessageStore, cid: str
) -> None:
    """The first ``premark`` stored messages (skipping expired and replayed ones) carry DUP."""
    await store.save_batch(cid, msgs(0, 1), partition=0)
    batch = [msg(0), msg(1, expiry=time.time() - 1), msg(2), msg(3), msg(4)]
    results = await store.save_many([ClientBatch(cid, batch, 0, [0, 1, 2, 3, 4], premark=2)])
    assert (results[0].duplicates, results[0].expired, results[0].saved) == (1, 1, 3)
    recs = await all_records(store, cid)
    assert [(r.packet_id, r.sent) for r in recs] == [(1, False), (2, True), (3, True), (4, False)]
    assert [r.message for r in recs] == kept(msg(0), msg(2), msg(3), msg(4))


async def test_save_many_reloads_flushed_scripts_for_every_client(store: RedisMessageStore) -> None:
    clients = [f"dev-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    await cmd(store, "SCRIPT FLUSH")
    results = await store.save_many([ClientBatch(c, msgs(0, 2), partition=0) for c in clients])
    assert [r.saved for r in results] == [2, 2, 2]
    assert [len(await all_records(store, c)) for c in clients] == [2, 2, 2]


async def test_replayed_batch_stores_nothing_twice(store: RedisMessageStore, cid: str) -> None:
    keys = client_keys(cid)
    first = await store.save_batch(cid, msgs(100, 10), partition=3)
    assert [a.packet_id for a in first.assigned if a] == list(range(1, 11))
    again = await store.save_batch(cid, msgs(100, 10), partition=3)
    assert again.assigned == [None] * 10
    assert again.duplicates == 10
    assert await cmd(store, "GET", keys.last_score) == b"10"
    # overlapping retry: only the new tail is stored
    tail = await store.save_batch(cid, msgs(105, 10), partition=3)
    assert tail.duplicates == 5
    assert [a for a in tail.assigned if a] == [Assigned(i, i) for i in range(11, 16)]
    # another producer, and the same producer through another partition, are apart
    other = await store.save_batch(cid, msgs(0, 2, producer=2), partition=3)
    moved = await store.save_batch(cid, msgs(0, 2), partition=4)
    assert (other.saved, moved.saved) == (2, 2)
    assert await cmd(store, "HGETALL", keys.seen) == {b"1:3": b"115", b"2:3": b"2", b"1:4": b"2"}
    assert await store.pending_count(cid) == 19


async def test_a_record_produced_twice_is_stored_once(store: RedisMessageStore, cid: str) -> None:
    """Finding 6 of the persistent path: a produce request that timed out after Kafka
    appended it is sent again, and Kafka holds the record twice, at two offsets.
    The store names records by (producer, seq), not by offset."""
    batch = msgs(0, 3)
    res = await store.save_batch(cid, [*batch, batch[2]], partition=0, offsets=[0, 1, 2, 3])
    assert (res.saved, res.duplicates) == (3, 1)
    stored = [r.message.payload for r in await all_records(store, cid)]  # type: ignore[union-attr]
    assert stored == [b"0", b"1", b"2"]


async def test_a_topic_recreated_from_offset_zero_loses_nothing(
    store: RedisMessageStore, cid: str
) -> None:
    """Finding 2 of the persistent path: after the embedded Kafka restarted, the new
    log began at offset 0 again and every new record looked already stored."""
    await store.save_batch(cid, msgs(0, 50), partition=0, offsets=list(range(50)))
    after_reset = await store.save_batch(cid, msgs(50, 5), partition=0, offsets=list(range(5)))
    assert (after_reset.saved, after_reset.duplicates) == (5, 0)


async def test_order_per_client_with_many_clients_saved_concurrently(
    store: RedisMessageStore,
) -> None:
    clients = [f"dev-{uuid.uuid4().hex[:8]}-{i}" for i in range(60)]
    batches = [
        ClientBatch(c, msgs(b * 20, 20, topic=f"{c}/{b}"), partition=i % 4)
        for b in range(5)
        for i, c in enumerate(clients)
    ]
    results = await store.save_many(batches)
    assert all(r.saved == 20 for r in results)
    for c in clients:
        recs = await all_records(store, c)
        assert [r.packet_id for r in recs] == list(range(1, 101))
        assert [r.score for r in recs] == list(range(1, 101))
        assert [int(r.message.payload) for r in recs if r.message] == list(range(100))
        assert [r.message.topic for r in recs if r.message] == [
            f"{c}/{b}" for b in range(5) for _ in range(20)
        ]
    # the whole thing again: idempotent
    again = await store.save_many(batches)
    assert all(r.duplicates == 20 for r in again)


async def test_paged_load_walks_everything_in_order(store: RedisMessageStore, cid: str) -> None:
    await store.save_batch(cid, msgs(0, 250), partition=0)
    await store.ack_many(cid, range(2, 250, 7))  # holes
    pages = []
    after = 0
    while recs := (await store.load_page(cid, after, 100)).records:
        pages.append(len(recs))
        after = recs[-1].score
    remaining = [i for i in range(1, 251) if i not in set(range(2, 250, 7))]
    assert sum(pages) == len(remaining)
    assert all(p == 100 for p in pages[:-1])
    assert [r.packet_id for r in await all_records(store, cid, page=33)] == remaining
    assert (await store.load_page(cid, 250, 10)).records == []


async def test_sessions_load_in_one_pipeline_across_slots(
    store: RedisMessageStore, cid: str
) -> None:
    """load_sessions answers as load_session does for each client, in order, the
    clients' keys in many Cluster slots; a missing one is None."""
    ids = [f"{cid}-{i}" for i in range(40)]
    for i, client_id in enumerate(ids[:30]):
        state = SessionState(expiry_interval=60 + i, last_seen=1700000000.0, owner=f"o{i}")
        assert (
            await store.open_session(client_id, resume=True, generation=7 + i, state=state) is None
        )
    loaded = await store.load_sessions(ids)
    assert loaded == [await store.load_session(client_id) for client_id in ids]
    assert [s.expiry_interval if s else None for s in loaded] == [60 + i for i in range(30)] + [
        None
    ] * 10
    assert [s.generation for s in loaded if s] == [7 + i for i in range(30)]
    assert await store.load_sessions([]) == []


async def test_session_save_load_delete(store: RedisMessageStore, cid: str) -> None:
    keys = client_keys(cid)
    state = SessionState(
        expiry_interval=3600,
        last_seen=1700000000.5,
        subscriptions={
            "a/+": SubscriptionState(1),
            "b/#": SubscriptionState(2, True, True, 2, 17),
        },
        protocol_level=5,
        owner="alice",
    )
    assert await store.load_session(cid) is None
    assert await store.open_session(cid, resume=True, generation=1000, state=state) is None
    assert state.generation == 1000  # nothing stored: a new session, its generation given
    assert await store.load_session(cid) == state
    assert await cmd(store, "TTL", keys.session) == -1
    await store.save_batch(cid, msgs(0, 5, generation=1000), partition=0)
    assert await store.end_session(cid, 1000) == 5
    assert await store.load_session(cid) is None
    for key in (keys.messages, keys.values, keys.seen, keys.session):
        assert await cmd(store, "EXISTS", key) == 0
    assert await cmd(store, "TTL", keys.last_score) > 0  # kept with the tombstone
    # a tombstone generation stays (with a TTL): a record of the ended session still in
    # Kafka is dropped, never stored into the next session (finding 3)
    assert await cmd(store, "GET", keys.generation) == b"1001"
    assert await cmd(store, "TTL", keys.generation) > 0
    late = await store.save_batch(cid, msgs(5, 1, generation=1000), partition=0)
    assert (late.saved, late.discarded) == (0, [0])
    # a new session takes a higher generation; its ids and scores go on
    new = SessionState(expiry_interval=60, last_seen=time.time())
    assert await store.open_session(cid, resume=True, generation=5, state=new) is None
    assert new.generation == 1002
    res = await store.save_batch(cid, msgs(6, 1, generation=1002), partition=0)
    assert res.assigned == [Assigned(6, 6)]
    # the old session's broker can neither overwrite nor end the new one
    assert not await store.save_session(cid, state)
    assert await store.end_session(cid, 1000) is None
    assert await store.pending_count(cid) == 1
    # a resume finds it, generation and all
    resumed = await store.open_session(cid, resume=True, generation=9, state=SessionState(1, 0))
    assert resumed == new
    # a clean start replaces it: its messages go
    fresh = SessionState(expiry_interval=60, last_seen=time.time())
    assert await store.open_session(cid, resume=False, generation=9, state=fresh) is None
    assert fresh.generation == 1003
    assert await store.pending_count(cid) == 0


async def test_an_end_by_expiry_keeps_a_session_resumed_since(
    store: RedisMessageStore, cid: str
) -> None:
    """Finding 40 across replicas: replica a holds the client's detached session and
    its expiry runs while the client resumes on replica b (b reads the session from
    Redis). a's end, counted from an earlier resume, must not delete what b resumed;
    an end by expiry that saw the latest resume, or any other end, still does."""
    state = SessionState(expiry_interval=2, last_seen=time.time())
    assert await store.open_session(cid, resume=True, generation=1000, state=state) is None
    await store.save_batch(cid, msgs(0, 3, generation=1000), partition=0)
    on_a = await store.open_session(cid, resume=True, generation=1, state=SessionState(2, 0))
    assert on_a is not None and on_a.opens == 1
    on_b = await store.open_session(cid, resume=True, generation=1, state=SessionState(3, 0))
    assert on_b is not None and on_b.opens == 2
    assert await store.end_session(cid, 1000, opens=on_a.opens) is None  # refused
    assert await store.pending_count(cid) == 3
    (loaded,) = await store.load_sessions([cid])
    assert loaded is not None and loaded.opens == 2  # what a restarted broker restores
    assert await store.end_session(cid, 1000, opens=on_b.opens) == 3  # b's own expiry
    assert await store.load_session(cid) is None
    # a new session counts from nothing; an unfenced end (a clean start) always ends
    fresh = SessionState(expiry_interval=60, last_seen=time.time())
    assert await store.open_session(cid, resume=True, generation=9, state=fresh) is None
    again = await store.open_session(cid, resume=True, generation=9, state=SessionState(60, 0))
    assert again is not None and again.opens == 1
    assert await store.end_session(cid, fresh.generation) == 0
    assert await store.load_session(cid) is None


async def test_what_goes_with_a_session_ended_by_expiry_waits_for_the_store(
    store: RedisMessageStore, cid: str
) -> None:
    """The session store's end (persistence/session_store.py) calls ``gone`` (the
    APPLICATION topic, group records and queue entries that go with the session,
    persistence/device_persistence.py) only once Redis ended the session: not when
    a client resumed it on another replica since, or an APPLICATION session resumed
    there would lose its topic."""
    sessions = SessionStateStore(store)
    state = SessionState(expiry_interval=2, last_seen=time.time())
    assert await store.open_session(cid, resume=True, generation=1000, state=state) is None
    seen = await store.open_session(cid, resume=True, generation=1, state=SessionState(2, 0))
    assert seen is not None
    assert await store.open_session(cid, resume=True, generation=1, state=SessionState(2, 0))
    gone: list[str] = []
    done: list[bool] = []
    sessions.end(cid, 1000, done.append, seen.opens, lambda: gone.append("stale"))
    await sessions.settled(cid)
    assert done == [True] and gone == []  # reached, and kept
    assert await store.load_session(cid) is not None
    sessions.end(cid, 1000, done.append, seen.opens + 1, lambda: gone.append("current"))
    await sessions.settled(cid)
    assert done == [True, True] and gone == ["current"]
    assert await store.load_session(cid) is None


async def test_late_progress_of_an_ended_session_takes_nothing_of_the_next(
    store: RedisMessageStore, cid: str
) -> None:
    """A sent mark and an ack of an ended session, retried after a Redis outage,
    land once the next session of the same client stored messages: they name
    (packet id, score) pairs of the old session, and the new session's scores go
    on from the old one's, so they match none of its messages (FINDINGS.md,
    finding 18). With scores starting again from 1, the ack deleted the new
    session's first message."""
    old = SessionState(expiry_interval=3600, last_seen=time.time())
    await store.open_session(cid, resume=True, generation=1, state=old)
    await store.save_batch(cid, msgs(0, 2, generation=old.generation), partition=0)
    sent = [(r.packet_id, r.score) for r in await all_records(store, cid)]
    fresh = SessionState(expiry_interval=3600, last_seen=time.time())
    assert await store.open_session(cid, resume=False, generation=2, state=fresh) is None
    await store.save_batch(cid, msgs(10, 2, generation=fresh.generation), partition=0)
    before = [(r.packet_id, r.score, r.sent) for r in await all_records(store, cid)]
    marked = await store.write_progress({cid: sent}, {}, {cid: sent})  # the late writes
    assert [(r.packet_id, r.score, r.sent) for r in await all_records(store, cid)] == before
    assert marked.get(cid, set()) == set()
    assert [score for _, score, _ in before] == [3, 4]


async def test_session_expiry_takes_every_key_and_reconnect_persists(
    store: RedisMessageStore, cid: str
) -> None:
    keys = client_keys(cid)
    state = SessionState(expiry_interval=1, last_seen=time.time())
    await store.open_session(cid, resume=True, generation=1, state=state)
    await store.save_batch(cid, msgs(0, 3, generation=state.generation), partition=0)
    assert await store.expire_session(cid, 100, state.generation)
    live = [key for key in keys if key != keys.bytes]  # the count is in keys.values now
    for key in live:
        assert 0 < await cmd(store, "TTL", key) <= 100
    # back online: everything persistent again
    await store.save_session(cid, state)
    for key in live:
        assert await cmd(store, "TTL", key) == -1
    # gone for good: the keys expire with the session
    assert await store.expire_session(cid, 1, state.generation)
    # a save while the session is expiring keeps the keys on the session's clock
    await store.save_batch(cid, msgs(3, 1, generation=state.generation), partition=0)
    assert 0 < await cmd(store, "PTTL", keys.seen) <= 1000
    await asyncio.sleep(1.2)
    for key in keys:
        assert await cmd(store, "EXISTS", key) == 0
    assert not await store.expire_session(cid, 0)


async def test_keys_of_a_client_without_a_session_expire_with_their_messages(
    store: RedisMessageStore, cid: str
) -> None:
    keys = client_keys(cid)
    await store.save_batch(cid, msgs(0, 2), partition=0)
    for key in (keys.messages, keys.values, keys.last_score, keys.seen):
        ttl = await cmd(store, "TTL", key)
        assert 7 * 86400 - 5 < ttl <= 7 * 86400


async def test_scripts_are_reloaded_after_a_script_flush(
    store: RedisMessageStore, cid: str
) -> None:
    await cmd(store, "SCRIPT FLUSH")
    res = await store.save_batch(cid, msgs(0, 2), partition=0)
    assert res.saved == 2
    await cmd(store, "SCRIPT FLUSH")
    assert len((await store.load_page(cid)).records) == 2


async def test_save_many_reports_failures_and_is_safe_to_retry(
    store: RedisMessageStore, cid: str
) -> None:
    from persistence.redis_store import BatchSaveError

    good = ClientBatch(cid, msgs(0, 3), partition=0)
    bad = ClientBatch(cid + "-bad", [b"\x09 not a stored message"], partition=0)
    with pytest.raises(BatchSaveError) as info:
        await store.save_many([good, bad])
    assert info.value.results[0].saved == 3  # type: ignore[union-attr]
    assert isinstance(info.value.results[1], ValueError)
    retry = await store.save_many([good])
    assert retry[0].duplicates == 3


async def test_a_lost_score_counter_never_sends_scores_backwards(
    store: RedisMessageStore, cid: str
) -> None:
    await store.save_batch(cid, msgs(0, 3), partition=0)
    await cmd(store, "DEL", client_keys(cid).last_score)
    res = await store.save_batch(cid, msgs(3, 1), partition=0)
    assert res.assigned == [Assigned(4, 4)]


async def test_progress_of_many_clients_in_one_pipelined_write(
    store: RedisMessageStore, cid: str
) -> None:
    """Sent marks, PUBREL stages and acks of several clients land in one round trip."""
    clients = [f"{cid}-{n}" for n in range(5)]
    for client in clients:
        await store.save_batch(client, msgs(0, 4, qos=2), 0, [0, 1, 2, 3])
    await store.write_progress(
        marks={c: [(1, 1), (2, 2), (3, 3)] for c in clients},  # (packet id, score)
        pubrels={c: [2] for c in clients},
        acks={c: [(1, 1)] for c in clients},
    )
    for client in clients:
        records = await all_records(store, client)
        assert [(r.packet_id, r.stage, r.sent) for r in records] == [
            (2, Stage.PUBREL, True),
            (3, Stage.PUBLISH, True),
            (4, Stage.PUBLISH, False),
        ]
    # Idempotent: writing the same progress again changes nothing.
    await store.write_progress(
        {clients[0]: [(1, 1), (2, 2), (3, 3)]}, {clients[0]: [2]}, {clients[0]: [(1, 1)]}
    )
    assert len(await all_records(store, clients[0])) == 3


async def test_a_packet_id_now_another_messages_is_not_marked_for_the_old_one(
    store: RedisMessageStore, cid: str
) -> None:
    """Found by the model checker (seed 755, under load): a message trimmed while
    the delivery side still held it in memory freed its packet id, and a newer
    message took it. The old message's send then marked the newer one sent, the
    client's PUBACK deleted it, and the newer message was never delivered. A mark
    carries the score its message was read with; an id whose ref has another
    score now is left out (not sent) and the message holding it is left alone."""
    await store.save_batch(cid, msgs(0, 2), 0, [0, 1])
    records = await all_records(store, cid)
    first = records[0]
    assert await store.mark_sent(cid, [first.packet_id], [first.score + 100]) == []
    after = await all_records(store, cid)
    assert [(r.packet_id, r.score, r.sent) for r in after] == [
        (r.packet_id, r.score, False) for r in records
    ]
    # Nor is it acknowledged (or dropped as undeliverable) for the old one.
    assert await store.ack_many(cid, [first.packet_id], [first.score + 100]) == 0
    assert len(await all_records(store, cid)) == 2
    assert await store.mark_sent(cid, [first.packet_id], [first.score]) == [first.packet_id]
    assert await store.ack_many(cid, [first.packet_id], [first.score]) == 1


async def test_bytes_per_client_are_limited_like_messages(
    store: RedisMessageStore, cid: str
) -> None:
    """Issue 19, finding 6: only the message count bounded a client's backlog, so ten
    1 MB messages per slot grew Redis without bound. Over max_bytes the oldest never
    sent go; a message over the limit on its own is not stored; acks give bytes back."""
    keys = client_keys(cid)
    small = RedisMessageStore(store.redis, max_bytes=3000)
    big = [msg(i, payload=b"x" * 900) for i in range(5)]  # ~950 bytes stored each
    res = await small.save_batch(cid, big, partition=0)
    assert res.trimmed_ids == [1, 2]
    assert [r.packet_id for r in await all_records(small, cid)] == [3, 4, 5]
    size = int(await cmd(small, "HGET", keys.values, "b") or 0)
    assert 2700 < size <= 3000
    assert await small.mark_sent(cid, [3]) == [3]  # in flight: never trimmed
    res = await small.save_batch(cid, [msg(5, payload=b"y" * 900)], partition=0)
    assert res.trimmed_ids == [4]
    res = await small.save_batch(cid, [msg(6, payload=b"z" * 5000)], partition=0)
    assert (res.saved, res.unstored, res.trimmed_ids) == (0, [0], [])  # too big alone
    assert [r.packet_id for r in await all_records(small, cid)] == [3, 5, 6]
    await small.ack_many(cid, [3, 5, 6])
    assert int(await cmd(small, "HGET", keys.values, "b") or 0) == 0


async def test_redis_wait_sees_every_earlier_save_on_a_replica() -> None:
    """persistence.redis_wait: replicas. ``wait_durable`` writes a fence and WAITs on
    its own connection; saves made on other connections before it are on the
    replica once it answers DURABLE (Redis replicates in one order). With the
    replica stopped it answers NOT_YET in time (the consumer holds the commit
    back); when Redis lost acknowledged saves, LOST."""
    import os
    import signal

    from redis.asyncio import Redis as AsyncRedis

    from tests.integration.redis_servers import RedisServer, follow

    primary, replica = RedisServer(), RedisServer()
    client = AsyncRedis.from_url(primary.url)
    other = AsyncRedis.from_url(primary.url)  # the saves' connections are not the wait's
    follower = AsyncRedis.from_url(replica.url)
    try:
        await follow(follower, primary.port)
        # Time enough for a replica of a loaded machine (a DURABLE expected); the
        # frozen replica's NOT_YET is asked of a store that waits 300 ms.
        store = RedisMessageStore(client, wait="replicas", wait_replicas=1, wait_timeout_ms=10_000)
        await store.check_wait()
        saver = RedisMessageStore(other)
        for n in range(20):
            (result,) = await saver.save_many([ClientBatch(f"dev-{n}", msgs(0, 3), 0)])
            assert result.saved == 3
        assert await store.wait_durable() == DURABLE
        keys = client_keys("dev-19")
        assert await follower.zcard(keys.messages) == 3  # the last save is on the replica
        short = RedisMessageStore(client, wait="replicas", wait_replicas=1, wait_timeout_ms=300)
        freeze(replica.process.pid)
        try:
            await saver.save_many([ClientBatch("dev-20", msgs(0, 3), 0)])
            assert await short.wait_durable() == NOT_YET
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        assert (short.wait_failures, store.wait_failures) == (1, 0)
        assert await RedisMessageStore(client).wait_durable() == DURABLE  # off: no wait
        # Redis loses acknowledged writes (a restart without them): the counter the
        # saves and fences increment goes back, and the fence says so.
        await store.save_many([ClientBatch("dev-21", msgs(0, 3), 0)])
        await client.delete(*[k async for k in client.scan_iter(match="devicemq:wait-fence:*")])
        assert await store.wait_durable() == LOST
        assert store.lost_writes == 1
        assert await store.wait_durable() == DURABLE  # from the new state on
        aof = RedisMessageStore(client, wait="aof")
        version = (await client.info("server"))["redis_version"]
        if tuple(int(x) for x in str(version).split(".")[:2]) < (7, 2):
            with pytest.raises(ValueError, match="aof needs WAITAOF"):
                await aof.check_wait()
    finally:
        await client.aclose()
        await other.aclose()
        await follower.aclose()
        replica.stop()
        primary.stop()


async def test_keys_of_the_installation_through_the_store(
    store: RedisMessageStore, cid: str
) -> None:
    """The session index, producer ids, topic epochs and the backlog sum, named in
    persistence/format.py and reached only through the store."""
    await store.index_session(cid, 123.5)
    assert (cid.encode(), 123.5) in await store.indexed_sessions()
    await store.unindex_session(cid)
    assert all(entry[0] != cid.encode() for entry in await store.indexed_sessions())
    first = await store.next_producer_id()
    assert await store.next_producer_id() > first
    topic = f"t-{uuid.uuid4().hex}"
    assert await store.topic_epoch(topic, created=False) == 0
    assert await store.topic_epoch(topic, created=True) == 1
    assert await store.topic_epoch(topic, created=False) == 1
    other = f"{cid}-other"
    await store.save_batch(cid, msgs(0, 3), partition=0)
    await store.save_batch(other, msgs(0, 2), partition=0)
    assert await store.pending_total([cid, other, f"{cid}-none"], chunk=2) == 5
    await store.ping()


async def _durable_soon(store: RedisMessageStore) -> str:
    """``wait_durable`` asked again while it says NOT_YET (a replica of a loaded
    machine may take longer than one short wait), ten times at most: DURABLE once
    the replica has everything; LOST at once."""
    for _ in range(10):
        verdict = await store.wait_durable()
        if verdict != NOT_YET:
            break
    return verdict


async def test_redis_wait_tells_a_loss_from_saves_overlapping_a_fence() -> None:
    """Found in review of the counter that tells a loss: a save answered while a
    fence's WAIT blocked made that fence look lost; and saves after a loss that
    counted past the old value hid it. Neither now."""
    import os
    import signal

    from redis.asyncio import Redis as AsyncRedis

    from tests.integration.redis_servers import RedisServer, follow

    primary, replica = RedisServer(), RedisServer()
    client = AsyncRedis.from_url(primary.url)
    follower = AsyncRedis.from_url(replica.url)
    try:
        await follow(follower, primary.port)
        store = RedisMessageStore(client, wait="replicas", wait_replicas=1, wait_timeout_ms=500)
        await store.save_many([ClientBatch("dev", msgs(0, 1), 0)])
        assert await _durable_soon(store) == DURABLE
        freeze(replica.process.pid)
        try:
            fence = asyncio.create_task(store.wait_durable())  # blocks in WAIT
            await asyncio.sleep(0.1)
            await store.save_many([ClientBatch("dev", msgs(1, 1), 0)])  # answered first
            assert await fence == NOT_YET  # not LOST
        finally:
            os.kill(replica.process.pid, signal.SIGCONT)
        assert await _durable_soon(store) == DURABLE
        # A loss of every increment so far, then more saves than there were: the
        # first save sees the loss and stores nothing (a later record stored before
        # the lost ones are read again would make them look like duplicates); the
        # count goes on from where Redis is, and what follows is stored.
        saved = [k async for k in client.scan_iter(match="devicemq:wait-fence:*")]
        before = int(await client.get(saved[0]))
        await client.delete(*saved)
        with pytest.raises(LostWrites):
            await store.save_many([ClientBatch("dev-lost", msgs(0, 1), 0)])
        assert await client.zcard(client_keys("dev-lost").messages) == 0
        assert store.lost_writes == 1
        for n in range(before + 3):
            await store.save_many([ClientBatch(f"dev-{n}", msgs(0, 1), 0)])
        # The next fence says LOST once more: a commit whose wait began while the
        # consumer was still asking Kafka where to read again must not commit (review).
        assert await store.wait_durable() == LOST
        assert await store.wait_durable() == DURABLE
    finally:
        await client.aclose()
        await follower.aclose()
        replica.stop()
        primary.stop()


async def test_a_new_master_without_the_scripts_still_shows_the_loss(
    store: RedisMessageStore,
) -> None:
    """A replica promoted after a loss has neither the last writes nor the scripts
    (SCRIPT LOAD is not replicated): the first save runs nothing (NOSCRIPT) but its
    counter increment lands. Retried once the scripts are loaded, it counted past
    the loss and stored later records before the lost ones were read again
    (finding 25, seen in tests/faults/test_redis_sentinel.py). It must say lost."""
    from redis.asyncio import Redis as AsyncRedis

    if not isinstance(store.redis, AsyncRedis):
        return  # a cluster's scripts cannot see the counter: the fence alone tells
    counting = RedisMessageStore(store.redis, wait="replicas", wait_timeout_ms=10)
    await counting.load_scripts()
    await counting.save_many([ClientBatch("dev-a", msgs(0, 1), 0)])
    key, floor = counting.loss_guard()  # type: ignore[misc]
    assert floor == 1
    await store.redis.delete(key)
    await store.redis.execute_command("SCRIPT", "FLUSH")
    with pytest.raises(LostWrites):
        await counting.save_many([ClientBatch("dev-b", msgs(0, 1), 0)])
    assert await store.redis.zcard(client_keys("dev-b").messages) == 0
    assert await counting.wait_durable() == LOST  # and the next fence too, once
    (result,) = await counting.save_many([ClientBatch("dev-b", msgs(0, 1), 0)])
    assert result.saved == 1


async def _script_calls(store: RedisMessageStore) -> int:
    """EVALSHA calls Redis has run so far (every primary's, on a cluster)."""
    from redis.asyncio import Redis

    if isinstance(store.redis, Redis):
        stats = [await store.redis.info("commandstats")]
    else:
        assert isinstance(store.redis, RedisCluster)
        by_node = await store.redis.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        stats = list(by_node.values())
    return sum(int(s.get("cmdstat_evalsha", {}).get("calls", 0)) for s in stats)


async def test_save_many_costs_one_script_call_per_redis_or_slot(
    store: RedisMessageStore, cid: str
) -> None:
    """The fleet shape: a poll holds one message for each of many clients. Their saves
    share script calls, CALL_CLIENTS at most in one, on a cluster one per hash slot
    (a script sees one slot), not one per client (BENCHMARKS.md, "The fleet shape")."""
    from redis.asyncio import Redis

    from persistence.redis_store import CALL_CLIENTS

    clients = [f"{cid}-{n}" for n in range(CALL_CLIENTS + 44)]
    await store.save_many([ClientBatch(clients[0], msgs(0, 1), partition=0)])  # scripts loaded
    before = await _script_calls(store)
    results = await store.save_many([ClientBatch(c, msgs(0, 1), partition=0) for c in clients])
    calls = await _script_calls(store) - before
    assert [r.saved for r in results[1:]] == [1] * (len(clients) - 1)
    assert results[0].duplicates == 1
    slots = {key_slot(client_keys(c).messages.encode()) for c in clients}
    # A call holds CALL_CLIENTS at most (Redis is not held long by one).
    assert calls == (2 if isinstance(store.redis, Redis) else len(slots))
    assert [len(await all_records(store, c)) for c in clients] == [1] * len(clients)


async def test_one_clients_failure_in_a_shared_save_call_fails_it_alone(
    store: RedisMessageStore, cid: str
) -> None:
    """Saved together, clients still fail apart: a client whose keys Redis refuses
    (here its seen hash is a string: WRONGTYPE) gets its error, the others are stored,
    and the retry of the whole poll stores nothing twice."""
    from persistence.redis_store import BatchSaveError

    a, b, c = f"{cid}-a", f"{cid}-b", f"{cid}-c"
    await cmd(store, "SET", client_keys(b).seen, "not a hash")
    batches = [ClientBatch(x, msgs(0, 2), partition=0) for x in (a, b, c)]
    with pytest.raises(BatchSaveError) as info:
        await store.save_many(batches)
    first, failed, third = info.value.results
    assert isinstance(failed, ResponseError) and "WRONGTYPE" in str(failed)
    assert (first.saved, third.saved) == (2, 2)  # type: ignore[union-attr]
    await cmd(store, "DEL", client_keys(b).seen)
    retry = await store.save_many(batches)
    assert [(r.saved, r.duplicates) for r in retry] == [(0, 2), (2, 0), (0, 2)]


async def test_progress_of_many_clients_costs_a_mark_and_an_ack_call_per_redis_or_slot(
    store: RedisMessageStore, cid: str
) -> None:
    """The fleet shape's delivery side: marks and acks of many clients, one message
    each, are one mark_sent.lua and one ack.lua call on a single Redis (one of each
    per hash slot on a cluster), not two per client."""
    from redis.asyncio import Redis

    clients = [f"{cid}-{n}" for n in range(100)]
    saved = await store.save_many([ClientBatch(c, msgs(0, 2), partition=0) for c in clients])
    first = {c: (r.assigned[0], r.assigned[1]) for c, r in zip(clients, saved, strict=True)}
    before = await _script_calls(store)
    marked = await store.write_progress(
        {c: [(a.packet_id, a.score)] for c, (a, _b) in first.items() if a},
        {},
        {c: [(b.packet_id, b.score)] for c, (_a, b) in first.items() if b},
    )
    calls = await _script_calls(store) - before
    slots = {key_slot(client_keys(c).messages.encode()) for c in clients}
    assert calls == (2 if isinstance(store.redis, Redis) else 2 * len(slots))
    assert marked == {c: {(a.packet_id, a.score)} for c, (a, _b) in first.items() if a}
    for c in clients:
        (left,) = await all_records(store, c)
        assert left.score == first[c][0].score and left.sent  # type: ignore[union-attr]


# --------------------------------------------------------------- the layout before


def old_last_packet_id(cid: str) -> str:
    return client_keys(cid).messages.removesuffix("_messages") + "_last_packet_id"


def old_bytes(cid: str) -> str:
    return client_keys(cid).messages.removesuffix("_messages") + "_bytes"


async def write_old_layout(store: RedisMessageStore, cid: str) -> list[bytes]:
    """What a7dfed5's scripts left for a connected client: a string per message
    ({cid}_messages_<id>: 1 sent, 2 in its PUBREL stage, both without a TTL; 3 and
    5 never sent, with their TTL; 4 expired, its string gone, its ref left),
    {cid}_last_packet_id, and the rest as now."""
    keys = client_keys(cid)
    await store.save_session(cid, SessionState(None, time.time()))
    values = [encode_message(msg(i), sent=(i == 0)) for i in range(5)]
    await cmd(store, "SET", keys.message(1), values[0])
    await cmd(store, "SET", keys.message(2), b"\x02\x03")
    await cmd(store, "SET", keys.message(3), values[2], "PX", 60_000)
    await cmd(store, "SET", keys.message(5), values[4], "PX", 120_000)
    for pid in range(1, 6):
        await cmd(store, "ZADD", keys.messages, pid, pid)
    await cmd(store, "SET", old_last_packet_id(cid), 5)
    await cmd(store, "SET", old_bytes(cid), len(values[0]) + 2 + len(values[2]) + len(values[4]))
    await cmd(store, "SET", keys.last_score, 5)
    return values


@pytest.mark.parametrize("first", ["load", "ack", "mark", "save", "purge", "end", "pubrel"])
async def test_messages_stored_by_the_layout_before_are_delivered(
    store: RedisMessageStore, cid: str, first: str
) -> None:
    """Data written by a7dfed5 (a string per message) is read after the upgrade,
    whichever operation touches the client first: it is moved into the values hash
    with its state (sent, PUBREL stage, time left) and the old keys go."""
    keys = client_keys(cid)
    values = await write_old_layout(store, cid)
    if first == "ack":
        assert await store.ack_many(cid, [3], [3]) == 1
    elif first == "mark":
        assert await store.mark_sent(cid, [3, 4], [3, 4]) == [3]
    elif first == "save":
        res = await store.save_batch(cid, [msg(9, seq=99)], partition=0)
        assert res.assigned == [Assigned(6, 6)]  # ids and scores go on
    elif first == "purge":
        assert await store.purge(cid) == [(3, 3), (5, 5)]  # the sent and PUBREL stay
    elif first == "end":
        assert await store.end_session(cid) == 5
        assert await cmd(store, "EXISTS", keys.messages, keys.values, keys.message(1)) == 0
        return
    elif first == "pubrel":
        assert await store.mark_pubrel(cid, 5)
    records = await all_records(store, cid)
    for pid in range(1, 6):
        assert await cmd(store, "EXISTS", keys.message(pid)) == 0  # moved, or expired
    assert await cmd(store, "EXISTS", old_last_packet_id(cid), old_bytes(cid)) == 0
    if first == "load":  # the byte count moved into the values hash
        count = len(values[0]) + 2 + len(values[2]) + len(values[4])
        assert int(await cmd(store, "HGET", keys.values, "b")) == count
    got = [(r.packet_id, r.stage, r.sent) for r in records]
    expected = {
        "load": [(1, Stage.PUBLISH, True), (2, Stage.PUBREL, True), (3, Stage.PUBLISH, False),
                 (5, Stage.PUBLISH, False)],
        "ack": [(1, Stage.PUBLISH, True), (2, Stage.PUBREL, True), (5, Stage.PUBLISH, False)],
        "mark": [(1, Stage.PUBLISH, True), (2, Stage.PUBREL, True), (3, Stage.PUBLISH, True),
                 (5, Stage.PUBLISH, False)],
        "save": [(1, Stage.PUBLISH, True), (2, Stage.PUBREL, True), (3, Stage.PUBLISH, False),
                 (5, Stage.PUBLISH, False), (6, Stage.PUBLISH, False)],
        "purge": [(1, Stage.PUBLISH, True), (2, Stage.PUBREL, True)],
        "pubrel": [(1, Stage.PUBLISH, True), (2, Stage.PUBREL, True), (3, Stage.PUBLISH, False),
                   (5, Stage.PUBREL, True)],
    }[first]  # fmt: skip
    assert got == expected
    by_id = {r.packet_id: r for r in records}
    assert by_id[1].message == decode_record(1, 1, values[0]).message
    if 3 in by_id and not by_id[3].sent:
        assert by_id[3].message == msg(2)  # stored by a7dfed5: its ids kept
        assert 55_000 < await entry_ttl(store, cid, 3) <= 60_000  # its time left kept
    assert await entry_ttl(store, cid, 1) == -1  # sent: lives with the session
    assert await store.pending_count(cid) == len(expected)


async def test_the_stores_connections_pack_with_hiredis(store: RedisMessageStore, cid: str) -> None:
    """persistence/redis_packing.py: a save wave's call is packed by hiredis, on every
    node of a cluster too, and Redis reads what it packed."""
    from redis.asyncio import Redis

    from persistence.redis_packing import _HiredisPacking

    payloads = [b"\x00\xff%d" % i * 40 for i in range(3)]
    batch = [msg(i, payload=p) for i, p in enumerate(payloads)]
    await store.save_many([ClientBatch(cid, batch, 0)])
    records = await all_records(store, cid)
    assert [r.message.payload for r in records if r.message] == payloads
    if isinstance(store.redis, Redis):
        used = [store.redis.connection_pool.connection_class]
    else:
        used = [node.connection_class for node in store.redis.get_nodes()]
    assert used and all(issubclass(cls, _HiredisPacking) for cls in used), used
