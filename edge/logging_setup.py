"""Process logging: stdlib ``logging``, one line per event, text or JSON.

Code logs with ``logging.getLogger(__name__)`` as usual; structured fields go
in ``extra``::

    log.info("client connected", extra={"client_id": cid, "protocol": 5})

The text format appends them as ``key=value``; the JSON format (one object
per line, written with orjson) makes them keys. A traceback stays on the
event's line: in text its line breaks are escaped as ``\\n``, in JSON it is
the ``exc`` field.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import orjson

__all__ = ["QUIET_LIBRARIES", "JsonFormatter", "TextFormatter", "setup_logging"]

# Libraries whose INFO is noise beside devicemq's own: WARNING and above unless DEBUG.
QUIET_LIBRARIES = ("aiokafka",)

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


def _timestamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


class TextFormatter(logging.Formatter):
    """``2024-05-01T12:00:00.123Z INFO devicemq.server: message key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v!r}" for k, v in extras.items())
        if record.exc_info:
            line += " | " + self.formatException(record.exc_info)
        elif record.stack_info:
            line += " | " + self.formatStack(record.stack_info)
        return _one_line(line)


class JsonFormatter(logging.Formatter):
    """``{"ts": ..., "level": ..., "logger": ..., "msg": ..., <extras>, "exc": ...}``."""

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            event.setdefault(key, value)
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            event["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(event, default=str).decode()
        except TypeError:  # e.g. an int beyond 64 bits, which default= does not see
            return orjson.dumps({k: str(v) for k, v in event.items()}).decode()


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every logger's events at ``level`` or above to ``stream`` (stderr).

    Replaces the root logger's handlers, so calling it twice is harmless.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    # aiokafka's INFO lines (group joins, every partition list at every start and
    # rebalance) drown the broker's own: they show with --log-level debug only.
    quiet = max(logging.WARNING, root.level) if root.level > logging.DEBUG else logging.NOTSET
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)
