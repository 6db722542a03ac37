"""Merging the workers' observations into one result; text, JSON and PNG output.

A result is a plain JSON-able dict:

- ``rates``: messages per second over the measured window (warm-up and
  drain excluded): ``delivered`` (received by subscribers), ``acked``
  (PUBLISHes the broker acknowledged), ``sent``;
- ``latency_ms``: ``e2e`` (publisher's send to subscriber's receive) and
  ``puback`` (send to PUBACK, or PUBCOMP at QoS 2), p50/p95/p99/max/mean over
  the window;
- ``check``: every message: ``lost`` (acknowledged to its publisher, never
  received by a subscriber that should get it, after the drain),
  ``duplicates`` (received again; ``duplicates_dup_flag`` of them with DUP=1),
  ``out_of_order`` (received after a higher sequence number of the same
  publisher), ``ok``;
- ``by_client``: the tail by client: each subscriber's own e2e p50 and p99
  over the window, and across the subscribers the median, p90 and worst of
  those (with the worst client's ID), so a few slow clients show apart
  from a slow run;
- ``cpu``: cores used during the window by the load generator, the broker
  (the process listening on the port and its children) and the whole machine,
  and the generator's cost per message;
- ``timeline``: one row per second since t0.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.client import THROTTLE_HINT
from loadtest.procstat import CpuSample, cores_by_process
from loadtest.replicas import by_consuming_replica
from loadtest.scenarios import LoadConfig, Plan
from loadtest.worker import WorkerResult

__all__ = ["compare_rows", "format_report", "plot", "summarize", "write_json"]


def _percentiles(samples: Sequence[int]) -> dict[str, float | int | None]:
    """p50/p95/p99/max/mean in milliseconds of microsecond samples (nearest rank)."""
    n = len(samples)
    if not n:
        return {"count": 0, "p50": None, "p95": None, "p99": None, "max": None, "mean": None}
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[min(n - 1, max(0, int(q * n + 0.999999) - 1))] / 1000

    return {
        "count": n,
        "p50": rank(0.50),
        "p95": rank(0.95),
        "p99": rank(0.99),
        "max": ordered[-1] / 1000,
        "mean": round(sum(ordered) / n / 1000, 3),
    }


def _merge_buckets(results: list[WorkerResult]) -> list[tuple[int, int, array[int], array[int]]]:
    seconds = max((len(r.buckets) for r in results), default=0)
    merged = []
    for sec in range(seconds):
        sent = acked = 0
        e2e: array[int] = array("I")
        puback: array[int] = array("I")
        for r in results:
            if sec < len(r.buckets):
                s, a, e, p = r.buckets[sec]
                sent += s
                acked += a
                e2e.frombytes(e)
                puback.frombytes(p)
        merged.append((sent, acked, e2e, puback))
    return merged


def _cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Cores used between ``start`` and ``end`` seconds after t0 (nearest samples)."""
    if len(samples) < 2:
        return None
    first = min(samples, key=lambda s: abs(s[0] - start))
    last = min(samples, key=lambda s: abs(s[0] - end))
    if last[0] <= first[0]:
        return None
    return (last[1] - first[1]) / (last[0] - first[0])


def _check(
    config: LoadConfig, plan: Plan, results: list[WorkerResult]
) -> tuple[dict[str, Any], dict[int, int]]:
    publishers = {i: p for r in results for i, p in r.publishers.items()}
    subscribers = {j: s for r in results for j, s in r.subscribers.items()}
    acked_count = {i: len(p.acked) - p.acked.count(0) for i, p in publishers.items()}
    lost = expected = delivered = delivered_unacked = unexpected = 0
    lost_examples: list[str] = []
    for spec in plan.subscribers:
        sub = subscribers.get(spec.index)
        if sub is None:
            continue
        wanted = set(spec.publishers)
        for publisher, counts in sub.counts.items():
            if publisher not in wanted:
                unexpected += len(counts) - counts.count(0)
        for publisher in spec.publishers:
            pub = publishers.get(publisher)
            if pub is None:
                continue
            flags = pub.acked
            n = len(flags)
            counts = sub.counts.get(publisher, bytearray())
            expected += acked_count[publisher]
            if flags.count(0) == 0:
                head = counts[:n]
                missing = head.count(0) + max(0, n - len(head))
                if missing and len(lost_examples) < 5:
                    first = next(i for i in range(n) if i >= len(counts) or not counts[i])
                    lost_examples.append(
                        f"subscriber {spec.index} publisher {publisher} seq {first}"
                    )
            else:
                missing = 0
                for i in range(n):
                    got = i < len(counts) and counts[i]
                    if flags[i] and not got:
                        missing += 1
                    elif got and not flags[i]:
                        delivered_unacked += 1
            lost += missing
            delivered += acked_count[publisher] - missing
    duplicates = sum(s.duplicates for s in subscribers.values())
    flagged = sum(s.duplicates_flagged for s in subscribers.values())
    out_of_order = sum(s.out_of_order for s in subscribers.values())
    tolerated = flagged if config.qos == 1 and config.reconnect_every else 0
    check = {
        "published": sum(p.sent for p in publishers.values()),
        "acked": sum(acked_count.values()),
        "rejected": sum(p.rejected for p in publishers.values()),
        "expected": expected,
        "delivered": delivered,
        "delivered_unacked": delivered_unacked,
        "lost": lost,
        "duplicates": duplicates,
        "duplicates_dup_flag": flagged,
        "out_of_order": out_of_order,
        "unexpected": unexpected,
        "foreign": sum(s.foreign for s in subscribers.values()),
        "reconnects": sum(s.reconnects for s in subscribers.values()),
        "lost_connections": sum(s.lost_connections for s in subscribers.values())
        + sum(p.lost_connections for p in publishers.values()),
        "lost_examples": lost_examples,
    }
    check["ok"] = bool(
        (lost == 0 or config.qos == 0)
        and duplicates - tolerated == 0
        and out_of_order == 0
        and unexpected == 0
        and check["rejected"] == 0
    )
    return check, acked_count


def summarize(
    config: LoadConfig,
    plan: Plan,
    results: list[WorkerResult],
    *,
    label: str,
    cpu_start: CpuSample | None = None,
    cpu_end: CpuSample | None = None,
    broker_pid: int | None = None,
    watched_pids: list[int] | None = None,
    owners: tuple[dict[int, int], int] | None = None,
) -> dict[str, Any]:
    buckets = _merge_buckets(results)
    w0 = round(config.warmup)
    w1 = max(w0 + 1, round(config.warmup + config.duration))
    window = buckets[w0:w1]
    seconds = w1 - w0
    e2e: array[int] = array("I")
    puback: array[int] = array("I")
    for _, _, e, p in window:
        e2e.extend(e)
        puback.extend(p)
    timeline = []
    for sec, (sent, acked, e, p) in enumerate(buckets):
        pe, pp = _percentiles(e), _percentiles(p)
        timeline.append(
            {
                "t": sec,
                "phase": "warmup" if sec < w0 else "measure" if sec < w1 else "drain",
                "sent": sent,
                "acked": acked,
                "delivered": len(e),
                "e2e_p50_ms": pe["p50"],
                "e2e_p99_ms": pe["p99"],
                "puback_p50_ms": pp["p50"],
                "puback_p99_ms": pp["p99"],
            }
        )
    check, _ = _check(config, plan, results)
    delivered_window = len(e2e)
    errors = [e for r in results for e in r.errors]

    # CPU over the measured window
    client_cores = None
    parts = [_cpu_between(r.cpu, config.warmup, config.total_seconds) for r in results]
    if all(p is not None for p in parts) and parts:
        client_cores = sum(p for p in parts if p is not None)
    broker_cores = system_cores = None
    broker_parts: dict[str, float] = {}
    if cpu_start is not None and cpu_end is not None and cpu_end.wall > cpu_start.wall:
        wall = cpu_end.wall - cpu_start.wall
        if cpu_start.watched is not None and cpu_end.watched is not None:
            broker_cores = (cpu_end.watched - cpu_start.watched) / wall
            broker_parts = cores_by_process(cpu_start, cpu_end, watched_pids or [])
        if cpu_start.busy is not None and cpu_end.busy is not None:
            system_cores = (cpu_end.busy - cpu_start.busy) / wall
    # The generator's cost: CPU per message through it (one publish + one receive)
    messages_per_s = max(delivered_window, sum(a for _, a, _, _ in window)) / seconds
    us_per_message = capacity = None
    if client_cores is not None and messages_per_s > 0:
        us_per_message = client_cores * 1e6 / messages_per_s
        capacity = 1e6 / us_per_message if us_per_message else None

    out: dict[str, Any] = {
        "label": label,
        "target": f"{config.host}:{config.port}",
        "scenario": config.scenario,
        "config": asdict(config),
        "run_id": plan.run_id,
        "clients": {
            "publishers": config.publishers,
            "subscribers": config.subscribers,
            "processes": config.processes,
        },
        "window": {"from_s": w0, "to_s": w1, "seconds": seconds},
        "rates": {
            "delivered": round(delivered_window / seconds, 1),
            "acked": round(sum(a for _, a, _, _ in window) / seconds, 1),
            "sent": round(sum(s for s, _, _, _ in window) / seconds, 1),
        },
        "latency_ms": {"e2e": _percentiles(e2e), "puback": _percentiles(puback)},
        "check": check,
        "cpu": {
            "cores": os.cpu_count(),
            "client_cores": _round(client_cores),
            "broker_cores": _round(broker_cores),
            # the broker and each child (its embedded Redis, Kafka), by name
            "broker_cores_by_process": broker_parts,
            "broker_pid": broker_pid,
            "watched_pids": watched_pids or [],
            "machine_busy_cores": _round(system_cores),
            # what neither the broker nor the generator used: other load on the machine
            "other_cores": _round(
                system_cores - (broker_cores or 0.0) - (client_cores or 0.0)
                if system_cores is not None and broker_cores is not None
                else None
            ),
            "client_us_per_message": _round(us_per_message),
            # TBMQ's measure: messages in (acked PUBLISHes) plus out (deliveries) a
            # second, per core the broker (with its embedded Redis and Kafka) used
            "messages_per_broker_core": round(
                (sum(a for _, a, _, _ in window) + delivered_window) / seconds / broker_cores
            )
            if broker_cores
            else None,
            "client_capacity_per_core": round(capacity) if capacity else None,
        },
        "connect_seconds": max((r.connect_seconds for r in results), default=0.0),
        "connect_busy_refusals": sum(r.busy_refusals for r in results),
        "connect_failures": sum(r.connect_failures for r in results),
        "drain_seconds": max((r.drain_seconds for r in results), default=0.0),
        "timeline": timeline,
        "errors": errors,
    }
    out["by_client"] = _by_client(
        (plan.subscribers[j].client_id, s.latencies)
        for r in results
        for j, s in r.subscribers.items()
    )
    if config.replicas:
        n = len(config.replicas)
        known, held = owners or ({}, 0)
        grouping = by_consuming_replica(
            known,
            held,
            (
                (plan.subscribers[j].client_id, j % n, s.latencies)
                for r in results
                for j, s in r.subscribers.items()
            ),
        )
        out["by_replica"] = {
            "partitions": {str(r): ps for r, ps in grouping.partitions.items()},
            "error": grouping.error,
            **{
                group: {"subscribers": grouping.subscribers[group], **_percentiles(samples)}
                for group, samples in grouping.latencies.items()
            },
        }
    return out


def _by_client(subscribers: Iterable[tuple[str, bytes]]) -> dict[str, Any]:
    """Each subscriber's e2e p50 and p99 over the window (from its samples, array
    "I" bytes), and their spread across the subscribers that received any."""
    own: list[tuple[float, float, str, int]] = []  # (p99, p50, client id, deliveries)
    for client_id, latencies in subscribers:
        samples: array[int] = array("I")
        samples.frombytes(latencies)
        if samples:
            mine = _percentiles(samples)
            own.append((mine["p99"], mine["p50"], client_id, len(samples)))  # type: ignore[arg-type]
    if not own:
        return {"clients": 0, "p50_ms": None, "p99_ms": None, "worst": None}

    def spread(values: list[float]) -> dict[str, float]:
        values = sorted(values)
        n = len(values)
        return {
            "median": values[(n - 1) // 2],
            "p90": values[min(n - 1, max(0, int(0.9 * n + 0.999999) - 1))],
            "max": values[-1],
        }

    worst = max(own)
    return {
        "clients": len(own),
        "p50_ms": spread([p50 for _, p50, _, _ in own]),
        "p99_ms": spread([p99 for p99, _, _, _ in own]),
        "worst": {"client_id": worst[2], "p99_ms": worst[0], "deliveries": worst[3]},
    }


def connect_line(r: dict[str, Any]) -> str:
    """How long connecting took, and what was retried on the way."""
    clients = r["clients"]["publishers"] + r["clients"]["subscribers"]
    retried = []
    if r.get("connect_busy_refusals"):
        retried.append(f"{r['connect_busy_refusals']:,} CONNECTs refused as busy (rate limit)")
    if r.get("connect_failures"):
        retried.append(f"{r['connect_failures']:,} failed connections")
    return (
        f"connect {r['label']}: {clients:,} clients connected in {r['connect_seconds']:.1f} s"
        + (f"; retried {' and '.join(retried)}" if retried else "")
    )


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# -- text ------------------------------------------------------------------------------


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and digits:
        return f"{value:,.{digits}f}"
    return f"{value:,.0f}" if isinstance(value, int | float) else str(value)


def _rows(result: dict[str, Any]) -> list[tuple[str, Any, int]]:
    """(name, value, decimals) of the summary table; ratios are taken of these."""
    lat = result["latency_ms"]
    check = result["check"]
    cpu = result["cpu"]
    by_client = result.get("by_client", {}).get("p99_ms")
    return [
        ("delivered msg/s", result["rates"]["delivered"], 0),
        ("acked (published) msg/s", result["rates"]["acked"], 0),
        ("e2e latency p50 ms", lat["e2e"]["p50"], 2),
        ("e2e latency p95 ms", lat["e2e"]["p95"], 2),
        ("e2e latency p99 ms", lat["e2e"]["p99"], 2),
        ("e2e latency max ms", lat["e2e"]["max"], 2),
        ("e2e p99 by client, median ms", by_client["median"] if by_client else None, 2),
        ("e2e p99 by client, worst ms", by_client["max"] if by_client else None, 2),
        ("PUBACK latency p50 ms", lat["puback"]["p50"], 2),
        ("PUBACK latency p99 ms", lat["puback"]["p99"], 2),
        ("messages acked", check["acked"], 0),
        ("messages delivered", check["delivered"], 0),
        ("lost", check["lost"], 0),
        ("duplicates (DUP=1)", f"{check['duplicates']} ({check['duplicates_dup_flag']})", 0),
        ("out of order", check["out_of_order"], 0),
        ("server CPU cores", cpu["broker_cores"], 2),
        ("in + out msg/s per server core", cpu.get("messages_per_broker_core"), 0),
        ("load generator CPU cores", cpu["client_cores"], 2),
        ("machine busy cores", cpu["machine_busy_cores"], 2),
        ("  of which other processes", cpu["other_cores"], 2),
        ("generator us/msg", cpu["client_us_per_message"], 2),
    ]


def _headline(config: dict[str, Any]) -> str:
    c = config
    if c.get("preset") == "fleet":
        who = f"fleet of {c['pairs']} devices (a publisher and a subscriber each)"
    elif c["scenario"] == "p2p":
        who = f"{c['pairs']} pairs"
    else:
        who = f"{c['publishers']} publishers, {c['subscribers']} subscribers"
    rate = f"unthrottled (in-flight {c['inflight']})"
    if c["rate"]:
        rate = f"{c['rate']:g} msg/s per publisher"
    subs = "persistent" if c["persistent"] else "clean"
    name = c.get("preset") or c["scenario"]
    return (
        f"{name}: {who}, QoS {c['qos']}, MQTT {c['mqtt']}, {subs} subscribers, "
        f"{c['payload_size']} B payload, {rate}, {c['duration']:g} s measured after "
        f"{c['warmup']:g} s warm-up, {c['processes']} process(es)"
    )


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out = []
    for (name, va, digits), (_, vb, _) in zip(_rows(a), _rows(b), strict=True):
        ratio = ""
        if isinstance(va, int | float) and isinstance(vb, int | float) and vb:
            ratio = f"{va / vb:.2f}x"
        out.append((name, _num(va, digits), _num(vb, digits), ratio))
    return out


def format_report(results: list[dict[str, Any]]) -> str:
    """The summary table of one run, or of two side by side with their ratio."""
    lines = [_headline(results[0]["config"]), ""]
    if len(results) == 1:
        r = results[0]
        width = max(len(n) for n, _, _ in _rows(r)) + 2
        lines.append(f"{'':<{width}}{r['label']:>16}")
        for name, value, digits in _rows(r):
            lines.append(f"{name:<{width}}{_num(value, digits):>16}")
    else:
        a, b = results[0], results[1]
        rows = compare_rows(a, b)
        width = max(len(n) for n, *_ in rows) + 2
        lines.append(f"{'':<{width}}{a['label']:>16}{b['label']:>16}{'ratio':>9}")
        for name, va, vb, ratio in rows:
            lines.append(f"{name:<{width}}{va:>16}{vb:>16}{ratio:>9}")
    for r in results:
        check = r["check"]
        verdict = "OK" if check["ok"] else "FAILED"
        lines.append(
            f"check {r['label']}: {verdict}: {check['delivered']:,} of {check['expected']:,} "
            f"expected deliveries, {check['lost']} lost, {check['duplicates']} duplicates, "
            f"{check['out_of_order']} out of order, {check['rejected']} rejected"
            + (f", {check['reconnects']} reconnects" if check["reconnects"] else "")
        )
        grouped = r.get("by_replica")
        if grouped and grouped["error"]:
            lines.append(f"by replica {r['label']}: {grouped['error']}")
        elif grouped:
            for group, text in (
                ("consuming", "on the replica consuming their partition"),
                ("other", "on another replica"),
            ):
                g = grouped[group]
                lines.append(
                    f"e2e ms, {g['subscribers']} subscribers {text} (measured window): "
                    f"p50 {_num(g['p50'], 1)}, p95 {_num(g['p95'], 1)}, "
                    f"p99 {_num(g['p99'], 1)}, max {_num(g['max'], 1)} "
                    f"({g['count']:,} deliveries)"
                )
        worst = r.get("by_client", {}).get("worst")
        if worst:
            lines.append(
                f"slowest client {r['label']}: {worst['client_id']}, e2e p99 "
                f"{_num(worst['p99_ms'], 1)} ms over {worst['deliveries']:,} deliveries "
                f"(p90 of the clients' p99: {_num(r['by_client']['p99_ms']['p90'], 1)} ms)"
            )
        lines.append(connect_line(r))
        if r.get("connect_busy_refusals"):
            lines.append(f"throttled {r['label']}: {THROTTLE_HINT}")
        for example in check["lost_examples"]:
            lines.append(f"  lost: {example}")
        cpu = r["cpu"]
        parts = cpu.get("broker_cores_by_process")
        if parts:
            lines.append(
                f"server CPU {r['label']} by process (cores): "
                + ", ".join(f"{name} {cores:.2f}" for name, cores in parts.items())
            )
        if cpu["client_capacity_per_core"]:
            lines.append(
                f"load generator {r['label']}: {cpu['client_us_per_message']:.2f} us CPU per "
                f"message, ~{cpu['client_capacity_per_core']:,} msg/s per core"
            )
        for error in r["errors"][:10]:
            lines.append(f"  error: {error}")
    return "\n".join(lines)


# -- files --------------------------------------------------------------------------------


def write_json(path: str | Path, results: list[dict[str, Any]]) -> None:
    document: dict[str, Any] = {"runs": results}
    if len(results) == 2:
        a, b = results
        document["ratio"] = {
            name: round(va / vb, 3)
            for (name, va, _), (_, vb, _) in zip(_rows(a), _rows(b), strict=True)
            if isinstance(va, int | float) and isinstance(vb, int | float) and vb
        }
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def plot(path: str | Path, results: list[dict[str, Any]]) -> None:
    """Delivered msg/s and end-to-end latency p50/p99 per second, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, lat_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for result, color in zip(results, colors, strict=False):
        rows = result["timeline"]
        t = [row["t"] + 0.5 for row in rows]
        rate_ax.plot(t, [row["delivered"] for row in rows], color=color, label=result["label"])
        p50 = [row["e2e_p50_ms"] for row in rows]
        p99 = [row["e2e_p99_ms"] for row in rows]
        lat_ax.plot(t, _nan(p50), color=color, linestyle="--", label=f"{result['label']} p50")
        lat_ax.plot(t, _nan(p99), color=color, label=f"{result['label']} p99")
    window = results[0]["window"]
    for ax in (rate_ax, lat_ax):
        ax.axvspan(0, window["from_s"], color="0.9", zorder=0)
        ax.axvline(window["to_s"], color="0.6", linewidth=0.8)
        ax.grid(True, alpha=0.3)
    rate_ax.set_ylabel("delivered msg/s")
    rate_ax.set_title(_headline(results[0]["config"]), fontsize=8)
    rate_ax.legend(fontsize=8)
    lat_ax.set_ylabel("end-to-end latency, ms")
    lat_ax.set_xlabel("seconds since start (grey: warm-up; after the line: drain)")
    if any(v for r in results for row in r["timeline"] for v in [row["e2e_p99_ms"]] if v):
        lat_ax.set_yscale("log")
    lat_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _nan(values: list[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]
