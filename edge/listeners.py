"""Which sockets devicemq listens on, and the TLS context of the secure ones.

Four listeners, each a section of the settings with ``enabled``, ``host``
and ``port`` (``broker/config.py``, ``config/devicemq.yml``):

============== ============ ========== ==============================
section        transport    framing    default port
============== ============ ========== ==============================
listener       TCP          MQTT       1883 (enabled)
tls            TLS          MQTT       8883
websocket      TCP          WebSocket  8083
websocket_tls  TLS          WebSocket  8084
============== ============ ========== ==============================

Both TLS listeners use the certificates of the ``tls`` section. A listener
without a ``host`` listens on 127.0.0.1 only unless authentication is
configured (:func:`effective_host`, SECURITY.md "Defaults"). All of them
feed the same :class:`~broker.connection.MQTTConnection` and session layer;
the WebSocket ones go through :mod:`edge.websocket` first.

TLS defaults (:func:`build_ssl_context`): a ``PROTOCOL_TLS_SERVER`` context,
TLS 1.2 or newer, Python's cipher defaults (forward-secret AEAD), no
compression, no renegotiation, server cipher preference. With ``cafile`` the
server asks for a client certificate (``CERT_OPTIONAL``: one presented must
verify); ``require_certificate`` makes it mandatory (``CERT_REQUIRED``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from broker.config import ConfigError, Settings, TlsSettings

__all__ = [
    "Framing",
    "ListenerSpec",
    "authentication_configured",
    "build_ssl_context",
    "effective_host",
    "listener_specs",
]


class Framing(Enum):
    MQTT = "mqtt"  # MQTT packets straight on the byte stream
    WEBSOCKET = "websocket"  # MQTT packets inside binary WebSocket frames


@dataclass(frozen=True)
class ListenerSpec:
    name: str  # the settings section: listener, tls, websocket, websocket_tls
    host: str
    port: int
    framing: Framing
    ssl: ssl.SSLContext | None = None

    @property
    def scheme(self) -> str:
        if self.framing is Framing.WEBSOCKET:
            return "wss" if self.ssl else "ws"
        return "mqtts" if self.ssl else "mqtt"


_TLS_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}


def build_ssl_context(tls: TlsSettings) -> ssl.SSLContext:
    """The server-side context for ``tls``; a :class:`ConfigError` names what is wrong."""
    if not tls.certfile:
        raise ConfigError(
            "a TLS listener is enabled but no certificate is set", name="tls.certfile"
        )
    if tls.require_certificate and not tls.cafile:
        raise ConfigError(
            "require_certificate needs cafile (the CAs client certificates are checked against)",
            name="tls.require_certificate",
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _TLS_VERSIONS[tls.min_version]
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    context.options |= ssl.OP_NO_RENEGOTIATION
    if tls.ciphers:
        try:
            context.set_ciphers(tls.ciphers)
        except ssl.SSLError as e:
            raise ConfigError(f"no usable cipher: {_why(e)}", name="tls.ciphers") from None
    _readable(tls.certfile, "tls.certfile")
    if tls.keyfile:
        _readable(tls.keyfile, "tls.keyfile")
    try:
        context.load_cert_chain(tls.certfile, tls.keyfile or None)
    except ssl.SSLError as e:
        raise ConfigError(
            f"cannot load the certificate and key: {_why(e)}", name="tls.certfile"
        ) from None
    if tls.cafile:
        _readable(tls.cafile, "tls.cafile")
        try:
            context.load_verify_locations(cafile=tls.cafile)
        except ssl.SSLError as e:
            raise ConfigError(f"cannot load CA file: {_why(e)}", name="tls.cafile") from None
        context.verify_mode = ssl.CERT_REQUIRED if tls.require_certificate else ssl.CERT_OPTIONAL
    else:
        context.verify_mode = ssl.CERT_NONE
    return context


def _why(error: ssl.SSLError) -> str:
    return str(getattr(error, "reason", None) or error)


def _readable(path: str, name: str) -> None:
    try:
        with Path(path).open("rb"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}", name=name) from None


LOOPBACK = "127.0.0.1"
EVERYWHERE = "0.0.0.0"


def authentication_configured(settings: Settings) -> bool:
    """Whether clients must prove who they are: a password file, certificate identities
    or an external check (auth.chain)."""
    auth = settings.auth
    return bool(auth.password_file or auth.chain_members) or auth.use_identity_as_username


def effective_host(settings: Settings, host: str) -> str:
    """A listener's address: ``host`` if one is configured; otherwise (empty, the
    default) every interface when authentication is configured and this machine
    only (127.0.0.1) when it is not, as Mosquitto 2 does: a broker that lets
    anyone in is not put on the network unless someone asked for it."""
    if host:
        return host
    return EVERYWHERE if authentication_configured(settings) else LOOPBACK


def listener_specs(settings: Settings) -> list[ListenerSpec]:
    """The enabled listeners, TLS contexts built (once, shared by both TLS listeners).

    Hosts are resolved (:func:`effective_host`)."""
    specs: list[ListenerSpec] = []
    context: ssl.SSLContext | None = None

    def tls_context() -> ssl.SSLContext:
        nonlocal context
        if context is None:
            context = build_ssl_context(settings.tls)
        return context

    def host(configured: str) -> str:
        return effective_host(settings, configured)

    if settings.listener.enabled:
        plain = settings.listener
        specs.append(ListenerSpec("listener", host(plain.host), plain.port, Framing.MQTT))
    if settings.tls.enabled:
        tls = settings.tls
        specs.append(ListenerSpec("tls", host(tls.host), tls.port, Framing.MQTT, tls_context()))
    if settings.websocket.enabled:
        ws = settings.websocket
        specs.append(ListenerSpec("websocket", host(ws.host), ws.port, Framing.WEBSOCKET))
    if settings.websocket_tls.enabled:
        wss = settings.websocket_tls
        specs.append(
            ListenerSpec(
                "websocket_tls", host(wss.host), wss.port, Framing.WEBSOCKET, tls_context()
            )
        )
    if not specs:
        raise ConfigError(
            "every listener is disabled (listener, tls, websocket, websocket_tls)",
            name="listener.enabled",
        )
    return specs
