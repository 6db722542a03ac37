"""One owner's stores together (issue 45, the last bullet): ``auth.max_bytes_per_owner``
as the sans-IO core applies a tally's answer (broker/budget.py), and
``ecq.max_queues_per_owner`` on the claims kept in memory (broker/ownership.py).
The tally itself reads Redis: tests/integration/test_owner_tally.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from broker.auth import hash_password, write_password_file
from broker.budget import OwnerBudget, Usage, could_pass
from broker.config import AuthSettings, EcqSettings, Settings
from broker.group_queue import GroupTarget
from broker.message import Delivery
from broker.ownership import QUEUE, Claim, MemoryOwners
from broker.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Properties,
    PubAck,
    Publish,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
)
from broker.persistent_path import DoneCallback, InMemoryPersistentPath
from broker.session import Session
from tests.unit.core_harness import V5, V311, Client, FakeClock, Harness

PASSWORD = b"pw"
MIB = 1024 * 1024
LIMITS = (64 * MIB, 64 * MIB, 64 * MIB)  # sessions, queues, groups: each store's own


# -- the pure rules ---------------------------------------------------------------------


def test_only_owners_whose_stores_could_pass_the_budget_are_read() -> None:
    gib = 1024 * MIB
    assert not could_pass(gib, (1, 0, 0), LIMITS)  # a device of its own: never read
    assert not could_pass(gib, (10, 4, 2), LIMITS)  # 16 x 64 MiB is the budget, not over
    assert could_pass(gib, (10, 4, 3), LIMITS)
    assert could_pass(gib, (0, 17, 0), LIMITS)
    assert could_pass(gib, (10_000, 0, 0), LIMITS)  # a fleet under one name
    assert could_pass(gib, (1, 0, 0), (0, 64 * MIB, 64 * MIB))  # a store without a limit
    assert not could_pass(gib, (0, 0, 0), (0, 0, 0))  # holding nothing


def test_a_tally_settles_who_is_over_and_logs_each_change_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budget = OwnerBudget(100)
    assert not budget.over  # empty: the routing pays one truth test
    caplog.set_level(logging.INFO, "devicemq.budget")
    usage = {"eve": Usage(60, 30, 20, 3, 1, 1), "bob": Usage(100, 0, 0, 5, 0, 0)}
    budget.settle(usage, {"eve": {"q-1"}, "bob": {"q-2"}})
    assert budget.over == {"eve"} and budget.over_queues == {"q-1"}
    budget.settle(usage, {"eve": {"q-1"}})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'eve' holds 110 bytes" in lines[0]
    assert "auth.max_bytes_per_owner (100)" in lines[0]
    budget.settle({"eve": Usage(10)}, {"eve": {"q-1"}})  # a later tally finds it under
    assert not budget.over and not budget.over_queues
    assert "under auth.max_bytes_per_owner again" in caplog.records[-1].getMessage()
    assert OwnerBudget(0).limit == 0  # no budget: settle never marks anyone
    off = OwnerBudget(0)
    off.settle(usage, {})
    assert not off.over


def test_memory_claims_count_an_owners_queues() -> None:
    owners = MemoryOwners(FakeClock())
    answers: list[Claim | None] = []
    for queue in ("q-1", "q-2", "q-3"):
        owners.claim(QUEUE, queue, "eve", 0, answers.append, most=2)
    owners.claim(QUEUE, "q-1", "eve", 0, answers.append, most=0)  # hers: no new one
    owners.claim(QUEUE, "q-3", "bob", 0, answers.append, most=2)  # another owner
    assert answers == [
        Claim(True),
        Claim(True),
        Claim(False, quota=True),
        Claim(True),
        Claim(True),
    ]
    assert asyncio.run(owners.queues_of("eve")) == {"q-1", "q-2"}
    asyncio.run(owners.assign(QUEUE, "q-1", "bob", 0))  # an admin moves one
    assert asyncio.run(owners.queues_of("eve")) == {"q-2"}
    assert asyncio.run(owners.queues_of("bob")) == {"q-1", "q-3"}


# -- through the core ---------------------------------------------------------------------


class StorePath(InMemoryPersistentPath):
    """Keeps queues and groups (delivering none) and notes what it was handed to
    store: the routing's answer."""

    keeps_queues = True  # type: ignore[assignment]
    keeps_groups = True  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.stored: list[str] = []  # client ids / group stores

    def submit(
        self,
        deliveries: Sequence[tuple[Session | GroupTarget, Delivery]],
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> None:
        self.stored += [target.client_id for target, _ in deliveries]
        on_accepted(True)

    def enqueue(
        self,
        queue: str,
        delivery: Delivery,
        on_accepted: DoneCallback,
        on_settled: DoneCallback | None = None,
    ) -> bool:
        self.stored.append(f"$ECQ:{queue}")
        on_accepted(True)
        return True


def harness(tmp_path: Path, **ecq: Any) -> tuple[Harness, StorePath]:
    passwd = tmp_path / "passwd"
    write_password_file(passwd, dict.fromkeys(("eve", "bob"), hash_password(PASSWORD)))
    settings = dataclasses.replace(
        Settings(),
        auth=AuthSettings(password_file=str(passwd), client_id_owner="off"),
        ecq=EcqSettings(**ecq),
    )
    path = StorePath()
    return Harness(settings, persistent_path=path), path


def connect(
    h: Harness, cid: str, user: str, *, expiry: int = 600, level: int = V5, resume: bool = False
) -> tuple[Client, int]:
    client = h.client(level, peer=cid)
    properties = Properties(session_expiry_interval=expiry) if level == V5 else None
    client.send(
        Connect(
            cid,
            protocol_level=level,
            clean_start=not resume and (level == V5 or expiry == 0),
            username=user,
            password=PASSWORD,
            keep_alive=0,
            properties=properties,
        )
    )
    connack = client.read()[0]
    assert isinstance(connack, ConnAck)
    return client, connack.reason_code


def suback(client: Client, topic_filter: str) -> int:
    client.send(Subscribe(client.next_id(), [Subscription(topic_filter, 1)]))
    (answer,) = client.read()
    assert isinstance(answer, SubAck)
    return answer.reason_codes[0]


def over(h: Harness, *owners: str, queues: Sequence[str] = ()) -> None:
    """A tally found ``owners`` over the budget (holding ``queues``)."""
    h.broker.budget.settle(
        {owner: Usage(h.broker.budget.limit + 1) for owner in owners},
        {owners[0]: set(queues)} if owners else {},
    )


def test_an_owner_over_budget_gets_no_new_store_and_nothing_more_stored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "devicemq")
    h, path = harness(tmp_path)
    held, code = connect(h, "eve-1", "eve")  # before: her session, a member of a group
    assert code == 0
    assert suback(held, "data/#") == 1
    assert suback(held, "$queue/g-eve/data/#") == 1
    assert suback(held, "$queue/g-both/data/#") == 1
    assert suback(held, "$ECQ/eve-1/#") == 1  # her queue, claimed
    bob, _ = connect(h, "bob-1", "bob")
    assert suback(bob, "data/#") == 1
    assert suback(bob, "$queue/g-both/data/#") == 1
    over(h, "eve", queues=["eve-1"])
    budget = h.broker.budget
    # a new persistent session: 0x97, 3.1.1 return code 3; an in-memory one is no store
    assert connect(h, "eve-2", "eve")[1] == ReasonCode.QUOTA_EXCEEDED
    assert connect(h, "eve-3", "eve", level=V311)[1] == ConnectReturnCode.SERVER_UNAVAILABLE
    assert connect(h, "eve-4", "eve", expiry=0)[1] == 0
    assert h.broker.stats.connections_rejected == {"max_bytes_per_owner": 2}
    # her session resumes (never refused), her memberships and queue stay hers
    held.conn.connection_lost()
    held, code = connect(h, "eve-1", "eve", resume=True)
    assert code == 0
    assert suback(held, "$queue/g-eve/data/#") == 1
    assert suback(held, "$queue/g-new/data/#") == ReasonCode.QUOTA_EXCEEDED
    assert suback(held, "$ECQ/eve-1/#") == 1
    four, _ = connect(h, "eve-4", "eve", expiry=0)  # a queue she does not hold yet
    assert suback(four, "$ECQ/eve-4/#") == ReasonCode.QUOTA_EXCEEDED
    # messages: not stored for her session, nor for a group only she is a member of
    sender, _ = connect(h, "bob-2", "bob", expiry=0)
    sender.send(Publish("data/1", b"x", qos=1, packet_id=1))
    (ack,) = sender.read()
    assert isinstance(ack, PubAck) and ack.reason_code == 0
    assert sorted(path.stored) == ["$queue/g-both/data/#", "bob-1"]
    assert h.broker.stats.dropped["owner_budget"] == 2
    logged = caplog.text
    assert "not stored for session eve-1: its owner is over auth.max_bytes_per_owner" in logged
    assert "not stored for group $queue/g-eve/data/#" in logged
    assert "may not join '$queue/g-new/data/#': auth.max_bytes_per_owner reached" in logged
    # a write to her queue: 0x97, as a full queue
    sender.send(Publish("$ECQ/w/eve-1/k", b"x", qos=1, packet_id=2))
    (ack,) = sender.read()
    assert isinstance(ack, PubAck) and ack.reason_code == ReasonCode.QUOTA_EXCEEDED
    assert budget.refusals == {
        ("session", "max_bytes_per_owner"): 3,  # two CONNECTs, one message
        ("group", "max_bytes_per_owner"): 2,  # one membership, one message
        ("queue", "max_bytes_per_owner"): 2,  # one claim, one write
    }
    # bob is not touched; and once a tally finds eve under, all is as before
    assert connect(h, "bob-3", "bob")[1] == 0
    over(h)
    assert connect(h, "eve-2", "eve")[1] == 0
    path.stored.clear()
    sender.send(Publish("data/1", b"x", qos=1, packet_id=3))
    sender.read()
    assert sorted(path.stored) == ["$queue/g-both/data/#", "$queue/g-eve/data/#", "bob-1", "eve-1"]


def test_one_queue_over_max_queues_per_owner_is_refused(tmp_path: Path) -> None:
    h, _ = harness(tmp_path, max_queues_per_owner=2)
    codes = []
    for i in range(3):
        device, _ = connect(h, f"eve-{i}", "eve", expiry=0)
        codes.append(suback(device, f"$ECQ/eve-{i}/#"))
        device.conn.connection_lost()
    assert codes == [1, 1, ReasonCode.QUOTA_EXCEEDED]
    again, _ = connect(h, "eve-0", "eve", expiry=0, level=V311)
    assert suback(again, "$ECQ/eve-0/#") == 1  # one she holds
    third, _ = connect(h, "eve-2", "eve", expiry=0, level=V311)
    assert suback(third, "$ECQ/eve-2/#") == 0x80  # 3.1.1 knows only Failure
    bob, _ = connect(h, "bob-0", "bob", expiry=0)
    assert suback(bob, "$ECQ/bob-0/#") == 1  # another owner's count
    assert h.broker.budget.refusals == {("queue", "max_queues_per_owner"): 2}


# -- the admin API (app/admin.py), in process ---------------------------------------------


def test_an_operator_sees_what_one_owner_holds(tmp_path: Path) -> None:
    import orjson

    from app.admin import AdminApi
    from app.http import Request

    h, _ = harness(tmp_path)
    device, _ = connect(h, "eve-1", "eve")
    assert suback(device, "$queue/g/data/#") == 1
    assert suback(device, "$ECQ/eve-1/#") == 1
    h.broker.budget.settle({"eve": Usage(2**31, 5, 6, 1, 1, 1)}, {"eve": {"eve-1"}})
    api = AdminApi(h.broker.settings, h.broker, "node-1", token="t")

    async def get(path: str) -> Any:
        request = Request("GET", "/api/v1/" + path, {}, {"authorization": "Bearer t"}, b"", "")
        response = await api.handle(request)
        assert response.status == 200
        return orjson.loads(response.body)

    eve = asyncio.run(get("owners/eve"))
    assert eve["sessions"] == 1 and eve["queues"] == ["eve-1"]
    assert eve["group_queues"] == ["$queue/g/data/#"]
    assert eve["over_budget"] and eve["measured"]["bytes"] == 2**31 + 11
    assert eve["max_bytes_per_owner"] == 2**30
    bob = asyncio.run(get("owners/bob"))
    assert bob["sessions"] == 0 and bob["measured"] is None and not bob["over_budget"]
