"""``loadtest fleet --storm``: the reconnect storm of a fleet of persistent devices.

1. subscribe: each of ``--devices`` devices connects with a persistent session
   (clean session 0; MQTT 5: a session expiry), subscribes to its own topic at
   QoS 1 and disconnects: the fleet is offline;
2. store: a publisher per device publishes ``--backlog`` QoS 1 messages to its
   topic (62 B, the fleet's shape), every one acknowledged, then disconnects:
   the broker now holds a backlog of that many messages per offline session;
3. storm: every device reconnects at a moment drawn evenly from the first
   ``--storm-window`` seconds, with its session (session present expected),
   and receives its backlog. Timed from the storm's start until every device
   has its whole backlog; each device's own time from its CONNECT too.

Checked: every device got seq 0..backlog-1 of its topic exactly once, in
order, with its session still there. Sampled every ``SAMPLE_INTERVAL`` seconds
from before the storm to its end: the RSS of the broker (the process
listening on the port) and of its process tree (the embedded Redis and Kafka
broker are its children); the report gives the curve as a few points, and
``--plot`` draws it with the devices complete over time.

One process, one event loop (uvloop), whatever ``--processes`` says: the
storm's client side is receiving, ~10,000 messages a second at most here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from time import monotonic_ns
from typing import Any

from loadtest import procstat
from loadtest.client import NS, ClientError, Publisher, Stats, Subscriber, _Client
from loadtest.scenarios import LoadConfig, make_plan
from loadtest.worker import raise_nofile_limit

__all__ = ["StormConfig", "format_storm", "run_from_args", "run_storm"]

SAMPLE_INTERVAL = 0.5  # seconds between RSS samples
STALL_TIMEOUT = 60.0  # seconds without a PUBACK before the store phase gives up
CURVE_POINTS = 8  # RSS points in the text report


@dataclass
class StormConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    devices: int = 1000
    backlog: int = 100  # stored messages per device
    window: float = 10.0  # seconds over which the devices reconnect
    goal: float = 60.0  # seconds from the storm's start to every backlog delivered
    drain: float = 15.0  # waited past the goal for the last backlogs before giving up
    mqtt: str = "3.1.1"
    payload_size: int = 62
    inflight: int = 10
    session_expiry: int = 3600  # MQTT 5
    seed: int | None = None
    connect_timeout: float = 300.0
    connect_concurrency: int = 100
    keep_sessions: bool = False
    label: str = ""

    def resolved(self) -> StormConfig:
        if self.devices < 1:
            raise ValueError("--devices must be at least 1")
        if self.backlog < 1:
            raise ValueError("--backlog must be at least 1")
        if self.window < 0 or self.goal <= 0 or self.drain < 0:
            raise ValueError("--storm-window and --drain must be >= 0, --storm-goal > 0")
        if self.payload_size < 20:
            raise ValueError("--payload-size must be at least 20 (the payload header)")
        if self.mqtt not in ("3.1.1", "5"):
            raise ValueError("--mqtt must be 3.1.1 or 5")
        if self.connect_timeout <= 0:
            raise ValueError("--connect-timeout must be > 0")
        seed = self.seed if self.seed is not None else random.SystemRandom().randrange(2**31)
        return StormConfig(**{**asdict(self), "seed": seed})

    @property
    def level(self) -> int:
        return 5 if self.mqtt == "5" else 4


class _Device(Subscriber):
    """A subscriber that notes when its backlog (seq 0..backlog-1) is whole."""

    def __init__(self, backlog: int, *args: Any) -> None:
        super().__init__(*args)
        self.backlog = backlog
        self.connect_ns = 0  # when it began to reconnect
        self.complete_ns = 0  # when its backlog was whole

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.complete_ns and self.received >= self.backlog:
            stream = self.streams.get(self.index)
            if stream is not None and stream.counts[: self.backlog].count(0) == 0:
                self.complete_ns = monotonic_ns()


class _Storm:
    def __init__(self, config: StormConfig, progress: bool) -> None:
        self.config = config
        self.show = progress
        lc = LoadConfig(
            "p2p", config.host, config.port, pairs=config.devices, seed=config.seed
        ).resolved()
        self.plan = make_plan(lc)
        self.stats = Stats()
        self.errors: list[str] = []
        self.busy_refusals = 0
        self.connect_failures = 0
        self.rss: list[tuple[float, int | None, int | None]] = []  # (s, broker KiB, tree KiB)
        self.pid = procstat.find_listener_pid(config.port) if _local(config.host) else None
        self._pids: list[int] = []
        self.cpu_parts: dict[str, float] = {}

    def say(self, text: str) -> None:
        if self.show:
            sys.stderr.write(f"storm: {text}\n")
            sys.stderr.flush()

    def device(self, i: int) -> _Device:
        c = self.config
        spec = self.plan.subscribers[i]
        expiry = c.session_expiry if c.level == 5 else 0
        return _Device(
            c.backlog,
            i,
            spec.client_id,
            spec.topic_filter,
            1,
            self.plan.nonce,
            c.level,
            False,
            expiry,
            self.stats,
        )

    async def bounded(self, jobs: list[Callable[[], Awaitable[None]]]) -> None:
        gate = asyncio.Semaphore(self.config.connect_concurrency)

        async def one(job: Callable[[], Awaitable[None]]) -> None:
            async with gate:
                await job()

        await asyncio.gather(*(one(job) for job in jobs))

    def _count(self, clients: list[Any]) -> None:
        self.busy_refusals += sum(c.busy_refusals for c in clients)
        self.connect_failures += sum(c.connect_failures for c in clients)

    # -- phases ---------------------------------------------------------------------

    async def subscribe(self) -> float:
        c = self.config
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + c.connect_timeout
        devices = [self.device(i) for i in range(c.devices)]

        async def one(d: _Device) -> None:
            await d.start(c.host, c.port, max(deadline - loop.time(), 0.1))
            if d.session_present:
                self.errors.append(f"{d.client_id}: a session was present on first connect")
            await d.disconnect()

        try:
            await self.bounded([lambda d=d: one(d) for d in devices])  # type: ignore[misc]
        finally:
            self._count(devices)
        return loop.time() - started

    async def store(self) -> float:
        c = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + c.connect_timeout
        publishers = []
        for spec in self.plan.publishers:
            p = Publisher(
                spec.index,
                spec.client_id,
                spec.topic,
                1,
                c.payload_size,
                self.plan.nonce,
                c.level,
                Stats(),
                0.0,
                c.inflight,
                self.plan.padding,
            )
            p.limit = c.backlog
            publishers.append(p)
        started = loop.time()

        async def one(p: Publisher) -> None:
            await p.connect(c.host, c.port, max(deadline - loop.time(), 0.1))
            p.start(monotonic_ns())

        try:
            await self.bounded([lambda p=p: one(p) for p in publishers])  # type: ignore[misc]
            total = c.devices * c.backlog
            acked, last_change = 0, loop.time()
            while acked < total:
                await asyncio.sleep(0.05)
                now_acked = sum(p.acked_count for p in publishers)
                if now_acked != acked:
                    acked, last_change = now_acked, loop.time()
                lost = [p.client_id for p in publishers if not p.connected]
                if lost:
                    raise ClientError(f"{lost[0]}: lost its connection while storing")
                if loop.time() - last_change > STALL_TIMEOUT:
                    raise ClientError(
                        f"storing stalled: {acked:,} of {total:,} messages acknowledged, "
                        f"none for {STALL_TIMEOUT:.0f} s"
                    )
            rejected = sum(p.rejected for p in publishers)
            if rejected:
                raise ClientError(f"{rejected} PUBLISHes rejected while storing the backlogs")
        finally:
            self._count(publishers)
            await asyncio.gather(*(p.disconnect() for p in publishers), return_exceptions=True)
        return loop.time() - started

    async def sample_rss(self, t0: int, stop: asyncio.Event) -> None:
        if self.pid is None:
            return
        self._pids = procstat.tree([self.pid])
        while True:
            broker = procstat.rss_kib(self.pid)
            parts = [procstat.rss_kib(p) for p in self._pids]
            tree = sum(v for v in parts if v is not None) if any(parts) else None
            self.rss.append((round((monotonic_ns() - t0) / NS, 2), broker, tree))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL)
                return

    async def storm(self) -> dict[str, Any]:
        c = self.config
        rng = random.Random(f"{c.seed}/storm")
        devices = [self.device(i) for i in range(c.devices)]
        offsets = [rng.random() * c.window for _ in devices]
        t0 = monotonic_ns() + NS // 10
        self.stats.restart(t0)
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sample_rss(t0, stop))
        cpu_start = procstat.sample([self.pid] if self.pid else [])
        end = t0 + int((c.goal + c.drain) * NS)
        connected: list[int] = []

        async def one(d: _Device, offset: float) -> None:
            await asyncio.sleep(max(0.0, (t0 + int(offset * NS) - monotonic_ns()) / NS))
            d.connect_ns = monotonic_ns()
            try:
                await d.start(c.host, c.port, max((end - monotonic_ns()) / NS, 0.1))
            except ClientError as e:
                self.errors.append(str(e))
                return
            connected.append(monotonic_ns())
            if not d.session_present:
                self.errors.append(f"{d.client_id}: its session was gone (session present 0)")

        tasks = [asyncio.create_task(one(d, o)) for d, o in zip(devices, offsets, strict=True)]
        next_say = t0
        while monotonic_ns() < end:
            if all(d.complete_ns for d in devices):
                break
            if monotonic_ns() >= next_say:
                done = sum(1 for d in devices if d.complete_ns)
                self.say(
                    f"{(monotonic_ns() - t0) / NS:5.1f} s: {len(connected):,} reconnected, "
                    f"{done:,} of {c.devices:,} backlogs whole"
                )
                next_say += 5 * NS
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # a duplicate right behind the last message still counts
        stop.set()
        await sampler
        cpu_end = procstat.sample([self.pid] if self.pid else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._count(devices)
        await asyncio.gather(*(d.disconnect() for d in devices), return_exceptions=True)
        broker_cores = None
        if cpu_start.watched is not None and cpu_end.watched is not None:
            broker_cores = (cpu_end.watched - cpu_start.watched) / (cpu_end.wall - cpu_start.wall)
        self.cpu_parts = procstat.cores_by_process(
            cpu_start, cpu_end, [self.pid] if self.pid else []
        )
        return self._result(devices, t0, connected, broker_cores)

    def _result(
        self,
        devices: list[_Device],
        t0: int,
        connected: list[int],
        broker_cores: float | None,
    ) -> dict[str, Any]:
        c = self.config
        lost = duplicates = out_of_order = unexpected = 0
        for d in devices:
            stream = d.streams.get(d.index)
            counts = stream.counts if stream is not None else bytearray()
            head = counts[: c.backlog]
            lost += head.count(0) + (c.backlog - len(head))
            unexpected += len(counts[c.backlog :]) - counts[c.backlog :].count(0)
            unexpected += sum(
                len(s.counts) - s.counts.count(0) for p, s in d.streams.items() if p != d.index
            )
            duplicates += d.duplicates
            out_of_order += d.out_of_order
        sessions_lost = sum(1 for e in self.errors if "session was gone" in e)
        complete = [d for d in devices if d.complete_ns]
        whole_s = (max(d.complete_ns for d in complete) - t0) / NS if complete else None
        all_whole = len(complete) == len(devices)
        per_device = sorted((d.complete_ns - d.connect_ns) // 1000 for d in complete)
        delivered_per_s = [len(b.e2e) for b in self.stats.buckets]
        check = {
            "expected": c.devices * c.backlog,
            "delivered": c.devices * c.backlog - lost,
            "lost": lost,
            "duplicates": duplicates,
            "out_of_order": out_of_order,
            "unexpected": unexpected,
            "sessions_lost": sessions_lost,
        }
        check["ok"] = bool(
            all_whole and not (lost or duplicates or out_of_order or unexpected or sessions_lost)
        )
        rss = self.rss
        broker_kib = [b for _, b, _ in rss if b is not None]
        tree_kib = [t for _, _, t in rss if t is not None]
        return {
            "label": c.label or f"{c.host}:{c.port}",
            "target": f"{c.host}:{c.port}",
            "scenario": "fleet --storm",
            "config": asdict(c),
            "run_id": self.plan.run_id,
            "storm": {
                "all_whole_seconds": round(whole_s, 3) if all_whole and whole_s else None,
                "within_goal": bool(all_whole and whole_s is not None and whole_s <= c.goal),
                "devices_whole": len(complete),
                "last_reconnect_seconds": round((max(connected) - t0) / NS, 3)
                if connected
                else None,
                "per_device_ms": _percentiles_ms(per_device),
                "delivered_per_second": delivered_per_s,
                "broker_cores": round(broker_cores, 3) if broker_cores is not None else None,
                "broker_cores_by_process": self.cpu_parts,
            },
            "check": check,
            "rss": {
                "broker_pid": self.pid,
                "pids": self._pids,
                "interval_s": SAMPLE_INTERVAL,
                "samples": [list(s) for s in rss],
                "broker_before_mib": _mib(broker_kib[0]) if broker_kib else None,
                "broker_peak_mib": _mib(max(broker_kib)) if broker_kib else None,
                "tree_before_mib": _mib(tree_kib[0]) if tree_kib else None,
                "tree_peak_mib": _mib(max(tree_kib)) if tree_kib else None,
            },
            "connect_busy_refusals": self.busy_refusals,
            "connect_failures": self.connect_failures,
            "errors": self.errors[:100],
        }

    async def cleanup(self) -> None:
        """Remove the run's sessions: connect once more with a clean session."""
        c = self.config
        if c.keep_sessions:
            return

        async def clean(client_id: str) -> None:
            client = _Client(client_id, c.level, True, 0, Stats())
            try:
                await client.connect(c.host, c.port, timeout=c.connect_timeout)
                await client.disconnect()
            except ClientError as e:
                self.errors.append(f"cleanup: {e}")

        await self.bounded(
            [lambda i=s.client_id: clean(i) for s in self.plan.subscribers]  # type: ignore[misc]
        )

    async def run(self) -> dict[str, Any]:
        c = self.config
        self.say(f"{c.devices:,} devices subscribe and go offline")
        subscribe_s = await self.subscribe()
        self.say(f"storing {c.backlog} messages for each ({c.devices * c.backlog:,})")
        store_s = await self.store()
        self.say(
            f"stored in {store_s:.1f} s; all reconnect within {c.window:g} s "
            f"(goal: every backlog whole within {c.goal:g} s)"
        )
        result = await self.storm()
        await self.cleanup()
        stored = c.devices * c.backlog
        result["subscribe_seconds"] = round(subscribe_s, 3)
        result["store"] = {
            "messages": stored,
            "seconds": round(store_s, 3),
            "rate": round(stored / store_s, 1) if store_s > 0 else None,
        }
        result["connect_busy_refusals"] = self.busy_refusals
        result["connect_failures"] = self.connect_failures
        result["errors"] = self.errors[:100]
        return result


def _local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


def _percentiles_ms(ordered: list[int]) -> dict[str, float | None]:
    n = len(ordered)
    if not n:
        return {"p50": None, "p99": None, "max": None}

    def rank(q: float) -> float:
        return ordered[min(n - 1, max(0, int(q * n + 0.999999) - 1))] / 1000

    return {"p50": rank(0.5), "p99": rank(0.99), "max": ordered[-1] / 1000}


def run_storm(config: StormConfig, progress: bool = True) -> dict[str, Any]:
    """Run the storm against ``config.host:config.port``; the result dict. Raises
    ``ClientError`` if the fleet could not be set up (connect, store)."""
    config = config.resolved()
    raise_nofile_limit()
    from loadtest.worker import _loop_factory

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_Storm(config, progress).run())


def _curve(samples: list[list[Any]], index: int) -> list[tuple[float, int]]:
    """At most ``CURVE_POINTS`` (seconds, KiB) points, evenly spread, with the peak."""
    points = [(s[0], s[index]) for s in samples if s[index] is not None]
    if len(points) <= CURVE_POINTS:
        return points
    step = (len(points) - 1) / (CURVE_POINTS - 1)
    chosen = {round(i * step) for i in range(CURVE_POINTS)}
    chosen.add(max(range(len(points)), key=lambda i: points[i][1]))
    return [points[i] for i in sorted(chosen)]


def format_storm(r: dict[str, Any]) -> str:
    c, s, check, rss = r["config"], r["storm"], r["check"], r["rss"]
    lines = [
        f"fleet --storm: {c['devices']:,} persistent devices (MQTT {c['mqtt']}), "
        f"{c['backlog']} stored QoS 1 messages of {c['payload_size']} B each, "
        f"all reconnect within {c['window']:g} s",
        f"subscribed and offline in {r['subscribe_seconds']:.1f} s; "
        f"{r['store']['messages']:,} messages stored in {r['store']['seconds']:.1f} s "
        f"({r['store']['rate'] or 0:,.0f}/s)",
    ]
    if s["all_whole_seconds"] is not None:
        verdict = "within" if s["within_goal"] else "OVER"
        lines.append(
            f"every backlog whole and in order {s['all_whole_seconds']:.1f} s after the storm "
            f"began ({verdict} the {c['goal']:g} s goal); last reconnect at "
            f"{s['last_reconnect_seconds']:.1f} s"
        )
    else:
        lines.append(
            f"NOT every backlog delivered: {s['devices_whole']:,} of {c['devices']:,} devices "
            f"whole after {c['goal'] + c['drain']:g} s"
        )
    per = s["per_device_ms"]
    if per["p50"] is not None:
        lines.append(
            f"per device, its reconnect to its whole backlog: p50 {per['p50']:,.0f} ms, "
            f"p99 {per['p99']:,.0f} ms, max {per['max']:,.0f} ms"
        )
    if rss["broker_pid"] is None:
        lines.append("broker RSS: not sampled (no local process listening on the port)")
    else:
        curve = ", ".join(f"{t:.1f} s {kib / 1024:,.0f}" for t, kib in _curve(rss["samples"], 1))
        lines.append(
            f"broker RSS MiB (pid {rss['broker_pid']}): {curve}; peak {rss['broker_peak_mib']:,}"
        )
        curve = ", ".join(f"{t:.1f} s {kib / 1024:,.0f}" for t, kib in _curve(rss["samples"], 2))
        lines.append(
            f"with its Redis and Kafka ({len(rss['pids'])} processes): {curve}; "
            f"peak {rss['tree_peak_mib']:,}"
        )
        if s["broker_cores"] is not None:
            parts = ", ".join(
                f"{name} {cores:.2f}" for name, cores in s["broker_cores_by_process"].items()
            )
            lines.append(
                f"server CPU during the storm: {s['broker_cores']:.2f} cores"
                + (f" ({parts})" if parts else "")
            )
    verdict = "OK" if check["ok"] and s["within_goal"] else "FAILED"
    lines.append(
        f"check: {verdict}: {check['delivered']:,} of {check['expected']:,} delivered, "
        f"{check['lost']} lost, {check['duplicates']} duplicates, {check['out_of_order']} out "
        f"of order, {check['unexpected']} unexpected, {check['sessions_lost']} sessions lost"
    )
    from loadtest.client import THROTTLE_HINT

    if r["connect_busy_refusals"] or r["connect_failures"]:
        lines.append(
            f"connect: retried {r['connect_busy_refusals']:,} CONNECTs refused as busy and "
            f"{r['connect_failures']:,} failed connections"
        )
    if r["connect_busy_refusals"]:
        lines.append(f"throttled: {THROTTLE_HINT}")
    for error in r["errors"][:10]:
        lines.append(f"  error: {error}")
    return "\n".join(lines)


def plot_storm(path: str | Path, r: dict[str, Any]) -> None:
    """Broker RSS (and its tree's) and messages delivered a second, over the storm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem_ax, rate_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    samples = r["rss"]["samples"]
    t = [s[0] for s in samples]
    mem_ax.plot(t, [(s[1] or 0) / 1024 for s in samples], label="broker")
    mem_ax.plot(t, [(s[2] or 0) / 1024 for s in samples], label="broker + Redis + Kafka")
    mem_ax.set_ylabel("RSS, MiB")
    mem_ax.legend(fontsize=8)
    per_s = r["storm"]["delivered_per_second"]
    rate_ax.plot([i + 0.5 for i in range(len(per_s))], per_s)
    rate_ax.set_ylabel("backlog messages delivered / s")
    rate_ax.set_xlabel("seconds since the storm began")
    window = r["config"]["window"]
    for ax in (mem_ax, rate_ax):
        ax.axvspan(0, window, color="0.9", zorder=0)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    mem_ax.set_title(format_storm(r).split("\n", 1)[0], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def config_from_args(args: argparse.Namespace) -> StormConfig:
    from loadtest.cli import FLEET_DEVICES, FLEET_PAYLOAD

    return StormConfig(
        host=args.host,
        port=args.port,
        devices=args.devices if args.devices is not None else FLEET_DEVICES,
        backlog=args.backlog,
        window=args.storm_window,
        goal=args.storm_goal,
        drain=args.drain,
        mqtt=args.mqtt,
        payload_size=args.payload_size or FLEET_PAYLOAD,
        inflight=args.inflight,
        seed=args.seed,
        connect_timeout=args.connect_timeout,
        keep_sessions=args.keep_sessions,
        label=args.label,
    )


def run_from_args(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args).resolved()
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        result = run_storm(config, progress=not args.quiet)
    except ClientError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    result["seconds"] = round(time.monotonic() - started, 1)
    print(format_storm(result))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [result]}, indent=2) + "\n")
    if args.plot:
        plot_storm(args.plot, result)
    return 0 if result["check"]["ok"] and result["storm"]["within_goal"] else 1
