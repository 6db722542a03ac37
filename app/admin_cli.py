"""``devicemq sessions|blocked|retained``: the admin API (app/admin.py) from a shell.

    devicemq sessions list [--connected|--offline] [--persistent] [--prefix P] [--username U]
    devicemq sessions show|messages|kick|delete|purge CLIENT_ID
    devicemq sessions rewind CLIENT_ID --since TIME | --offset N
    devicemq queues list [--kind ecq|group] | show|purge ID | rewind CLIENT_ID --seq N
    devicemq queues owner CLIENT_ID [--set OWNER | --clear]
    devicemq client-ids owner CLIENT_ID [--release]
    devicemq owners usage OWNER
    devicemq blocked list | add KIND VALUE [--ttl S] [--reason R] | remove KIND VALUE
    devicemq retained list [--topic FILTER] [--limit N] [--all] | delete TOPIC

Every command takes ``--url`` (default http://127.0.0.1:18083), the token from
``--token-file`` or ``DEVICEMQ_ADMIN_TOKEN``, and ``--json`` for scripts
(the API's answer as it came); without it, tables for people. Exit status: 0,
1 when the API refused or could not be reached (its error on one line), 2
for a usage mistake.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlencode

import orjson

DEFAULT_URL = "http://127.0.0.1:18083"
TOKEN_ENV = "DEVICEMQ_ADMIN_TOKEN"
TOKEN_FILE_ENV = "DEVICEMQ_ADMIN_TOKEN_FILE"
TIMEOUT = 10.0
REWIND_TIMEOUT = 600.0  # seconds a session rewind may take (it reads a Kafka partition)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ApiError(Exception):
    """The API answered with an error, or could not be reached (``status`` 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminClient:
    """The admin API over HTTP, JSON in and out (urllib: nothing to install)."""

    def __init__(self, url: str = DEFAULT_URL, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token

    def call(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: object = None,
        timeout: float = TIMEOUT,
    ) -> Any:
        """The decoded JSON answer of a 2xx; raises :class:`ApiError` otherwise."""
        target = self.url + "/api/v1/" + path
        if query:
            kept = {k: _text(v) for k, v in query.items() if v is not None}
            if kept:
                target += "?" + urlencode(kept)
        data = orjson.dumps(body) if body is not None else None
        request = urllib.request.Request(target, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            # Not to a redirect's target, and through no proxy: the token goes to the
            # admin API it was given for and nowhere else.
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            with _OPENER.open(request, timeout=timeout) as response:
                return orjson.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, _error_text(e.code, e.read())) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ApiError(0, f"cannot reach the admin API at {self.url}: {reason}") from None

    def session_path(self, client_id: str, *rest: str) -> str:
        return "/".join(["sessions", client_id_segment(client_id), *rest])


def client_id_segment(client_id: str) -> str:
    """``client_id`` as a path segment; "." and ".." behind "%00" (app/admin.py _route),
    so that no proxy resolves them as the segments "." and ".."."""
    encoded = quote(client_id, safe="")
    return "%00" + encoded if client_id in (".", "..") else encoded


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _error_text(status: int, body: bytes) -> str:
    try:
        data = orjson.loads(body)
        message = data["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body.decode(errors="replace").strip()[:200] or "no detail"
    return f"{status}: {message}"


# -- arguments -------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the admin API (default {DEFAULT_URL})")
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"file holding the admin token (default: ${TOKEN_ENV}, else ${TOKEN_FILE_ENV})",
    )
    p.add_argument("--json", action="store_true", help="print the API's JSON answer")


def add_sessions_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("list", help="sessions, one line each")
    _common(ls)
    state = ls.add_mutually_exclusive_group()
    state.add_argument("--connected", dest="connected", action="store_const", const=True)
    state.add_argument("--offline", dest="connected", action="store_const", const=False)
    ls.add_argument("--persistent", action="store_const", const=True, default=None)
    ls.add_argument("--prefix", metavar="P", help="client IDs starting with P")
    ls.add_argument("--username", metavar="U")
    ls.add_argument("--limit", type=int, default=100, help="sessions per page (1..1000)")
    ls.add_argument("--all", action="store_true", help="follow the pages to the end")
    for action, text in (
        ("show", "one session: subscriptions, backlog, in flight"),
        ("messages", "stored messages of a persistent session, oldest first"),
        ("kick", "disconnect the client (MQTT 5: DISCONNECT 0x98)"),
        ("delete", "end the session and delete its stored messages"),
        ("purge", "delete the backlog (messages in flight stay), keep the session"),
    ):
        one = sub.add_parser(action, help=text)
        _common(one)
        one.add_argument("client_id", metavar="CLIENT_ID")
        if action == "messages":
            one.add_argument("--limit", type=int, default=20)
            one.add_argument("--payload", action="store_true", help="include payloads (base64)")
    rewind = sub.add_parser(
        "rewind", help="deliver again (DUP) what was published since a time, from Kafka"
    )
    _common(rewind)
    rewind.add_argument("client_id", metavar="CLIENT_ID")
    where = rewind.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--since",
        metavar="TIME",
        help="ISO 8601 with its zone (2026-11-26T06:00:00Z) or epoch seconds",
    )
    where.add_argument(
        "--offset",
        type=int,
        metavar="N",
        help="an APPLICATION session: read its topic again from offset N (each partition)",
    )


def add_blocked_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    _common(sub.add_parser("list", help="the block list"))
    kinds = ("client_id", "username", "address", "client_id_regex")
    add = sub.add_parser("add", help="block a client ID, username, address/CIDR or ID pattern")
    _common(add)
    add.add_argument("kind", choices=kinds)
    add.add_argument("value")
    add.add_argument("--ttl", type=float, help="seconds until the entry ends (default: never)")
    add.add_argument("--reason", default="")
    remove = sub.add_parser("remove", help="remove an entry")
    _common(remove)
    remove.add_argument("kind", choices=kinds)
    remove.add_argument("value")


def add_retained_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("list", help="retained messages matching a filter")
    _common(ls)
    ls.add_argument("--topic", default="#", help="topic filter (default #)")
    ls.add_argument("--limit", type=int, default=100, help="per page (at most 1000)")
    ls.add_argument("--all", action="store_true", help="follow the pages to the end")
    delete = sub.add_parser("delete", help="delete the retained message of a topic")
    _common(delete)
    delete.add_argument("topic")


def add_queues_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = sub.add_parser("list", help="$ECQ queues and group queue stores: backlog, bytes")
    _common(ls)
    ls.add_argument("--kind", choices=("ecq", "group"), help="only queues, or group stores")
    ls.add_argument("--limit", type=int, default=100, help="at most this many (100)")
    show = sub.add_parser(
        "show", help="a queue (its consumer's client ID) or a group store ($queue/G/FILTER)"
    )
    _common(show)
    show.add_argument("client_id", metavar="ID")
    purge = sub.add_parser("purge", help="remove every entry of a queue or group store")
    _common(purge)
    purge.add_argument("client_id", metavar="ID")
    rewind = sub.add_parser("rewind", help="deliver the latest value of every key again")
    _common(rewind)
    rewind.add_argument("client_id", metavar="CLIENT_ID")
    rewind.add_argument(
        "--seq", type=int, required=True, help="from this sequence number on (1: every key)"
    )
    add_queue_owner_arguments(sub)


def add_queue_owner_arguments(sub: Any) -> None:
    """``queues owner``: whose a queue is (broker/ownership.py), changed or cleared."""
    owner = sub.add_parser("owner", help="whose the queue is; --set or --clear changes it")
    _common(owner)
    owner.add_argument("client_id", metavar="CLIENT_ID")
    change = owner.add_mutually_exclusive_group()
    change.add_argument("--set", metavar="OWNER", help="give the queue to this owner")
    change.add_argument("--clear", action="store_true", help="its next consumer's owner holds it")


def add_client_ids_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    owner = sub.add_parser("owner", help="who holds a client ID; --release frees it")
    _common(owner)
    owner.add_argument("client_id", metavar="CLIENT_ID")
    owner.add_argument(
        "--release", action="store_true", help="the next owner to connect with it holds it"
    )


def add_owners_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    usage = sub.add_parser(
        "usage", help="what one owner holds, and the bytes auth.max_bytes_per_owner counts"
    )
    _common(usage)
    usage.add_argument("owner", metavar="OWNER")


# -- commands --------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> AdminClient:
    token = os.environ.get(TOKEN_ENV) or None
    token_file = args.token_file
    if token_file is None and token is None:
        # The broker's own admin.token_file, as in its container (docker-compose.yml)
        token_file = os.environ.get(TOKEN_FILE_ENV) or None
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise ApiError(0, f"cannot read the token file {token_file}: {e.strerror}") from None
    return AdminClient(args.url, token)


def run(args: argparse.Namespace, command: Callable[[AdminClient, argparse.Namespace], Any]) -> int:
    """Run one command; errors are one line on stderr, exit status 1."""
    try:
        client = _client(args)
        answer, table = command(client, args)
    except ApiError as e:
        print(f"devicemq: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(table)
    return 0


def sessions(client: AdminClient, args: argparse.Namespace) -> tuple[Any, str]:
    action = args.action
    if action == "list":
        query: dict[str, Any] = {
            "connected": args.connected,
            "persistent": args.persistent,
            "client_id": args.prefix,
            "username": args.username,
            "limit": args.limit,
        }
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = client.call("GET", "sessions", {**query, "cursor": cursor})
            items += page["items"]
            cursor = page["next_cursor"]
            if cursor is None or not args.all:
                break
        answer = {"items": items, "next_cursor": cursor}
        columns = (
            "client_id",
            "connected",
            "persistent",
            "session_type",
            "replica",
            "peer",
            "protocol",
            "subscriptions",
            "backlog",
            "in_flight",
            "last_seen",
        )
        table = _table(items, columns)
        if cursor is not None:
            table += f"\n(more: --all, or the API with cursor={cursor})"
        return answer, table
    cid = args.client_id
    if action == "show":
        answer = client.call("GET", client.session_path(cid))
        rows = [(k, _cell(k, v)) for k, v in answer.items() if k != "subscription_list"]
        text = "\n".join(f"{k:<16} {v}" for k, v in rows)
        subs = answer.get("subscription_list") or []
        if subs:
            text += "\n\n" + _table(subs, ("filter", "qos", "no_local", "retain_as_published"))
        return answer, text
    if action == "messages":
        answer = client.call(
            "GET",
            client.session_path(cid, "messages"),
            {"limit": args.limit, "payload": args.payload or None},
        )
        fields = ["packet_id", "score", "sent", "topic", "qos", "size", "published_at"]
        if args.payload:
            fields.append("payload")
        return answer, _table(answer["items"], fields)
    if action == "kick":
        answer = client.call("POST", client.session_path(cid, "disconnect"))
        return answer, f"{cid}: disconnected"
    if action == "delete":
        answer = client.call("DELETE", client.session_path(cid))
        return answer, f"{cid}: session ended, its stored messages deleted"
    if action == "rewind" and args.offset is not None:
        path = client.session_path(cid, "rewind")
        answer = client.call("POST", path, body={"offset": args.offset}, timeout=REWIND_TIMEOUT)
        return answer, f"{cid}: reads its topic again from offsets {answer['offsets']}"
    if action == "rewind":
        since: object = args.since  # an ISO 8601 time: the API reads it
        with contextlib.suppress(ValueError):
            since = float(args.since)
        # It reads the client's Kafka partition from its start: more than a moment.
        path = client.session_path(cid, "rewind")
        answer = client.call("POST", path, body={"since": since}, timeout=REWIND_TIMEOUT)
        if "offsets" in answer:  # an APPLICATION session's
            return answer, f"{cid}: reads its topic again from offsets {answer['offsets']}"
        return answer, (
            f"{cid}: {answer['rewound']} of {answer['matched']} messages since the time given "
            f"stored again, {answer['over_limit']} beyond its limit's room "
            f"({answer['records_read']} records of its partition read)"
        )
    answer = client.call("DELETE", client.session_path(cid, "messages"))
    return answer, f"{cid}: {answer['purged']} stored messages purged"


def blocked(client: AdminClient, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "list":
        answer = client.call("GET", "blocked")
        return answer, _table(answer["items"], ("kind", "value", "until", "by", "reason"))
    if args.action == "add":
        body: dict[str, Any] = {"kind": args.kind, "value": args.value, "reason": args.reason}
        if args.ttl is not None:
            body["ttl"] = args.ttl
        answer = client.call("POST", "blocked", body=body)
        return answer, f"blocked {answer['kind']}:{answer['value']}"
    answer = client.call("DELETE", "blocked", {"kind": args.kind, "value": args.value})
    return answer, f"removed {answer['key']}"


def retained(client: AdminClient, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "list":
        items: list[dict[str, Any]] = []
        cursor = None
        while True:
            query = {"topic": args.topic, "limit": args.limit, "cursor": cursor}
            page = client.call("GET", "retained", query)
            items += page["items"]
            cursor = page["next_cursor"]
            if cursor is None or not args.all:
                break
        answer = {"items": items, "next_cursor": cursor}
        table = _table(items, ("topic", "qos", "size", "origin"))
        if cursor is not None:
            table += f"\n(more: --all, or the API with cursor={cursor})"
        return answer, table
    answer = client.call("DELETE", "retained", {"topic": args.topic})
    return answer, f"deleted the retained message of {args.topic}"


def queues(client: AdminClient, args: argparse.Namespace) -> tuple[Any, str]:
    if args.action == "list":
        answer = client.call("GET", "queues", {"kind": args.kind, "limit": args.limit})
        columns = ("client_id", "kind", "pending", "keys", "bytes", "members")
        return answer, _table(answer["queues"], columns)
    path = "queues/" + quote(args.client_id, safe="")
    if args.action == "owner":
        return queue_owner(client, args, path + "/owner")
    if args.action == "show":
        answer = client.call("GET", path)
        return answer, "\n".join(f"{k:<20} {_cell(k, v)}" for k, v in answer.items())
    if args.action == "purge":
        answer = client.call("DELETE", path)
        return answer, (
            f"{args.client_id}: {answer['entries']} entries purged "
            f"({answer['pending']} pending, {answer['bytes']} bytes)"
        )
    answer = client.call("POST", f"{path}/rewind", body={"seq": args.seq})
    return answer, f"{args.client_id}: {answer['pending_again']} entries pending again"


def queue_owner(client: AdminClient, args: argparse.Namespace, path: str) -> tuple[Any, str]:
    cid = args.client_id
    if args.set is not None:
        answer = client.call("PUT", path, body={"owner": args.set})
    elif args.clear:
        answer = client.call("DELETE", path)
    else:
        answer = client.call("GET", path)
        return answer, f"{cid}: {_owner_text(answer['owner'])}"
    kicked = ", its client disconnected" if answer["disconnected"] else ""
    return answer, f"{cid}: {_owner_text(answer['owner'])} (was {answer['before'] or '-'}){kicked}"


def client_ids(client: AdminClient, args: argparse.Namespace) -> tuple[Any, str]:
    cid = args.client_id
    path = "client-ids/" + quote(cid, safe="") + "/owner"
    if args.release:
        answer = client.call("DELETE", path)
        return answer, f"{cid}: released (was {answer['before']}'s)"
    answer = client.call("GET", path)
    left = answer["released_in"]
    until = f", free after {left:.0f} s unused" if left is not None else ""
    return answer, f"{cid}: {_owner_text(answer['owner'])}{until}"


def owners(client: AdminClient, args: argparse.Namespace) -> tuple[Any, str]:
    answer = client.call("GET", "owners/" + quote(args.owner, safe=""))
    measured = answer["measured"]
    if measured is None:
        held = "not measured (its stores cannot pass the budget)"
    else:
        held = (
            f"{measured['bytes']} bytes (sessions {measured['session_bytes']}, queues "
            f"{measured['queue_bytes']}, group queues {measured['group_bytes']})"
        )
    over = ", OVER auth.max_bytes_per_owner" if answer["over_budget"] else ""
    lines = [
        f"{answer['owner']}: {held}{over}; budget {answer['max_bytes_per_owner']}",
        f"sessions: {answer['sessions']} (at most {answer['max_sessions_per_owner']})",
        f"queues: {len(answer['queues'])} (at most {answer['max_queues_per_owner']})"
        + "".join(f"\n  {q}" for q in answer["queues"]),
        f"group queues: {len(answer['group_queues'])}"
        + "".join(f"\n  {g}" for g in answer["group_queues"]),
    ]
    return answer, "\n".join(lines)


def _owner_text(owner: str | None) -> str:
    return f"owned by {owner}" if owner is not None else "nobody's"


# -- tables ----------------------------------------------------------------------------------


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column in ("last_seen", "connected_at", "published_at", "until", "created") and isinstance(
        value, int | float
    ):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value)) + "Z"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | dict):
        return orjson.dumps(value).decode()
    return str(value)


def _table(items: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    if not items:
        return "(none)"
    rows = [[_cell(c, item.get(c)) for c in columns] for item in items]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
