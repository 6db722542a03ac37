"""Micro-benchmark of one auth.chain decision: ``python -m benchmarks.auth_chain_bench``.

Microseconds per CONNECT decided by ``Authenticator.authenticate`` (best of
several repeats): a JWT password with HS256, RS256 and ES256, an HTTP check
answered from the cache, and one that asks a ``http.server`` on this machine
(made inline here; the broker makes it in a thread). The JWT check runs on the
event loop in the broker, which is why its cost matters (SECURITY.md
"External authentication").
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from app.authentication import open_authenticator
from broker.auth import Authenticator, AuthResult
from broker.config import AuthSettings
from tests.auth_service import SECRET, SigningKey, claims, hs256, running_service, write_jwks

REPEAT = 5


def _us_per_call(auth: Authenticator, username: str, password: bytes, number: int) -> float:
    results: list[AuthResult] = []
    best = float("inf")
    for _ in range(REPEAT):
        start = time.perf_counter()
        for _ in range(number):
            auth.authenticate(
                username, password, None, results.append, "192.0.2.1", None, "c1", "192.0.2.1"
            )
        best = min(best, (time.perf_counter() - start) / number)
    assert all(result.ok for result in results), results[-1]
    return best * 1e6


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        secret, jwks = Path(tmp) / "secret", Path(tmp) / "jwks.json"
        secret.write_bytes(SECRET)
        rs, es = SigningKey.new("rs", "RS256"), SigningKey.new("es", "ES256")
        write_jwks(jwks, rs, es)
        settings = AuthSettings(chain="jwt", jwt_secret_file=str(secret), jwt_jwks_file=str(jwks))
        auth = open_authenticator(settings)
        token = claims("c1", "dev", acl=["readwrite devices/%c/#"])
        rows.append(("jwt HS256", _us_per_call(auth, "dev", hs256(token).encode(), 2000)))
        rows.append(("jwt RS256", _us_per_call(auth, "dev", rs.sign(token).encode(), 2000)))
        rows.append(("jwt ES256", _us_per_call(auth, "dev", es.sign(token).encode(), 2000)))
    with running_service() as service:
        service.allow("dev", acl=["readwrite devices/%c/#"])
        base = AuthSettings(chain="http", http_url=service.url, max_verify_rate_per_source=0)
        rows.append(("http, cached", _us_per_call(open_authenticator(base), "dev", b"pw", 5000)))
        uncached = AuthSettings(
            chain="http", http_url=service.url, max_verify_rate_per_source=0, http_cache_seconds=0
        )
        rows.append(("http, asked", _us_per_call(open_authenticator(uncached), "dev", b"pw", 200)))
    print(f"{'decision':<16}{'us per CONNECT':>16}")
    for name, us in rows:
        print(f"{name:<16}{us:>16.1f}")


if __name__ == "__main__":
    main()
