"""Run a plan against fresh processes, check it, shrink a failing one.

:func:`run_plan` starts Redis, Tansu and the broker(s) in a new directory,
creates the clients, executes the operations one after the other (checking
after each one that no broker died), ends with a drain (resume everything,
reconnect every persistent session, wait until every owed message arrived
or is excused) and returns a :class:`Result`. Timing-sensitive steps wait for
conditions (a CONNACK, the answers to a publish, zero consumer lag); only
``wait`` and session/message expiry wait for time itself.

:func:`shrink` is delta debugging over the operation list: a sub-list that
still shows a violation of the same kind, replayed against fresh processes,
replaces the plan, until a time budget runs out.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.errors import KafkaError

from tests.model.clients import PahoPublisher, PahoSubscriber, RawClient, Scheduler
from tests.model.groups import group_filter, group_topic
from tests.model.model import Config, Model, Msg, Violation
from tests.model.ops import LONG_EXPIRY, V311_EXPIRY, Op, Plan, op
from tests.model.queues import write_topic
from tests.model.system import System

OP_TIMEOUT = 5.0  # s a CONNACK / SUBACK / publish answer is waited for
DRAIN_TIMEOUT = 25.0  # s the drain waits for owed messages
QUIESCE_TIMEOUT = 20.0  # s to wait for zero consumer lag before a Kafka restart
PUBREL_BOUND = 10.0  # s after a resume within which a held QoS 2 id gets its PUBREL
FREEZE_AFTER_TAKEOVER = 0.5  # s the old replica stays frozen after the new one CONNACKed


@dataclass
class Result:
    plan: Plan
    violations: list[Violation]
    executed: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    published: int = 0
    acked: int = 0
    receipts: int = 0
    checked: int = 0
    delivered: int = 0
    excused: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    root: Path | None = None
    logs: list[Path] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.violations)

    def kinds(self) -> set[str]:
        return {v.kind for v in self.violations}


Subscriber = RawClient | PahoSubscriber
Publisher = RawClient | PahoPublisher


class Runner:
    def __init__(
        self,
        plan: Plan,
        root: Path,
        log: Callable[[str], None] = print,
        ignore: frozenset[str] = frozenset(),
    ) -> None:
        self.plan = plan
        self.root = root
        self.log = log
        self.tag = f"r{random.getrandbits(32):08x}"
        self.system = System(root, plan.replicas, plan.settings)
        self.model = Model(
            Config(
                plan.limit,
                plan.max_inflight,
                plan.default_ttl,
                plan.replicas > 1,
                application=plan.application,
            )
        )
        self.model.ignore = set(ignore)
        self.scheduler = Scheduler()
        self.subs: dict[str, Subscriber] = {}
        self.pubs: dict[str, Publisher] = {}
        self.expiry: dict[str, int] = {}  # a subscriber's last Session Expiry Interval
        self.sub_ids: dict[str, int] = {}
        self.background: dict[str, threading.Thread] = {}
        self.stop_background = threading.Event()
        self.timers: list[threading.Timer] = []
        self.result = Result(plan, self.model.violations, root=root, logs=self.system.logs())
        self.executed = 0

    # -- setup -------------------------------------------------------------------------

    def _make_clients(self) -> None:
        for spec in self.plan.subscribers:
            if spec.kind == "paho":
                self.subs[spec.cid] = PahoSubscriber(
                    self.model, spec.cid, spec.version, self.scheduler
                )
            else:
                self.subs[spec.cid] = RawClient(
                    self.model,
                    spec.cid,
                    spec.version,
                    self.scheduler,
                    receive_maximum=spec.receive_maximum,
                    tag=self.tag,
                )
            self.expiry[spec.cid] = LONG_EXPIRY if spec.version == 5 else V311_EXPIRY
            self.sub_ids[spec.cid] = 0
        for spec in self.plan.publishers:
            if spec.kind == "paho":
                self.pubs[spec.cid] = PahoPublisher(self.model, spec.cid, spec.version, self.tag)
            else:
                client = RawClient(self.model, spec.cid, spec.version, self.scheduler, tag=self.tag)
                self.pubs[spec.cid] = client

    def run(self, stop_kinds: set[str] | None = None) -> Result:
        """Execute the plan; stop early once a violation of ``stop_kinds`` shows."""
        started = time.monotonic()
        try:
            self.system.start()
            self._make_clients()
            for operation in [*self.plan.ops, op("drain", abrupt=False, final=True)]:
                self._execute(operation)
                self.executed += 1
                self._after_op()
                if stop_kinds and stop_kinds & {v.kind for v in self.model.violations}:
                    break
        except Exception as error:  # an infrastructure failure, not a finding
            import traceback

            self.result.error = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        finally:
            self._teardown()
            self.result.seconds = time.monotonic() - started
            self.result.executed = self.executed
            stats = self.model.stats
            self.result.published = stats.published
            self.result.acked = stats.acked
            self.result.receipts = stats.receipts
            self.result.checked = stats.checked
            self.result.delivered = stats.delivered
            self.result.excused = dict(stats.excused)
            if self.result.failed or self.result.error:
                with contextlib.suppress(OSError):
                    self.model.write_trace(self.root / "trace.log")
                    self.result.logs.append(self.root / "trace.log")
        return self.result

    def _teardown(self) -> None:
        self.stop_background.set()
        for timer in self.timers:
            timer.cancel()
        for thread in self.background.values():
            thread.join(5)
        for sub in self.subs.values():
            with contextlib.suppress(Exception):
                sub.disconnect(abrupt=True)
        for pub in self.pubs.values():
            with contextlib.suppress(Exception):
                if isinstance(pub, PahoPublisher):
                    pub.close()
                else:
                    pub.disconnect(abrupt=True)
        self.scheduler.stop()
        self.system.stop()

    def _after_op(self) -> None:
        for text in self.system.check_alive():
            self.model.violate("broker", text)
            with contextlib.suppress(Exception):
                self.system.start_broker(int(text.split()[1]))
        self.model.expire_sessions()

    def _fault(self, kind: str) -> None:
        self.result.faults[kind] = self.result.faults.get(kind, 0) + 1
        self.model.fault(kind)

    # -- operations --------------------------------------------------------------------

    def _execute(self, operation: Op) -> None:
        self.model.log(f"--- op {self.executed}: {operation}")
        handler = getattr(self, f"_op_{operation.kind}")
        handler(operation)

    def _sub(self, operation: Op) -> Subscriber:
        return self.subs[operation.get("client")]

    def _ensure_connected(self, sub: Subscriber) -> bool:
        if sub.connected:
            return True
        return sub.connect(
            self.system.address(sub.broker), sub.broker, False, self.expiry[sub.cid], OP_TIMEOUT
        )

    def _op_connect(self, operation: Op) -> None:
        sub = self._sub(operation)
        broker = operation.get("broker", 0) % len(self.system.brokers)
        expiry = operation.get("expiry", LONG_EXPIRY)
        self.expiry[sub.cid] = expiry
        old = sub.broker if sub.connected else None
        if not operation.get("freeze_old") or old is None or old == broker:
            sub.connect(
                self.system.address(broker), broker, operation.get("clean"), expiry, OP_TIMEOUT
            )
            return
        # The old replica hears the connection end (and the takeover) only once the new
        # one has answered the CONNECT: a client back through another replica before
        # the old one noticed (finding 37).
        with self.system.frozen_broker(old):
            sub.connect(
                self.system.address(broker), broker, operation.get("clean"), expiry, OP_TIMEOUT
            )
            time.sleep(FREEZE_AFTER_TAKEOVER)

    def _op_blink(self, operation: Op) -> None:
        """CONNECT and DISCONNECT in one write (RawClient.blink); a paho client connects."""
        sub = self._sub(operation)
        broker = operation.get("broker", 0) % len(self.system.brokers)
        expiry = operation.get("expiry", LONG_EXPIRY)
        self.expiry[sub.cid] = expiry
        if isinstance(sub, RawClient):
            sub.blink(self.system.address(broker), broker, expiry, OP_TIMEOUT)
        else:
            sub.connect(self.system.address(broker), broker, False, expiry, OP_TIMEOUT)

    def _op_disconnect(self, operation: Op) -> None:
        self._sub(operation).disconnect(abrupt=operation.get("abrupt"))

    def _next_sub_id(self, cid: str) -> int:
        self.sub_ids[cid] += 1
        return self.sub_ids[cid]

    def _op_subscribe(self, operation: Op) -> None:
        sub = self._sub(operation)
        if not self._ensure_connected(sub):
            return
        entries = []
        for topic_filter, qos in operation.get("filters"):
            if sub.version == 4 and topic_filter.startswith("$share/"):
                continue  # routes of 3.1.1 copies are told apart by subscription ids only
            sub_id = self._next_sub_id(sub.cid) if sub.version == 5 else None
            entries.append((topic_filter, qos, sub_id))
        sub.subscribe(entries, OP_TIMEOUT)

    def _op_groups(self, operation: Op) -> None:
        """Join ``n`` shared-subscription groups on ``topic`` (one copy per group)."""
        sub = self._sub(operation)
        if sub.version != 5 or not self._ensure_connected(sub):
            return
        topic = operation.get("topic")
        entries = [
            (f"$share/w{i}/{topic}", 1, self._next_sub_id(sub.cid))
            for i in range(operation.get("n"))
        ]
        sub.subscribe(entries, 30.0)

    def _op_unsubscribe(self, operation: Op) -> None:
        sub = self._sub(operation)
        if sub.connected:
            sub.unsubscribe([operation.get("filter")], OP_TIMEOUT)

    def _op_policy(self, operation: Op) -> None:
        self._sub(operation).set_policy(operation.get("policy"))

    def _op_release(self, operation: Op) -> None:
        self._sub(operation).release()

    def _publisher(self, operation: Op) -> Publisher | None:
        pub = self.pubs[operation.get("client")]
        thread = self.background.get(pub.cid)
        if thread is not None:
            thread.join(30)
            del self.background[pub.cid]
        broker = operation.get("broker", 0) % len(self.system.brokers)
        if isinstance(pub, PahoPublisher):
            if pub.client is None and not pub.connect(self.system.address(broker), broker):
                return None
            return pub
        if not pub.connected and not pub.connect(
            self.system.address(broker), broker, True, 0, OP_TIMEOUT
        ):
            return None
        return pub

    def _op_publish(self, operation: Op) -> None:
        pub = self._publisher(operation)
        if pub is None:
            return
        items = [(operation.get("topic"), operation.get("qos"), operation.get("expiry"))]
        items = items * operation.get("count")
        if pub.version != 5:
            items = [(t, q, None) for t, q, _ in items]
        if operation.get("background"):
            thread = threading.Thread(
                target=pub.publish,
                args=(items, 20, 10.0, self.stop_background),
                name=f"bg-{pub.cid}",
                daemon=True,
            )
            self.background[pub.cid] = thread
            thread.start()
        else:
            pub.publish(items, 20, 10.0)

    def _op_group_write(self, operation: Op) -> None:
        pub = self._publisher(operation)
        if pub is None:
            return
        group = operation.get("group")
        self.model.groups.writing(group)
        topic = group_topic(group)
        pub.publish([(topic, operation.get("qos"), None)] * operation.get("count"), 20, 10.0)

    def _join_group(self, sub: Subscriber, group: str) -> None:
        if not self._ensure_connected(sub):
            return
        sub_id = self._next_sub_id(sub.cid) if sub.version == 5 else None
        self.model.groups.joining(sub.cid, group)
        if sub.subscribe([(group_filter(group), 1, sub_id)], OP_TIMEOUT):
            self.model.groups.joined(sub.cid, group)

    def _op_group_join(self, operation: Op) -> None:
        self._join_group(self._sub(operation), operation.get("group"))

    def _op_group_leave(self, operation: Op) -> None:
        sub = self._sub(operation)
        if sub.connected:
            group = operation.get("group")
            self.model.groups.left(sub.cid, group)
            sub.unsubscribe([group_filter(group)], OP_TIMEOUT)

    def _op_ecq_write(self, operation: Op) -> None:
        pub = self._publisher(operation)
        if pub is None:
            return
        topic = write_topic(operation.get("queue"), operation.get("key"))
        pub.publish([(topic, operation.get("qos"), None)] * operation.get("count"), 20, 10.0)

    def _subscribe_queue(self, sub: Subscriber) -> None:
        if not self._ensure_connected(sub):
            return
        sub_id = self._next_sub_id(sub.cid) if sub.version == 5 else None
        if sub.subscribe([(f"$ECQ/{sub.cid}/#", 1, sub_id)], OP_TIMEOUT):
            self.model.queues.consuming(sub.cid)

    def _op_ecq_consume(self, operation: Op) -> None:
        self._subscribe_queue(self._sub(operation))

    def _op_ecq_unconsume(self, operation: Op) -> None:
        sub = self._sub(operation)
        if sub.connected:
            sub.unsubscribe([f"$ECQ/{sub.cid}/#"], OP_TIMEOUT)

    def _op_ecq_rewind(self, operation: Op) -> None:
        sub = self._sub(operation)
        if not isinstance(sub, RawClient) or not self._ensure_connected(sub):
            return  # paho subscribers here do not publish
        topic = f"$ECQ/c/{sub.cid}/rewind"
        if sub.send_control(topic, str(operation.get("seq", 1)).encode()):
            self.model.queues.rewound(sub.cid)

    def _op_flood(self, operation: Op) -> None:
        """QoS 1 as fast as the broker takes it: ``count`` messages, or (``wrap``) as
        many as take that client's session ``past`` copies beyond packet id 65535."""
        pub = self._publisher(operation)
        if pub is None:
            return
        topic = operation.get("topic")
        count = operation.get("count", 0)
        target = operation.get("wrap")
        if target is not None:
            stored, per = self.model.stored_for(target, topic)
            if per == 0:
                return
            goal = 65_535 + self.plan.max_inflight + operation.get("past", 0)
            count = max(0, -(-(goal - stored) // per))
        pub.publish([(topic, 1, None)] * count, 200, 60.0)

    def _op_settle(self, operation: Op) -> None:
        """Until the client has everything owed to it so far, or nothing arrived for
        0.5 s (it may hold its window closed); at most 10 s."""
        cid = operation.get("client")
        deadline = time.monotonic() + 2 * OP_TIMEOUT
        last, quiet_since = -1, time.monotonic()
        while self.model.open_for(cid) and time.monotonic() < deadline:
            receipts = self.model.stats.receipts
            if receipts != last:
                last, quiet_since = receipts, time.monotonic()
            elif time.monotonic() - quiet_since > 0.5:
                return
            time.sleep(0.02)

    def _op_wait(self, operation: Op) -> None:
        time.sleep(operation.get("seconds"))

    def _resume_later(self, seconds: float, resume: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, resume)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _resume_redis(self) -> None:
        self.system.resume_redis()
        self.model.resume_redis()

    def _op_pause_redis(self, operation: Op) -> None:
        if self.system.redis_paused:
            return
        self.system.pause_redis()
        self.model.pause_redis()
        self.result.faults["pause_redis"] = self.result.faults.get("pause_redis", 0) + 1
        self._resume_later(operation.get("seconds"), self._resume_redis)

    def _op_pause_kafka(self, operation: Op) -> None:
        if self.system.tansu.paused:
            return
        self.system.pause_kafka()
        self.model.note_fault("pause_kafka")
        self.result.faults["pause_kafka"] = self.result.faults.get("pause_kafka", 0) + 1
        self._resume_later(operation.get("seconds"), self.system.resume_kafka)

    def _resume_all(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.timers.clear()
        self._resume_redis()
        self.system.resume_kafka()

    def _op_kill_broker(self, operation: Op) -> None:
        self._resume_all()
        i = operation.get("broker") % len(self.system.brokers)
        self.system.kill_broker(i)
        self._fault("kill_broker")
        if operation.get("failover") and len(self.system.brokers) > 1:
            other = (i + 1) % len(self.system.brokers)
            for sub in self.subs.values():
                if sub.broker == i:
                    sub.disconnect(abrupt=True)
                    sub.broker = other
                    self._ensure_connected(sub)
        time.sleep(operation.get("down", 0.0))
        self.system.start_broker(i)
        for sub in self.subs.values():
            if sub.broker == i and not sub.connected and self._session_alive(sub):
                self._ensure_connected(sub)

    def _session_alive(self, sub: Subscriber) -> bool:
        state = self.model.clients[sub.cid]
        return state.inc is not None and state.inc.ended is None and state.inc.persistent

    def _op_restart_redis(self, operation: Op) -> None:
        self._resume_all()
        sig = signal.SIGKILL if operation.get("signal") == "KILL" else signal.SIGTERM
        self.system.restart_redis(sig)
        self._fault("restart_redis")

    def _op_lag_replica(self, operation: Op) -> None:
        if self.system.lag_replica():
            self.model.note_fault("lag_replica")

    def _op_failover(self, operation: Op) -> None:
        self._resume_all()  # but the replica: it lags on if it was cut off
        if self.system.replica_lagging:
            # From the kill on: what the broker does meanwhile already meets the new
            # master, which lacks the last writes.
            self.model.redis_lost_writes()
        self.system.kill_master()
        during = operation.get("during")
        if during is not None:  # acknowledged by Kafka; stored once there is a master
            self._op_publish(during)
        self.system.promote()
        self._fault("failover")

    def _wait_publishers(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for cid, thread in list(self.background.items()):
            thread.join(max(0.1, deadline - time.monotonic()))
            if not thread.is_alive():
                del self.background[cid]
        while any(p.unanswered() for p in self.pubs.values()) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _op_restart_kafka(self, operation: Op) -> None:
        """Only once Kafka holds nothing unstored: then nothing may be lost."""
        self._resume_all()
        self._wait_publishers()
        if any(p.unanswered() for p in self.pubs.values()) or self.background:
            self.result.notes.append("kafka restart skipped: publishers still waiting")
            return
        deadline = time.monotonic() + QUIESCE_TIMEOUT
        while not self.system.quiesced():
            if time.monotonic() > deadline:
                self.result.notes.append("kafka restart skipped: consumer lag not 0")
                return
            time.sleep(0.1)
        if operation.get("frozen"):
            try:
                self.system.restart_kafka_frozen()
            except (KafkaError, OSError, TimeoutError) as error:
                self.result.notes.append(f"naming the topic failed: {error!r}")
        else:
            self.system.restart_kafka()
        self._fault("restart_kafka")

    def _op_name_topic(self, operation: Op) -> None:
        """A Kafka client asks for the topic by name (finding 26)."""
        if self.system.tansu.paused or not self.system.tansu.alive():
            return
        try:
            self.system.name_topic()
        except (KafkaError, OSError, TimeoutError) as error:
            self.result.notes.append(f"naming the topic failed: {error!r}")

    # -- the drain ---------------------------------------------------------------------

    def _op_drain(self, operation: Op) -> None:
        """Everything resumed and acknowledged; every owed message must arrive."""
        self._resume_all()
        self.system.thaw_replica()
        self._wait_publishers()
        for pub in self.pubs.values():
            if isinstance(pub, PahoPublisher):
                pub.give_up()
        for i in range(len(self.system.brokers)):
            if not self.system.brokers[i].alive():
                self.system.start_broker(i)
        start = time.monotonic()
        for sub in self.subs.values():
            sub.set_policy("auto")
            persistent = self._session_alive(sub) or (
                not sub.connected and self.model.clients[sub.cid].inc is not None
            )
            if sub.connected and not persistent:
                # A clean session: a reconnect would end it. What it holds unacked
                # keeps its window closed (seed 569: Receive Maximum 2, both held),
                # so the later messages could never come: acknowledge them now.
                sub.release()
                continue
            if self.model.clients[sub.cid].inc is None:
                continue
            sub.disconnect(abrupt=operation.get("abrupt", False))
            self._ensure_connected(sub)
        queues = self.model.queues
        for cid in {*queues.owed(), *queues.consumers}:
            if cid in self.subs:  # the queue's client comes for it, at the latest now
                self._subscribe_queue(self.subs[cid])
        groups = self.model.groups
        if groups.written and self.subs:  # a member for every group, at the latest now
            collector = next(iter(self.subs.values()))
            for group in sorted(groups.written):
                self._join_group(collector, group)
        deadline = start + DRAIN_TIMEOUT + self.model.stats.published / 5000
        last_receipts, quiet_since, trimmed_at = -1, time.monotonic(), 0.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            open_obs = self.model.open_obligations(start)
            queued = queues.open() + groups.open()
            receipts = (
                self.model.stats.receipts
                + sum(len(r) for r in queues.receipts.values())
                + sum(len(r) for r in groups.receipts.values())
            )
            if receipts != last_receipts:
                last_receipts, quiet_since = receipts, now
            quiet = now - quiet_since
            if open_obs and quiet > 2.0 and now - trimmed_at > 5.0:
                with self.model.lock:  # expensive: only once nothing arrives any more
                    trimmed = self.model._trim_excused(open_obs)
                open_obs = [o for o in open_obs if o not in trimmed]
                trimmed_at = now
            if (open_obs or queued) and quiet > 8.0 and self.system.quiesced():
                break  # nothing arrives, Kafka holds nothing unstored: it will not come
            if (
                not open_obs
                and not queued
                and (not self._pubrels_missing(start, strict=False) or now - start > PUBREL_BOUND)
            ):
                break
            time.sleep(0.2)
        while (
            self._pubrels_missing(start, strict=False) and time.monotonic() < start + PUBREL_BOUND
        ):
            time.sleep(0.2)
        time.sleep(0.3)  # late repeats still get checked
        self.model.kafka_reused_offsets = self.system.tansu.reused_offsets()
        self.model.kafka_topic_size = self._kafka_topic_size()
        self.model.check_losses(start)
        queues.check()
        groups.check()
        if groups.written and operation.get("final"):
            owed = groups.owed()
            again = sum(len(r) - 1 for r in groups.receipts.values())
            self.result.notes.append(
                f"group writes owed {len(owed)}, received {len(groups.receipts)}, "
                f"again (with DUP) {again}"
            )
        self.model.check_order()
        self._pubrels_missing(start, strict=True)
        for i in range(len(self.system.brokers)):
            if not self.system.brokers[i].alive():
                self.model.violate("broker", f"broker {i} is not running after the drain")

    def _maybe_trimmed(self, cid: str, msg: Msg) -> bool:
        """Could ``msg`` have been trimmed for ``cid``'s session (or was it never owed)?"""
        inc = self.model.clients[cid].inc
        obs = [ob for ob in msg.obs if inc in ob.incs]
        if not obs:
            return True
        with self.model.lock:
            return bool(self.model._trim_excused(obs))

    def _kafka_topic_size(self) -> tuple[int, int] | None:
        """(listed, configured) while Tansu lists the topic with fewer partitions than
        the replicas were set to use, after a Kafka restart: what the model excuses
        as finding 28 (Model._in_a_partition_kafka_no_longer_lists)."""
        known = self.model.kafka_topic_size
        if self.plan.replicas < 2 or not any(
            kind == "restart_kafka" for _, kind in self.model.fault_log
        ):
            return known
        configured = int(str(self.plan.settings.get("persistence.partitions", 12)))
        try:
            listed = self.system.listed_partitions()
        except Exception as error:  # Kafka paused or away: what was seen last holds
            self.result.notes.append(f"asking kafka for the topic's size failed: {error!r}")
            return known
        if listed is not None and listed < configured:
            return listed, configured
        return None

    def _pubrels_missing(self, start: float, strict: bool) -> bool:
        """QoS 2 ids held from before the drain's reconnect and not released again."""
        missing = False
        now = time.monotonic()
        for sub in self.subs.values():
            if not isinstance(sub, RawClient) or not sub.connected:
                continue
            for pid, held in sub.unreleased():
                msg = self.model.msgs.get(held.payload)
                name = msg.name() if msg is not None else repr(held.payload)
                if held.stage == "rec":
                    expired = (held.expiry is not None and now > held.expiry) or (
                        msg is not None
                        and (gone := msg.expires(self.model.config.default_ttl)) is not None
                        and now > gone
                    )
                    if expired or (
                        strict and msg is not None and self._maybe_trimmed(sub.cid, msg)
                    ):
                        continue  # the PUBREC may not have reached the broker: like a queued one
                missing = True
                if strict:
                    what = "PUBREL" if held.stage == "rel" else "PUBREL or the PUBLISH"
                    seen = ", PUBREL seen" if held.stage == "rel" else ""
                    self.model.violate(
                        "pubrel",
                        f"{sub.cid}: no {what} for packet id {pid} ({name}, PUBREC'd on "
                        f"connection {held.acked_conn}{seen}) "
                        f"within {now - sub.resumed_at:.1f} s of resuming "
                        f"(connection {sub.conn})",
                        dedupe=f"pubrel:{sub.cid}:{pid}:{held.payload!r}",
                    )
        return missing


def run_plan(
    plan: Plan,
    root: Path,
    log: Callable[[str], None] = print,
    stop_kinds: set[str] | None = None,
    ignore: frozenset[str] = frozenset(),
) -> Result:
    return Runner(plan, root, log, ignore).run(stop_kinds)


def shrink(
    plan: Plan,
    kinds: set[str],
    root: Path,
    budget: float,
    log: Callable[[str], None] = print,
    ignore: frozenset[str] = frozenset(),
) -> tuple[Plan, Result | None]:
    """ddmin over ``plan.ops``: the smallest sub-list (within ``budget`` s) that still
    shows a violation of one of ``kinds`` against fresh processes."""
    deadline = time.monotonic() + budget
    ops = list(plan.ops)
    best: Result | None = None
    attempt = 0

    def fails(candidate: list[Op]) -> Result | None:
        nonlocal attempt
        attempt += 1
        trial = Plan(
            plan.seed,
            plan.replicas,
            plan.scenario,
            plan.settings,
            plan.subscribers,
            plan.publishers,
            candidate,
        )
        directory = root / f"shrink-{attempt}"
        result = run_plan(trial, directory, log, stop_kinds=kinds, ignore=ignore)
        hit = result.kinds() & kinds
        log(
            f"  shrink attempt {attempt}: {len(candidate)} ops -> "
            f"{'reproduced ' + ','.join(sorted(hit)) if hit else 'not reproduced'} "
            f"({result.seconds:.0f} s)"
        )
        if hit:
            return result
        shutil.rmtree(directory, ignore_errors=True)
        return None

    n = 2
    while len(ops) >= 2 and time.monotonic() < deadline:
        chunk = max(1, len(ops) // n)
        reduced = False
        for start in range(0, len(ops), chunk):
            if time.monotonic() >= deadline:
                break
            complement = ops[:start] + ops[start + chunk :]
            if not complement:
                continue
            result = fails(complement)
            if result is not None:
                ops, best = complement, result
                n = max(n - 1, 2)
                reduced = True
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(ops), n * 2)
    shrunk = Plan(
        plan.seed,
        plan.replicas,
        plan.scenario,
        plan.settings,
        plan.subscribers,
        plan.publishers,
        ops,
    )
    return shrunk, best
