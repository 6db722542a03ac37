"""An APPLICATION session offline while the fleet publishes, then back (issue 43's goal).

A backend's APPLICATION session subscribes to ``f/devices/+/telemetry`` and goes
offline; one publisher sends ``--rate`` QoS 1 messages a second for
``--seconds`` (payload: the message's number, over 100 device topics), each
acknowledged; then the session reconnects (Receive Maximum 1,000; the broker's
window is ``mqtt.max_inflight``) and reads everything, acknowledging each. It
checks that every message comes, once and in order, and reports the catch-up
rate and the broker's RSS over the run (sampled every 5 s).

    python -m benchmarks.app_offline_bench --rate 2000 --seconds 600
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time

from benchmarks.blocking_mqtt import BlockingClient, running_broker
from broker.packets import PubAck, Publish, SubAck, Subscribe, Subscription

DEVICES = 100
WINDOW = 100  # the publisher's PUBLISHes in flight


class _Rss:
    """The broker's RSS (MiB), every 5 s, in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples, self._stop = pid, [0], threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(
                ["ps", "-o", "rss=", "-p", str(self.pid)], capture_output=True, text=True
            ).stdout.strip()
            self.samples.append(int(out or 0) // 1024)
            self._stop.wait(5)

    def stop(self) -> None:
        self._stop.set()


def _session(port: int, clean: bool) -> BlockingClient:
    return BlockingClient(port, "app-backend", expiry=3600, clean_start=clean, receive_maximum=1000)


def _publish(port: int, rate: int, count: int, rss: _Rss) -> float:
    """``count`` QoS 1 messages paced at ``rate``; returns the seconds taken."""
    topics = [f"f/devices/d{i}/telemetry" for i in range(DEVICES)]
    pub = BlockingClient(port, "app-bench-pub")
    start, sent = time.perf_counter(), 0
    while sent < count:
        batch = min(WINDOW, count - sent)
        for i in range(sent, sent + batch):
            pub.send(Publish(topics[i % DEVICES], str(i).encode(), 1, packet_id=i % WINDOW + 1))
        for _ in range(batch):
            ack = pub.recv()
            assert isinstance(ack, PubAck) and ack.reason_code == 0, ack
        sent += batch
        ahead = sent / rate - (time.perf_counter() - start)
        if ahead > 0:
            time.sleep(ahead)
        if sent % (rate * 60) == 0:
            took = time.perf_counter() - start
            print(f"  {sent:,} acked after {took:.0f} s, broker RSS {rss.samples[-1]} MiB")
    pub.close()
    return time.perf_counter() - start


def _catch_up(raw: BlockingClient, count: int, rss: _Rss) -> float:
    """Read ``count`` messages, in order, acknowledging each; returns the seconds taken."""
    start, expected = time.perf_counter(), 0
    while expected < count:
        packet = raw.recv()
        assert isinstance(packet, Publish) and packet.packet_id is not None, packet
        raw.send(PubAck(packet.packet_id))
        number = int(packet.payload)
        assert number == expected, f"got message {number}, expected {expected}"
        expected += 1
        if expected % 200_000 == 0:
            took = time.perf_counter() - start
            print(f"  {expected:,} in order after {took:.0f} s, broker RSS {rss.samples[-1]} MiB")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=2000, help="messages a second (2000)")
    parser.add_argument("--seconds", type=int, default=600, help="offline for (600)")
    args = parser.parse_args(argv)
    count = args.rate * args.seconds
    with running_broker({"DEVICEMQ_APPLICATION_CLIENT_IDS": '["^app-"]'}) as broker:
        rss = _Rss(broker.pid)
        try:
            raw = _session(broker.port, clean=True)
            raw.send(Subscribe(1, [Subscription("f/devices/+/telemetry", 1)]))
            assert isinstance(raw.until(SubAck), SubAck)
            raw.close()
            took = _publish(broker.port, args.rate, count, rss)
            print(f"published {count:,} QoS 1 in {took:.1f} s: {count / took:,.0f} msg/s acked")
            took = _catch_up(_session(broker.port, clean=False), count, rss)
            print(f"caught up {count:,} in order in {took:.1f} s: {count / took:,.0f} msg/s")
            low, high, curve = min(rss.samples[1:]), max(rss.samples), rss.samples[1::12]
            print(f"broker RSS MiB: min {low}, max {high}; a minute apart {curve}")
        finally:
            rss.stop()


if __name__ == "__main__":
    main()
