"""``python -m loadtest SCENARIO [options]``, also ``devicemq loadtest ...``.

Exit status: 0 when every message checked out, 1 when the check failed
(loss, duplicates, disorder) or the run could not be carried out, 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from loadtest.scenarios import SCENARIOS, LoadConfig

__all__ = [
    "ALIASES",
    "CHOICES",
    "add_arguments",
    "config_from_args",
    "fleet_processes",
    "main",
    "run_command",
]

# fleet: the shape of TBMQ's persistent P2P benchmark, one publisher and one
# persistent subscriber per device, 62-byte QoS 1 messages at 1 a second each
FLEET_DEVICES = 1000
FLEET_PAYLOAD = 62
FLEET_RATE = 1.0
DEVICES_PER_PROCESS = 5000
FD_RESERVE = 256  # descriptors a worker keeps for other things than its clients


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


# Old names a scenario still answers to: ``shared-queue`` was the group queue's.
ALIASES = {"shared-queue": "group-queue"}
CHOICES = (*SCENARIOS, "fleet", "ecq", "group-queue")


def _scenario(text: str) -> str:
    return ALIASES.get(text, text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "scenario",
        type=_scenario,
        choices=CHOICES,
        help="p2p, fan-in or fan-out; fleet: the TBMQ benchmark's shape as a preset (p2p, "
        "--devices pairs, 62 B QoS 1 at 1 msg/s each, persistent subscribers; --storm: the "
        "reconnect storm, loadtest/storm.py); ecq: exclusive compacted queues "
        "(loadtest/ecq.py); group-queue (or its old name shared-queue): durable group "
        "queues (loadtest/group_queue.py)",
    )
    g = p.add_argument_group("fleet")
    g.add_argument(
        "--devices",
        type=int,
        help="fleet: devices, each a publisher on its own topic and a persistent subscriber "
        f"to it (default {FLEET_DEVICES})",
    )
    g.add_argument(
        "--storm",
        action="store_true",
        help="fleet: the reconnect storm: the devices subscribe and go offline, --backlog "
        "messages each are stored for them, all reconnect within --storm-window seconds; "
        "measures how long until every backlog is delivered whole and in order",
    )
    g.add_argument(
        "--backlog", type=int, default=100, help="--storm: stored messages per device (100)"
    )
    g.add_argument(
        "--storm-window",
        type=float,
        default=10.0,
        metavar="S",
        help="--storm: the devices reconnect spread over S seconds (default 10)",
    )
    g.add_argument(
        "--storm-goal",
        type=float,
        default=60.0,
        metavar="S",
        help="--storm: the run fails if the backlogs take longer (default 60)",
    )
    g = p.add_argument_group("clients")
    g.add_argument("--pairs", type=int, help="p2p: publisher/subscriber pairs (default 100)")
    g.add_argument("--publishers", type=int, help="fan-in default 100, fan-out default 1")
    g.add_argument("--subscribers", type=int, help="fan-in default 2, fan-out default 100")
    g.add_argument("--mqtt", choices=("3.1.1", "5"), default="3.1.1", help="protocol version")
    persistence = g.add_mutually_exclusive_group()
    persistence.add_argument(
        "--persistent",
        dest="persistent",
        action="store_true",
        default=None,
        help="subscribers keep a session: clean session 0 / session expiry > 0 (p2p default)",
    )
    persistence.add_argument(
        "--clean", dest="persistent", action="store_false", help="clean-session subscribers"
    )
    g.add_argument(
        "--reconnect-every",
        type=float,
        default=0.0,
        metavar="S",
        help="subscribers drop their connection and reconnect every S seconds",
    )
    g.add_argument(
        "--keep-sessions", action="store_true", help="leave the persistent sessions behind"
    )
    g = p.add_argument_group("messages")
    g.add_argument("--qos", type=int, choices=(0, 1, 2), default=1)
    g.add_argument(
        "--payload-size",
        type=int,
        metavar="BYTES",
        help="min 20; default 64 (fleet: 62, ecq: 1024)",
    )
    g.add_argument(
        "--rate",
        type=float,
        help="msg/s per publisher; 0 = unthrottled (the default; fleet: 1)",
    )
    g.add_argument(
        "--inflight",
        type=int,
        default=10,
        help="unacknowledged PUBLISHes per publisher (default 10)",
    )
    g = p.add_argument_group("ecq and group-queue")
    g.add_argument(
        "--queues",
        type=int,
        help="ecq: queues, one consumer each (10); group-queue: groups (4)",
    )
    g.add_argument("--members", type=int, default=4, help="group-queue: members per group (4)")
    g.add_argument(
        "--churn",
        type=float,
        default=0.0,
        metavar="S",
        help="group-queue: a member drops its connection every S seconds and comes back",
    )
    g.add_argument(
        "--keys", type=int, default=1000, help="keys per queue (1000): fewer, more compaction"
    )
    g = p.add_argument_group("timing")
    g.add_argument("--duration", type=float, default=20.0, help="measured seconds (default 20)")
    g.add_argument("--warmup", type=float, default=5.0, help="seconds before them (default 5)")
    g.add_argument(
        "--drain", type=float, default=15.0, help="longest wait for stragglers (default 15)"
    )
    g = p.add_argument_group("target and output")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=1883)
    g.add_argument(
        "--replicas",
        type=_replicas,
        default=[],
        metavar="PORT:METRICS_PORT,...",
        help="devicemq replicas on --host, each with its own MQTT and metrics port: clients "
        "are spread over them, and latency is reported for subscribers on the replica "
        "that consumes their Kafka partition and for the others",
    )
    g.add_argument("--label", default="", help="name of the target in reports")
    g.add_argument(
        "--compare",
        type=_host_port,
        metavar="HOST:PORT",
        help="then run the same scenario against this broker and report the ratio",
    )
    g.add_argument("--compare-label", default="", help="name of the --compare target")
    g.add_argument(
        "--processes",
        type=int,
        help="worker processes (default 1; fleet: "
        f"one per {DEVICES_PER_PROCESS:,} devices, more if `ulimit -n` needs)",
    )
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds for every client to connect, retrying refusals as busy and failed "
        "connections with backoff (default 300)",
    )
    g.add_argument("--seed", type=int, help="seed for run id, nonce, padding, start phases")
    g.add_argument("--json", metavar="FILE", help="write the results as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="plot rate and latency per second")
    g.add_argument(
        "--watch-pid",
        type=int,
        action="append",
        default=[],
        metavar="PID",
        help="also count this process (and children) as server CPU",
    )
    g.add_argument("--quiet", action="store_true", help="no progress line")


def _replicas(text: str) -> list[tuple[int, int]]:
    """``--replicas 18883:18884,18893:18894``."""
    out = []
    for part in text.split(","):
        mqtt, sep, metrics = part.partition(":")
        if not (sep and mqtt.isdigit() and metrics.isdigit()):
            raise argparse.ArgumentTypeError(f"{part!r}: expected PORT:METRICS_PORT")
        out.append((int(mqtt), int(metrics)))
    if len(out) < 2:
        raise argparse.ArgumentTypeError("two or more replicas, comma-separated")
    return out


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    if args.scenario == "fleet":
        return fleet_config(args)
    return LoadConfig(
        scenario=args.scenario,
        host=args.host,
        port=args.port,
        pairs=args.pairs,
        publishers=args.publishers,
        subscribers=args.subscribers,
        qos=args.qos,
        payload_size=args.payload_size or 64,
        rate=args.rate or 0.0,
        inflight=args.inflight,
        duration=args.duration,
        warmup=args.warmup,
        drain=args.drain,
        mqtt=args.mqtt,
        persistent=args.persistent,
        processes=args.processes or 1,
        seed=args.seed,
        reconnect_every=args.reconnect_every,
        keep_sessions=args.keep_sessions,
        label=args.label,
        replicas=args.replicas,
        connect_timeout=args.connect_timeout,
    )


def fleet_config(args: argparse.Namespace) -> LoadConfig:
    """``fleet``: p2p in the TBMQ benchmark's shape; any option given still counts."""
    if args.pairs or args.publishers or args.subscribers:
        raise ValueError("fleet: --devices sets the publishers and subscribers")
    devices = args.devices if args.devices is not None else FLEET_DEVICES
    if devices < 1:
        raise ValueError("fleet: --devices must be at least 1")
    return LoadConfig(
        scenario="p2p",
        preset="fleet",
        host=args.host,
        port=args.port,
        pairs=devices,
        qos=args.qos,
        payload_size=args.payload_size or FLEET_PAYLOAD,
        rate=FLEET_RATE if args.rate is None else args.rate,
        inflight=args.inflight,
        duration=args.duration,
        warmup=args.warmup,
        drain=args.drain,
        mqtt=args.mqtt,
        persistent=True if args.persistent is None else args.persistent,
        processes=args.processes or fleet_processes(devices),
        seed=args.seed,
        reconnect_every=args.reconnect_every,
        keep_sessions=args.keep_sessions,
        label=args.label,
        replicas=args.replicas,
        connect_timeout=args.connect_timeout,
    )


def fleet_processes(devices: int, open_files: int | None = None) -> int:
    """``fleet``'s worker processes when ``--processes`` is not given: one per
    ``DEVICES_PER_PROCESS`` devices (at 1 msg/s a device costs a process ~0.15 ms
    of CPU a second: 5,000 are ~0.7 of a core), and at least as many as the
    open-files limit needs, two sockets per device (``open_files``: this process's
    hard limit, which each worker raises its soft limit to)."""
    if open_files is None:
        open_files = _hard_nofile()
    by_cpu = -(-devices // DEVICES_PER_PROCESS)
    usable = max(open_files - FD_RESERVE, 2)
    by_files = -(-2 * devices // usable)
    return max(1, by_cpu, by_files)


def _hard_nofile() -> int:
    try:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    except (ImportError, OSError):  # pragma: no cover - not Linux
        return 1024
    return hard if hard != resource.RLIM_INFINITY else 1 << 20


def run_command(args: argparse.Namespace) -> int:
    if args.scenario != "fleet" and (args.storm or args.devices is not None):
        print("loadtest: error: --devices and --storm are fleet's", file=sys.stderr)
        return 2
    if args.scenario == "ecq":
        from loadtest.ecq import run_from_args

        return run_from_args(args)
    if args.scenario == "group-queue":
        from loadtest.group_queue import run_from_args as run_group_queue

        return run_group_queue(args)
    if args.scenario == "fleet" and args.storm:
        from loadtest.storm import run_from_args as run_storm

        return run_storm(args)
    from loadtest.report import format_report, plot, write_json
    from loadtest.runner import LoadTestError, run_load

    try:
        config = config_from_args(args).resolved()
    except ValueError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    show = not args.quiet
    results: list[dict[str, Any]] = []
    try:
        results.append(run_load(config, progress=show, watch_pids=args.watch_pid))
        if args.compare:
            host, port = args.compare
            other = LoadConfig(
                **{**vars(config), "host": host, "port": port, "label": "", "replicas": []}
            )
            results.append(
                run_load(other, label=args.compare_label or f"{host}:{port}", progress=show)
            )
    except LoadTestError as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(format_report(results))
    if args.json:
        write_json(args.json, results)
    if args.plot:
        plot(args.plot, results)
    return 0 if all(r["check"]["ok"] for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest", description="MQTT load scenarios with per-message checks"
    )
    add_arguments(parser)
    return run_command(parser.parse_args(argv))
