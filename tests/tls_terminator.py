"""A TLS terminator in front of a plaintext server, for tests: Tansu 0.6.0 serves
no TLS (its ``broker --cert`` and ``--key`` are refused together, and ``--cert``
alone leaves the listener plain), so a secured Kafka is a real Tansu behind this,
as a Kafka behind a TLS load balancer is. It runs as a process of its own so a
test can stop it by PID and start another on the same port (a certificate
rotated under a running broker)::

    python -m tests.tls_terminator LISTEN_PORT TARGET_PORT CERT KEY [CLIENT_CA]

With CLIENT_CA, clients must show a certificate that CA signed. It prints
``ready`` once it listens on 127.0.0.1:LISTEN_PORT and 127.0.0.2:LISTEN_PORT.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import sys
from pathlib import Path

HOST = "127.0.0.1"
# Also loopback, but named by no certificate of tests/pki.py: a host-name mismatch.
OTHER_HOST = "127.0.0.2"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(listen: int, target: int, context: ssl.SSLContext) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(HOST, target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pump(client_r, server_w), _pump(server_r, client_w))

    server = await asyncio.start_server(handle, [HOST, OTHER_HOST], listen, ssl=context)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    listen, target, cert, key = int(argv[0]), int(argv[1]), argv[2], argv[3]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if len(argv) > 4:
        context.load_verify_locations(argv[4])
        context.verify_mode = ssl.CERT_REQUIRED
    asyncio.run(_serve(listen, target, context))


def start(
    listen: int, target: int, cert: Path, key: Path, client_ca: Path | None = None
) -> subprocess.Popen[str]:
    """The terminator as a process, once it listens (stop it with ``terminate``)."""
    argv = [sys.executable, "-m", "tests.tls_terminator", str(listen), str(target)]
    argv += [str(cert), str(key)] + ([str(client_ca)] if client_ca else [])
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(argv, cwd=repo, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the TLS terminator did not start on {listen}")
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM by PID, SIGKILL after 5 s, and reap."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


if __name__ == "__main__":
    main(sys.argv[1:])
