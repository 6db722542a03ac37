"""CPU per message of the sans-IO broker core, no sockets: ``python -m benchmarks.core_bench``.

The p2p shape in memory (``--pairs`` publishers, each with its own clean QoS 1
subscriber on its own topic, MQTT 5, or 3.1.1 with ``--mqtt 3.1.1`` as the load
test's default): every round, each publisher's PUBLISH
bytes go into its connection (``receive_data``), every subscriber's output is
read and decoded and its PUBACK fed back. It prints microseconds of this
process's CPU per message (publish to PUBACK both ways), best of ``--repeat``
runs: what the core costs, without the machine's other work, which a load test
on this 2-core machine cannot separate (loadtest.ab's msg/s moved +-10% between
rounds of the same code). Sockets, the event loop and the loader are left out:
compare two trees with it, not with a load test's numbers. The garbage
collector runs as ``devicemq run`` sets it (app/serve.py ``tune_gc``; a tree
without it, with CPython's defaults, as its broker did).

``--instructions`` counts instead of timing: it runs this benchmark twice under
valgrind's callgrind (``--rounds`` 5 and 25, one run each) and prints the
instructions per message of the difference. The count does not move with the
machine's other work (CPU time moved +-30% on a loaded 2-core machine, the
count by a few hundred instructions in 110k), though it sees no cache misses:
use it to compare two trees, CPU time to confirm. Needs ``valgrind`` on PATH;
about a minute and a half of one core.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from contextlib import suppress

from broker.codec import encode
from broker.packets import PubAck, Publish
from tests.unit.core_harness import V5, V311, Harness


def _setup(pairs: int, level: int = V5) -> tuple[Harness, list, list]:  # type: ignore[type-arg]
    harness = Harness()
    pubs, subs = [], []
    for i in range(pairs):
        sub = harness.connected(f"sub-{i}", level=level)
        sub.subscribe(f"bench/{i}", qos=1)
        subs.append(sub)
        pubs.append(harness.connected(f"pub-{i}", level=level))
    return harness, pubs, subs


# The shortest PUBACK, the same bytes in 3.1.1 and 5.
_PUBACKS = {i: encode(PubAck(i), V5) for i in range(1, 65536)}


def _round(pubs: list, subs: list, frames: list[list[bytes]], n: int) -> int:  # type: ignore[type-arg]
    """One PUBLISH per publisher, delivered and acknowledged both ways."""
    for pub, frame in zip(pubs, frames[n % len(frames)], strict=True):
        pub.conn.receive_data(frame)
    delivered = 0
    for sub in subs:
        for packet in sub.read():
            if isinstance(packet, Publish) and packet.packet_id is not None:
                sub.conn.receive_data(_PUBACKS[packet.packet_id])
                delivered += 1
    for pub in pubs:
        pub.conn.data_to_send()  # its PUBACK
    return delivered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200, help="messages per publisher per run")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mqtt", choices=("3.1.1", "5"), default="5", help="protocol version")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="instructions per message under callgrind (rounds 25 minus rounds 5), not CPU time",
    )
    args = parser.parse_args()
    if args.instructions:
        _count_instructions(args.pairs, args.mqtt)
        return
    with suppress(ImportError):
        from app.serve import tune_gc

        tune_gc()
    level = V5 if args.mqtt == "5" else V311
    _harness, pubs, subs = _setup(args.pairs, level)
    # Packet ids cycle through a few values: the window never fills.
    frames = [
        [encode(Publish(f"bench/{i}", bytes(64), 1, packet_id=k), level) for i in range(args.pairs)]
        for k in range(1, 9)
    ]
    _round(pubs, subs, frames, 0)  # warm-up
    best = float("inf")
    for _ in range(args.repeat):
        cpu = time.process_time()
        delivered = sum(_round(pubs, subs, frames, n) for n in range(args.rounds))
        cpu = time.process_time() - cpu
        assert delivered == args.pairs * args.rounds, delivered
        best = min(best, cpu / delivered)
    print(
        f"{args.pairs} pairs, {args.rounds} rounds, MQTT {args.mqtt}: "
        f"{best * 1e6:.2f} us of CPU per message"
    )


def _count_instructions(pairs: int, mqtt: str) -> None:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--instructions needs valgrind on PATH (apt-get install valgrind)")

    def collected(rounds: int) -> int:
        callgrind = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null"]
        bench = ["-m", "benchmarks.core_bench", "--pairs", str(pairs), "--mqtt", mqtt]
        done = subprocess.run(
            [*callgrind, sys.executable, *bench, "--repeat", "1", "--rounds", str(rounds)],
            capture_output=True,
            text=True,
            check=True,
        )
        found = re.search(r"Collected : (\d+)", done.stderr)
        if found is None:
            raise SystemExit(f"no instruction count in callgrind's output:\n{done.stderr[-2000:]}")
        return int(found.group(1))

    few, many = collected(5), collected(25)
    per_message = (many - few) / (pairs * 20)
    print(f"{pairs} pairs, MQTT {mqtt}: {per_message / 1000:.1f}k instructions per message")


if __name__ == "__main__":
    main()
