"""How devicemq connects to a Redis that wants TLS, an ACL user, a password.

One place turns the ``persistence.redis_*`` settings into redis-py's connection
options, checked at start with a one-line error naming the setting (a missing
certificate file, a key without its certificate, TLS files for a ``redis://``
URL). Every Redis client of the broker (the store, the cluster link) is made
with them. The credentials may also be in the URL
(``rediss://user:password@host:6379/0``); the settings win.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from broker.config import ConfigError, PersistenceSettings


def _readable(name: str, path: str) -> Path:
    file = Path(path).expanduser()
    try:
        with file.open("rb"):
            pass
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}", name=name) from None
    return file


def connect_options(config: PersistenceSettings, url: str) -> dict[str, Any]:
    """redis-py keyword arguments for ``url`` as the settings say; ConfigError names the
    setting that is wrong."""
    options: dict[str, Any] = {}
    tls = url.startswith("rediss://")
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
            ca = _readable("persistence.redis_tls_ca_file", config.redis_tls_ca_file)
            try:
                ssl.create_default_context(cafile=str(ca))
            except ssl.SSLError as error:
                raise ConfigError(
                    f"{config.redis_tls_ca_file} holds no CA certificate ({error.reason})",
                    name="persistence.redis_tls_ca_file",
                ) from None
            options["ssl_ca_certs"] = str(ca)
        if config.redis_tls_cert_file:
            options["ssl_certfile"] = str(
                _readable("persistence.redis_tls_cert_file", config.redis_tls_cert_file)
            )
            options["ssl_keyfile"] = str(
                _readable("persistence.redis_tls_key_file", config.redis_tls_key_file)
            )
        options["ssl_check_hostname"] = config.redis_tls_check_hostname
        options["ssl_cert_reqs"] = "required"
    if config.redis_username:
        options["username"] = config.redis_username
    if config.redis_password_file:
        file = _readable("persistence.redis_password_file", config.redis_password_file)
        password = file.read_text().strip()
        if not password:
            raise ConfigError(f"{file} is empty", name="persistence.redis_password_file")
        options["password"] = password
    return options


def explain(error: BaseException) -> str:
    """What a failed connection to Redis means for the operator, naming the settings."""
    from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError

    text = str(error) or type(error).__name__
    if isinstance(error, AuthenticationError | AuthenticationWrongNumberOfArgsError) or (
        "NOAUTH" in text or "WRONGPASS" in text or "NOPERM" in text
    ):
        return (
            f"redis refused the credentials ({text}): check persistence.redis_username and "
            "persistence.redis_password_file (or the user in redis_url)"
        )
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return _tls(str(cause.reason or cause))
        cause = cause.__cause__ or cause.__context__
    if "SSL" in text or "certificate" in text.lower():
        return _tls(text)
    return text


def _tls(reason: str) -> str:
    """A failed TLS handshake with Redis, with the setting most likely to blame."""
    upper = reason.upper()
    if "CERTIFICATE_REQUIRED" in upper:
        hint = "redis wants a client certificate: persistence.redis_tls_cert_file and key_file"
    elif "HOSTNAME" in upper or "IP ADDRESS MISMATCH" in upper:
        hint = "its certificate does not name that host: persistence.redis_tls_check_hostname"
    elif "VERIFY" in upper or "SELF" in upper:
        hint = "its certificate is not signed by persistence.redis_tls_ca_file"
    elif "UNKNOWN_CA" in upper or "BAD_CERTIFICATE" in upper:
        hint = "redis refused the client certificate: persistence.redis_tls_cert_file"
    else:
        hint = (
            "check persistence.redis_tls_ca_file, redis_tls_cert_file, redis_tls_key_file "
            "and redis_tls_check_hostname"
        )
    return f"TLS with redis failed ({reason}): {hint}"
