"""How devicemq connects to a Kafka that wants TLS, SASL, or both.

One place turns the ``persistence.kafka_*`` security settings into a
:class:`KafkaSecurity`, checked at start with a one-line error naming the
setting (an unknown protocol or mechanism is refused by broker/config.py; a
missing or unreadable file, a certificate without its key, TLS files or a SASL
user with a protocol that uses neither, an empty password file are refused
here). Every Kafka client devicemq makes (the persistent path's producer and
consumer, the events producer, the admin clients, a session rewind's reader,
the pipeline's reader) takes its options from it: aiokafka keyword arguments
from :meth:`KafkaSecurity.aiokafka`, librdkafka's from
:meth:`KafkaSecurity.librdkafka`.

Trust: with a CA file only that file's CAs are trusted, else the system's;
Kafka's certificate must name the host it is reached at (the bootstrap's, then
the advertised listeners') unless ``kafka_tls_check_hostname`` is false.

A :class:`KafkaSecurity` holds plain values (the password read from its file,
not an SSL context): it pickles, so the pipeline ships it to Spark's workers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from broker.config import ConfigError, PersistenceSettings
from persistence import secret_files, tls_failure

__all__ = [
    "PLAINTEXT",
    "SETTINGS",
    "KafkaSecurity",
    "diagnose",
    "explain",
    "for_embedded",
    "from_options",
    "from_settings",
]

PREFIX = "persistence.kafka"  # of the settings (persistence/secret_files.py)

log = logging.getLogger("devicemq.persistence")

# The settings that change how a Kafka client connects (their defaults: plaintext).
SETTINGS = (
    "kafka_sasl_username",
    "kafka_sasl_password_file",
    "kafka_tls_ca_file",
    "kafka_tls_cert_file",
    "kafka_tls_key_file",
)
_TLS_PROTOCOLS = ("SSL", "SASL_SSL")
_SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """What a Kafka client needs besides the bootstrap servers."""

    protocol: str = "PLAINTEXT"
    mechanism: str = ""  # SASL only: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512
    username: str = ""
    password_file: str = ""
    password: str = field(default="", repr=False)  # read from password_file at start
    ca_file: str = ""  # empty: the system's CAs
    cert_file: str = ""
    key_file: str = ""
    check_hostname: bool = True

    @property
    def tls(self) -> bool:
        return self.protocol in _TLS_PROTOCOLS

    @property
    def sasl(self) -> bool:
        return self.protocol in _SASL_PROTOCOLS

    def ssl_context(self) -> ssl.SSLContext:
        """The client side of the TLS handshake (files checked by :func:`from_settings`),
        one for every client with these files: making one reads the system's CAs,
        160 ms on the event loop (BENCHMARKS.md "Kafka over TLS")."""
        return _ssl_context(self.ca_file, self.cert_file, self.key_file, self.check_hostname)

    def aiokafka(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's producer, consumer, admin client and client."""
        options: dict[str, Any] = {"security_protocol": self.protocol}
        if self.tls:
            options["ssl_context"] = self.ssl_context()
        if self.sasl:
            options["sasl_mechanism"] = self.mechanism
            options["sasl_plain_username"] = self.username
            options["sasl_plain_password"] = self.password
        return options

    def librdkafka(self) -> dict[str, str]:
        """The same for confluent-kafka (librdkafka's property names)."""
        options = {"security.protocol": self.protocol.lower()}
        if self.tls:
            if self.ca_file:
                options["ssl.ca.location"] = self.ca_file
            if self.cert_file:
                options["ssl.certificate.location"] = self.cert_file
                options["ssl.key.location"] = self.key_file
            options["ssl.endpoint.identification.algorithm"] = (
                "https" if self.check_hostname else "none"
            )
        if self.sasl:
            options["sasl.mechanism"] = self.mechanism
            options["sasl.username"] = self.username
            options["sasl.password"] = self.password
        return options

    def as_options(self) -> dict[str, str]:
        """These settings as text options (the pipeline's Spark source): file names,
        never the password; :func:`from_options` reads them back."""
        options = {
            "kafka.security.protocol": self.protocol,
            "kafka.sasl.mechanism": self.mechanism,
            "kafka.sasl.username": self.username,
            "kafka.sasl.password.file": self.password_file,
            "kafka.ssl.ca.file": self.ca_file,
            "kafka.ssl.cert.file": self.cert_file,
            "kafka.ssl.key.file": self.key_file,
            "kafka.ssl.check.hostname": "true" if self.check_hostname else "false",
        }
        return {name: value for name, value in options.items() if value}


PLAINTEXT = KafkaSecurity()


@functools.lru_cache(maxsize=4)
def _ssl_context(
    ca_file: str, cert_file: str, key_file: str, check_hostname: bool
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file or None)
    context.check_hostname = check_hostname
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    return context


# Option names of :meth:`KafkaSecurity.as_options`, and the setting each stands for.
_OPTION_SETTINGS = {
    "kafka.security.protocol": "kafka_security_protocol",
    "kafka.sasl.mechanism": "kafka_sasl_mechanism",
    "kafka.sasl.username": "kafka_sasl_username",
    "kafka.sasl.password.file": "kafka_sasl_password_file",
    "kafka.ssl.ca.file": "kafka_tls_ca_file",
    "kafka.ssl.cert.file": "kafka_tls_cert_file",
    "kafka.ssl.key.file": "kafka_tls_key_file",
}


def from_options(options: Mapping[str, str]) -> KafkaSecurity:
    """The :class:`KafkaSecurity` of :meth:`KafkaSecurity.as_options` (names in any case,
    as Spark hands options on), checked as :func:`from_settings` checks settings."""
    given = {name.lower(): value for name, value in options.items()}
    values: dict[str, Any] = {
        setting: given[name] for name, setting in _OPTION_SETTINGS.items() if name in given
    }
    values["kafka_tls_check_hostname"] = given.get("kafka.ssl.check.hostname", "true") != "false"
    if not given.get("kafka.sasl.mechanism"):
        values.pop("kafka_sasl_mechanism", None)
    return from_settings(replace(PersistenceSettings(), **values))


def from_settings(config: PersistenceSettings) -> KafkaSecurity:
    """The security of ``config.kafka_bootstrap``; ConfigError names the setting that
    is wrong."""
    protocol = config.kafka_security_protocol
    for key, known in (
        ("kafka_security_protocol", ("PLAINTEXT", *_TLS_PROTOCOLS, *_SASL_PROTOCOLS)),
        ("kafka_sasl_mechanism", _MECHANISMS),
    ):  # as loaded settings are checked (options of the pipeline's source are not)
        if getattr(config, key) not in known:
            raise ConfigError(
                f"must be one of {', '.join(known)}, got {getattr(config, key)!r}",
                name=f"persistence.{key}",
            )
    tls_files = {
        "persistence.kafka_tls_ca_file": config.kafka_tls_ca_file,
        "persistence.kafka_tls_cert_file": config.kafka_tls_cert_file,
        "persistence.kafka_tls_key_file": config.kafka_tls_key_file,
    }
    named = [name for name, value in tls_files.items() if value]
    if named and protocol not in _TLS_PROTOCOLS:
        raise ConfigError(
            f"TLS files are set but kafka_security_protocol is {protocol} (SSL or SASL_SSL "
            "use them)",
            name=named[0],
        )
    sasl_set = [
        f"persistence.{key}"
        for key in ("kafka_sasl_username", "kafka_sasl_password_file")
        if getattr(config, key)
    ]
    if sasl_set and protocol not in _SASL_PROTOCOLS:
        raise ConfigError(
            f"a SASL login is set but kafka_security_protocol is {protocol} (SASL_PLAINTEXT "
            "or SASL_SSL use it)",
            name=sasl_set[0],
        )
    if bool(config.kafka_tls_cert_file) != bool(config.kafka_tls_key_file):
        missing = "kafka_tls_key_file" if config.kafka_tls_cert_file else "kafka_tls_cert_file"
        raise ConfigError(
            "a client certificate needs its key, and a key its certificate",
            name=f"persistence.{missing}",
        )
    security = KafkaSecurity(protocol=protocol, check_hostname=config.kafka_tls_check_hostname)
    if protocol in _TLS_PROTOCOLS:
        security = _with_tls(config, security)
    if protocol in _SASL_PROTOCOLS:
        security = _with_sasl(config, security)
    return security


def _with_tls(config: PersistenceSettings, security: KafkaSecurity) -> KafkaSecurity:
    ca = cert = key = ""
    if config.kafka_tls_ca_file:
        ca = str(secret_files.ca_file(PREFIX, config.kafka_tls_ca_file))
    if config.kafka_tls_cert_file:
        pair = secret_files.key_pair(PREFIX, config.kafka_tls_cert_file, config.kafka_tls_key_file)
        cert, key = str(pair[0]), str(pair[1])
    return KafkaSecurity(
        protocol=security.protocol,
        check_hostname=security.check_hostname,
        ca_file=ca,
        cert_file=cert,
        key_file=key,
    )


def _with_sasl(config: PersistenceSettings, security: KafkaSecurity) -> KafkaSecurity:
    if not config.kafka_sasl_username:
        raise ConfigError(
            f"kafka_security_protocol {security.protocol} needs a user",
            name="persistence.kafka_sasl_username",
        )
    if not config.kafka_sasl_password_file:
        raise ConfigError(
            f"kafka_security_protocol {security.protocol} needs a password file",
            name="persistence.kafka_sasl_password_file",
        )
    file, password = secret_files.password(
        "persistence.kafka_sasl_password_file", config.kafka_sasl_password_file
    )
    mechanism = config.kafka_sasl_mechanism
    if mechanism == "PLAIN" and security.protocol == "SASL_PLAINTEXT":
        log.warning(
            "kafka: SASL PLAIN over SASL_PLAINTEXT sends the password in the clear; "
            "use SASL_SSL or a SCRAM mechanism (persistence.kafka_sasl_mechanism)"
        )
    return KafkaSecurity(
        protocol=security.protocol,
        mechanism=mechanism,
        username=config.kafka_sasl_username,
        password_file=str(file),
        password=password,
        ca_file=security.ca_file,
        cert_file=security.cert_file,
        key_file=security.key_file,
        check_hostname=security.check_hostname,
    )


def for_embedded(config: PersistenceSettings) -> KafkaSecurity:
    """The embedded Kafka is plaintext on loopback: these settings are for a Kafka of
    one's own (``kafka_bootstrap``)."""
    keys = ("kafka_security_protocol", *SETTINGS)
    for key in keys:
        default = PersistenceSettings.__dataclass_fields__[key].default
        if getattr(config, key) != default:
            raise ConfigError(
                "applies to a Kafka of your own (persistence.kafka_bootstrap); the embedded "
                "one is plaintext on loopback",
                name=f"persistence.{key}",
            )
    return PLAINTEXT


def explain(error: BaseException, security: KafkaSecurity = PLAINTEXT) -> str:
    """What a failed connection to Kafka means for the operator, naming the settings."""
    from aiokafka.errors import (
        AuthenticationFailedError,
        IllegalSaslStateError,
        SaslAuthenticationFailed,
        UnsupportedSaslMechanismError,
    )

    refusals = (SaslAuthenticationFailed, AuthenticationFailedError, IllegalSaslStateError)

    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    text = str(error) or type(error).__name__
    for link in chain:
        if isinstance(link, UnsupportedSaslMechanismError):
            return (
                f"kafka does not offer {security.mechanism} ({link}): set "
                "persistence.kafka_sasl_mechanism to one it offers"
            )
        if isinstance(link, refusals) or (
            # aiokafka's SCRAM reads the server's last message without looking for an
            # error in it: a refused login shows as a missing 'v' (server signature).
            security.sasl and isinstance(link, KeyError) and link.args == ("v",)
        ):
            detail = str(link) if not isinstance(link, KeyError) else "login refused"
            return (
                f"kafka refused the credentials ({detail}): check "
                "persistence.kafka_sasl_username, kafka_sasl_password_file and "
                f"kafka_sasl_mechanism ({security.mechanism})"
            )
        if isinstance(link, ssl.SSLError):
            return _tls(tls_failure.reason(link))
    closed = "closed" in text.lower()
    if closed and not security.tls and not security.sasl:
        return (
            f"kafka closed the connection ({text}): if it wants TLS or a SASL login, set "
            "persistence.kafka_security_protocol"
        )
    if closed and security.tls and not security.cert_file:
        # TLS 1.3: a server that wants a client certificate says so after the
        # handshake, in an alert the client reads as the connection closing.
        return (
            f"kafka closed the connection ({text}): if it wants a client certificate, set "
            "persistence.kafka_tls_cert_file and kafka_tls_key_file"
        )
    return text


_TLS_HINTS = {
    tls_failure.CLIENT_CERT_REQUIRED: (
        "kafka wants a client certificate: persistence.kafka_tls_cert_file and key_file"
    ),
    tls_failure.HOSTNAME: (
        "its certificate does not name the host it was reached at (the bootstrap's or "
        "an advertised listener's; persistence.kafka_tls_check_hostname)"
    ),
    tls_failure.EXPIRED: "its certificate has expired",
    tls_failure.UNSIGNED: "its certificate is not signed by persistence.kafka_tls_ca_file",
    tls_failure.CLIENT_CERT_REFUSED: (
        "kafka refused the client certificate: persistence.kafka_tls_cert_file"
    ),
    tls_failure.NOT_TLS: "kafka does not speak TLS there: persistence.kafka_security_protocol",
    tls_failure.OTHER: (
        "check persistence.kafka_tls_ca_file, kafka_tls_cert_file, kafka_tls_key_file "
        "and kafka_tls_check_hostname"
    ),
}


def _tls(reason: str) -> str:
    """A failed TLS handshake with Kafka, with the setting most likely to blame."""
    return tls_failure.explain("kafka", reason, _TLS_HINTS)


async def diagnose(bootstrap: str, security: KafkaSecurity, timeout: float = 5.0) -> str | None:
    """Why Kafka at ``bootstrap`` cannot be used, if the reason is the connection itself
    (TLS, login), else None. aiokafka's clients log such a failure and report only
    that no broker answered: one connection made here, to the first server, says
    why."""
    from aiokafka.conn import create_conn

    first = bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    try:
        conn = await asyncio.wait_for(
            create_conn(
                host.strip("[]"),
                int(port),
                request_timeout_ms=int(timeout * 1000),
                **security.aiokafka(),
            ),
            timeout,
        )
    except (OSError, ValueError) as error:
        if isinstance(error, ssl.SSLError):
            return explain(error, security)
        return None  # unreachable, or a bootstrap that is not host:port: not ours to say
    except TimeoutError:
        return None
    except Exception as error:
        reason = explain(error, security)
        return reason if reason != (str(error) or type(error).__name__) else None
    conn.close()
    return None
