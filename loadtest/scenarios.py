"""Scenarios: who publishes where, who subscribes to what, which worker runs whom.

- ``p2p``: N publisher/subscriber pairs, pair i on topic ``.../p2p/i``; QoS 1,
  persistent subscribers by default (the shape of TBMQ's P2P test). A pair
  always lives in one worker.
- ``fan-in``: many publishers on ``.../in/<i>``, a few subscribers on the
  wildcard ``.../in/+``; every subscriber gets every message.
- ``fan-out``: one topic (``--publishers`` publishers, default 1), many
  subscribers; every subscriber gets every message.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

__all__ = ["SCENARIOS", "LoadConfig", "Plan", "PublisherSpec", "SubscriberSpec", "make_plan"]

SCENARIOS = ("p2p", "fan-in", "fan-out")

# (publishers, subscribers) when not given
_DEFAULT_SIZES = {"p2p": (100, 100), "fan-in": (100, 2), "fan-out": (1, 100)}


@dataclass
class LoadConfig:
    """Every option of a run (also the ``config`` section of the JSON result)."""

    scenario: str = "p2p"
    host: str = "127.0.0.1"
    port: int = 1883
    pairs: int | None = None  # p2p: publishers = subscribers = pairs
    publishers: int | None = None
    subscribers: int | None = None
    qos: int = 1
    payload_size: int = 64
    rate: float = 0.0  # messages/s per publisher; 0 = as fast as the window allows
    inflight: int = 10  # unacknowledged PUBLISHes per publisher (QoS 0 unthrottled: burst)
    duration: float = 20.0  # measured seconds
    warmup: float = 5.0  # seconds before the measured window
    drain: float = 15.0  # longest wait for outstanding deliveries after publishing stops
    mqtt: str = "3.1.1"  # or "5"
    persistent: bool | None = None  # persistent subscribers; default: p2p yes, others no
    session_expiry: int = 3600  # MQTT 5 session expiry of persistent subscribers
    processes: int = 1
    seed: int | None = None
    reconnect_every: float = 0.0  # subscribers drop and reconnect every S seconds (0: never)
    keep_sessions: bool = False  # leave persistent sessions in the broker afterwards
    connect_concurrency: int = 100
    # Seconds every client of the run has to connect, retrying CONNECTs refused as
    # busy and failed connections with backoff (loadtest/client.py connect)
    connect_timeout: float = 300.0
    label: str = ""
    preset: str = ""  # "fleet": the run was loadtest fleet's preset (loadtest/cli.py)
    # Replicas, each as (MQTT port, metrics port) on ``host``: clients are spread
    # over their ports and latency is reported by whether a subscriber is on the
    # replica that consumes its Kafka partition (loadtest/replicas.py). Empty: one
    # target, ``port``.
    replicas: list[tuple[int, int]] = field(default_factory=list)

    def resolved(self) -> LoadConfig:
        """A copy with the scenario's defaults filled in, checked."""
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r} (one of {', '.join(SCENARIOS)})")
        default_pubs, default_subs = _DEFAULT_SIZES[self.scenario]
        pubs, subs = self.publishers, self.subscribers
        if self.scenario == "p2p":
            n = self.pairs or pubs or subs or default_pubs
            if (pubs and pubs != n) or (subs and subs != n):
                raise ValueError("p2p: --pairs sets both publishers and subscribers")
            pubs = subs = n
        else:
            pubs = pubs or self.pairs or default_pubs
            subs = subs or default_subs
        if self.qos not in (0, 1, 2):
            raise ValueError("--qos must be 0, 1 or 2")
        if self.mqtt not in ("3.1.1", "5"):
            raise ValueError("--mqtt must be 3.1.1 or 5")
        if self.payload_size < 20:
            raise ValueError("--payload-size must be at least 20 (the payload header)")
        if self.inflight < 1 or self.inflight > 65000:
            raise ValueError("--inflight must be 1..65000")
        if self.rate < 0 or self.duration <= 0 or self.warmup < 0 or self.drain < 0:
            raise ValueError("--rate, --warmup and --drain must be >= 0, --duration > 0")
        if self.processes < 1:
            raise ValueError("--processes must be at least 1")
        if self.connect_timeout <= 0:
            raise ValueError("--connect-timeout must be > 0")
        if len(self.replicas) == 1:
            raise ValueError("--replicas needs two or more PORT:METRICS_PORT")
        persistent = self.persistent
        if persistent is None:
            persistent = self.scenario == "p2p"
        seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**31)
        fields = asdict(self)
        fields.update(
            pairs=pubs if self.scenario == "p2p" else None,
            publishers=pubs,
            subscribers=subs,
            persistent=persistent,
            seed=seed,
        )
        return LoadConfig(**fields)

    @property
    def level(self) -> int:
        return 5 if self.mqtt == "5" else 4

    @property
    def total_seconds(self) -> float:
        return self.warmup + self.duration

    def subscriber_port(self, index: int) -> int:
        """Subscriber ``index``'s port: round robin over the replicas."""
        if not self.replicas:
            return self.port
        return self.replicas[index % len(self.replicas)][0]

    def publisher_port(self, index: int) -> int:
        """Publisher ``index``'s port: round robin in runs of ``len(replicas)``, so
        that p2p pairs cover every (publisher replica, subscriber replica) pair."""
        if not self.replicas:
            return self.port
        n = len(self.replicas)
        return self.replicas[(index // n) % n][0]


@dataclass
class PublisherSpec:
    index: int
    client_id: str
    topic: str


@dataclass
class SubscriberSpec:
    index: int
    client_id: str
    topic_filter: str
    publishers: list[int]  # whose messages it must receive


@dataclass
class Plan:
    """The clients of one run, split into per-worker shares."""

    run_id: str
    nonce: int
    padding: bytes
    publishers: list[PublisherSpec] = field(default_factory=list)
    subscribers: list[SubscriberSpec] = field(default_factory=list)
    worker_publishers: list[list[int]] = field(default_factory=list)
    worker_subscribers: list[list[int]] = field(default_factory=list)

    def expected_deliveries(self, acked: dict[int, int]) -> int:
        return sum(acked.get(p, 0) for s in self.subscribers for p in s.publishers)


def make_plan(config: LoadConfig) -> Plan:
    """Topics, client IDs and worker shares for a resolved ``config``.

    The seed gives the run ID (part of every topic and client ID), the nonce
    in every payload and the padding bytes, so two runs with one seed send the
    same bytes. A fresh run ID per run keeps runs apart in the broker: a stale
    persistent session of an earlier run cannot feed this one.
    """
    assert config.publishers is not None and config.subscribers is not None
    rng = random.Random(config.seed)
    run_id = f"{rng.getrandbits(32):08x}"
    nonce = rng.getrandbits(32)
    padding = bytes(rng.getrandbits(8) for _ in range(max(0, config.payload_size - 20)))
    plan = Plan(run_id, nonce, padding)
    workers = config.processes
    plan.worker_publishers = [[] for _ in range(workers)]
    plan.worker_subscribers = [[] for _ in range(workers)]
    base = f"loadtest/{run_id}"
    n_pubs, n_subs = config.publishers, config.subscribers
    if config.scenario == "p2p":
        for i in range(n_pubs):
            topic = f"{base}/p2p/{i}"
            plan.publishers.append(PublisherSpec(i, f"lt-{run_id}-p{i}", topic))
            plan.subscribers.append(SubscriberSpec(i, f"lt-{run_id}-s{i}", topic, [i]))
            plan.worker_publishers[i % workers].append(i)
            plan.worker_subscribers[i % workers].append(i)
        return plan
    every = list(range(n_pubs))
    if config.scenario == "fan-in":
        for i in range(n_pubs):
            plan.publishers.append(PublisherSpec(i, f"lt-{run_id}-p{i}", f"{base}/in/{i}"))
        topic_filter = f"{base}/in/+"
    else:  # fan-out
        for i in range(n_pubs):
            plan.publishers.append(PublisherSpec(i, f"lt-{run_id}-p{i}", f"{base}/out"))
        topic_filter = f"{base}/out"
    for j in range(n_subs):
        plan.subscribers.append(SubscriberSpec(j, f"lt-{run_id}-s{j}", topic_filter, every))
    for i in range(n_pubs):
        plan.worker_publishers[i % workers].append(i)
    for j in range(n_subs):
        # offset so that with few clients of each kind they do not all share worker 0
        plan.worker_subscribers[(j + n_pubs) % workers].append(j)
    return plan
