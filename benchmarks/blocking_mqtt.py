"""What the benchmarks that drive a real ``devicemq run`` share: a blocking MQTT 5
client on devicemq's codec, and a broker with persistence in a temporary data dir."""

from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from app.embedded_services import EmbeddedServices, free_port
from broker.codec import PacketDecoder, encode
from broker.packets import Connect, Packet, Properties


class BlockingClient:
    """A blocking MQTT 5 client over a socket, devicemq's codec on both sides.
    ``user`` logs in with the password ``<user>-pw`` (:func:`running_broker`'s)."""

    def __init__(
        self,
        port: int,
        client_id: str,
        user: str | None = None,
        expiry: int = 0,
        clean_start: bool = True,
        receive_maximum: int | None = None,
    ) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), 30)
        self.decoder = PacketDecoder(protocol_level=5)
        self.ready: collections.deque[Packet] = collections.deque()
        password = f"{user}-pw".encode() if user else None
        properties = None
        if expiry or receive_maximum:
            properties = Properties(
                session_expiry_interval=expiry or None, receive_maximum=receive_maximum
            )
        connect = Connect(
            client_id,
            protocol_level=5,
            clean_start=clean_start,
            username=user,
            password=password,
            properties=properties,
        )
        self.send(connect)
        connack = self.recv()
        assert getattr(connack, "reason_code", 1) == 0, connack

    def send(self, packet: Packet) -> None:
        self.sock.sendall(encode(packet, 5))

    def recv(self) -> Packet:
        while not self.ready:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.ready.extend(self.decoder.feed(data))
        return self.ready.popleft()

    def until(self, kind: type) -> Packet:
        while not isinstance(packet := self.recv(), kind):
            pass
        return packet

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class RunningBroker:
    port: int
    pid: int
    data_dir: Path  # broker.log is in it
    redis_url: str  # the embedded Redis, with the password it asks for ("": none)


@contextmanager
def running_broker(
    settings: Mapping[str, str] | None = None, users: tuple[str, ...] = ()
) -> Iterator[RunningBroker]:
    """``devicemq run`` with persistence in a temporary data dir, ``settings`` as
    ``DEVICEMQ_*`` variables; ``users``: a password file with each (password
    ``<user>-pw``), so anonymous clients are refused."""
    tmp = Path(tempfile.mkdtemp(prefix="devicemq-bench-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICEMQ_")}
    env.update(DEVICEMQ_PERSISTENCE_ENABLED="true", DEVICEMQ_ADMIN_ENABLED="false")
    env.update(settings or {})
    if users:
        from broker.auth import hash_password, write_password_file

        write_password_file(tmp / "passwd", {u: hash_password(f"{u}-pw") for u in users})
        env["DEVICEMQ_AUTH_PASSWORD_FILE"] = str(tmp / "passwd")
    argv = [sys.executable, "-m", "app.cli", "run", "--host", "127.0.0.1", "--port", str(port)]
    with (tmp / "broker.log").open("wb") as log:
        proc = subprocess.Popen([*argv, "--data-dir", str(tmp)], env=env, stdout=log, stderr=log)
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        redis_url = ""
        if (tmp / "services" / "ports.json").exists():  # persistence on
            ports = json.loads((tmp / "services" / "ports.json").read_text())
            password = EmbeddedServices(tmp).redis_password(create=False) or ""
            redis_url = f"redis://:{password}@127.0.0.1:{int(ports['redis'])}/0"
        yield RunningBroker(port, proc.pid, tmp, redis_url)
    finally:
        proc.terminate()
        try:
            proc.wait(60)  # its consumer stores what Kafka still holds first
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        subprocess.run(
            [sys.executable, "-m", "app.embedded_services", "stop", "--data-dir", str(tmp)],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(tmp, ignore_errors=True)
