"""The admin HTTP API (``admin.*``): sessions and their backlog, the block list,
retained messages, and the web console's files (docs/operating.md).

It runs in the broker's event loop, beside the metrics server. Any replica
answers any request: every replica holds the whole cluster's session table
(broker/cluster.py: a session connected elsewhere is a ``RemoteSession``
naming its replica), the backlog and the block list are in Redis, and a
disconnect or a block reaches the replica holding the connection over the
cluster link.

Authentication: a bearer token (``admin.token_file`` or ``admin.token`` /
``DEVICEMQ_ADMIN_TOKEN``) on every ``/api`` request. Without one configured
the API answers loopback clients only, and refuses every write with 403.
Every write is logged and written to the events topic as an ``admin`` event;
a purge also as one ``purged`` event per message, so the audit counts those
messages as purged, never lost.
"""

from __future__ import annotations

import asyncio
import base64
import heapq
import hmac
import logging
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from app.http import HttpError, HttpServer, Request, Response, json_response, segments
from broker import __version__
from broker.blocklist import BadEntry, make_entry
from broker.cluster import RemoteSession
from broker.config import ConfigError, Settings
from broker.ecq import valid_client_id
from broker.group_queue import is_group_store
from broker.limits import LogLimiter, TokenBucket, is_loopback, source_key
from broker.message import Message
from broker.ownership import CLIENT_ID, QUEUE
from broker.packets import ProtocolLevel
from broker.session import NEVER_EXPIRES, Session
from broker.topics import is_sys_topic, is_valid_topic_filter, is_valid_topic_name
from broker.watched_file import FileChangeWatch
from persistence.application_feed import ApplicationFeed, app_topic
from persistence.session_rewind import RewindUnderWay

if TYPE_CHECKING:
    from broker.core import Broker
    from persistence.application_feed import ApplicationSessions
    from persistence.blocklist_store import BlockListStore
    from persistence.events import EventSink
    from persistence.queue_store import QueueStore
    from persistence.redis_store import RedisMessageStore
    from persistence.session_rewind import Rewound

log = logging.getLogger("devicemq.admin")

API = "/api/v1"
MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
MAX_PEEK = 1000
SCAN_CHUNK = 5000  # sessions looked at between two turns of the event loop
RETAINED_SLICE = 64  # retained walk steps (each at most 64 nodes) per turn of the loop
PAYLOAD_MAX = 64 * 1024  # bytes of each payload a peek shows by default (payload_max=)
MIN_TOKEN_LENGTH = 16  # characters of admin.token: guessing it must be hopeless
AUTH_FAILURE_BURST = 10.0  # wrong tokens one address may send at once
_PROTOCOLS = {ProtocolLevel.MQTT_3_1: "3.1", ProtocolLevel.MQTT_3_1_1: "3.1.1", 5: "5.0"}
_CONSOLE = "console"  # the web console's files: app/console/


class AdminUnavailable(Exception):
    """The admin listener could not open (the port is taken, the address is wrong)."""


def create_token_file(settings: Settings) -> None:
    """``admin.generate_token``: write ``admin.token_file`` unless it exists (mode
    0600, its directory 0700 if missing), holding ``admin.token`` if set, else a new
    random token, which is logged this once. Replicas and workers starting together
    create it once (O_EXCL): the others read it."""
    admin = settings.admin
    if not admin.token_file:
        raise ConfigError(
            "admin.generate_token needs admin.token_file: where to keep the token",
            name="admin.generate_token",
        )
    path = Path(admin.token_file)
    if path.exists():
        return
    token = admin.token or secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return  # another replica or worker made it first
    except FileExistsError:  # from mkdir: a file where the directory should be
        raise ConfigError(
            f"cannot create the token file {path}: {path.parent} is not a directory",
            name="admin.token_file",
        ) from None
    except OSError as e:
        raise ConfigError(
            f"cannot create the token file {path}: {e.strerror or e}", name="admin.token_file"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    if admin.token:
        log.warning("created the admin token file %s with admin.token", path)
    else:
        # Printed this once (admin.generate_token): the file keeps it.
        log.warning("created the admin token file %s; the admin token is: %s", path, token)


def admin_token(settings: Settings) -> str | None:
    """The configured bearer token, or None; a token file that cannot be read is a
    start error naming ``admin.token_file``."""
    admin = settings.admin
    if admin.generate_token:
        create_token_file(settings)
    if admin.token_file:
        try:
            token = Path(admin.token_file).read_text().strip()
        except OSError as e:
            raise ConfigError(
                f"cannot read the token file {admin.token_file}: {e.strerror or e}",
                name="admin.token_file",
            ) from None
        if not token:
            raise ConfigError(
                f"the token file {admin.token_file} is empty", name="admin.token_file"
            )
        _long_enough(token, "admin.token_file")
        return token
    if admin.token:
        _long_enough(admin.token, "admin.token")
    return admin.token or None


def _long_enough(token: str, name: str) -> None:
    """A token guessed one try at a time must not be short: MIN_TOKEN_LENGTH at least."""
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"the token has {len(token)} characters, at least {MIN_TOKEN_LENGTH} are needed "
            "(e.g. head -c 32 /dev/urandom | base64)",
            name=name,
        )


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: what answers it (an :class:`AdminApi` method, called with the
    captured segments) and what the OpenAPI document says of it."""

    method: str
    pattern: tuple[str, ...]  # path segments after /api/v1; "{name}" captures one
    handler: str
    summary: str
    write: bool = False
    query: tuple[str, ...] = ()
    body: str = ""  # the JSON body, described


ROUTES: tuple[Route, ...] = (
    Route(
        "GET",
        ("sessions",),
        "list_sessions",
        "Sessions, filtered, by client ID, one page",
        query=("connected", "persistent", "client_id", "username", "cursor", "limit"),
    ),
    Route(
        "GET",
        ("sessions", "{client_id}"),
        "show_session",
        "One session, with its subscriptions and backlog",
    ),
    Route(
        "GET",
        ("sessions", "{client_id}", "messages"),
        "peek_messages",
        "Stored messages of a persistent session, oldest first",
        query=("limit", "payload", "payload_max"),
    ),
    Route(
        "POST",
        ("sessions", "{client_id}", "disconnect"),
        "disconnect",
        "Disconnect the client (MQTT 5: DISCONNECT 0x98)",
        write=True,
    ),
    Route(
        "DELETE",
        ("sessions", "{client_id}"),
        "delete_session",
        "End the session and delete its stored messages",
        write=True,
    ),
    Route(
        "DELETE",
        ("sessions", "{client_id}", "messages"),
        "purge",
        "Purge the backlog (messages in flight stay until acknowledged)",
        write=True,
    ),
    Route(
        "POST",
        ("sessions", "{client_id}", "rewind"),
        "rewind_session",
        "Deliver again (DUP) the persistent session's messages published since a time, "
        "from the records the persisted Kafka topic still holds",
        write=True,
        body='{"since": "2026-11-26T06:00:00Z" or epoch seconds}',
    ),
    Route(
        "GET",
        ("subscriptions",),
        "list_subscriptions",
        "Subscriptions, by filter and client",
        query=("filter", "client_id", "limit"),
    ),
    Route(
        "GET",
        ("retained",),
        "list_retained",
        "Retained messages matching a filter, by topic, one page (next_cursor)",
        query=("topic", "limit", "cursor", "payload"),
    ),
    Route(
        "DELETE",
        ("retained",),
        "delete_retained",
        "Delete the retained message of a topic",
        write=True,
        query=("topic",),
    ),
    Route("GET", ("blocked",), "list_blocked", "The block list"),
    Route(
        "POST",
        ("blocked",),
        "block",
        "Block a client ID, username, address or CIDR, or ID pattern",
        write=True,
        body='{"kind": "client_id|username|address|client_id_regex", '
        '"value": "...", "reason": "...", "ttl": seconds}',
    ),
    Route(
        "DELETE",
        ("blocked",),
        "unblock",
        "Remove a block-list entry",
        write=True,
        query=("kind", "value"),
    ),
    Route(
        "GET",
        ("queues",),
        "list_queues",
        "$ECQ queues and group queue stores ($queue/...) with their backlog and bytes",
        query=("kind", "limit"),
    ),
    Route(
        "GET",
        ("queues", "{client_id}"),
        "show_queue",
        "The exclusive compacted queue ($ECQ) a client consumes, or a group queue's store "
        "(its id is the filter, $queue/{group}/{filter}, URL-encoded): pending, keys, "
        "sequence, bytes",
    ),
    Route(
        "DELETE",
        ("queues", "{client_id}"),
        "purge_queue",
        "Remove every entry of a queue or group store (its sequence numbers go on)",
        write=True,
    ),
    Route(
        "POST",
        ("queues", "{client_id}", "rewind"),
        "rewind_queue",
        "Deliver the queue again from a sequence number (the latest value of each key)",
        write=True,
        body='{"seq": N}',
    ),
    Route(
        "GET",
        ("replicas",),
        "list_replicas",
        "The replicas this one knows (itself first): when each last spoke on the cluster "
        "link and how many clients are connected there",
    ),
    Route(
        "GET",
        ("subscribers",),
        "list_subscribers",
        "Who gets a message published on a topic: the subscriptions (shared ones too) "
        "whose filter matches the topic name, by client ID",
        query=("topic", "limit"),
    ),
    Route("GET", ("stats",), "stats", "Headline numbers of this replica"),
    Route("GET", ("openapi.json",), "openapi", "This API's OpenAPI 3 document"),
)

# Who holds a queue and a client ID (broker/ownership.py; SECURITY.md "Client IDs and
# queues belong to their owner").
OWNER_ROUTES = (
    Route(
        "GET",
        ("queues", "{client_id}", "owner"),
        "show_queue_owner",
        "Whose the $ECQ queue is: the owner of its first consumer (null: nobody's yet)",
    ),
    Route(
        "PUT",
        ("queues", "{client_id}", "owner"),
        "set_queue_owner",
        "Give the queue to another owner (the client ID is disconnected)",
        write=True,
        body='{"owner": "user name or certificate identity"}',
    ),
    Route(
        "DELETE",
        ("queues", "{client_id}", "owner"),
        "clear_queue_owner",
        "Clear the queue's owner: its next consumer's owner holds it (disconnected)",
        write=True,
    ),
    Route(
        "GET",
        ("client-ids", "{client_id}", "owner"),
        "show_client_id_owner",
        "Who holds the client ID (auth.client_id_owner: first) and for how long unused",
    ),
    Route(
        "DELETE",
        ("client-ids", "{client_id}", "owner"),
        "release_client_id",
        "Release the client ID: the next owner to connect with it holds it",
        write=True,
    ),
    Route(
        "GET",
        ("owners", "{owner}"),
        "show_owner",
        "What one owner holds (sessions, queues, group queues) and the bytes the last "
        "tally of auth.max_bytes_per_owner measured",
    ),
)
ROUTES = ROUTES + OWNER_ROUTES


class AdminApi:
    """Requests in, responses out; the parts it reads and changes are given at
    construction (app/serve.py)."""

    def __init__(
        self,
        settings: Settings,
        broker: Broker,
        node_id: str,
        *,
        token: str | None,
        store: RedisMessageStore | None = None,
        blocks: BlockListStore | None = None,
        events: EventSink | None = None,
        queues: QueueStore | None = None,
        rewind: Callable[[str, int], Awaitable[int]] | None = None,
        rewind_session: Callable[[str, float], Awaitable[Rewound]] | None = None,
        group_store: QueueStore | None = None,
        applications: ApplicationSessions | None = None,
    ) -> None:
        """``queues``: the $ECQ store (None: no queues); ``rewind(client_id, seq)``
        makes entries pending again and has them delivered (persistence);
        ``group_store``: where group queues are kept (None: no group queues);
        ``applications``: the APPLICATION sessions (None: none configured)."""
        self.applications = applications
        self.queues = queues
        self.group_store = group_store
        self.rewind = rewind
        self.rewind_session_to = rewind_session
        self.settings = settings
        self.broker = broker
        self.node_id = node_id
        self.token = token
        self.store = store
        self.blocks = blocks
        self.events = events
        self._started = broker.clock()
        # /ready's answer, Kafka lag and backlog for the stats (app/serve.py sets it)
        self.health: Callable[[], Awaitable[dict[str, Any]]] | None = None
        # admin.token_file is read again when it changes (as the password file is)
        self._token_watch = (
            FileChangeWatch(Path(settings.admin.token_file), broker.clock)
            if settings.admin.token_file and token is not None
            else None
        )
        # Wrong tokens per address (source_key): a bucket of AUTH_FAILURE_BURST, refilled
        # at admin.max_auth_failures_per_source; the least recently seen dropped first.
        self._failures: OrderedDict[str, TokenBucket] = OrderedDict()
        self._failure_log = LogLimiter(log, "admin token refusals")

    # -- dispatch ----------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        path = segments(request.path)
        if path[:2] != ["api", "v1"]:
            return _console_file(request.path, method)
        route, args = _route(method, path[2:])
        self._authorize(request, route.write)
        handler: Callable[..., Awaitable[Response]] = getattr(self, route.handler)
        return await handler(request, *args)

    def _reload_token(self) -> None:
        """A changed ``admin.token_file``: its new token from now on. A file that
        cannot be read, is empty or holds a token shorter than MIN_TOKEN_LENGTH keeps
        the token in force (logged)."""
        watch = self._token_watch
        if watch is None or not watch.changed():
            return
        try:
            token = watch.path.read_text().strip()
        except OSError as e:
            log.warning("admin token file %s: %s: the token in force stays", watch.path, e)
            return
        if not token:
            log.warning("admin token file %s is empty: the token in force stays", watch.path)
        elif len(token) < MIN_TOKEN_LENGTH:
            log.warning(
                "admin token file %s holds a token of %d characters, at least %d are needed: "
                "the token in force stays",
                watch.path,
                len(token),
                MIN_TOKEN_LENGTH,
            )
        elif token != self.token:
            self.token = token
            log.warning("admin token file %s changed: its new token is in force", watch.path)

    def _authorize(self, request: Request, write: bool) -> None:
        self._reload_token()
        if self.token is not None:
            sent = request.headers.get("authorization")
            source = source_key(request.peer)
            now = self.broker.clock()
            bucket = self._failures.get(source)
            if bucket is not None and bucket.available(now) < 1:
                # Guessing too fast: refused before the token is compared, so a guess
                # sent now says nothing, right or wrong.
                self._failure_log.log(
                    now,
                    logging.WARNING,
                    "admin: too many wrong tokens from %s: its requests refused 429 "
                    "(admin.max_auth_failures_per_source)",
                    source,
                )
                raise HttpError(
                    429,
                    "too many wrong admin tokens from your address: slow down",
                    headers={"Retry-After": str(math.ceil(1 / bucket.rate))},
                )
            scheme, _, given = (sent or "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self.token.encode()
            ):
                if sent is not None:  # a guess (a request without any is none)
                    self._wrong_token(source, now, request)
                raise HttpError(401, "send the admin token: Authorization: Bearer <token>")
            return
        if not is_loopback(request.peer):
            raise HttpError(403, "without admin.token the admin API answers loopback only")
        if not _loopback_host(request.headers.get("host", "localhost")):
            # A page in the operator's browser whose name was rebound to 127.0.0.1
            # (DNS rebinding) sends its own name: it gets nothing without the token.
            raise HttpError(403, "without admin.token the Host must name this machine")
        if write:
            raise HttpError(403, "writes need admin.token_file or DEVICEMQ_ADMIN_TOKEN")

    def _wrong_token(self, source: str, now: float, request: Request) -> None:
        rate = self.settings.admin.max_auth_failures_per_source
        self._failure_log.log(
            now,
            logging.WARNING,
            "admin: a wrong token from %s (%s %s)",
            source,
            request.method,
            request.path[:200],
        )
        if rate <= 0:
            return
        failures = self._failures
        bucket = failures.get(source)
        if bucket is None:
            bucket = failures[source] = TokenBucket(rate, now, AUTH_FAILURE_BURST)
            if len(failures) > 65_536:
                failures.popitem(last=False)
        else:
            failures.move_to_end(source)
        bucket.available(now)
        bucket.spend(1)

    # -- sessions ----------------------------------------------------------------------

    async def list_sessions(self, request: Request) -> Response:
        q = request.query
        limit = _int(q, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        connected = _bool(q, "connected")
        persistent = _bool(q, "persistent")
        prefix = q.get("client_id", "")
        username = q.get("username")
        cursor = q.get("cursor", "")

        def wanted(session: Session) -> bool:
            cid = session.client_id
            return (
                cid > cursor
                and cid.startswith(prefix)
                and (connected is None or _connected(session) == connected)
                and (persistent is None or session.durable == persistent)
                and (username is None or session.username == username)
            )

        chosen = await self._first(limit + 1, wanted)
        more = len(chosen) > limit
        chosen = chosen[:limit]
        backlogs = await self._backlogs(chosen)
        items = [self._view(s, b) for s, b in zip(chosen, backlogs, strict=True)]
        return json_response(
            200, {"items": items, "next_cursor": chosen[-1].client_id if more else None}
        )

    async def show_session(self, request: Request, client_id: str) -> Response:
        session = self._session(client_id)
        view = self._view(session, (await self._backlogs([session]))[0])
        view["subscription_list"] = [
            {
                "filter": e.topic_filter,
                "qos": e.qos,
                "no_local": e.no_local,
                "retain_as_published": e.retain_as_published,
                "retain_handling": e.retain_handling,
                "subscription_identifier": e.subscription_id,
            }
            for e in session.subscriptions.values()
        ]
        backlog: dict[str, Any] = {"oldest_age": None, "scores": None, "packet_ids": None}
        in_flight: list[int] | None = None
        if not isinstance(session, RemoteSession):
            in_flight = sorted(session.outflow.inflight)
        apps = self.applications
        if apps is not None and apps.is_application(session):
            lag = await apps.lag(client_id)
            committed = await apps.committed(client_id)
            view["backlog_detail"] = {
                "messages": None if lag is None else lag.messages,
                "oldest_age": None
                if lag is None or lag.oldest_age is None
                else round(lag.oldest_age, 3),
                "committed_offsets": {str(p): o for p, o in sorted(committed.items())},
                "kafka_topic": app_topic(client_id),
            }
            view["in_flight_ids"] = in_flight
            return json_response(200, view)
        if session.durable and self.store is not None:
            _, ends = await self.store.backlog_range(client_id)
            if ends is not None:
                (first_id, first_score), (last_id, last_score) = ends
                backlog["scores"] = [first_score, last_score]
                backlog["packet_ids"] = [first_id, last_id]
                # Messages in flight are the oldest (delivery goes in score order), at
                # most a window of them: one page of that size holds them and the oldest.
                window = self.settings.mqtt.max_inflight + 1
                page = await self.store.load_page(client_id, first_score - 1, window)
                times = [r.message.publish_time for r in page.records if r.message is not None]
                if times:
                    age = self.broker.wall_clock() - min(times)
                    backlog["oldest_age"] = round(max(0.0, age), 3)
                in_flight = sorted(
                    {*(in_flight or ()), *(r.packet_id for r in page.records if r.sent)}
                )
        view["backlog_detail"] = backlog
        view["in_flight_ids"] = in_flight
        return json_response(200, view)

    async def peek_messages(self, request: Request, client_id: str) -> Response:
        session = self._session(client_id)
        limit = _int(request.query, "limit", DEFAULT_LIMIT, 1, MAX_PEEK)
        with_payload = _bool(request.query, "payload") or False
        cut = _int(request.query, "payload_max", PAYLOAD_MAX, 0, 16 * 1024 * 1024)
        if not session.durable or self.store is None:
            raise HttpError(
                409, f"{client_id} has no stored messages: its session is not persistent"
            )
        page = await self.store.load_page(client_id, 0, limit)
        items = []
        for record in page.records:
            message = record.message
            item: dict[str, Any] = {
                "packet_id": record.packet_id,
                "score": record.score,
                "sent": record.sent,
                "stage": str(record.stage),
            }
            if message is not None:
                item.update(
                    topic=message.topic,
                    qos=message.qos,
                    published_at=message.publish_time,
                    expiry=message.expiry,
                    size=len(message.payload),
                )
                if with_payload:
                    item["payload"] = base64.b64encode(message.payload[:cut]).decode()
                    item["payload_truncated"] = len(message.payload) > cut
            items.append(item)
        return json_response(200, {"items": items})

    async def disconnect(self, request: Request, client_id: str) -> Response:
        session = self._session(client_id)
        if not _connected(session):
            raise HttpError(409, f"{client_id} is not connected")
        self.broker.kick(client_id)
        self._audit(client_id, "kick", {"replica": _replica(session, self.node_id)})
        return json_response(200, {"client_id": client_id, "disconnected": True})

    async def delete_session(self, request: Request, client_id: str) -> Response:
        session = self.broker.sessions.get(client_id)
        deleted: int | None = None
        if session is not None:
            self.broker.kick(client_id, end_session=True)
        elif self.store is not None and (stored := await self.store.load_session(client_id)):
            # Known to Redis only (this replica never restored it): ended there, fenced
            # by the generation read (a client connecting meanwhile keeps its new one).
            deleted = await self.store.end_session(client_id, stored.generation)
            if deleted is None:
                raise HttpError(409, f"{client_id} connected again meanwhile: not deleted")
            await self.store.unindex_session(client_id)
            if self.events is not None:
                self.events.session(client_id, "session_ended")
        else:
            raise HttpError(404, f"no session {client_id}")
        self._audit(client_id, "delete_session", {"messages_deleted": deleted})
        return json_response(200, {"client_id": client_id, "deleted": True})

    async def purge(self, request: Request, client_id: str) -> Response:
        session = self._session(client_id)
        if not session.durable or self.store is None:
            raise HttpError(
                409, f"{client_id} has no stored messages: its session is not persistent"
            )
        removed = await self.store.purge(client_id)
        if self.events is not None:
            for packet_id, score in removed:
                self.events.purged(client_id, packet_id, score)
        self._audit(client_id, "purge", {"purged": len(removed)})
        return json_response(200, {"client_id": client_id, "purged": len(removed)})

    async def rewind_session(self, request: Request, client_id: str) -> Response:
        session = self._session(client_id)
        apps = self.applications
        if apps is not None and apps.is_application(session):
            return await self._rewind_application(request, session, apps)
        if not session.durable or self.rewind_session_to is None:
            raise HttpError(
                409, f"{client_id} has no stored messages: its session is not persistent"
            )
        data = _json_body(request)
        unknown = set(data) - {"since"}
        if unknown:
            field = sorted(unknown)[0]
            raise HttpError(400, f"unknown field {field}", {"field": field})
        since = _instant(data.get("since"))
        try:
            rewound = await self.rewind_session_to(client_id, since)
        except RewindUnderWay:
            raise HttpError(409, f"a rewind of {client_id} is under way") from None
        answer = {
            "client_id": client_id,
            "since": since,
            "records_read": rewound.read,
            "matched": rewound.matched,
            "rewound": rewound.stored,
            "over_limit": rewound.over_limit,
            "oldest_in_kafka": rewound.oldest,
        }
        self._audit(client_id, "rewind_session", answer)
        return json_response(200, answer)

    async def _rewind_application(
        self, request: Request, session: Session, apps: ApplicationSessions
    ) -> Response:
        """An APPLICATION session reads its topic again from an offset or a time."""
        client_id = session.client_id
        data = _json_body(request)
        unknown = set(data) - {"since", "offset"}
        if unknown:
            field = sorted(unknown)[0]
            raise HttpError(400, f"unknown field {field}", {"field": field})
        if ("since" in data) == ("offset" in data):
            raise HttpError(400, "give since or offset", {"field": "since"})
        offset: int | None = None
        since: float | None = None
        if "offset" in data:
            offset = data["offset"]
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
                raise HttpError(400, "offset must be an integer >= 0", {"field": "offset"})
        else:
            since = _instant(data.get("since"))
        feed = session.outflow.feed if not isinstance(session, RemoteSession) else None
        try:
            offsets = await apps.rewind(
                client_id,
                feed if isinstance(feed, ApplicationFeed) else None,
                offset=offset,
                since=since,
            )
        except KeyError:
            raise HttpError(409, f"{client_id} is no APPLICATION session now") from None
        answer = {
            "client_id": client_id,
            "since": since,
            "offset": offset,
            "offsets": {str(p): o for p, o in sorted(offsets.items())},
        }
        if isinstance(session, RemoteSession) and session.online:
            # Its replica's connection lost the session with the rewind (the owner
            # fence, docs/application-sessions.md): it lets the client go now, and the
            # client, connecting again, reads from the rewound offsets.
            self.broker.kick(client_id)
        self._audit(client_id, "rewind_session", answer)
        return json_response(200, answer)

    # -- subscriptions and retained ---------------------------------------------------

    async def list_subscriptions(self, request: Request) -> Response:
        q = request.query
        limit = _int(q, "limit", MAX_LIMIT, 1, MAX_LIMIT)
        wanted_filter = q.get("filter")
        client_id = q.get("client_id")

        def wanted(session: Session) -> bool:
            return (client_id is None or session.client_id == client_id) and any(
                wanted_filter is None or f == wanted_filter for f in session.subscriptions
            )

        # Each session found holds one subscription at least: the first ``limit``
        # sessions by client ID hold the first ``limit`` subscriptions.
        sessions = await self._first(limit, wanted)
        items = []
        for session in sessions:
            for entry in session.subscriptions.values():
                if wanted_filter is not None and entry.topic_filter != wanted_filter:
                    continue
                items.append(
                    {
                        "client_id": session.client_id,
                        "filter": entry.topic_filter,
                        "qos": entry.qos,
                        "replica": _replica(session, self.node_id),
                    }
                )
                if len(items) >= limit:
                    return json_response(200, {"items": items, "truncated": True})
        return json_response(200, {"items": items, "truncated": False})

    async def list_subscribers(self, request: Request) -> Response:
        """Who a message published on ``topic`` goes to: the subscriptions whose filter
        matches it (SubscriptionTree.match, as routing does), shared groups' members
        and group queues' members included, by client ID then filter, the first
        ``limit``."""
        q = request.query
        topic = q.get("topic", "")
        if not is_valid_topic_name(topic):
            raise HttpError(400, "topic: a topic name (no + or #, not empty)", {"field": "topic"})
        limit = _int(q, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        found = self.broker.subscriptions.match(topic)
        rows: list[tuple[str, str, int, str | None, bool]] = [
            (e.client_id, e.topic_filter, e.qos, None, False) for e in found.entries
        ]
        for group in found.groups:
            rows.extend(
                (m.client_id, m.topic_filter, m.qos, group.name, group.queue) for m in group.members
            )
        first = heapq.nsmallest(limit + 1, rows)
        items = []
        for client_id, topic_filter, qos, share, queue in first[:limit]:
            session = self.broker.sessions.get(client_id)
            items.append(
                {
                    "client_id": client_id,
                    "filter": topic_filter,
                    "qos": qos,
                    "share_group": share,
                    "group_queue": queue,
                    "replica": _replica(session, self.node_id) if session else None,
                }
            )
        return json_response(
            200,
            {"topic": topic, "items": items, "count": len(rows), "truncated": len(first) > limit},
        )

    async def list_retained(self, request: Request) -> Response:
        """One page of the retained messages a filter matches, by topic, after
        ``cursor`` (the last topic of the page before). The walk goes a slice per
        event-loop iteration and keeps only the page's topics, never the whole
        match sorted: a filter matching a million messages neither stalls the loop
        nor holds them all."""
        q = request.query
        topic_filter = q.get("topic") or "#"
        if not is_valid_topic_filter(topic_filter):
            raise HttpError(400, "topic: not a valid topic filter", {"field": "topic"})
        limit = _int(q, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        with_payload = _bool(q, "payload") or False
        cursor = q.get("cursor", "")
        # The smallest topics after the cursor: candidates gathered, cut down to the
        # best limit + 1 whenever they reach four times that (a sort of a few
        # thousand), and anything not below the cut's last topic skipped.
        page: list[Message] = []
        keep = limit + 1
        ceiling: str | None = None
        steps = 0
        for message in self.broker.retained.walk(topic_filter, self.broker.clock()):
            steps += 1
            if steps % RETAINED_SLICE == 0:
                await asyncio.sleep(0)  # other clients are served between slices
            if message is None or message.topic <= cursor:
                continue
            if ceiling is not None and message.topic >= ceiling:
                continue
            page.append(message)
            if len(page) >= 4 * keep:
                page.sort(key=_topic)
                del page[keep:]
                ceiling = page[-1].topic
        page.sort(key=_topic)
        more = len(page) > limit
        page = page[:limit]
        items = []
        for message in page:
            item: dict[str, Any] = {
                "topic": message.topic,
                "qos": message.qos,
                "size": len(message.payload),
                "origin": message.origin,
            }
            if with_payload:
                item["payload"] = base64.b64encode(message.payload).decode()
            items.append(item)
        return json_response(
            200,
            {"items": items, "truncated": more, "next_cursor": page[-1].topic if more else None},
        )

    async def delete_retained(self, request: Request) -> Response:
        topic = request.query.get("topic", "")
        if not topic or not is_valid_topic_name(topic):
            raise HttpError(400, "topic: give one topic name (no wildcards)", {"field": "topic"})
        if is_sys_topic(topic):
            raise HttpError(400, "topic: $SYS topics are the broker's own", {"field": "topic"})
        retained = self.broker.retained
        if not retained.matching(topic, self.broker.clock()):
            raise HttpError(404, f"no retained message on {topic}")
        # As a client's empty retained PUBLISH deletes it (MQTT-3.3.1-6): stored and
        # shared with the other replicas the same way.
        retained.store(Message(topic, b"", 0, True))
        self._audit("", "delete_retained", {"topic": topic})
        return json_response(200, {"topic": topic, "deleted": True})

    # -- block list -------------------------------------------------------------------

    async def list_blocked(self, request: Request) -> Response:
        entries = await self.blocks.load() if self.blocks is not None else None
        if entries is None:
            entries = self.broker.blocklist.entries()
        now = self.broker.wall_clock()
        return json_response(
            200,
            {
                "items": [
                    e.to_json() for e in sorted(entries, key=lambda e: e.key) if not e.expired(now)
                ]
            },
        )

    async def block(self, request: Request) -> Response:
        data = _json_body(request)
        ttl = data.get("ttl")
        if ttl is not None and (
            not isinstance(ttl, int | float) or isinstance(ttl, bool) or not 0 < ttl < math.inf
        ):
            raise HttpError(400, "ttl: seconds, a positive number", {"field": "ttl"})
        unknown = set(data) - {"kind", "value", "reason", "ttl"}
        if unknown:
            raise HttpError(
                400, f"unknown field {sorted(unknown)[0]}", {"field": sorted(unknown)[0]}
            )
        now = self.broker.wall_clock()
        try:
            entry = make_entry(
                data.get("kind"),
                data.get("value"),
                reason=data.get("reason", ""),
                until=None if ttl is None else now + ttl,
                created=now,
            )
        except BadEntry as e:
            raise HttpError(400, f"{e.field}: {e}", {"field": e.field}) from None
        if self.blocks is not None:
            await self.blocks.add(entry)
        closed = self.broker.add_block(entry)
        self._audit("", "block", {**entry.to_json(), "closed": closed})
        return json_response(201, {**entry.to_json(), "closed_here": closed})

    async def unblock(self, request: Request) -> Response:
        q = request.query
        try:
            key = make_entry(q.get("kind"), q.get("value")).key
        except BadEntry as e:
            raise HttpError(400, f"{e.field}: {e}", {"field": e.field}) from None
        found = self.broker.blocklist.get(key) is not None
        if self.blocks is not None:
            found = await self.blocks.remove(key) or found
        self.broker.remove_block(key)
        if not found:
            raise HttpError(404, f"no block-list entry {key}")
        self._audit("", "unblock", {"key": key})
        return json_response(200, {"key": key, "removed": True})

    # -- the rest ----------------------------------------------------------------------

    # -- queues ------------------------------------------------------------------------

    async def show_queue(self, request: Request, client_id: str) -> Response:
        if is_group_store(client_id):
            return json_response(200, await self._group_view(client_id))
        queues = self._queues(client_id)
        info = await queues.info(client_id)
        return json_response(
            200,
            {
                "client_id": client_id,
                "kind": "ecq",
                "pending": info.pending,
                "keys": info.keys,
                "bytes": info.bytes,
                "max_bytes": queues.max_bytes,
                "last_seq": info.last_seq,
                "acked_seq": info.acked_seq,
                "oldest_pending_seq": info.oldest_pending_seq or None,
                "retention": queues.retention,
            },
        )

    async def list_queues(self, request: Request) -> Response:
        """$ECQ queues, then group stores, each with its backlog and bytes."""
        kind = request.query.get("kind", "")
        if kind not in ("", "ecq", "group"):
            raise HttpError(400, "kind: ecq or group", {"field": "kind"})
        limit = _int(request.query, "limit", 100, 1, 10_000)
        views: list[dict[str, Any]] = []
        if kind in ("", "ecq") and self.queues is not None:
            for queue in await self.queues.queue_ids(limit):
                info = await self.queues.info(queue)
                views.append(
                    {"client_id": queue, "kind": "ecq", "pending": info.pending,
                     "keys": info.keys, "bytes": info.bytes, "last_seq": info.last_seq}
                )  # fmt: skip
        if kind in ("", "group") and self.group_store is not None:
            for store_id in list(await self.group_store.group_store_ids())[:limit]:
                views.append(await self._group_view(store_id))
        return json_response(200, {"queues": views[:limit], "count": len(views[:limit])})

    async def purge_queue(self, request: Request, client_id: str) -> Response:
        """Every entry of the queue or group store goes (acknowledged ones too)."""
        group = is_group_store(client_id)
        store = self._group_store() if group else self._queues(client_id)
        purged = await store.purge(client_id)
        if self.events is not None:
            for key, seq in purged.pending:
                self.events.queue(client_id, "purged", seq, key)
        detail = {"entries": purged.entries, "pending": len(purged.pending), "bytes": purged.bytes}
        self._audit(client_id, "purge_queue", detail)
        return json_response(200, {"client_id": client_id, "purged": True, **detail})

    async def _group_view(self, store_id: str) -> dict[str, Any]:
        store = self._group_store()
        info = await store.info(store_id)
        since = await store.group_unused_since(store_id)
        return {
            "client_id": store_id,
            "kind": "group",
            "pending": info.pending,
            "keys": info.keys,
            "bytes": info.bytes,
            "max_bytes": store.group_max_bytes,
            "last_seq": info.last_seq,
            "oldest_pending_seq": info.oldest_pending_seq or None,
            "members": self.broker.subscriptions.has_group(store_id),
            "unused_since": since or None,  # no members since (epoch seconds)
            "retention": store.group_retention,
        }

    def _group_store(self) -> QueueStore:
        if self.group_store is None:
            raise HttpError(
                409, "no group queues here: group_queues.enabled and persistence are needed"
            )
        return self.group_store

    async def rewind_queue(self, request: Request, client_id: str) -> Response:
        self._queues(client_id)
        data = _json_body(request)
        seq = data.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
            raise HttpError(400, "seq: a sequence number, 1 or more", {"field": "seq"})
        unknown = set(data) - {"seq"}
        if unknown:
            field = sorted(unknown)[0]
            raise HttpError(400, f"unknown field {field}", {"field": field})
        assert self.rewind is not None
        again = await self.rewind(client_id, seq)
        self._audit(client_id, "rewind_queue", {"seq": seq, "pending_again": again})
        return json_response(200, {"client_id": client_id, "seq": seq, "pending_again": again})

    # -- owners (broker/ownership.py) --------------------------------------------------

    async def show_queue_owner(self, request: Request, client_id: str) -> Response:
        self._queues(client_id)
        held = await self.broker.owners.holder(QUEUE, client_id)
        return json_response(
            200, {"client_id": client_id, "owner": held[0] if held is not None else None}
        )

    async def set_queue_owner(self, request: Request, client_id: str) -> Response:
        self._queues(client_id)
        data = _json_body(request)
        owner = data.get("owner")
        if not isinstance(owner, str) or not owner or len(owner.encode()) > 65535:
            raise HttpError(400, "owner: a user name (or certificate identity)", {"field": "owner"})
        unknown = set(data) - {"owner"}
        if unknown:
            field = sorted(unknown)[0]
            raise HttpError(400, f"unknown field {field}", {"field": field})
        return await self._queue_owner_is(client_id, owner)

    async def clear_queue_owner(self, request: Request, client_id: str) -> Response:
        self._queues(client_id)
        return await self._queue_owner_is(client_id, None)

    async def _queue_owner_is(self, client_id: str, owner: str | None) -> Response:
        before = await self.broker.owners.assign(QUEUE, client_id, owner, 0)
        # A consumer of the owner before stops now; its next subscription is decided
        # by the new owner.
        disconnected = before != owner and self.broker.kick(client_id)
        detail = {"owner": owner, "before": before, "disconnected": disconnected}
        self._audit(client_id, "queue_owner", detail)
        return json_response(200, {"client_id": client_id, **detail})

    async def show_client_id_owner(self, request: Request, client_id: str) -> Response:
        held = await self.broker.owners.holder(CLIENT_ID, client_id)
        return json_response(
            200,
            {
                "client_id": client_id,
                "owner": held[0] if held is not None else None,
                "released_in": held[1] if held is not None else None,
                "client_id_owner": self.broker.client_id_policy,
            },
        )

    async def release_client_id(self, request: Request, client_id: str) -> Response:
        before = await self.broker.owners.assign(CLIENT_ID, client_id, None, 0)
        if before is None:
            raise HttpError(404, f"nobody holds the client ID {client_id}")
        self._audit(client_id, "release_client_id", {"before": before})
        return json_response(200, {"client_id": client_id, "released": True, "before": before})

    async def show_owner(self, request: Request, owner: str) -> Response:
        """Live counts from this replica and Redis; bytes as the last tally found them
        (null: it did not read this owner, whose stores could not pass the budget)."""
        broker = self.broker
        budget = broker.budget
        usage = budget.usage.get(owner)
        measured = None
        if usage is not None:
            measured = {
                "bytes": usage.total,
                "session_bytes": usage.session_bytes,
                "queue_bytes": usage.queue_bytes,
                "group_bytes": usage.group_bytes,
            }
        settings = broker.settings
        return json_response(
            200,
            {
                "owner": owner,
                "sessions": broker.sessions_owned(owner),
                "queues": sorted(await broker.owners.queues_of(owner)),
                "group_queues": sorted(broker.group_queues_of(owner)),
                "over_budget": owner in budget.over,
                "measured": measured,
                "max_bytes_per_owner": settings.auth.max_bytes_per_owner,
                "max_queues_per_owner": settings.ecq.max_queues_per_owner,
                "max_sessions_per_owner": settings.auth.max_sessions_per_owner,
            },
        )

    def _queues(self, client_id: str) -> QueueStore:
        if self.queues is None or self.rewind is None:
            raise HttpError(409, "no $ECQ queues here: ecq.enabled and persistence are needed")
        if not valid_client_id(client_id):
            raise HttpError(
                400, "a client ID with /, + or # names no queue", {"field": "client_id"}
            )
        return self.queues

    async def list_replicas(self, request: Request) -> Response:
        """The cluster's replicas (broker/cluster.py ClusterState.replicas); without a
        cluster, this one."""
        cluster = self.broker.cluster
        if cluster is not None:
            items = cluster.replicas()
        else:
            here = {"node": self.node_id, "here": True, "last_seen": time.time()}
            items = [{**here, "connected": len(self.broker.connections)}]
        return json_response(200, {"cluster": cluster is not None, "items": items})

    async def stats(self, request: Request) -> Response:
        broker = self.broker
        s = broker.stats
        local = [x for x in broker.sessions.values() if not isinstance(x, RemoteSession)]
        return json_response(
            200,
            {
                "node": self.node_id,
                "version": __version__,
                "uptime": round(broker.clock() - self._started, 3),
                "connections": len(broker.connections),
                "sessions": len(broker.sessions),
                "sessions_here": len(local),
                "persistent_sessions": sum(1 for x in broker.sessions.values() if x.durable),
                "retained": len(broker.retained),
                "blocked": len(broker.blocklist),
                "messages_received": sum(s.messages_received),
                "messages_sent": sum(s.messages_sent),
                "connections_total": s.connections_total,
                "integrations": self._integrations(),
                "health": await self.health() if self.health is not None else None,
            },
        )

    def _integrations(self) -> list[dict[str, Any]]:
        """Each integration rule with its audit count (records produced, failed)."""
        sink = self.broker.integration_sink
        counts = sink.counts() if sink is not None else {}
        return [
            {
                "name": rule.name,
                "topic_filter": rule.topic_filter,
                "kafka_topic": rule.kafka_topic,
                "produced": counts.get(rule.name, (0, 0))[0],
                "failed": counts.get(rule.name, (0, 0))[1],
            }
            for rule in self.settings.integrations
        ]

    async def openapi(self, request: Request) -> Response:
        return json_response(200, openapi_document())

    # -- helpers -----------------------------------------------------------------------

    async def _first(self, count: int, wanted: Callable[[Session], bool]) -> list[Session]:
        """The first ``count`` sessions by client ID that ``wanted`` accepts, looked
        for in chunks with the loop let go between them (a replica holding a
        million sessions serves MQTT meanwhile), never more than ``count`` kept."""
        snapshot = list(self.broker.sessions.values())
        best: list[Session] = []
        for start in range(0, len(snapshot), SCAN_CHUNK):
            if start:
                await asyncio.sleep(0)
            found = [s for s in snapshot[start : start + SCAN_CHUNK] if wanted(s)]
            if found:
                best = heapq.nsmallest(count, [*best, *found], key=_client_id)
        return best

    def _session(self, client_id: str) -> Session:
        session = self.broker.sessions.get(client_id)
        if session is None:
            raise HttpError(404, f"no session {client_id}")
        return session

    async def _backlogs(self, sessions: list[Session]) -> list[int | None]:
        """Messages waiting for each: stored in Redis (persistent), queued in memory."""
        out: list[int | None] = [None] * len(sessions)
        apps = self.applications
        mine = {i for i, s in enumerate(sessions) if apps is not None and apps.is_application(s)}
        lags = [(i, sessions[i].client_id) for i in sorted(mine)]
        if lags and apps is not None:  # in their topics: the messages after their commit
            found = await asyncio.gather(*(apps.lag(cid) for _, cid in lags))
            for (i, _), lag in zip(lags, found, strict=True):
                out[i] = None if lag is None else lag.messages
        durable = [i for i, s in enumerate(sessions) if s.durable and i not in mine]
        if durable and self.store is not None:
            counts = await self.store.pending_counts([sessions[i].client_id for i in durable])
            for i, n in zip(durable, counts, strict=True):
                out[i] = n
        for i, s in enumerate(sessions):
            if not s.durable and not isinstance(s, RemoteSession):
                out[i] = s.outflow.feed.queued()
        return out

    def _view(self, session: Session, backlog: int | None) -> dict[str, Any]:
        remote = isinstance(session, RemoteSession)
        return {
            "client_id": session.client_id,
            "username": session.username,
            "connected": _connected(session),
            "replica": _replica(session, self.node_id),
            "peer": session.address,
            "protocol": _PROTOCOLS.get(session.protocol_level or 0),
            "persistent": session.durable,
            "session_type": self._session_type(session),
            "session_expiry": None
            if session.expiry_interval == NEVER_EXPIRES
            else session.expiry_interval,
            "subscriptions": len(session.subscriptions),
            "backlog": backlog,
            "in_flight": None if remote else len(session.outflow.inflight),
            "connected_at": session.connected_at,
            "last_seen": session.connected_at
            if _connected(session) and remote
            else (self.broker.wall_clock() if _connected(session) else session.last_seen),
        }

    def _session_type(self, session: Session) -> str | None:
        """application or device for a persistent session (docs/application-sessions.md)."""
        if not session.durable:
            return None
        apps = self.applications
        return "application" if apps is not None and apps.is_application(session) else "device"

    def _audit(self, client_id: str, action: str, detail: dict[str, Any]) -> None:
        log.info("admin: %s %s %s", action, client_id or "-", orjson.dumps(detail).decode())
        if self.events is not None:
            self.events.admin(client_id, action, detail)


class AdminServer:
    """The listener of :class:`AdminApi` (``admin.host:admin.port``)."""

    def __init__(self, settings: Settings, api: AdminApi) -> None:
        admin = settings.admin
        self.api = api
        self.http = HttpServer(
            api.handle,
            admin.host,
            admin.port,
            reuse_port=settings.cluster.share_ports,
            max_per_source=admin.max_connections_per_source,
        )

    @property
    def port(self) -> int:
        return self.http.port

    async def start(self) -> None:
        try:
            await self.http.start()
        except OSError as e:
            raise AdminUnavailable(
                f"admin.port: cannot serve the admin API on {self.http.host}:"
                f"{self.http.requested_port}: {e.strerror or e} (set admin.port, or "
                "admin.enabled: false)"
            ) from e
        where = f"http://{self.http.host}:{self.port}/"
        auth = "token required" if self.api.token else "no token: read-only, loopback only"
        log.info("admin API and console on %s (%s)", where, auth)

    async def stop(self) -> None:
        await self.http.stop()


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3 from :data:`ROUTES`: one description, never out of step."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        path = API + "/" + "/".join(route.pattern)
        operation: dict[str, Any] = {
            "summary": route.summary,
            "parameters": [
                {"name": p[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                for p in route.pattern
                if p.startswith("{")
            ]
            + [
                {"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
                for name in route.query
            ],
            "responses": {
                "200": {"description": "OK, JSON"},
                **{
                    str(c): {"$ref": "#/components/responses/Error"}
                    for c in (400, 401, 403, 404, 409)
                },
            },
        }
        if route.body:
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"type": "object"}, "example": route.body}
                },
            }
        if route.write:
            operation["description"] = "A write: needs the admin token."
        paths.setdefault(path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.0.3",
        "info": {"title": "devicemq admin API", "version": "1"},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "Error": {
                    "description": '{"error": "...", "detail": ...}',
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {"error": {"type": "string"}, "detail": {}},
                            }
                        }
                    },
                }
            },
        },
        "security": [{"bearer": []}],
    }


# -- small pure helpers ------------------------------------------------------------------


def _route(method: str, path: list[str]) -> tuple[Route, list[str]]:
    allowed = False
    for route in ROUTES:
        if len(route.pattern) != len(path):
            continue
        args = []
        for want, got in zip(route.pattern, path, strict=True):
            if want.startswith("{"):
                if not got:
                    break
                # "%00." is the client ID ".": a segment "." or ".." would be resolved
                # by browsers (and proxies) before it arrives; a client ID never holds
                # U+0000 (MQTT-1.5.4-2), so one leading NUL marks it (app/console).
                args.append(got[1:] if got.startswith("\0") and len(got) > 1 else got)
            elif want != got:
                break
        else:
            if route.method == method:
                return route, args
            allowed = True
    if allowed:
        raise HttpError(405, f"{method} is not allowed here")
    raise HttpError(404, "no such endpoint: see /api/v1/openapi.json")


def _client_id(session: Session) -> str:
    return session.client_id


def _topic(message: Message) -> str:
    return message.topic


def _connected(session: Session) -> bool:
    if isinstance(session, RemoteSession):
        return session.online
    return session.connection is not None


def _replica(session: Session, here: str) -> str:
    return session.node if isinstance(session, RemoteSession) else here


def _loopback_host(host: str) -> bool:
    """A Host header naming this machine: localhost or a loopback address, any port."""
    if host.startswith("["):
        name = host[1 : host.find("]")] if "]" in host else host
    else:
        name, colon, port = host.rpartition(":")
        if not colon or not port.isdigit():
            name = host
    return name.lower() in ("localhost", "localhost.") or is_loopback(name)


def _int(query: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    text = query.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise HttpError(400, f"{name}: an integer is needed", {"field": name}) from None
    if not low <= value <= high:
        raise HttpError(400, f"{name}: within {low}..{high}", {"field": name})
    return value


def _bool(query: dict[str, str], name: str) -> bool | None:
    text = query.get(name)
    if text is None or text == "":
        return None
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise HttpError(400, f"{name}: true or false", {"field": name})


def _instant(value: object) -> float:
    """``since``: epoch seconds, or an ISO 8601 time with its zone (``Z`` for UTC)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            moment = None
        if moment is not None and moment.tzinfo is not None:
            return moment.timestamp()
    raise HttpError(
        400,
        "since: epoch seconds, or an ISO 8601 time with its zone (2026-11-26T06:00:00Z)",
        {"field": "since"},
    )


def _json_body(request: Request) -> dict[str, Any]:
    try:
        data = orjson.loads(request.body or b"null")
    except orjson.JSONDecodeError:
        raise HttpError(400, "the body is not JSON") from None
    if not isinstance(data, dict):
        raise HttpError(400, "the body must be a JSON object")
    return data


_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}


def _console_file(path: str, method: str) -> Response:
    """The web console's static files (no data in them: the page asks the API)."""
    if method != "GET":
        raise HttpError(405, f"{method} is not allowed here")
    name = path.strip("/") or "index.html"
    if "/" in name or name.startswith(".") or Path(name).suffix not in _TYPES:
        raise HttpError(404, "not found")
    try:
        body = resources.files("app").joinpath(_CONSOLE, name).read_bytes()
    except (OSError, ValueError):  # missing, a directory, a NUL in the name
        raise HttpError(404, "not found") from None
    return Response(
        200,
        body,
        _TYPES[Path(name).suffix],
        {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:"},
    )
