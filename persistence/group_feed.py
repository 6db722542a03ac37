"""Delivering durable group queues ($queue, broker/group_queue.py) to their members.

A group queue is a queue store named by its filter (persistence/queue_store.py:
the persistence consumer saves each message once for the group, with the
next sequence number). A member's :class:`GroupFeed` is a side feed of its
outflow (broker/outflow.py): it *claims* entries in sequence order, as many
as the member's window takes, under a token of its own
(persistence/lua/group_claim.lua), so no other member is given them while
the claim holds. An acknowledgement from any member removes an entry. A
member that leaves (its connection closes, it unsubscribes, its session
ends) gives its claims back, those it had sent or got with DUP marked so
that the next member gets them with DUP too, and the other members are told
to claim again. A member that may not take an entry (larger than its Maximum
Packet Size, or its ACL keeps it from the topic) gives that one back and
skips it after.

What the member had in flight when it left, its resumed session re-sends
all the same under the same packet identifiers (MQTT-4.4.0-1): whichever
member acknowledges first removes the entry; both copies carry DUP.

A broker that dies gives nothing back: its claims hold only while it renews
their lease (:class:`GroupQueues`, every third of ``group_queues.lease``, on
Redis's clock). Once a lease runs out the entries are free again, with DUP.

What a persistent session's member has in flight is recorded with the session
before each write is sent (``{cid}_ecq_group_writes``: packet id -> group store
and entry, fenced by the session's generation; :meth:`GroupFeed.mark`), kept
again as it leaves (:meth:`GroupFeed.keep`), and forgotten once acknowledged: a
broker killed with writes in flight closes no connection, and its successor
finds them all the same (tests/model/FINDINGS.md, finding 43). The records and
forgets of one member go through one journal, one write at a time, in the
order asked (:meth:`GroupQueues.record`). The first connection
of the session in a process (after a restart, or on another replica) reads it
back before any packet identifier is given and sends those writes again under
their identifiers with DUP, as a process that lived on does
(persistence/device_persistence.py ``restore_group_writes``): the rule is one,
an identifier the client may hold is never given to another message
(MQTT-2.2.1-3, MQTT-4.4.0-1; tests/model/FINDINGS.md, finding 35). What is kept
is bounded by the window: only what is in flight.

A give-back may be decided while a claim of the same token is on its way (the
connection closed meanwhile): the feed cannot list what it has not got yet.
The claim itself keeps whether an entry may have been seen
(persistence/lua/group_claim.lua), so a give-back that does not list that
entry still leaves it with DUP for the next member (tests/model/FINDINGS.md,
finding 34).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Collection, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any

from broker.message import Delivery
from broker.outflow import Outgoing
from persistence.coalescing import CoalescingWriter, Retry
from persistence.events import NO_EVENTS, EventSink
from persistence.queue_feed import AckBatch, entry_delivery, merge_acks
from persistence.queue_store import LeaseLapsed, QueueEntry, QueueStore, group_write_packed

if TYPE_CHECKING:
    from broker.outflow import Outflow
    from broker.stats import BrokerStats

log = logging.getLogger("devicemq.persistence")

_tokens = itertools.count(1)
MAX_DECLINED = 1000  # keys one member remembers it may not take
KEEP_ATTEMPTS = 20  # tries to keep a leaving member's group writes in flight with its session


_Acks = AckBatch[tuple[str, int]]  # key, seq


class _Journal:
    """A member's records and forgets of group writes to write in one call, in the
    order asked, and who waits for it."""

    __slots__ = ("generation", "landed", "ops", "then", "writing")

    def __init__(self, generation: int | None, landed: asyncio.Future[None]) -> None:
        self.generation = generation  # of the records in it (None: forgets only)
        self.ops: list[bytes | int] = []  # b"+" or b"-", packet id, the record
        self.then: list[Callable[[], None]] = []
        self.landed = landed
        self.writing = False

    def record(self, records: list[tuple[int, bytes]]) -> None:
        ops = self.ops
        for packet_id, packed in records:
            ops += (b"+", packet_id, packed)

    def forget(self, packet_id: int, packed: bytes) -> None:
        self.ops += (b"-", packet_id, packed)


class GroupQueues:
    """This process's members of group queues: their acknowledgements (one write per
    group per round, retried until they land), the leases of their claims, and who
    is told when a group has entries to give."""

    def __init__(
        self,
        store: QueueStore,
        lease: float,
        announce: Callable[[str], None] = lambda store_id: None,
    ) -> None:
        """``announce(store_id)``: tell the other replicas' members to claim again."""
        self.store = store
        self.lease = lease
        self._announce = announce
        self.node = f"{os.getpid()}-{time.time_ns() % 10**9}"  # tokens of this process
        self.feeds: dict[str, set[GroupFeed]] = {}
        self.retry = Retry("group_acks")
        self._writer: CoalescingWriter[_Acks] = CoalescingWriter(
            self._write, merge_acks, _Acks, self.retry
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._renewer: asyncio.Task[None] | None = None
        # Group writes of persistent members in flight, as kept in Redis: client id ->
        # packet id -> the record (forgotten there once acknowledged).
        self.kept: dict[str, dict[int, bytes]] = {}
        # Their records and forgets on the way, per member, in the order asked: one
        # write at a time, what is asked meanwhile in the next (a give-back of the
        # member's waits for them, so no other member gets a write before the
        # session keeps it: a kill right after).
        self._journals: dict[str, deque[_Journal]] = {}
        self.expired = 0  # stores deleted after group_queues.unused_expiry without members
        self.events: EventSink = NO_EVENTS  # told of what an expiry removed

    def new_token(self, member: str) -> str:
        # Starts with the pid, never with '-' (group_claim.lua marks a claim on an
        # entry seen before with '-' in front of the token).
        return f"{self.node}:{next(_tokens)}:{member}"

    def joined(self, feed: GroupFeed) -> None:
        self.feeds.setdefault(feed.store_id, set()).add(feed)
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew())

    def left(self, feed: GroupFeed) -> None:
        feeds = self.feeds.get(feed.store_id)
        if feeds is not None:
            feeds.discard(feed)
            if not feeds:
                del self.feeds[feed.store_id]

    def ack(self, store_id: str, key: str, seq: int) -> None:
        self._writer.add(_Acks({store_id: [(key, seq)]}))

    def release(
        self,
        store_id: str,
        token: str,
        dup: dict[str, bool],
        everything: bool = True,
        member: str = "",
    ) -> None:
        """Give the claims of ``token`` back (all, or those on ``dup``'s keys; True: the
        next member gets it with DUP), then have every member claim again (best
        effort: claims not given back are free once their lease runs out)."""
        self.spawn(self._release(store_id, token, dup, everything, member))

    def keep(self, member: str, generation: int, held: list[tuple[int, str, QueueEntry]]) -> None:
        """``member``'s session (of ``generation``) left with these group writes in
        flight (packet id, group store, entry): kept with it, tried until it lands."""
        self._journal(member, generation).record(self._kept_now(member, held))

    def record(
        self,
        member: str,
        generation: int,
        held: list[tuple[int, str, QueueEntry]],
        then: Callable[[], None],
    ) -> None:
        """Keep these group writes with ``member``'s session before they are sent
        (:meth:`GroupFeed.mark`), then ``then()``: once landed, or once the tries
        are given up (they go out unrecorded then, as before finding 43's fix)."""
        journal = self._journal(member, generation)
        journal.record(self._kept_now(member, held))
        journal.then.append(then)

    def _kept_now(
        self, member: str, held: list[tuple[int, str, QueueEntry]]
    ) -> list[tuple[int, bytes]]:
        kept = self.kept.setdefault(member, {})
        records = []
        for packet_id, store_id, entry in held:
            packed = kept[packet_id] = group_write_packed(store_id, entry)
            records.append((packet_id, packed))
        return records

    def _journal(self, member: str, generation: int | None = None) -> _Journal:
        """The member's journal that what is asked now joins: the last one not yet
        being written, unless it is another generation's (a session that ended and
        began again); ``generation`` None: only forgets, which join any."""
        journals = self._journals.get(member)
        if journals is None:
            journals = self._journals[member] = deque()
            self.spawn(self._write_journals(member, journals))
        last = journals[-1] if journals else None
        if (
            last is None
            or last.writing
            or (
                generation is not None
                and last.generation is not None
                and last.generation != generation
            )
        ):
            last = _Journal(generation, asyncio.get_running_loop().create_future())
            journals.append(last)
        elif generation is not None:
            last.generation = generation
        return last

    async def _write_journals(self, member: str, journals: deque[_Journal]) -> None:
        """Write the member's journals one at a time, in order: an identifier's
        records and forgets land as they were asked (persistence/lua/group_writes.lua)."""
        try:
            while journals:
                journal = journals[0]
                journal.writing = True
                for attempt in range(KEEP_ATTEMPTS):
                    try:
                        await self.store.write_group_writes(member, journal.generation, journal.ops)
                        self.retry.succeeded()
                        break
                    except Exception as error:  # Redis away: again
                        log.warning(
                            "writing the record of the group writes in flight to %s failed: %s",
                            member,
                            error,
                        )
                        if attempt + 1 < KEEP_ATTEMPTS:
                            await self.retry.wait()
                else:
                    # Memory still holds them: this process sends them again; a
                    # restart would not, and a forget left out brings one back with DUP.
                    self.retry.gave_up()
                journals.popleft()
                journal.landed.set_result(None)
                for then in journal.then:
                    try:
                        then()
                    except Exception:
                        log.exception("after recording the group writes of %s", member)
        finally:
            if self._journals.get(member) is journals:
                del self._journals[member]

    async def keeps_landed(self, member: str) -> None:
        """Every record and forget of ``member``'s group writes asked so far has landed
        (or been given up)."""
        journals = self._journals.get(member)
        if journals:
            await asyncio.shield(journals[-1].landed)

    def kept_again(self, member: str, records: dict[int, bytes]) -> None:
        """Records read back (a restart): forgotten in Redis once done with."""
        if records:
            self.kept.setdefault(member, {}).update(records)

    def done_with(self, member: str, packet_id: int, packed: bytes | None = None) -> None:
        """A group write kept under ``packet_id`` is done with (acknowledged, or dropped
        from flight): its record goes, unless the id was kept again for another.
        ``packed``: the record of the write meant (None: the one kept now). After any
        record asked before it: a record landing later would outlive the
        acknowledgement, and a restarted broker would send the write again under an
        id the client may hold for another message by then."""
        kept = self.kept.get(member)
        now = kept.get(packet_id) if kept is not None else None
        if packed is None:
            packed = now
        if packed is None:
            return
        if kept is not None and now == packed:
            del kept[packet_id]
            if not kept:
                del self.kept[member]
        self._journal(member).forget(packet_id, packed)

    def session_ended(self, member: str, generation: int) -> None:
        """Its session ended: what it kept goes (a later session drops an older
        generation's record too, by its generation)."""
        self.kept.pop(member, None)
        self.spawn(self._end_kept(member, generation))

    async def _end_kept(self, member: str, generation: int) -> None:
        await self.keeps_landed(member)  # (its last connection's, as the session ended)
        try:
            await self.store.end_group_writes(member, generation)
        except Exception as error:  # the next session drops it by its generation
            log.info("forgetting the group writes kept for %s failed: %s", member, error)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, referenced until done (awaited at close)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stored(self, store_id: str, elsewhere: bool = True) -> None:
        """Entries are there to be claimed (stored, or given back): members here claim,
        and with ``elsewhere`` the other replicas' are told."""
        for feed in list(self.feeds.get(store_id, ())):
            feed.poke()
        if elsewhere:
            self._announce(store_id)

    async def flush(self) -> None:
        await self._writer.drain()

    async def sweep(
        self, has_members: Callable[[str], bool], unused_for: float, now: float | None = None
    ) -> list[str]:
        """One look at every group store saved to: a store whose group has members (in
        this broker's view, which holds every replica's subscriptions) is marked so; one
        with none is marked with the time first seen so, and deleted once that is
        ``unused_for`` seconds ago. Any replica that sees a member clears the mark.
        Returns the stores deleted."""
        now = time.time() if now is None else now
        deleted: list[str] = []
        for store_id, since in (await self.store.group_store_ids()).items():
            if has_members(store_id) or store_id in self.feeds:
                if since:
                    await self.store.mark_group(store_id, 0)
            elif not since:
                await self.store.mark_group(store_id, now)
            elif now - since >= unused_for:
                purged = await self.store.purge(store_id, everything=True)
                log.info(
                    "group queue %s had no members for %.0f s: deleted (%d entries, "
                    "%d pending, %d bytes; group_queues.unused_expiry)",
                    store_id, now - since, purged.entries, len(purged.pending), purged.bytes,
                )  # fmt: skip
                for key, seq in purged.pending:
                    self.events.queue(store_id, "purged", seq, key)
                self.expired += 1
                deleted.append(store_id)
        return deleted

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _release(
        self, store_id: str, token: str, dup: dict[str, bool], everything: bool, member: str
    ) -> None:
        await self.keeps_landed(member)  # the member's session keeps them first
        try:
            await self.flush()  # acknowledged ones first: they must not come back
            await self.store.release(store_id, token, dup, everything=everything)
        except Exception as error:  # Redis away: the lease frees them later
            log.info("giving back the claims of %s on %s failed: %s", token, store_id, error)
            return
        self.stored(store_id)

    async def _renew(self) -> None:
        """Renew the leases of live claims; and since a lease that ran out (a broker
        that died) frees entries without anyone saying so, members claim again."""
        while True:
            await asyncio.sleep(self.lease / 3)
            for store_id, feeds in list(self.feeds.items()):
                tokens = [feed.token for feed in feeds if feed.token]
                try:
                    await self.store.renew(store_id, tokens, self.lease)
                except Exception as error:  # tried again at the next round
                    log.warning("renewing claims on %s failed: %s", store_id, error)
                for feed in list(feeds):
                    feed.poke()

    async def _write(self, batch: _Acks) -> _Acks:
        left = _Acks()
        for store_id, pairs in batch.items():
            try:
                await self.store.group_ack(store_id, pairs)
            except Exception as error:  # connection errors, cluster errors: retried
                log.warning(
                    "acknowledging %d entries of %s failed: %s", len(pairs), store_id, error
                )
                left[store_id] = pairs
        return left


class GroupFeed:
    """:class:`broker.outflow.Feed` of one member's share of one group queue.

    ``_buffer``: entries claimed and not yet taken; ``_out``: taken and not yet
    acknowledged (key -> seq); ``_sent``: keys sent under the current token;
    ``_dup``: keys held that were claimed with DUP.
    """

    durable = True

    def __init__(
        self,
        store_id: str,
        member: str,
        groups: GroupQueues,
        stats: BrokerStats,
        *,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
        events: EventSink = NO_EVENTS,
        subscription_ids: Callable[[], tuple[int, ...]] = tuple,
        generation: int | None = None,
    ) -> None:
        """``generation``: a persistent session's, whose group writes in flight are kept
        with it as it leaves (None: a session that ends with its connection)."""
        self.store_id = store_id
        self.member = member
        self.generation = generation
        self.outflow: Outflow | None = None
        self.token = ""  # "" while not a live member (no connection)
        self._groups = groups
        self._stats = stats
        self._clock = clock
        self._wall_clock = wall_clock
        self._events = events
        self._subscription_ids = subscription_ids
        self._buffer: deque[tuple[QueueEntry, bool]] = deque()
        self._out: dict[str, int] = {}
        self._sent: set[str] = set()
        self._dup: set[str] = set()
        # Keys this member may not take (too large for it, or its ACL), newest last:
        # its claims skip them, for the other members.
        self._declined: dict[str, None] = {}
        self._declined_full = False
        self._claimed_once = False  # under the current token (a lapsed one is refused)
        self._loading = False
        self._more = False  # entries may be there to claim (stored, given back)
        self._epoch = 0

    # -- Feed ----------------------------------------------------------------------------

    def offer(self, delivery: Delivery) -> None:
        raise RuntimeError("a group queue receives messages through the store")

    def take(self, n: int) -> list[Outgoing]:
        if not self.token:
            return []
        items: list[Outgoing] = []
        while self._buffer and len(items) < n:
            entry, dup = self._buffer.popleft()
            self._out[entry.key] = entry.seq
            # A persistent session's group writes go out once recorded (mark).
            items.append(
                Outgoing(
                    0, self._delivery(entry), sent=dup, marked=self.generation is None, ref=entry
                )
            )
        if len(items) < n and not self._loading:
            self._claim(n - len(items))
        return items

    def mark(self, items: list[Outgoing], done: Callable[[Collection[int]], None]) -> None:
        """Record them with the session under their packet ids before they go out (a
        persistent session's), so that a broker killed with them in flight leaves
        them to its successor under those ids (finding 43). The claim is the group's
        record; this one is the member's."""
        ids = [item.packet_id for item in items]
        if self.generation is None:
            done(ids)
            return
        held = [(item.packet_id, self.store_id, self._entry(item)) for item in items]
        # One whose connection ends before this lands is forgotten as it ends
        # (Outflow.left, :meth:`never_sent`), not here: a forget asked after the
        # member's records were waited for could remove the record another
        # replica has restored since.
        self._groups.record(self.member, self.generation, held, partial(done, ids))

    def never_sent(self, item: Outgoing) -> None:
        """Taken and never sent (its connection ended while it waited for its record):
        the record goes, after the record itself if that is still on its way."""
        if self.generation is not None:
            entry = self._entry(item)
            self._groups.done_with(
                self.member, item.packet_id, group_write_packed(self.store_id, entry)
            )

    def release(self, item: Outgoing, done: Callable[[], None]) -> None:
        done()  # QoS 1 only

    def finished(self, item: Outgoing) -> None:
        entry = self._forget(item)
        groups = self._groups
        if self.generation is not None:  # its record goes (mark): the one under its id
            groups.done_with(self.member, item.packet_id)
        groups.ack(self.store_id, entry.key, entry.seq)
        self._events.queue(self.store_id, "acked", entry.seq, entry.key)
        self._stats.queue_acked += 1

    def undeliverable(self, item: Outgoing) -> None:
        """Expired before its first send: for every member (the outflow asks
        :meth:`decline` for the other reasons)."""
        entry = self._forget(item)
        if self.generation is not None:
            self._groups.done_with(self.member, item.packet_id)
        self._groups.ack(self.store_id, entry.key, entry.seq)
        self._events.queue(self.store_id, "discarded", entry.seq, entry.key)

    def decline(self, item: Outgoing) -> None:
        """This member may not take it (larger than its Maximum Packet Size, or its ACL
        keeps it from the topic): another member may, and this connection skips it.
        An expired one is dropped. An entry no member can take waits for one that
        can, until retention removes it."""
        assert item.delivery is not None
        if not item.sent and item.delivery.message.expired(self._clock()):
            self.undeliverable(item)
            return
        entry = self._entry(item)
        dup = item.sent or entry.key in self._dup
        self._forget(item)
        if self.generation is not None:
            # Out of flight, perhaps recorded before its send failed: its id is free.
            self._groups.done_with(
                self.member, item.packet_id, group_write_packed(self.store_id, entry)
            )
        self._declined[entry.key] = None
        if len(self._declined) >= MAX_DECLINED and not self._declined_full:
            # Claiming more would only hand back what it declined before: it takes
            # nothing more from this group on this connection.
            self._declined_full = True
            log.warning(
                "%s may not take %d entries of %s: it claims no more of them until it "
                "connects again",
                self.member,
                len(self._declined),
                self.store_id,
            )
        if self.token:
            self._groups.release(self.store_id, self.token, {entry.key: dup}, everything=False)

    def sent(self, item: Outgoing, dup: bool) -> None:
        entry = self._entry(item)
        self._sent.add(entry.key)
        self._events.queue(self.store_id, "delivered", entry.seq, entry.key, dup=dup)
        self._stats.queue_delivered += 1

    def restart(self) -> None:
        """A (new) connection of the member: claim under a new token; what it declined
        on the last one (its Maximum Packet Size, its ACL) may be different now."""
        self._give_back()
        self._epoch += 1
        self._declined.clear()
        self._declined_full = False
        self.token = self._groups.new_token(self.member)
        self._claimed_once = False
        self._groups.joined(self)
        self._more = True
        self.poke()

    def discard(self) -> None:
        """The member left (connection closed, unsubscribed, session ended): its claims
        go back to the group."""
        self._give_back()
        self._groups.left(self)

    def queued(self) -> int:
        return len(self._buffer)

    def keep(self, items: list[Outgoing]) -> None:
        """The member left with ``items`` (group writes of any of its groups) in flight:
        a persistent session keeps them, to send them again under their packet ids
        after a restart of the broker as well (MQTT-4.4.0-1)."""
        if self.generation is None:
            return
        held = [(item.packet_id, self._store_of(item), self._entry(item)) for item in items]
        self._groups.keep(self.member, self.generation, held)

    def delivery_of(self, entry: QueueEntry) -> Delivery:
        """``entry`` as it goes to this member."""
        return self._delivery(entry)

    # -- told by GroupQueues ---------------------------------------------------------------

    def poke(self) -> None:
        """Entries may be there to claim."""
        self._more = True
        outflow = self.outflow
        if not self.token or outflow is None or outflow.connection is None:
            return
        if not self._buffer and not self._loading:
            room = outflow.room()
            if room > 0:
                self._claim(room)

    # -- internals -----------------------------------------------------------------------

    def _forget(self, item: Outgoing) -> QueueEntry:
        entry = self._entry(item)
        if self._out.get(entry.key) == entry.seq:
            del self._out[entry.key]
        self._sent.discard(entry.key)
        self._dup.discard(entry.key)
        return entry

    def _held_dup(self) -> dict[str, bool]:
        """What goes back with DUP: sent, got with DUP, or taken (the outflow may still
        send it, perhaps on a later connection)."""
        return dict.fromkeys(self._sent | self._dup | self._out.keys(), True)

    def _give_back(self) -> None:
        """Every claim of the token goes back: with DUP what may be seen."""
        token = self.token
        if not token:
            return
        self.token = ""
        self._epoch += 1
        self._buffer.clear()
        self._loading = False
        dup = self._held_dup()
        self._sent, self._dup, self._out = set(), set(), {}
        self._groups.release(self.store_id, token, dup, member=self.member)

    def _in_flight_keys(self) -> list[str]:
        """Keys the outflow holds in flight from this feed (re-sent after a reconnect):
        not claimed again under a new token, so not delivered twice to this client."""
        outflow = self.outflow
        if outflow is None:
            return []
        return [
            held.item.ref.key
            for held in outflow.inflight.values()
            if held.item.side is self and isinstance(held.item.ref, QueueEntry)
        ]

    def _claim(self, n: int) -> None:
        """Claim at least a window's worth: one claim per acknowledgement would cost a
        Redis script each (the buffer holds the rest, given back if the member leaves)."""
        if not self._more or self._declined_full:
            return
        outflow = self.outflow
        if outflow is not None and outflow.restoring_groups:
            return  # what it held before a restart first (it pokes every group after)
        self._loading = True
        self._more = False
        batch = max(n, outflow.max_inflight if outflow is not None else 1)
        self._groups.spawn(self._claim_now(self._epoch, self.token, batch))

    async def _claim_now(self, epoch: int, token: str, n: int) -> None:
        groups = self._groups
        skip = (*self._declined, *self._in_flight_keys())
        try:
            claimed = await groups.store.claim(
                self.store_id, token, n, groups.lease, skip, fresh=not self._claimed_once
            )
            groups.retry.succeeded()
        except LeaseLapsed:
            # Its broker could not renew it in time: its claims may be other members'
            # now (with DUP). A new token; what it holds goes back.
            log.warning("claims of %s on %s lapsed: claiming anew", self.member, self.store_id)
            if epoch == self._epoch and self.token == token:
                self._rotate_token()
                self._loading = False
                self._more = True
                self.poke()
            return
        except Exception as error:
            log.warning(
                "claiming entries of %s for %s failed: %s", self.store_id, self.member, error
            )
            if epoch == self._epoch and self.token == token:
                # It may have run with its answer lost: what it took would stay held
                # by this token, sent to no one. A new token; the old one's claims go
                # back (with DUP what may be seen).
                self._rotate_token()
                epoch = self._epoch
                await groups.retry.wait()
                if epoch == self._epoch:  # nothing else started meanwhile
                    self._loading = False
                    self._more = True
                    self.poke()
            return
        if epoch != self._epoch:
            if claimed:  # claimed for a token given back meanwhile: these go back too
                dup = {entry.key: seen for entry, seen in claimed}
                groups.release(self.store_id, token, dup, everything=False)
            return
        self._claimed_once = True
        self._loading = False
        for entry, seen in claimed:
            if seen:
                self._dup.add(entry.key)
        self._buffer.extend(claimed)
        if len(claimed) >= n:
            self._more = True  # there may be more
        outflow = self.outflow
        if outflow is not None:
            outflow.pump()

    def _rotate_token(self) -> None:
        """A new token for the same connection; the old one's claims go back, with DUP
        what may be seen. What the outflow holds in flight it still sends."""
        old = self.token
        self.token = self._groups.new_token(self.member)
        self._claimed_once = False
        self._epoch += 1
        self._loading = False
        self._buffer.clear()
        dup = self._held_dup()
        self._dup &= self._out.keys()  # the buffer's went back
        self._groups.release(self.store_id, old, dup)

    def _delivery(self, entry: QueueEntry) -> Delivery:
        return entry_delivery(entry, self._wall_clock(), self._clock(), self._subscription_ids())

    @staticmethod
    def _store_of(item: Outgoing) -> str:
        side = item.side
        assert isinstance(side, GroupFeed)
        return side.store_id

    @staticmethod
    def _entry(item: Outgoing) -> QueueEntry:
        entry = item.ref
        assert isinstance(entry, QueueEntry)
        return entry
