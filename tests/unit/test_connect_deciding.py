"""A detached session's deadlines wait for a CONNECT of its client that is still being
decided (broker/core.py, ``Broker.connect_began``; tests/model/FINDINGS.md, finding 40).

The client came back before its session's expiry (or its will delay) passed, but its
CONNECT waited: for the persistent path to read the session back (a replica reopens a
detached copy from the store), for the session save of an earlier CONNECT, or for
its client ID's claim. The deadline fired meanwhile: the session was ended in the
store while the CONNECT resumed it, so another replica (or this one after a restart)
found no session. Here the store and the claims are held by hand, as a paused Redis
holds them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from broker.config import ClusterSettings, Settings
from broker.ownership import ClaimDone, MemoryOwners
from broker.packets import ConnAck, Connect, Properties, ReasonCode, Will
from broker.persistent_path import (
    DoneCallback,
    InMemoryPersistentPath,
    OpenedCallback,
    OpenedSession,
    OpenRequest,
)
from broker.session import Session
from tests.unit.core_harness import V5, Client, Harness, payloads
from tests.unit.test_ownership import PASSWORD, harness


class HeldStore(InMemoryPersistentPath):
    """Sessions kept by client id; opens and saves can be held back."""

    def __init__(self) -> None:
        self.stored: set[str] = set()
        self.hold_opens = False
        self.hold_saves = False
        self.held: list[Callable[[], None]] = []
        self.ends: list[tuple[str, bool, int]] = []  # (client id, by expiry, its opens)
        self.opens = 0  # resumes counted, as open_session.lua counts them

    def open(self, client_id: str, request: OpenRequest, done: OpenedCallback) -> None:
        def answer() -> None:
            resumed = client_id in self.stored and not request.clean_start
            self.opens = self.opens + 1 if resumed else 0
            done(OpenedSession(1, resumed, [], (), request.owner, opens=self.opens))

        if self.hold_opens:
            self.held.append(answer)
        else:
            answer()

    def save_session(self, session: Session, on_saved: DoneCallback = lambda ok: None) -> None:
        def saved() -> None:
            self.stored.add(session.client_id)
            on_saved(True)

        if self.hold_saves:
            self.held.append(saved)
        else:
            saved()

    def session_ended(
        self, session: Session, on_ended: DoneCallback | None = None, expired: bool = False
    ) -> None:
        self.ends.append((session.client_id, expired, session.opens))
        self.stored.discard(session.client_id)
        if on_ended is not None:
            on_ended(True)

    def release(self) -> None:
        self.hold_opens = self.hold_saves = False
        held, self.held = self.held, []
        for then in held:
            then()


def _connect(client: Client, client_id: str, expiry: int, **connect: object) -> None:
    client.send(
        Connect(
            client_id,
            protocol_level=V5,
            clean_start=False,
            keep_alive=0,
            properties=Properties(session_expiry_interval=expiry),
            **connect,  # type: ignore[arg-type]
        )
    )


def _connack(client: Client) -> ConnAck:
    packets = client.read()
    assert packets and isinstance(packets[0], ConnAck), packets
    return packets[0]


def test_a_replica_reopening_a_detached_copy_from_the_store_does_not_let_it_expire() -> None:
    """Finding 40 (seed 11403): the replica reopened the client's detached copy from
    the store (the copy may be stale); the copy's expiry fired while the store was
    paused and ended the session there; the client got session present 1 here, and
    the other replica, reading the store, found none."""
    store = HeldStore()
    settings = Settings(cluster=ClusterSettings(enabled=True, node_id="b"))
    h = Harness(settings, persistent_path=store)
    first = h.client(peer="dev")
    _connect(first, "dev", expiry=2)
    assert _connack(first).reason_code == 0
    first.conn.connection_lost()  # detached: expires in 2 s
    store.hold_opens = store.hold_saves = True  # Redis paused
    again = h.client(peer="dev")
    _connect(again, "dev", expiry=3)
    again.expect_nothing()  # reading the session back from the store
    h.advance(2.5)  # past the detached copy's expiry
    assert store.stored == {"dev"}  # not ended in the store
    store.release()
    connack = _connack(again)
    assert connack.reason_code == 0 and connack.session_present
    assert store.stored == {"dev"}
    assert h.broker.sessions["dev"].connection is again.conn
    h.advance(10)  # nothing left to fire
    assert h.broker.sessions["dev"].connection is again.conn and store.stored == {"dev"}


def test_a_connect_queued_behind_the_previous_connections_save_keeps_the_session() -> None:
    """CONNECTs of one client id are opened one at a time: the second waited behind
    the first's session save while the first's client left and its expiry passed."""
    store = HeldStore()
    h = Harness(persistent_path=store)
    first = h.client(peer="dev")
    _connect(first, "dev", expiry=2)
    assert _connack(first).reason_code == 0
    first.conn.connection_lost()
    store.hold_saves = True
    second = h.client(peer="dev")
    _connect(second, "dev", expiry=2)  # its save waits
    second.conn.connection_lost()  # and it leaves: detached, expires in 2 s
    third = h.client(peer="dev")
    _connect(third, "dev", expiry=60)  # queued behind the second's save
    third.expect_nothing()
    h.advance(3)
    assert "dev" in h.broker.sessions and store.stored == {"dev"}
    store.release()
    connack = _connack(third)
    assert connack.reason_code == 0 and connack.session_present
    h.advance(10)
    assert h.broker.sessions["dev"].connection is third.conn and store.stored == {"dev"}


class HeldClaims(MemoryOwners):
    """Claims answered when released, as a paused Redis answers them."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock)
        self.hold = False
        self.held: list[Callable[[], None]] = []

    def claim(
        self,
        kind: str,
        name: str,
        owner: str | None,
        ttl: float,
        done: ClaimDone,
        most: int | None = None,
    ) -> None:
        def answer() -> None:
            super(HeldClaims, self).claim(kind, name, owner, ttl, done, most)

        if self.hold:
            self.held.append(answer)
        else:
            answer()

    def release(self) -> None:
        self.hold = False
        held, self.held = self.held, []
        for answer in held:
            answer()


def _will_delayed(seconds: int) -> Will:
    return Will("wills/dev", b"gone", properties=Properties(will_delay_interval=seconds))


def _device_gone(tmp_path: Path, expiry: int) -> tuple[Harness, HeldClaims, Client]:
    """alice's device "dev" connected with a will delayed 1 s and left; claims held
    by hand (auth.client_id_owner first); a watcher of the wills."""
    h = harness(tmp_path, client_id_owner="first")
    claims = HeldClaims(h.clock)
    h.broker.owners = claims
    watcher = h.connected("watcher")
    watcher.subscribe("wills/#")
    device = h.client(peer="dev")
    _connect(device, "dev", expiry, username="alice", password=PASSWORD, will=_will_delayed(1))
    assert _connack(device).reason_code == 0
    device.conn.connection_lost()
    return h, claims, watcher


def test_a_connect_waiting_for_its_client_ids_claim_keeps_the_session_and_the_will(
    tmp_path: Path,
) -> None:
    """auth.client_id_owner first: the claim is asked of Redis before the session is
    opened. The client is back before its will delay and its expiry passed: neither
    fires while the claim waits (MQTT-3.1.3-9: no will)."""
    h, claims, watcher = _device_gone(tmp_path, expiry=2)  # the will in 1 s, the end in 2 s
    claims.hold = True
    again = h.client(peer="dev")
    _connect(again, "dev", 60, username="alice", password=PASSWORD)
    h.advance(3)
    assert watcher.read() == []
    assert "dev" in h.broker.sessions
    claims.release()
    connack = _connack(again)
    assert connack.reason_code == 0 and connack.session_present
    h.advance(10)
    assert watcher.read() == []


def test_the_deadlines_apply_once_the_clients_waiting_connect_is_gone(tmp_path: Path) -> None:
    """The wait lasts as long as the client's CONNECT is decided, no longer: once its
    socket closes the deadlines fire at the next look, and a stranger's CONNECT
    (another user naming the client ID, to be refused) holds nothing back."""
    h, claims, watcher = _device_gone(tmp_path, expiry=2)
    claims.hold = True
    stranger = h.client(peer="bob")
    _connect(stranger, "dev", 60, username="bob", password=PASSWORD)
    gone = h.client(peer="dev")
    _connect(gone, "dev", 60, username="alice", password=PASSWORD)
    h.advance(3)
    assert watcher.read() == [] and "dev" in h.broker.sessions
    gone.conn.connection_lost()  # never answered; bob's CONNECT still waits
    h.advance(0.5)
    assert payloads(watcher.read()) == [b"gone"]
    assert "dev" not in h.broker.sessions
    claims.release()
    assert _connack(stranger).reason_code == ReasonCode.NOT_AUTHORIZED
    assert not h.broker._deciding  # nothing kept for the CONNECTs that ended


def test_a_strangers_connect_alone_holds_back_no_deadline(tmp_path: Path) -> None:
    """Without the check, any user naming the client ID (or a stream of them) kept
    another user's session from expiring and its will from being sent."""
    h, claims, watcher = _device_gone(tmp_path, expiry=2)
    claims.hold = True
    for _ in range(3):
        _connect(h.client(peer="bob"), "dev", 60, username="bob", password=PASSWORD)
    h.advance(1.5)
    assert payloads(watcher.read()) == [b"gone"]
    h.advance(1)
    assert "dev" not in h.broker.sessions


def test_a_connect_that_began_after_the_deadline_holds_it_back_no_longer(
    tmp_path: Path,
) -> None:
    """MQTT-3.1.3-9 cancels the will of a client back before its delay passed: one
    back after it (its CONNECT begun once the delay had passed, before the tick looked)
    gets its will sent; the session, not yet expired, is still resumed."""
    h, claims, watcher = _device_gone(tmp_path, expiry=10)
    h.advance(0.9)
    h.clock.now += 0.3  # the delay passed; the tick has not looked yet
    claims.hold = True
    late = h.client(peer="dev")
    _connect(late, "dev", 60, username="alice", password=PASSWORD)
    h.advance(0.1)
    assert payloads(watcher.read()) == [b"gone"]
    claims.release()
    connack = _connack(late)
    assert connack.reason_code == 0 and connack.session_present


def test_a_connect_that_times_out_while_decided_is_forgotten() -> None:
    """The connect timeout bounds the wait: the connection closes, and the detached
    session's deadline applies."""
    store = HeldStore()
    settings = Settings(cluster=ClusterSettings(enabled=True, node_id="b"))
    h = Harness(settings, persistent_path=store)
    first = h.client(peer="dev")
    _connect(first, "dev", expiry=2)
    assert _connack(first).reason_code == 0
    first.conn.connection_lost()
    store.hold_opens = True
    again = h.client(peer="dev")
    _connect(again, "dev", expiry=3)
    timeout = settings.mqtt.connect_timeout
    h.advance(timeout + 1)
    assert again.closed
    h.advance(1)
    assert "dev" not in h.broker.sessions and store.stored == set()
    store.release()  # the open answers late: nobody waits for it
    assert "dev" not in h.broker.sessions or h.broker.sessions["dev"].connection is None


def _resumed_then_left(expiry: int) -> tuple[HeldStore, Harness]:
    """Replica b: "dev" made durable, left, resumed from the store with ``expiry``
    (its first resume), and left again."""
    store = HeldStore()
    settings = Settings(cluster=ClusterSettings(enabled=True, node_id="b"))
    h = Harness(settings, persistent_path=store)
    first = h.client(peer="dev")
    _connect(first, "dev", expiry=60)
    assert _connack(first).reason_code == 0
    first.conn.connection_lost()
    again = h.client(peer="dev")
    _connect(again, "dev", expiry=expiry)
    assert _connack(again).session_present
    again.conn.connection_lost()
    return store, h


def test_an_end_by_expiry_carries_the_resumes_it_saw_and_a_clean_start_none() -> None:
    """The store refuses an end by expiry counted from an older resume than its own
    (RedisMessageStore.end_session; another replica resumed the session meanwhile):
    the tick's end says it is one, with the count this replica saw; a clean start's end
    is not fenced."""
    store, h = _resumed_then_left(expiry=2)  # reopened from the store: its first resume
    h.advance(3)
    assert store.ends == [("dev", True, 1)]
    clean = h.client(peer="dev")
    _connect(clean, "dev", expiry=60)
    assert _connack(clean).reason_code == 0
    fresh = h.client(peer="dev")
    fresh.send(Connect("dev", protocol_level=V5, clean_start=True, keep_alive=0))
    assert _connack(fresh).reason_code == 0
    assert store.ends[1:] == [("dev", False, 0)]


def test_a_session_resumed_with_expiry_0_ends_at_its_disconnect_fenced_by_its_count() -> None:
    """Finding 42: a durable session resumed on replica b with expiry 0 ends when that
    connection closes; the client had already resumed it on replica a, which answered
    session present first, and b's end then deleted it from Redis: the next resume
    said present 0 within the session's expiry. The end by an expiry of 0 is now one
    by expiry, with the count of resumes b saw: the store refuses it when a resume
    came since (RedisMessageStore.end_session), as the tick's end."""
    store, _ = _resumed_then_left(expiry=0)  # the client moved on to replica a
    assert store.ends == [("dev", True, 1)]
