"""devicemq on a Redis that Sentinel keeps available: a master, a replica, one
Sentinel (persistence.redis_sentinels, issue 18).

The master is killed (SIGKILL) while publishers are acknowledged and the
consumer stores: the Sentinel promotes the replica, the broker's clients find
it through the Sentinel, and an offline persistent session gets every message
its publisher had acknowledged. ``persistence.redis_wait: replicas`` is what
makes that hold (docs/backends.md "Redis Sentinel"): Kafka offsets are committed only for
saves a replica has, so what the dead master alone held is read from Kafka
again and stored on the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.packets import ConnAck, Properties, PubAck, Publish, SubAck, Subscribe, Subscription
from persistence.format import client_keys
from tests.e2e.clients import Raw
from tests.faults.conftest import HOST, DeviceMQ, RedisProcess
from tests.faults.sentinel import MASTER_NAME, Found, ReplicaRedis, SentinelProcess, cut_off

Stack = tuple[RedisProcess, ReplicaRedis, SentinelProcess]


@contextlib.contextmanager
def _running_stack(directory: Path) -> Iterator[Stack]:
    master = RedisProcess(directory / "master")
    master.start()
    replica = ReplicaRedis(directory / "replica", master)
    sentinel = SentinelProcess(directory / "sentinel", master)
    try:
        replica.start()
        sentinel.start()
        yield master, replica, sentinel
    finally:
        sentinel.stop()
        replica.stop()
        master.stop()


@pytest.fixture
def sentinel_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of the test's own: for the tests that kill or freeze one of its parts."""
    with _running_stack(tmp_path) as stack:
        yield stack


@pytest.fixture(scope="module")
def _module_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with _running_stack(tmp_path_factory.mktemp("sentinel")) as stack:
        yield stack


@pytest.fixture
def shared_sentinel_stack(_module_stack: Stack) -> Stack:
    """The module's stack (~5 s to start, a sync and a Sentinel's first look), for
    the tests that harm none of its parts; each uses keys, topics and a consumer
    group of its own. The test fails if a part died or the master changed."""
    master, replica, sentinel = _module_stack
    assert master.alive() and replica.alive(), "a part of the module's stack died"
    assert sentinel.master_port() == master.port, "the module's master is not the master"
    return _module_stack


def _broker(tmp_path: Path, sentinel: SentinelProcess, kafka: str, **more: object) -> DeviceMQ:
    tag = tmp_path.name[-8:]
    settings: dict[str, object] = {
        "persistence.topic": f"sentinel.{tag}",
        "persistence.consumer_group": f"sentinel-{tag}",
        "persistence.partitions": 2,
        "persistence.redis_sentinels": f"{HOST}:{sentinel.port}",
        "persistence.redis_sentinel_master": MASTER_NAME,
        "persistence.redis_wait": "replicas",
        "log.level": "INFO",
        **more,
    }
    return DeviceMQ(tmp_path / "broker", Found(tmp_path / "unused"), kafka, settings)


EXPIRY = Properties(session_expiry_interval=600)


def _offline_subscriber(broker: DeviceMQ, client_id: str, topic: str) -> None:
    sub = Raw(broker)
    assert isinstance(sub.connect(client_id, clean_start=True, properties=EXPIRY), ConnAck)
    sub.send(Subscribe(1, [Subscription(topic, 1)]))
    assert isinstance(sub.recv(), SubAck)
    sub.close()


def _publish(pub: Raw, topic: str, payloads: list[bytes], first_id: int) -> None:
    """QoS 1, all in flight at once, then every PUBACK read: acknowledged."""
    for i, payload in enumerate(payloads):
        pub.send(Publish(topic, payload, 1, packet_id=first_id + i))
    for _ in payloads:
        ack = pub.recv(timeout=30)
        assert isinstance(ack, PubAck) and ack.reason_code == 0, ack


def _receive_all(
    broker: DeviceMQ, client_id: str, want: set[bytes], patience: float = 60
) -> set[bytes]:
    """What the resumed session gets, until it has ``want`` or ``patience`` passed."""
    sub = Raw(broker)
    connack = sub.connect(client_id, clean_start=False, properties=EXPIRY)
    assert isinstance(connack, ConnAck) and connack.session_present
    got: set[bytes] = set()
    deadline = time.monotonic() + patience
    while not want <= got and time.monotonic() < deadline:
        packet = sub.recv_or_none(timeout=5)
        if isinstance(packet, Publish):
            got.add(packet.payload)
            if packet.packet_id:
                sub.send(PubAck(packet.packet_id))
    sub.close()
    return got


def test_a_message_goes_through_the_master_the_sentinel_names(
    tmp_path: Path, shared_sentinel_stack: Stack, kafka: tuple[str, int | None]
) -> None:
    master, _, sentinel = shared_sentinel_stack
    broker = _broker(tmp_path, sentinel, kafka[0])
    broker.start()
    try:
        _offline_subscriber(broker, "sen-sub", "sen/t")
        pub = Raw(broker)
        pub.connect("sen-pub")
        _publish(pub, "sen/t", [b"via sentinel"], 1)
        pub.close()
        assert _receive_all(broker, "sen-sub", {b"via sentinel"}) == {b"via sentinel"}
        # It was stored on the master the Sentinel named.
        with redis.Redis(host=HOST, port=master.port) as direct:
            assert any(b"sen-sub" in key for key in direct.scan_iter())
    finally:
        broker.stop()


def test_the_master_dies_under_load_and_nothing_acknowledged_is_lost(
    tmp_path: Path, sentinel_stack, kafka: tuple[str, int | None]
) -> None:
    master, replica, sentinel = sentinel_stack
    broker = _broker(tmp_path, sentinel, kafka[0])
    broker.start()
    try:
        _offline_subscriber(broker, "fo-sub", "fo/t")
        pub = Raw(broker)
        pub.connect("fo-pub")
        acknowledged: list[bytes] = []
        for batch in range(12):
            payloads = [b"%d-%d" % (batch, i) for i in range(50)]
            _publish(pub, "fo/t", payloads, 1 + (batch * 50) % 60_000)
            acknowledged += payloads
            if batch == 4:
                # Killed while the consumer still stores the batches just acknowledged.
                master.stop(sig=9)
        deadline = time.monotonic() + 30
        while sentinel.master_port() != replica.port:
            assert time.monotonic() < deadline, "the sentinel did not promote the replica"
            time.sleep(0.1)
        for batch in range(12, 16):  # and after the failover
            payloads = [b"%d-%d" % (batch, i) for i in range(50)]
            _publish(pub, "fo/t", payloads, 1 + (batch * 50) % 60_000)
            acknowledged += payloads
        pub.close()
        got = _receive_all(broker, "fo-sub", set(acknowledged))
        missing = set(acknowledged) - got
        assert not missing, f"{len(missing)} acknowledged messages lost: {sorted(missing)[:5]}"
        assert broker.alive()
    finally:
        broker.stop()


def _stored(port: int, client_id: str) -> int:
    """Messages stored for ``client_id`` on the Redis at ``port``."""
    key = client_keys(client_id).messages
    with redis.Redis(host=HOST, port=port, socket_timeout=2) as direct:
        kind = direct.type(key)
        if kind == b"zset":
            return int(direct.zcard(key))
        if kind == b"hash":
            return int(direct.hlen(key))
        return 0


def _wait_committed_to_the_end(bootstrap: str, tmp_path: Path) -> None:
    """Until the broker's group (see ``_broker``) has committed all of its topic."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    tag = tmp_path.name[-8:]
    topic, group = f"sentinel.{tag}", f"sentinel-{tag}"

    async def wait() -> None:
        reader = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
        )
        await reader.start()
        try:
            partitions = [TopicPartition(topic, p) for p in range(2)]
            deadline = time.monotonic() + 30
            while True:
                ends = await reader.end_offsets(partitions)
                behind = [tp for tp in partitions if (await reader.committed(tp) or 0) < ends[tp]]
                if not behind:
                    return
                assert time.monotonic() < deadline, f"never committed: {behind}"
                await asyncio.sleep(0.05)
        finally:
            await reader.stop()

    asyncio.run(wait())


@pytest.mark.parametrize("wait", ["replicas", "off"])
def test_saves_only_the_dead_master_had_are_stored_again_with_redis_wait(
    tmp_path: Path, sentinel_stack, kafka: tuple[str, int | None], wait: str
) -> None:
    """The fault made on purpose: the replica is frozen
    and cut off while a batch is stored, so the master alone has it when it dies,
    and the replica that takes over lacks it.
    With ``redis_wait: replicas`` those Kafka offsets were never committed and the
    lost saves are seen (the store's fence): the batch is read again and stored on
    the new master. With ``off`` the batch is gone: the hazard the setting is for."""
    master, replica, sentinel = sentinel_stack
    broker = _broker(tmp_path, sentinel, kafka[0], **{"persistence.redis_wait": wait})
    broker.start()
    try:
        _offline_subscriber(broker, "lag-sub", "lag/t")
        pub = Raw(broker)
        pub.connect("lag-pub")
        before = [b"before-%d" % i for i in range(20)]
        _publish(pub, "lag/t", before, 1)
        deadline = time.monotonic() + 30
        while _stored(replica.port, "lag-sub") < len(before):
            assert time.monotonic() < deadline, "the replica never had the first batch"
            time.sleep(0.05)
        assert replica.proc is not None
        cut_off(replica)
        try:
            only_master = [b"only-master-%d" % i for i in range(20)]
            _publish(pub, "lag/t", only_master, 101)
            deadline = time.monotonic() + 30
            while _stored(master.port, "lag-sub") < len(before) + len(only_master):
                assert time.monotonic() < deadline, "the master never stored the batch"
                time.sleep(0.05)
            if wait == "off":
                # Without the wait the offsets commit at once, but "at once" is a task
                # of its own: had the master died before it ran, the batch would be read
                # again from Kafka and the fault would not happen.
                _wait_committed_to_the_end(kafka[0], tmp_path)
            master.stop(sig=9)
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while sentinel.master_port() != replica.port:
            assert time.monotonic() < deadline, "the sentinel did not promote the replica"
            time.sleep(0.1)
        after = [b"after-%d" % i for i in range(20)]
        _publish(pub, "lag/t", after, 201)
        pub.close()
        acknowledged = set(before + only_master + after)
        got = _receive_all(broker, "lag-sub", acknowledged, patience=60 if wait != "off" else 15)
        if wait == "replicas":
            assert got == acknowledged, f"lost: {sorted(acknowledged - got)[:5]}"
        else:
            assert acknowledged - got == set(only_master), "the fault did not happen"
    finally:
        broker.stop()


def test_the_pipeline_reads_the_stored_messages_from_the_master_the_sentinel_names(
    tmp_path: Path, shared_sentinel_stack: Stack
) -> None:
    """The audit's Redis reads (pipeline/audit.py ``stored_refs``, run by Spark's
    workers) find the master through the Sentinel too; no Spark needed to drive it."""
    from broker.config import PersistenceSettings
    from persistence.redis_security import connect_options, sentinels
    from pipeline.audit import stored_refs
    from pipeline.common import Endpoints

    master, _, sentinel = shared_sentinel_stack
    with redis.Redis(host=HOST, port=master.port) as direct:
        direct.zadd(client_keys("pipe-sub").messages, {"7": 3})
        direct.set(client_keys("pipe-sub").message(7), b"x")
    config = PersistenceSettings(
        redis_sentinels=f"{HOST}:{sentinel.port}", redis_sentinel_master=MASTER_NAME
    )
    url = "redis:///0"
    endpoints = Endpoints("unused:1", url, False, redis_connect=connect_options(config, url),
                          redis_sentinels=sentinels(config, url))  # fmt: skip
    assert list(stored_refs(endpoints, [("pipe-sub",)])) == [("pipe-sub", 3, 7, True)]


def test_a_master_name_the_sentinels_do_not_know_is_named_in_one_line_at_start(
    tmp_path: Path, shared_sentinel_stack: Stack, kafka: tuple[str, int | None]
) -> None:
    _, _, sentinel = shared_sentinel_stack
    broker = _broker(tmp_path, sentinel, kafka[0], **{"persistence.redis_sentinel_master": "nope"})
    with pytest.raises(RuntimeError):
        broker.start()
    lines = [line for line in broker.log().splitlines() if line.strip()]
    assert "persistence.redis_sentinel_master" in lines[-1], lines[-1]
    assert "'nope'" in lines[-1] and "ConnectionPool" not in lines[-1], lines[-1]
