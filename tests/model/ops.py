"""Operations and the seeded generator of operation sequences.

A :class:`Plan` is everything a run does, fixed by its seed: the broker
settings, the clients, and the list of :class:`Op`. Every operation is
self-contained (a subscribe on a disconnected client resumes it first, a
pause resumes by itself), so any sub-list is a valid plan too: the shrinker
removes operations freely.

The seed also picks a *scenario*, a bias of the weights towards one kind of
trouble (``SCENARIOS``); every scenario still draws from every operation.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

SCENARIOS = (
    "mixed",
    "faults",
    "expiry",
    "clean",
    "kafka",
    "wrap",
    "queues",
    "failover",
    "handover",
)
# The scenarios a seed picks by itself (seed % len): "failover" and "handover" are
# asked for by name (--scenario failover), so every seed keeps the scenario it had.
ROTATION = SCENARIOS[:7]

TOPICS = ("m/a", "m/b", "m/c/d", "m/w")
FILTERS = ("m/a", "m/b", "m/c/d", "m/+", "m/#", "m/c/+")
LONG_EXPIRY = 600
V311_EXPIRY = 604_800  # mqtt.max_session_expiry_interval: a 3.1.1 persistent session


@dataclass(frozen=True)
class Op:
    kind: str
    args: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        for k, v in self.args:
            if k == name:
                return v
        return default

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.args)
        return f"{self.kind}({inner})"


def op(kind: str, **args: Any) -> Op:
    return Op(kind, tuple(args.items()))


@dataclass(frozen=True)
class ClientSpec:
    cid: str
    kind: str  # raw or paho
    version: int  # 4 (3.1.1) or 5
    receive_maximum: int | None = None


@dataclass
class Plan:
    seed: int
    replicas: int
    scenario: str
    settings: dict[str, object]
    subscribers: list[ClientSpec]
    publishers: list[ClientSpec]
    ops: list[Op] = field(default_factory=list)

    @property
    def limit(self) -> int:
        return int(str(self.settings["persistence.max_messages_per_client"]))

    @property
    def max_inflight(self) -> int:
        return int(str(self.settings["mqtt.max_inflight"]))

    @property
    def application(self) -> frozenset[str]:
        """The subscribers whose new persistent sessions are APPLICATION sessions
        (``application.client_ids``, matched as the broker matches them)."""
        patterns = json.loads(str(self.settings.get("application.client_ids", "[]")))
        return frozenset(
            c.cid for c in self.subscribers if any(re.match(p, c.cid) for p in patterns)
        )

    @property
    def default_ttl(self) -> float | None:
        ttl = self.settings.get("persistence.default_message_ttl")
        return None if ttl is None else float(str(ttl))

    def describe(self) -> str:
        subs = ", ".join(f"{c.cid}:{c.kind}/v{c.version}" for c in self.subscribers)
        pubs = ", ".join(f"{c.cid}:{c.kind}/v{c.version}" for c in self.publishers)
        sets = ", ".join(f"{k}={v}" for k, v in sorted(self.settings.items()))
        return (
            f"seed {self.seed}, scenario {self.scenario}, replicas {self.replicas}\n"
            f"  settings: {sets}\n  subscribers: {subs}\n  publishers: {pubs}"
        )


# weights per scenario: op kind -> weight
_BASE = {
    "connect": 8,
    "disconnect": 6,
    "subscribe": 7,
    "unsubscribe": 2,
    "policy": 6,
    "release": 4,
    "publish": 26,
    "wait": 2,
    "kill_broker": 2,
    "restart_redis": 2,
    "restart_kafka": 1,
    # A Kafka client that names the topic (a reader, the stream audit): Tansu makes a
    # topic it does not have at its own size (finding 26). The "kafka" scenario only.
    "name_topic": 0,
    "pause_redis": 2,
    "pause_kafka": 1,
    "drain": 2,
    "settle": 3,
    "held_pubrel": 1,
    "expire_session": 1,
    # $ECQ queues (tests/model/queues.py): only the "queues" scenario draws them, so the
    # other scenarios' plans stay what they were for every seed.
    "ecq_write": 0,
    "ecq_consume": 0,
    "ecq_rewind": 0,
    "ecq_unconsume": 0,
    # $queue group queues (tests/model/groups.py): the "queues" scenario too.
    "group_write": 0,
    "group_join": 0,
    "group_leave": 0,
    # Redis failovers (a replica, a Sentinel, redis_wait: replicas): the "failover"
    # scenario only. lag_replica cuts the replica off, so a failover loses writes.
    "lag_replica": 0,
    "failover": 0,
    # A group queue's writes handed from a member that leaves to one that resumes and
    # leaves in one write, then connects (finding 34): the "handover" scenario only.
    # Last, with weight 0 elsewhere, so the other scenarios draw what they drew
    # before for every seed.
    "group_handover": 0,
}
_BIAS: dict[str, dict[str, int]] = {
    "mixed": {},
    # Redis is a master, a replica and a Sentinel here: it restarts and pauses only
    # by failing over (a paused master would be failed over under the test's feet).
    "failover": {"lag_replica": 4, "failover": 3, "restart_redis": 0, "pause_redis": 0},
    "faults": {"kill_broker": 6, "restart_redis": 5, "pause_redis": 4, "pause_kafka": 3},
    "expiry": {
        "policy": 10,
        "wait": 6,
        "disconnect": 8,
        "connect": 10,
        "held_pubrel": 4,
        "expire_session": 3,
    },
    "clean": {"connect": 14, "pause_redis": 6, "pause_kafka": 3, "disconnect": 4},
    "kafka": {"restart_kafka": 5, "pause_kafka": 3, "name_topic": 2},
    "wrap": {"kill_broker": 1, "restart_kafka": 0},
    "queues": {
        "ecq_write": 16,
        "ecq_consume": 4,
        "ecq_rewind": 2,
        "ecq_unconsume": 1,
        "policy": 10,  # held and delayed acknowledgements: values replaced in flight
        # members that join, leave (unsubscribe, disconnect: the base kinds) mid-flight
        "group_write": 12,
        "group_join": 4,
        "group_leave": 1,
    },
    "handover": {
        "policy": 8,
        "group_write": 8,
        "group_join": 3,
        "group_leave": 1,
        "group_handover": 10,
    },
}


def make_plan(
    seed: int,
    replicas: int,
    n_ops: int,
    scenario: str | None = None,
    application: bool | None = None,
) -> Plan:
    """``application``: whether some subscribers get APPLICATION sessions (None: the
    seed draws it, see :func:`_application_clients`)."""
    rnd = random.Random(seed)
    scenario = scenario or ROTATION[seed % len(ROTATION)]
    max_inflight = rnd.choice((4, 8, 16)) if scenario != "wrap" else 32
    limit = rnd.choice((10, 15, 20, 30, 10_000)) if scenario != "wrap" else rnd.choice((3000, 5000))
    if scenario == "expiry":
        limit = rnd.choice((15, 30, 10_000))
    settings: dict[str, object] = {
        "persistence.max_messages_per_client": max(limit, max_inflight + 4),
        "mqtt.max_inflight": max_inflight,
        "persistence.kafka_request_timeout_ms": 3000,
        # A killed broker's members' claims lapse within the drain's patience.
        "group_queues.lease": 3.0,
    }
    if scenario == "kafka":
        # Not Tansu's default size (4): a topic it makes by itself is another one.
        settings["persistence.partitions"] = 12
    if scenario == "failover":
        settings["persistence.redis_wait"] = "replicas"
        settings["persistence.redis_wait_timeout_ms"] = 1000  # the default
    if rnd.random() < 0.3:
        settings["persistence.replay_page_size"] = rnd.choice((5, 20, 100))
    if scenario in ("expiry", "mixed") and rnd.random() < 0.25:
        settings["persistence.default_message_ttl"] = rnd.choice((6, 10, 20))
    subscribers = []
    n_subs = rnd.randint(2, 4)
    for i in range(n_subs):
        kind = "paho" if rnd.random() < 0.2 else "raw"
        version = 5 if rnd.random() < 0.7 else 4
        rm = rnd.choice((None, None, 2, 5, 20)) if version == 5 else None
        subscribers.append(ClientSpec(f"s{i}", kind, version, rm))
    if scenario == "wrap":
        subscribers[0] = ClientSpec("s0", "raw", 5, None)
    publishers = [
        ClientSpec("p0", "raw", 5),
        ClientSpec("p1", "raw", rnd.choice((4, 5))),
        ClientSpec("p2", "paho", rnd.choice((4, 5))),
    ]
    plan = Plan(seed, replicas, scenario, settings, subscribers, publishers)
    gen = _Generator(rnd, plan)
    plan.ops = gen.generate(n_ops)
    chosen = _application_clients(seed, replicas, scenario, subscribers, application)
    if chosen:
        settings["application.client_ids"] = json.dumps([f"^{c}$" for c in chosen])
    return plan


def _application_clients(
    seed: int,
    replicas: int,
    scenario: str,
    subscribers: list[ClientSpec],
    wanted: bool | None,
) -> list[str]:
    """The subscribers that get APPLICATION sessions (docs/application-sessions.md),
    from a generator of their own, so a seed's operations stay what they were. None
    with replicas (refused at start) nor in "wrap" (its ~65k copies for one session
    outlast the drain through Kafka: seed 306 of the first run still received at its
    end); drawn (``wanted`` None) in about half the plans but those of "failover".
    With replicas only when asked (``--application on``): the seeds the suite runs
    with replicas draw none, as before replicas served them."""
    if (replicas > 1 and not wanted) or wanted is False or scenario == "wrap":
        return []
    rnd = random.Random(f"application-{seed}")
    drawn = rnd.random() >= 0.5 and scenario != "failover"
    if not (wanted or drawn):
        return []
    count = rnd.randint(1, max(1, len(subscribers) - 1))
    return sorted(rnd.sample([c.cid for c in subscribers], count))


class _Generator:
    def __init__(self, rnd: random.Random, plan: Plan) -> None:
        self.rnd = rnd
        self.plan = plan
        self.weights = {**_BASE, **_BIAS[plan.scenario]}
        self.short_expiry = plan.scenario == "expiry"
        # Its own stream: drawing from it leaves every seed's other operations as
        # they were (pinned seeds reproduce what they found).
        self.freeze_rnd = random.Random(f"freeze-{plan.seed}")

    def generate(self, n_ops: int) -> list[Op]:
        rnd = self.rnd
        ops: list[Op] = []
        for spec in self.plan.subscribers:
            ops.append(self._connect(spec, initial=True))
            ops.append(self._subscribe(spec))
            if self.plan.scenario == "queues" and rnd.random() < 0.7:
                ops.append(op("ecq_consume", client=spec.cid))
        if self.plan.scenario == "wrap":
            ops.extend(self._wrap())
        kinds = list(self.weights)
        weights = [self.weights[k] for k in kinds]
        while len(ops) < n_ops:
            kind = rnd.choices(kinds, weights)[0]
            made = getattr(self, f"_{kind}")()
            ops.extend(made if isinstance(made, list) else [made])
        return ops

    # -- helpers ---------------------------------------------------------------------

    def _sub(self) -> ClientSpec:
        return self.rnd.choice(self.plan.subscribers)

    def _broker(self) -> int:
        return self.rnd.randrange(self.plan.replicas)

    def _expiry_for(self, spec: ClientSpec) -> int:
        r = self.rnd.random()
        if spec.version == 4:
            return 0 if r < 0.15 else V311_EXPIRY
        short = 0.35 if self.short_expiry else 0.12
        if r < 0.08:
            return 0
        if r < 0.08 + short:
            return self.rnd.choice((2, 3, 4))
        return LONG_EXPIRY

    # -- operations --------------------------------------------------------------------

    def _connect(self, spec: ClientSpec | None = None, initial: bool = False) -> Op:
        spec = spec or self._sub()
        clean_p = 0.0 if initial else (0.35 if self.plan.scenario == "clean" else 0.15)
        expiry = LONG_EXPIRY if initial and spec.version == 5 else self._expiry_for(spec)
        if initial and spec.version == 4:
            expiry = V311_EXPIRY
        args: dict[str, Any] = {
            "client": spec.cid,
            "clean": self.rnd.random() < clean_p,
            "expiry": expiry,
            "broker": self._broker(),
        }
        if not initial and self.plan.replicas > 1 and self.freeze_rnd.random() < 0.3:
            # Back through another replica before the old one hears the connection
            # end (frozen across it): a takeover that reads what the old one keeps
            # (tests/model/FINDINGS.md, finding 37).
            args["freeze_old"] = True
        return op("connect", **args)

    def _disconnect(self) -> Op:
        return op("disconnect", client=self._sub().cid, abrupt=self.rnd.random() < 0.6)

    def _subscribe(self, spec: ClientSpec | None = None) -> Op:
        spec = spec or self._sub()
        n = self.rnd.randint(1, 2)
        entries = []
        for _ in range(n):
            topic_filter = self.rnd.choice(FILTERS)
            if spec.version == 5 and self.rnd.random() < 0.25:
                topic_filter = f"$share/g{self.rnd.randint(0, 2)}/{topic_filter}"
            qos = (
                self.rnd.choice((0, 1, 1, 2, 2))
                if spec.kind == "raw"
                else self.rnd.choice((0, 1, 1))
            )
            entries.append((topic_filter, qos))
        return op("subscribe", client=spec.cid, filters=tuple(entries))

    def _unsubscribe(self) -> Op:
        spec = self._sub()
        topic_filter = self.rnd.choice(FILTERS)
        return op("unsubscribe", client=spec.cid, filter=topic_filter)

    def _policy(self) -> Op:
        spec = self._sub()
        if spec.kind == "paho":
            choices: tuple[str, ...] = ("auto", "auto", "delay", "hold")
        elif self.plan.scenario == "expiry":
            choices = ("auto", "delay", "hold", "hold_comp", "hold_comp")
        else:
            choices = ("auto", "auto", "delay", "hold", "hold_comp")
        return op("policy", client=spec.cid, policy=self.rnd.choice(choices))

    def _release(self) -> Op:
        return op("release", client=self._sub().cid)

    def _publish(self) -> Op:
        rnd = self.rnd
        pub = rnd.choice(self.plan.publishers)
        qos = rnd.choices((0, 1, 2), (1, 4, 3))[0]
        count = rnd.choice((1, 1, 2, 3, 5, 8, 20))
        expiry = None
        if pub.version == 5:
            r = rnd.random()
            short_p = 0.4 if self.short_expiry else 0.15
            if r < short_p:
                expiry = rnd.choice((1, 2, 3))
            elif r < short_p + 0.1:
                expiry = rnd.choice((10, 30))
        return op(
            "publish",
            client=pub.cid,
            topic=rnd.choice(TOPICS[:3]),
            qos=qos,
            count=count,
            expiry=expiry,
            background=rnd.random() < 0.3,
            broker=self._broker(),
        )

    def _ecq_write(self) -> Op:
        """Writes to a subscriber's queue; a key belongs to one publisher (its name)."""
        rnd = self.rnd
        pub = rnd.choice(self.plan.publishers)
        return op(
            "ecq_write",
            client=pub.cid,
            queue=self._sub().cid,
            key=f"{pub.cid}-k{rnd.randrange(3)}",
            qos=rnd.choice((1, 1, 2)),
            count=rnd.choice((1, 2, 3, 5, 10)),
            broker=self._broker(),
        )

    def _group_write(self) -> Op:
        rnd = self.rnd
        return op(
            "group_write",
            client=rnd.choice(self.plan.publishers).cid,
            group=f"g{rnd.randrange(2)}",
            qos=rnd.choice((1, 1, 2)),
            count=rnd.choice((1, 2, 5, 10, 20)),
            broker=self._broker(),
        )

    def _group_handover(self) -> list[Op]:
        """A member leaves holding writes it was sent and did not acknowledge (they go
        back to the group, may have been seen); another member's persistent session
        resumes and leaves in one write (``blink``: its connection closes while its
        claim of those writes is on its way), then connects. Finding 34: the
        give-back of that connection, decided before the claim landed, took their
        DUP away."""
        rnd = self.rnd
        holder, taker = rnd.sample(self.plan.subscribers, 2)
        group = f"g{rnd.randrange(2)}"
        expiry = LONG_EXPIRY if taker.version == 5 else V311_EXPIRY
        broker = self._broker()
        return [
            op("group_join", client=holder.cid, group=group),
            op("group_join", client=taker.cid, group=group),
            op("policy", client=holder.cid, policy="hold"),
            op(
                "group_write",
                client=rnd.choice(self.plan.publishers).cid,
                group=group,
                qos=1,
                count=rnd.choice((5, 10, 20)),
                broker=self._broker(),
            ),
            op("settle", client=holder.cid),
            op("disconnect", client=taker.cid, abrupt=False),
            op("disconnect", client=holder.cid, abrupt=rnd.random() < 0.5),
            op("blink", client=taker.cid, expiry=expiry, broker=broker),
            op("connect", client=taker.cid, clean=False, expiry=expiry, broker=broker),
            op("policy", client=holder.cid, policy="auto"),
        ]

    def _group_join(self) -> Op:
        return op("group_join", client=self._sub().cid, group=f"g{self.rnd.randrange(2)}")

    def _group_leave(self) -> Op:
        return op("group_leave", client=self._sub().cid, group=f"g{self.rnd.randrange(2)}")

    def _ecq_consume(self) -> Op:
        return op("ecq_consume", client=self._sub().cid)

    def _ecq_rewind(self) -> Op:
        return op("ecq_rewind", client=self._sub().cid, seq=self.rnd.choice((1, 1, 5, 20)))

    def _ecq_unconsume(self) -> Op:
        return op("ecq_unconsume", client=self._sub().cid)

    def _settle(self) -> Op:
        return op("settle", client=self._sub().cid)

    def _wait(self) -> Op:
        return op("wait", seconds=self.rnd.choice((0.5, 1.0, 2.5, 5.0)))

    def _kill_broker(self) -> Op:
        return op(
            "kill_broker",
            broker=self._broker(),
            down=self.rnd.choice((0.0, 0.5, 2.0)),
            failover=self.plan.replicas > 1 and self.rnd.random() < 0.5,
        )

    def _restart_redis(self) -> Op:
        return op("restart_redis", signal=self.rnd.choice(("TERM", "KILL")))

    def _restart_kafka(self) -> Op | list[Op]:
        if self.plan.scenario == "kafka":
            roll = self.rnd.random()
            if roll < 0.35:
                # named before the broker has made it again (finding 26)
                return [op("restart_kafka"), op("name_topic")]
            if roll < 0.5:
                # the brokers stopped across the restart and the naming: Tansu's own
                # topic is what they find, for certain (finding 27)
                return op("restart_kafka", frozen=True)
        return op("restart_kafka")

    def _name_topic(self) -> Op:
        return op("name_topic")

    def _lag_replica(self) -> list[Op]:
        # A subscriber away meanwhile: what is published for it lives only in Redis (a
        # connected one gets it from the broker's memory, lost saves or not).
        return [op("lag_replica"), self._disconnect(), self._publish()]

    def _failover(self) -> list[Op]:
        # Publishes while the master is down (their saves wait for the new master) and
        # right after: a later record of a producer stored on the new master before
        # the loss is seen is what hid the lost ones (finding 25).
        during = self._publish()
        during = Op(
            during.kind, tuple((k, False if k == "background" else v) for k, v in during.args)
        )
        return [op("failover", during=during), self._publish()]

    def _pause_redis(self) -> list[Op]:
        out = [op("pause_redis", seconds=self.rnd.choice((0.5, 1.5, 3.0)))]
        if self.plan.scenario == "clean":  # the window finding 3 needs: records not yet stored
            spec = self._sub()
            out.append(self._publish())
            out.append(
                op(
                    "connect",
                    client=spec.cid,
                    clean=True,
                    expiry=LONG_EXPIRY if spec.version == 5 else V311_EXPIRY,
                    broker=self._broker(),
                )
            )
        return out

    def _pause_kafka(self) -> Op:
        return op("pause_kafka", seconds=self.rnd.choice((0.5, 1.5, 4.0)))

    def _held_pubrel(self) -> list[Op]:
        """A QoS 2 receiver that has the PUBREL but holds PUBCOMP, away past the expiry."""
        raw = [c for c in self.plan.subscribers if c.kind == "raw"]
        if not raw:
            return []
        spec = self.rnd.choice(raw)
        expiry = self.rnd.choice((1, 2))
        pub = self.rnd.choice([p for p in self.plan.publishers if p.version == 5])
        topic = self.rnd.choice(TOPICS[:3])
        return [
            op("subscribe", client=spec.cid, filters=((topic, 2),)),
            op("policy", client=spec.cid, policy="hold_comp"),
            op(
                "publish",
                client=pub.cid,
                topic=topic,
                qos=2,
                count=self.rnd.randint(1, 3),
                expiry=expiry,
                background=False,
                broker=self._broker(),
            ),
            op("settle", client=spec.cid),
            op("disconnect", client=spec.cid, abrupt=self.rnd.random() < 0.5),
            op("wait", seconds=expiry + 1.0),
            op("policy", client=spec.cid, policy="auto"),
            op(
                "connect",
                client=spec.cid,
                clean=False,
                expiry=LONG_EXPIRY if spec.version == 5 else V311_EXPIRY,
                broker=self._broker(),
            ),
        ]

    def _expire_session(self) -> list[Op]:
        """A short Session Expiry Interval, messages while away, back after it passed."""
        spec = self.rnd.choice([c for c in self.plan.subscribers if c.version == 5] or [None])
        if spec is None:
            return []
        expiry = self.rnd.choice((1, 2))
        pub = self.rnd.choice(self.plan.publishers)
        topic = self.rnd.choice(TOPICS[:3])
        return [
            op("connect", client=spec.cid, clean=False, expiry=expiry, broker=self._broker()),
            op("subscribe", client=spec.cid, filters=((topic, self.rnd.choice((1, 2))),)),
            op("disconnect", client=spec.cid, abrupt=self.rnd.random() < 0.5),
            op(
                "publish",
                client=pub.cid,
                topic=topic,
                qos=self.rnd.choice((1, 2)),
                count=self.rnd.choice((1, 5, 20)),
                expiry=None,
                background=self.rnd.random() < 0.5,
                broker=self._broker(),
            ),
            op("wait", seconds=expiry + 3.0),
            op("connect", client=spec.cid, clean=False, expiry=LONG_EXPIRY, broker=self._broker()),
        ]

    def _drain(self) -> Op:
        return op("drain", abrupt=self.rnd.random() < 0.5)

    def _wrap(self) -> list[Op]:
        """Held ids, then enough copies for the packet ids to come round (65535).

        Many shared-subscription groups multiply the copies one PUBLISH makes for
        the same session (one per group), so the flood needs ~65535/(groups+1)
        publishes. The held copies are either trimmed (newer ones pushed over the
        limit while the client is away) or expire (and the replay drops them).
        """
        rnd = self.rnd
        groups = rnd.randint(60, 120)
        per = groups + 1
        expire = rnd.random() < 0.5
        ops = [
            op("subscribe", client="s0", filters=(("m/w", 1),)),
            op("groups", client="s0", topic="m/w", n=groups),
            op("policy", client="s0", policy="hold"),
            op(
                "publish",
                client="p0",
                topic="m/w",
                qos=1,
                count=rnd.randint(1, 2),
                expiry=1 if expire else None,
                background=False,
                broker=0,
            ),
            op("settle", client="s0"),
            op("disconnect", client="s0", abrupt=True),
        ]
        if expire:
            ops.append(op("wait", seconds=2.0))
        else:
            ops.append(
                op(
                    "publish",
                    client="p0",
                    topic="m/w",
                    qos=1,
                    count=(self.plan.limit + 50) // per + 1,
                    expiry=None,
                    background=False,
                    broker=0,
                )
            )
        ops += [
            op("policy", client="s0", policy="auto"),
            op("connect", client="s0", clean=False, expiry=LONG_EXPIRY, broker=0),
            op("flood", client="p0", topic="m/w", wrap="s0", past=rnd.randint(0, 1000), broker=0),
            op("settle", client="s0"),
        ]
        return ops
