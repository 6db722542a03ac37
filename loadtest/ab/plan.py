"""The A/B tool's scenarios, and the order its runs take.

A scenario is a preset of the load tool's own (``loadtest.scenarios``): the
same loader, options fixed so that every side gets the same load. The sizes
are settable (:class:`Sizes`); the defaults are the shapes the hot path is
measured in (BENCHMARKS.md) and fit a 2-core machine that also runs the loader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from loadtest.scenarios import LoadConfig

__all__ = [
    "DEFAULT_SCENARIOS",
    "SCENARIOS",
    "SIDES",
    "Scenario",
    "Sizes",
    "Timing",
    "make_scenario",
    "schedule",
    "sides_for",
]

SIDES = ("base", "head", "mosquitto")

SCENARIOS = ("p2p-memory", "p2p-persistent", "fan-in", "fan-in-application", "fan-out", "fleet")

# The loader's subscribers are ``lt-<run id>-s<n>`` (loadtest/scenarios.py): in
# ``fan-in-application`` every one of them gets an APPLICATION session
# (docs/application-sessions.md), its messages in a Kafka topic of its own.
APPLICATION_SUBSCRIBERS = "^lt-[0-9a-f]+-s[0-9]+$"
DEFAULT_SCENARIOS = ("p2p-memory", "p2p-persistent")


@dataclass(frozen=True)
class Sizes:
    memory_pairs: int = 200
    persistent_pairs: int = 100
    fan_in: tuple[int, int] = (100, 2)  # publishers, subscribers
    # msg/s per fan-in publisher: unthrottled, 100 publishers offer more than two
    # subscribers can take through their windows, and both devicemq and Mosquitto
    # drop for full queues (an overload test, BENCHMARKS.md "fan-in")
    fan_in_rate: float = 20.0
    fan_out: tuple[int, int] = (1, 100)
    devices: int = 1000


@dataclass(frozen=True)
class Timing:
    duration: float = 10.0  # measured seconds
    warmup: float = 3.0
    drain: float = 15.0  # in-memory scenarios
    persistent_drain: float = 60.0


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str  # what the table calls it
    config: LoadConfig  # the load, without a target (port) or seed yet
    persistent: bool  # the broker keeps sessions in Redis through Kafka
    paced: bool  # publishers keep a fixed rate (the offer): the speed weighs the cost too
    # DEVICEMQ_* settings the scenario needs of every devicemq side (before a
    # side's own --base-setting / --head-setting)
    settings: dict[str, str] = field(default_factory=dict)


def make_scenario(
    name: str,
    sizes: Sizes,
    timing: Timing,
    *,
    mqtt: str = "3.1.1",
    inflight: int = 10,
    processes: int = 1,
) -> Scenario:
    """The preset ``name`` (one of :data:`SCENARIOS`)."""
    load = LoadConfig(
        qos=1,
        mqtt=mqtt,
        inflight=inflight,
        processes=processes,
        duration=timing.duration,
        warmup=timing.warmup,
        drain=timing.drain,
        persistent=False,
    )
    if name == "p2p-memory":
        n = sizes.memory_pairs
        config = replace(load, scenario="p2p", pairs=n)
        return Scenario(name, f"p2p {n} pairs, clean", config, persistent=False, paced=False)
    if name == "p2p-persistent":
        n = sizes.persistent_pairs
        config = replace(
            load, scenario="p2p", pairs=n, persistent=True, drain=timing.persistent_drain
        )
        return Scenario(name, f"p2p {n} pairs, persistent", config, persistent=True, paced=False)
    if name == "fan-in":
        pubs, subs = sizes.fan_in
        rate = sizes.fan_in_rate
        config = replace(load, scenario=name, publishers=pubs, subscribers=subs, rate=rate)
        title = f"fan-in {pubs}x{subs} x {rate:g} msg/s" if rate else f"fan-in {pubs}x{subs}"
        return Scenario(name, title, config, persistent=False, paced=rate > 0)
    if name == "fan-in-application":
        # the same load as fan-in, its subscribers APPLICATION sessions: run both
        # in one invocation and the summary gives their ratio (the goal of
        # docs/application-sessions.md: at least 0.8x the in-memory fan-in)
        pubs, subs = sizes.fan_in
        rate = sizes.fan_in_rate
        config = replace(
            load,
            scenario="fan-in",
            publishers=pubs,
            subscribers=subs,
            rate=rate,
            persistent=True,
            drain=timing.persistent_drain,
        )
        title = f"app. fan-in {pubs}x{subs}" + (f" x {rate:g}/s" if rate else "")
        settings = {"DEVICEMQ_APPLICATION_CLIENT_IDS": APPLICATION_SUBSCRIBERS}
        return Scenario(name, title, config, persistent=True, paced=rate > 0, settings=settings)
    if name == "fan-out":
        pubs, subs = sizes.fan_out
        config = replace(load, scenario=name, publishers=pubs, subscribers=subs)
        title = f"fan-out {pubs}x{subs}, clean"
        return Scenario(name, title, config, persistent=False, paced=False)
    if name == "fleet":
        # the fleet's shape (TBMQ's): a 62-byte QoS 1 message a second from each
        # device to its own persistent subscriber
        n = sizes.devices
        config = replace(
            load,
            scenario="p2p",
            pairs=n,
            persistent=True,
            rate=1.0,
            payload_size=62,
            drain=timing.persistent_drain,
        )
        return Scenario(name, f"fleet {n} x 1 msg/s", config, persistent=True, paced=True)
    raise ValueError(f"unknown scenario {name!r} (one of {', '.join(SCENARIOS)})")


def sides_for(scenario: Scenario, sides: Sequence[str]) -> list[str]:
    """The sides that run ``scenario``: Mosquitto keeps sessions in memory only, so
    it sits out the persistent scenarios (a comparison with a path that stores
    nothing would say little)."""
    return [s for s in sides if not (s == "mosquitto" and scenario.persistent)]


def schedule(
    rounds: int, scenarios: Sequence[Scenario], sides: Sequence[str]
) -> list[tuple[int, Scenario, str]]:
    """Every run as (round, scenario, side), in the order they run: round by
    round, each scenario's sides back to back, their order reversed every other
    round (base head / head base), so that a drift of the machine over the
    session weighs on every side alike."""
    out: list[tuple[int, Scenario, str]] = []
    for round_ in range(rounds):
        for scenario in scenarios:
            order = sides_for(scenario, sides)
            if round_ % 2:
                order.reverse()
            out.extend((round_, scenario, side) for side in order)
    return out
