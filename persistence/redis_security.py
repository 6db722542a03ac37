"""How devicemq connects to a Redis that wants TLS, an ACL user, a password, or
that Sentinels name.

One place turns the ``persistence.redis_*`` settings into redis-py's connection
options, checked at start with a one-line error naming the setting (a missing
certificate file, a key without its certificate, TLS files for a ``redis://``
URL, a user or password given both in the URL and in the settings). Every
Redis client of the broker (the store, the cluster link) is made with them.

Sentinel (``redis_sentinels``, ``redis_sentinel_master``): each new connection
asks the Sentinels where the master is, so after a failover the clients reach
the promoted replica; ``redis_url`` then gives the scheme, database and
credentials only (``redis:///0``). TLS settings apply towards the Sentinels too.

Trust: redis-py verifies Redis's certificate against ``redis_tls_ca_file``
*in addition to* the system's CAs, and checks that it names the host of the
URL unless ``redis_tls_check_hostname`` is false (then any certificate a
trusted CA signed passes: for private networks only).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from broker.config import ConfigError, PersistenceSettings
from persistence import secret_files, tls_failure
from persistence.redis_packing import packed_by_hiredis

PREFIX = "persistence.redis"  # of the settings (persistence/secret_files.py)

SETTINGS = (
    "redis_username",
    "redis_password_file",
    "redis_tls_ca_file",
    "redis_tls_cert_file",
    "redis_tls_key_file",
    "redis_sentinels",
    "redis_sentinel_master",
)


@dataclass(frozen=True, slots=True)
class Sentinels:
    """Where to ask for the master (``persistence.redis_sentinels``) and its name."""

    addresses: tuple[tuple[str, int], ...]
    master: str
    db: int = 0


def sentinels(config: PersistenceSettings, url: str) -> Sentinels | None:
    """The Sentinels the settings name, checked; None without them."""
    if not config.redis_sentinels:
        if config.redis_sentinel_master:
            raise ConfigError(
                "a master name needs persistence.redis_sentinels",
                name="persistence.redis_sentinel_master",
            )
        return None
    if not config.redis_sentinel_master:
        raise ConfigError(
            "the Sentinels need the name of the master they monitor",
            name="persistence.redis_sentinel_master",
        )
    if config.redis_cluster:
        raise ConfigError(
            "a Redis Cluster fails over on its own; Sentinels watch one master and its "
            "replicas: set one of redis_cluster and redis_sentinels",
            name="persistence.redis_sentinels",
        )
    addresses = []
    for entry in config.redis_sentinels.split(","):
        host, _, port = entry.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"{entry.strip()!r} is not host:port", name="persistence.redis_sentinels"
            )
        addresses.append((host.strip("[]"), int(port)))
    parts = urlsplit(url)
    if parts.hostname or parts.port:
        raise ConfigError(
            f"with redis_sentinels the Sentinels name the master: write "
            f"{parts.scheme or 'redis'}:///{parts.path.strip('/') or '0'} (no host)",
            name="persistence.redis_url",
        )
    if parts.query:
        raise ConfigError(
            "URL options are not read with redis_sentinels: use the persistence.redis_* settings",
            name="persistence.redis_url",
        )
    db = parts.path.strip("/") or "0"
    if not db.isdigit():
        raise ConfigError(f"database {db!r} is not a number", name="persistence.redis_url")
    return Sentinels(tuple(addresses), config.redis_sentinel_master, int(db))


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's master lookup with a pool that makes callers wait for a free
    connection (the store's; see RedisMessageStore.from_url)."""


def redis_client(
    url: str,
    connect: dict[str, Any],
    found_by: Sentinels | None = None,
    *,
    max_connections: int | None = None,
    **extra: Any,
) -> Redis:
    """A client of the Redis at ``url``, or of the master ``found_by`` names (see
    :func:`_client`), whose connections pack commands with hiredis."""
    return packed_by_hiredis(
        _client(url, connect, found_by, max_connections=max_connections, **extra)
    )


def _client(
    url: str,
    connect: dict[str, Any],
    found_by: Sentinels | None,
    *,
    max_connections: int | None,
    **extra: Any,
) -> Redis:
    """A client of the Redis at ``url``, or of the master ``found_by`` names, with
    ``connect`` (:func:`connect_options`); ``max_connections``: a pool that waits
    for a free connection past it instead of failing."""
    options: dict[str, Any] = {"decode_responses": False, **connect, **extra}
    options.update(_no_maintenance_notifications())
    if found_by is None:
        if max_connections is None:
            return Redis.from_url(url, **options)
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=None, **options
        )
        return Redis(connection_pool=pool)
    towards_sentinels = _of_master(url, options, found_by)
    manager = Sentinel(list(found_by.addresses), sentinel_kwargs=towards_sentinels)  # type: ignore[no-untyped-call]
    if max_connections is None:
        return cast(Redis, manager.master_for(found_by.master, **options))
    return cast(
        Redis,
        manager.master_for(
            found_by.master,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=max_connections,
            timeout=None,
            **options,
        ),
    )


def _no_maintenance_notifications() -> dict[str, Any]:
    """redis-py's maintenance notifications off (Redis Enterprise's, RESP3 only).

    While they are "auto" (their default), redis-py's pool hands out a connection
    the server has closed without replacing it (its check is skipped), so
    after a Redis restart every pooled connection failed its next command: the
    background writes retried, /ready flapped (tests/faults/test_redis_restart.py).
    """
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # an older redis-py: no notifications, the check is made
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def _of_master(url: str, options: dict[str, Any], found_by: Sentinels) -> dict[str, Any]:
    """Complete ``options`` for the master the Sentinels name (TLS, credentials and the
    database from ``url``, which names no host); answers the options towards the
    Sentinels themselves (TLS only)."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "rediss":
        options["ssl"] = True
    if parts.username:
        options.setdefault("username", unquote(parts.username))
    if parts.password:
        options.setdefault("password", unquote(parts.password))
    options["db"] = found_by.db
    return {key: value for key, value in options.items() if key.startswith("ssl")}


def blocking_client(
    url: str, connect: dict[str, Any], found_by: Sentinels | None = None, *, cluster: bool = False
) -> Any:
    """A blocking (not asyncio) client, for code off the event loop: the pipeline's
    Spark driver and workers. Same settings as :func:`redis_client`."""
    import redis as blocking
    from redis.sentinel import Sentinel as BlockingSentinel

    options: dict[str, Any] = dict(connect)
    if cluster:
        return blocking.RedisCluster.from_url(url, **options)
    if found_by is None:
        return blocking.Redis.from_url(url, **options)
    towards_sentinels = _of_master(url, options, found_by)
    manager = BlockingSentinel(  # type: ignore[no-untyped-call]
        list(found_by.addresses), sentinel_kwargs=towards_sentinels
    )
    return manager.master_for(found_by.master, **options)  # type: ignore[no-untyped-call]


def connect_options(config: PersistenceSettings, url: str) -> dict[str, Any]:
    """redis-py keyword arguments for ``url`` as the settings say; ConfigError names the
    setting that is wrong."""
    options: dict[str, Any] = {}
    parts = urlsplit(url)
    tls = parts.scheme.lower() == "rediss"
    query = parse_qs(parts.query)
    if config.redis_username and (parts.username or "username" in query):
        raise ConfigError(
            "redis_url names a user too: give it in one place", name="persistence.redis_username"
        )
    if config.redis_password_file and (parts.password or "password" in query):
        raise ConfigError(
            "redis_url holds a password too: give it in one place",
            name="persistence.redis_password_file",
        )
    tls_files = {
        "persistence.redis_tls_ca_file": config.redis_tls_ca_file,
        "persistence.redis_tls_cert_file": config.redis_tls_cert_file,
        "persistence.redis_tls_key_file": config.redis_tls_key_file,
    }
    named = [name for name, value in tls_files.items() if value]
    if named and not tls:
        raise ConfigError("TLS files are set but redis_url is not rediss://", name=named[0])
    if bool(config.redis_tls_cert_file) != bool(config.redis_tls_key_file):
        missing = "redis_tls_key_file" if config.redis_tls_cert_file else "redis_tls_cert_file"
        raise ConfigError(
            "a client certificate needs its key, and a key its certificate",
            name=f"persistence.{missing}",
        )
    if tls:
        if config.redis_tls_ca_file:
            ca = secret_files.ca_file(PREFIX, config.redis_tls_ca_file)
            options["ssl_ca_certs"] = str(ca)
        if config.redis_tls_cert_file:
            cert, key = secret_files.key_pair(
                PREFIX, config.redis_tls_cert_file, config.redis_tls_key_file
            )
            options["ssl_certfile"] = str(cert)
            options["ssl_keyfile"] = str(key)
        options["ssl_check_hostname"] = config.redis_tls_check_hostname
        options["ssl_cert_reqs"] = "required"
    if config.redis_username:
        options["username"] = config.redis_username
    if config.redis_password_file:
        _, options["password"] = secret_files.password(
            "persistence.redis_password_file", config.redis_password_file
        )
    return options


def for_embedded(config: PersistenceSettings) -> None:
    """The embedded Redis is plain and has no users: these settings are for a Redis of
    one's own (``redis_url``)."""
    for key in SETTINGS:
        if getattr(config, key):
            raise ConfigError(
                "applies to a Redis of your own (persistence.redis_url); the embedded "
                "one is plain, with no users",
                name=f"persistence.{key}",
            )


def explain(error: BaseException, options: dict[str, Any] | None = None) -> str:
    """What a failed connection to Redis means for the operator, naming the settings
    (``options``: those it was made with, from :func:`connect_options`)."""
    from redis.exceptions import AuthenticationError, NoPermissionError

    options = options or {}
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    text = str(error) or type(error).__name__
    for link in chain:
        if type(link).__name__ == "MasterNotFoundError":  # asyncio's or redis-py's own
            master = str(link).split(" : ", 1)[0].removeprefix("No master found for ")
            return (
                f"no Sentinel of persistence.redis_sentinels names a master {master}: "
                "check persistence.redis_sentinel_master, and that the Sentinels answer "
                "(with TLS if redis_url is rediss://)"
            )
        if isinstance(link, AuthenticationError):
            return (
                f"redis refused the credentials ({link}): check persistence.redis_username "
                "and persistence.redis_password_file (or the user in redis_url)"
            )
        if isinstance(link, NoPermissionError):
            return (
                f"the redis user may not run what devicemq needs ({link}): give it "
                '~* &* +@all (docs/backends.md "Secured Redis")'
            )
        if isinstance(link, ssl.SSLError):
            return _tls(tls_failure.reason(link))
    if "ssl_cert_reqs" in options and "ssl_certfile" not in options and "closed" in text.lower():
        return (
            f"redis closed the connection ({text}): if it wants a client certificate, set "
            "persistence.redis_tls_cert_file and redis_tls_key_file"
        )
    return text


_TLS_HINTS = {
    tls_failure.CLIENT_CERT_REQUIRED: (
        "redis wants a client certificate: persistence.redis_tls_cert_file and key_file"
    ),
    tls_failure.HOSTNAME: (
        "its certificate does not name the host of redis_url (or give Redis a "
        "certificate that does; persistence.redis_tls_check_hostname)"
    ),
    tls_failure.EXPIRED: "its certificate has expired",
    tls_failure.UNSIGNED: "its certificate is not signed by persistence.redis_tls_ca_file",
    tls_failure.CLIENT_CERT_REFUSED: (
        "redis refused the client certificate: persistence.redis_tls_cert_file"
    ),
    tls_failure.OTHER: (
        "check persistence.redis_tls_ca_file, redis_tls_cert_file, redis_tls_key_file "
        "and redis_tls_check_hostname"
    ),
}


def _tls(reason: str) -> str:
    """A failed TLS handshake with Redis, with the setting most likely to blame."""
    return tls_failure.explain("redis", reason, _TLS_HINTS)
