"""Throughput of RedisMessageStore.save_many against local Redis (not a test).

    python -m benchmarks.redis_store_bench                 # single and cluster
    python -m benchmarks.redis_store_bench --mode single --clients 200 --batch 50 \\
        --batches 20
    python -m benchmarks.redis_store_bench --url redis://127.0.0.1:6379   # a running Redis

It starts its own redis-server (and a 3-master cluster) on free 127.0.0.1
ports, stops them by PID at the end, and prints msg/s for:

* ``save_many``: clients x batches of ``--batch`` messages, one pipelined
  round trip per poll (the persistence consumer's path), and the time Redis
  itself spent per client batch (its script call, from INFO commandstats);
* ``per-message``: one awaited script call per message, for comparison;
* ``replay``: ``load_page`` pages of 1000 over one client's 10k messages;
* ``fleet``: the fleet shape's store work (issue 39): one message for each of
  100 clients per save call (of 2,000 connected clients, stored marked sent as
  the consumer stores what goes out at once), then their acknowledgements in one
  progress write; Redis's CPU per message and the commands its scripts ran per
  message (a call from Lua costs about what the command's own work does);
* ``replay progress``: a reconnecting client's 10,000 stored messages, read in
  pages of 500, each page's marks then acknowledgements written in calls of
  ``--progress-batch`` ids (40: what a real replay's progress writes carry);
  Redis's CPU per message and the commands its scripts ran per message.

Every run uses fresh client ids, so nothing is skipped as a duplicate.

Measured on the 2-core development machine, quiet, 2026-11-22 (the
defaults: 200 clients x 20 batches of 50): save_many 74-79k msg/s single,
99k on the 3-master cluster; per-message calls 3.1-3.8k msg/s; replay
(pages of 1000) 112-121k msg/s single, 193k cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

from redis.asyncio.cluster import RedisCluster as RedisClusterClient

from persistence.format import StoredMessage, client_keys
from persistence.redis_store import ClientBatch, RedisMessageStore
from tests.integration.redis_servers import RedisCluster3, RedisServer

PAYLOAD = b"x" * 100


def _messages(first: int, count: int) -> list[StoredMessage]:
    return [
        StoredMessage(
            topic=f"devices/{i % 97}/telemetry",
            payload=PAYLOAD,
            qos=1,
            publish_time=time.time(),
            producer=1,
            seq=first + i + 1,
        )
        for i in range(count)
    ]


async def bench_save_many(
    store: RedisMessageStore, clients: int, batch: int, batches: int
) -> float:
    run = uuid.uuid4().hex[:6]
    ids = [f"bench-{run}-{c}" for c in range(clients)]
    # One "poll" of the consumer = one batch per client; several polls in a row.
    polls = [
        [
            ClientBatch(cid, _messages(p * batch, batch), partition=c % 12)
            for c, cid in enumerate(ids)
        ]
        for p in range(batches)
    ]
    total = clients * batch * batches
    t0 = time.perf_counter()
    for poll in polls:
        results = await store.save_many(poll)
        assert all(r.saved == batch for r in results)
    elapsed = time.perf_counter() - t0
    return total / elapsed


async def bench_per_message(store: RedisMessageStore, count: int) -> float:
    cid = f"bench-one-{uuid.uuid4().hex[:6]}"
    messages = _messages(0, count)
    t0 = time.perf_counter()
    for m in messages:
        await store.save_batch(cid, [m], partition=0)
    return count / (time.perf_counter() - t0)


async def bench_replay(store: RedisMessageStore, count: int = 10_000) -> float:
    cid = f"bench-replay-{uuid.uuid4().hex[:6]}"
    for first in range(0, count, 1000):
        await store.save_batch(cid, _messages(first, 1000), partition=0)
    t0 = time.perf_counter()
    after, seen = 0, 0
    while records := (await store.load_page(cid, after, 1000)).records:
        seen += len(records)
        after = records[-1].score
    assert seen == count
    return count / (time.perf_counter() - t0)


async def _redis_totals(store: RedisMessageStore) -> tuple[float, int]:
    """Redis's CPU seconds so far and the commands run since the statistics were
    reset, scripts' own calls included (summed over a cluster's nodes)."""
    every: dict[str, Any] = {}
    if isinstance(store.redis, RedisClusterClient):
        every["target_nodes"] = RedisClusterClient.ALL_NODES
    cpu = await store.redis.info("cpu", **every)
    stats = await store.redis.info("commandstats", **every)
    nodes_cpu = [cpu] if "used_cpu_user" in cpu else list(cpu.values())
    nodes_stats = [stats] if any(k.startswith("cmdstat_") for k in stats) else list(stats.values())
    seconds = sum(float(n["used_cpu_user"]) + float(n["used_cpu_sys"]) for n in nodes_cpu)
    calls = sum(
        int(v["calls"])
        for n in nodes_stats
        for k, v in n.items()
        if k.startswith("cmdstat_") and k not in ("cmdstat_evalsha", "cmdstat_info")
    )
    return seconds, calls


async def bench_fleet(
    store: RedisMessageStore, clients: int = 2000, per_call: int = 100, rounds: int = 300
) -> tuple[float, float]:
    """Redis CPU us per message and commands per message, saving one message per
    client and acknowledging it (module docstring, ``fleet``)."""
    run = uuid.uuid4().hex[:6]
    ids = [f"fleet-{run}-{c}" for c in range(clients)]
    for cid in ids:  # connected sessions: a session key without a TTL
        await store.redis.set(client_keys(cid).session, b"s")
    seq = 0

    async def one_round(r: int) -> None:
        nonlocal seq
        first = r * per_call % clients
        batches = []
        for j in range(per_call):
            seq += 1
            m = StoredMessage("devices/x", b"x" * 62, 1, producer=1, seq=seq)
            batches.append(ClientBatch(ids[(first + j) % clients], [m], 0, premark=1))
        results = await store.save_many(batches)
        acks = {
            b.client_id: [(a.packet_id, a.score) for a in result.assigned if a is not None]
            for b, result in zip(batches, results, strict=True)
        }
        await store.write_progress({}, {}, acks)

    for r in range(20):  # warm-up: every client has stored and acknowledged once
        await one_round(r)
    if isinstance(store.redis, RedisClusterClient):
        await store.redis.config_resetstat(target_nodes=RedisClusterClient.ALL_NODES)
    else:
        await store.redis.config_resetstat()
    cpu0, _ = await _redis_totals(store)
    for r in range(rounds):
        await one_round(r)
    cpu1, calls = await _redis_totals(store)
    count = rounds * per_call
    return 1e6 * (cpu1 - cpu0) / count, calls / count


async def bench_replay_progress(
    store: RedisMessageStore, per_call: int, count: int = 10_000
) -> tuple[float, float]:
    """Redis CPU us per message and commands per message of a replay's marks and
    acknowledgements (module docstring, ``replay progress``)."""
    cid = f"bench-progress-{uuid.uuid4().hex[:6]}"
    await store.redis.set(client_keys(cid).session, b"s")
    for first in range(0, count, 1000):
        await store.save_batch(cid, _messages(first, 1000), partition=0)
    if isinstance(store.redis, RedisClusterClient):
        await store.redis.config_resetstat(target_nodes=RedisClusterClient.ALL_NODES)
    else:
        await store.redis.config_resetstat()
    cpu0, _ = await _redis_totals(store)
    after = 0
    while records := (await store.load_page(cid, after, 500)).records:
        pairs = [(r.packet_id, r.score) for r in records]
        for at in range(0, len(pairs), per_call):
            chunk = pairs[at : at + per_call]
            marked = await store.write_progress({cid: chunk}, {}, {})
            assert len(marked[cid]) == len(chunk)
            await store.write_progress({}, {}, {cid: chunk})
        after = records[-1].score
    cpu1, calls = await _redis_totals(store)
    assert await store.pending_count(cid) == 0
    return 1e6 * (cpu1 - cpu0) / count, calls / count


async def _script_us(store: RedisMessageStore) -> float:
    """Redis's own time per script call since its statistics were reset (INFO
    commandstats; on a cluster, averaged over the primaries)."""
    stats = await store.redis.info("commandstats")
    if "cmdstat_evalsha" in stats:
        return float(stats["cmdstat_evalsha"]["usec_per_call"])
    per_node = [
        node["cmdstat_evalsha"]["usec_per_call"]
        for node in stats.values()
        if "cmdstat_evalsha" in node
    ]
    return sum(per_node) / len(per_node) if per_node else 0.0


async def run(url: str, cluster: bool, args: argparse.Namespace) -> dict[str, float]:
    store = RedisMessageStore.from_url(url, cluster=cluster, limit=65535)
    try:
        await store.load_scripts()
        await bench_save_many(store, 20, args.batch, 2)  # warm-up
        await store.redis.config_resetstat()
        out = {
            "save_many": await bench_save_many(store, args.clients, args.batch, args.batches),
            "redis_us_per_save": await _script_us(store),
            "per-message": await bench_per_message(store, args.single_count),
            "replay": await bench_replay(store),
        }
        out["fleet_us"], out["fleet_calls"] = await bench_fleet(store)
        out["progress_us"], out["progress_calls"] = await bench_replay_progress(
            store, args.progress_batch
        )
    finally:
        await store.aclose()
    return out


@contextlib.contextmanager
def _servers(mode: str) -> Iterator[tuple[str, bool]]:
    if mode == "single":
        with RedisServer() as server:
            yield server.url, False
    else:
        with RedisCluster3() as cluster:
            yield cluster.url, True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["single", "cluster", "both"], default="both")
    parser.add_argument("--url", help="use this running Redis instead of starting one")
    parser.add_argument("--cluster", action="store_true", help="--url is a cluster node")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--batches", type=int, default=20, help="batches per client")
    parser.add_argument("--single-count", type=int, default=10_000)
    parser.add_argument(
        "--progress-batch", type=int, default=40, help="ids per mark / ack call of the replay"
    )
    args = parser.parse_args()
    print(
        f"{args.clients} clients x {args.batches} batches of {args.batch} "
        f"({args.clients * args.batches * args.batch} messages, {len(PAYLOAD)} B payload)"
    )
    targets: list[tuple[str, contextlib.AbstractContextManager[tuple[str, bool]]]]
    if args.url:
        targets = [("given", contextlib.nullcontext((args.url, args.cluster)))]
    else:
        modes = ["single", "cluster"] if args.mode == "both" else [args.mode]
        targets = [(m, _servers(m)) for m in modes]
    for name, servers in targets:
        with servers as (url, cluster):
            result = asyncio.run(run(url, cluster, args))
        print(
            f"{name:8s} save_many {result['save_many']:>9,.0f} msg/s "
            f"(Redis {result['redis_us_per_save']:,.0f} us per client batch)   "
            f"per-message {result['per-message']:>8,.0f} msg/s   "
            f"replay {result['replay']:>9,.0f} msg/s\n"
            f"{name:8s} fleet: Redis CPU {result['fleet_us']:.1f} us per message (save + ack), "
            f"{result['fleet_calls']:.1f} commands per message\n"
            f"{name:8s} replay progress ({args.progress_batch} ids per call): Redis CPU "
            f"{result['progress_us']:.1f} us per message (marks + acks), "
            f"{result['progress_calls']:.1f} commands per message"
        )


if __name__ == "__main__":
    main()
