"""The embedded Kafka on each storage: start time, memory and disk under one load.

For each ``--storage`` (``persistence.embedded_kafka_storage``; repeat it, the
runs go in the order given), a fresh data dir and ``devicemq run`` on it with
the embedded services; then: the seconds until ``/ready``, the resident memory
of the broker and of each service (idle, and 2 s after the load), a
persistent p2p load (``devicemq loadtest p2p --persistent``, QoS 1), the
records then in the persisted and events topics and the bytes under
``DATA_DIR/s3`` and ``DATA_DIR/redis``. Compaction is off for the run
(``embedded_kafka_compact_after`` 0), so every record is still in the log
when it is measured. One JSON line per run. The rate is better compared with
``python -m loadtest.ab --head-setting persistence.embedded_kafka_storage=s3``
(alternating sides, CPU per message); this is for what that does not show.

    python -m benchmarks.embedded_storage_bench --storage memory --storage s3 \\
        --storage memory --storage s3 --pairs 100 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from app.embedded_services import EmbeddedServices, free_port
from loadtest import procstat

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("devicemq.device.persisted", "devicemq.events")
READY_TIMEOUT = 120.0


def _du(path: Path) -> int:
    """Bytes of disk the files under ``path`` take (allocated blocks)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


async def _records(bootstrap: str) -> dict[str, int]:
    """Records per topic, by the end a fetch reports (Tansu's ListOffsets is not
    to be trusted: docs/embedded-kafka.md); a topic this consumer's metadata does
    not list (the events topic, sometimes) is left out."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    out: dict[str, int] = {}
    try:
        for topic in TOPICS:
            tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            if not tps:
                continue
            consumer.assign(tps)
            starts = await consumer.beginning_offsets(tps)
            for tp in tps:
                consumer.seek(tp, starts[tp])
            deadline = time.monotonic() + 10
            while any(consumer.highwater(tp) is None for tp in tps):
                await consumer.getmany(timeout_ms=200, max_records=1)
                if time.monotonic() > deadline:
                    break
            out[topic] = sum((consumer.highwater(tp) or 0) - starts[tp] for tp in tps)
    finally:
        await consumer.stop()
    return out


def _rss_mb(pids: dict[str, int | None]) -> dict[str, float]:
    return {
        name: round((procstat.rss_kib(pid) or 0) / 1024, 1)
        for name, pid in pids.items()
        if pid is not None
    }


def run_one(storage: str, pairs: int, duration: float, workdir: Path) -> dict[str, Any]:
    data = workdir / f"data-{storage}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    port, metrics = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    env["PYTHONPATH"] = str(REPO)
    env.update(
        DEVICEMQ_PERSISTENCE_EMBEDDED_KAFKA_STORAGE=storage,
        DEVICEMQ_PERSISTENCE_EMBEDDED_KAFKA_COMPACT_AFTER="0",
        DEVICEMQ_MQTT_MAX_CONNECTION_RATE="0",
        DEVICEMQ_MQTT_MAX_CONNECTION_RATE_PER_SOURCE="0",
        DEVICEMQ_ADMIN_ENABLED="false",
        DEVICEMQ_METRICS_HOST="127.0.0.1",
    )
    argv = [sys.executable, "-m", "app.cli", "run", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--metrics-port", str(metrics), "--data-dir", str(data), "--log-level", "WARNING"]
    started = time.monotonic()
    with open(data / "broker.log", "wb") as log:
        broker = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if broker.poll() is not None or time.monotonic() - started > READY_TIMEOUT:
                raise RuntimeError(f"{storage}: the broker did not get ready (see {data})")
            time.sleep(0.05)
        ready = time.monotonic() - started
        services = {s.name: s for s in EmbeddedServices(data).status()}
        pids: dict[str, int | None] = {n: s.pid for n, s in services.items()}
        pids["broker"] = broker.pid
        idle = _rss_mb(pids)
        load = subprocess.run(
            [
                *(sys.executable, "-m", "app.cli", "loadtest", "p2p", "--persistent"),
                *("--qos", "1", "--pairs", str(pairs), "--duration", f"{duration:g}"),
                *("--warmup", "2", "--port", str(port), "--label", storage),
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        lines = [
            " ".join(line.split())
            for line in load.stdout.splitlines()
            if line.strip().startswith(("delivered msg/s", "e2e latency p99", "lost"))
        ]
        time.sleep(2)
        loaded = _rss_mb(pids)
        records = asyncio.run(_records(f"127.0.0.1:{services['kafka'].port}"))
        disk = {"s3": _du(data / "s3"), "redis": _du(data / "redis")}
    finally:
        broker.terminate()
        broker.wait(60)
        EmbeddedServices(data).stop()
    count = sum(records.values())
    return {
        "storage": storage,
        "ready_s": round(ready, 2),
        "rss_mb_idle": idle,
        "rss_mb_after_load": loaded,
        "load": lines,
        "records": records,
        "disk_bytes": disk,
        "s3_gb_per_million_records": round(disk["s3"] / count * 1e6 / 1e9, 2) if count else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.embedded_storage_bench")
    parser.add_argument(
        "--storage", action="append", choices=("memory", "s3"), help="repeatable, in order"
    )
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="storage-bench-") as workdir:
        for storage in args.storage or ["memory", "s3"]:
            result = run_one(storage, args.pairs, args.duration, Path(workdir))
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
