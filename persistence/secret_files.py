"""The files a secured connection is configured with (CA, certificate and key, a
password), checked at start with one line naming the setting: for Redis
(persistence/redis_security.py) and Kafka (persistence/kafka_security.py) alike.
``prefix`` is the settings' common part, e.g. ``persistence.redis``."""

from __future__ import annotations

import ssl
from pathlib import Path

from broker.config import ConfigError


def readable(name: str, path: str) -> Path:
    """``path`` if it can be read, else ConfigError naming setting ``name``."""
    file = Path(path).expanduser()
    try:
        with file.open("rb"):
            pass
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}", name=name) from None
    return file


def ca_file(prefix: str, path: str) -> Path:
    """``<prefix>_tls_ca_file``: readable, and holding a CA certificate."""
    name = f"{prefix}_tls_ca_file"
    file = readable(name, path)
    try:
        ssl.create_default_context(cafile=str(file))
    except ssl.SSLError as error:
        raise ConfigError(f"{path} holds no CA certificate ({error.reason})", name=name) from None
    return file


def key_pair(prefix: str, cert_path: str, key_path: str) -> tuple[Path, Path]:
    """``<prefix>_tls_cert_file`` and ``_key_file``: readable, and a certificate with its
    key, without a passphrase (a pair that does not match fails here, not at every
    connect)."""
    cert = readable(f"{prefix}_tls_cert_file", cert_path)
    key = readable(f"{prefix}_tls_key_file", key_path)

    def no_passphrase() -> str:
        raise ConfigError(
            "the key is protected by a passphrase: give one without",
            name=f"{prefix}_tls_key_file",
        )

    try:
        ssl.create_default_context().load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as error:
        raise ConfigError(
            f"{cert} and {key} are not a certificate and its key ({error.reason})",
            name=f"{prefix}_tls_cert_file",
        ) from None
    return cert, key


def password(name: str, path: str) -> tuple[Path, str]:
    """The password in file ``path`` (setting ``name``), stripped; not empty."""
    file = readable(name, path)
    text = file.read_text().strip()
    if not text:
        raise ConfigError(f"{file} is empty", name=name)
    return file, text
