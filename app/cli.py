"""The ``devicemq`` command.

    devicemq run [--config FILE] [--host HOST] [--port PORT] [--data-dir DIR]
                 [--log-level LEVEL] [--metrics-port PORT]
    devicemq --version

Each subcommand is one entry of :data:`COMMANDS`: a function adding its
arguments and a handler returning the exit status. Adding ``services``,
``loadtest``, ``pipeline`` or ``passwd`` later is one new entry.

Exit status: 0 success, 1 runtime failure (e.g. the port is taken), 2 usage or
configuration error. Errors are one line on stderr, ``devicemq: error: ...``,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from broker import __version__
from broker.compiled import describe as describe_compiled
from broker.config import ConfigError, Settings, load_settings
from edge.logging_setup import setup_logging

__all__ = ["COMMANDS", "Command", "main"]

PROG = "devicemq"
CONFIG_ENV = "DEVICEMQ_CONFIG"  # path of the YAML file when --config is not given

log = logging.getLogger("broker.cli")


class UsageError(Exception):
    """A mistake on the command line; reported like argparse does, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise UsageError(f"{self.prog}: error: {message}")


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


# --------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------

# flag destination -> dotted setting it overrides
_RUN_OVERRIDES = {
    "host": "listener.host",
    "port": "listener.port",
    "data_dir": "data_dir",
    "log_level": "log.level",
    "metrics_port": "metrics.port",
    "workers": "workers",
}


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"YAML settings file (default: ${CONFIG_ENV}, else built-in defaults)",
    )
    p.add_argument(
        "--host",
        help="address to listen on (listener.host; default: 127.0.0.1 unless "
        "authentication is configured)",
    )
    # Text on purpose: config.py parses and range-checks it like any other value.
    p.add_argument("--port", help="TCP port for MQTT (listener.port)")
    p.add_argument("--data-dir", metavar="DIR", help="directory for broker files (data_dir)")
    p.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO, WARNING or ERROR (log.level)")
    p.add_argument(
        "--metrics-port",
        metavar="PORT",
        help="serve /metrics, /health and /ready on PORT (metrics.port; sets metrics.enabled)",
    )
    p.add_argument(
        "--workers",
        metavar="N",
        help="broker processes sharing the ports, a number or auto: one per core (workers)",
    )


def _config_path(args: argparse.Namespace) -> str | None:
    return args.config or os.environ.get(CONFIG_ENV) or None


def _settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {
        name: getattr(args, dest)
        for dest, name in _RUN_OVERRIDES.items()
        if getattr(args, dest) is not None
    }
    if args.metrics_port is not None:
        overrides["metrics.enabled"] = "true"
    return load_settings(_config_path(args), overrides=overrides)


def _run(args: argparse.Namespace) -> int:
    settings = _settings_from_args(args)
    setup_logging(settings.log.level, settings.log.format)
    log.info(
        "devicemq %s (%s), config: %s",
        __version__,
        describe_compiled(),
        _config_path(args) or "built-in defaults",
    )
    log.debug("settings: %r", settings)
    try:
        # Imported here: --help, --version and config errors stay fast and
        # work whatever the server's own imports need.
        server = importlib.import_module("app.serve")
    except ModuleNotFoundError as e:
        if e.name != "app.serve":
            raise
        _error("app.serve is not available in this installation")
        return 1
    from app.start_errors import startup_error
    from app.workers import check_workers, run_workers, worker_count

    count = worker_count(settings)
    check_workers(settings, count)
    try:
        if count > 1:
            log.info("%d workers on one port", count)
            return run_workers(settings, count, lambda: _embedded_services(settings))
        server.run(settings)
    except Exception as e:
        line = startup_error(settings, e)
        if line is None or isinstance(e, ConfigError):
            raise
        _error(line)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the server installed its handler
        return 130
    return 0


def _embedded_services(settings: Settings) -> tuple[str, str]:
    """Start (or reuse) the embedded Redis and Kafka of ``data_dir``: their addresses."""
    from app.serve import embedded_services

    running = embedded_services(settings).ensure_running()
    return running.redis_url, running.kafka_bootstrap


# --------------------------------------------------------------------------
# services
# --------------------------------------------------------------------------


def _add_services_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("status", "stop"), help="show or stop them")
    p.add_argument("--data-dir", metavar="DIR", help="the broker's data_dir (default ./data)")
    p.add_argument("--config", metavar="FILE", help="YAML settings file, for data_dir")


def _services(args: argparse.Namespace) -> int:
    """The embedded Redis and Kafka-protocol broker of a data dir."""
    from pathlib import Path

    from app.embedded_services import EmbeddedServices, ServiceError, format_status

    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    settings = load_settings(_config_path(args), overrides=overrides)
    services = EmbeddedServices(Path(settings.data_dir))
    try:
        if args.action == "stop":
            services.stop()
        print(format_status(services.status()))
    except ServiceError as e:
        _error(str(e))
        return 1
    return 0


# --------------------------------------------------------------------------
# loadtest (the loadtest package; imported only when used)
# --------------------------------------------------------------------------


def _add_loadtest_arguments(p: argparse.ArgumentParser) -> None:
    from loadtest.cli import add_arguments

    add_arguments(p)


def _loadtest(args: argparse.Namespace) -> int:
    from loadtest.cli import run_command

    return run_command(args)


# --------------------------------------------------------------------------
# sessions, blocked, retained, queues (the admin API: app/admin_cli.py)
# --------------------------------------------------------------------------


def _admin_command(name: str) -> Command:
    """One admin command: its arguments and handler live in app/admin_cli.py."""

    attribute = name.replace("-", "_")

    def add_arguments(p: argparse.ArgumentParser) -> None:
        admin_cli = importlib.import_module("app.admin_cli")
        getattr(admin_cli, f"add_{attribute}_arguments")(p)

    def handler(args: argparse.Namespace) -> int:
        admin_cli = importlib.import_module("app.admin_cli")
        return int(admin_cli.run(args, getattr(admin_cli, attribute)))

    helps = {
        "sessions": "list, show, kick, delete, purge or rewind sessions, or list a session's "
        "stored messages (the admin API)",
        "blocked": "list, add or remove block-list entries (the admin API)",
        "retained": "list or delete retained messages (the admin API)",
        "queues": "list, show, purge or rewind $ECQ queues and group queue stores, or show "
        "or change a queue's owner (the admin API)",
        "client-ids": "owner: show or release who holds a client ID (the admin API)",
        "owners": "usage: what one owner holds and the bytes auth.max_bytes_per_owner "
        "counts (the admin API)",
    }
    return Command(helps[name], add_arguments, handler)


# --------------------------------------------------------------------------
# passwd
# --------------------------------------------------------------------------


def _add_passwd_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the password file (auth.password_file)")
    p.add_argument("user", metavar="USER", help="the user name")
    p.add_argument(
        "password",
        metavar="PASSWORD",
        nargs="?",
        help="with -b only: the password (visible to other local users; avoid)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-D", "--delete", action="store_true", help="delete USER from FILE")
    mode.add_argument(
        "--password-stdin", action="store_true", help="read the password from standard input"
    )
    mode.add_argument(
        "-b",
        "--batch",
        action="store_true",
        help="take PASSWORD from the command line, like mosquitto_passwd -b (discouraged)",
    )


def _passwd(args: argparse.Namespace) -> int:
    """Add, change or delete a user of a password file (one username:argon2id-hash a line).

    Asks for the password twice unless --password-stdin or -b. The file is
    created if missing and always rewritten atomically with mode 0600.
    """
    import getpass
    from pathlib import Path

    from broker.auth import (
        PasswordFileError,
        check_username,
        hash_password,
        read_password_file,
        write_password_file,
    )

    if (args.password is not None) != args.batch:
        print(f"{PROG} passwd: error: PASSWORD goes with -b, and -b needs it", file=sys.stderr)
        return 2
    path = Path(args.file)
    try:
        users = read_password_file(path) if path.exists() else {}
    except PasswordFileError as e:
        _error(str(e))
        return 1
    if args.delete:
        if users.pop(args.user, None) is None:
            _error(f"{args.user!r} is not in {path}")
            return 1
        write_password_file(path, users)
        return 0
    try:
        check_username(args.user)
    except ValueError as e:
        _error(str(e))
        return 2
    if args.batch:
        print(
            f"{PROG}: warning: a password on the command line can be seen by other local "
            "users and stays in shell history; prefer --password-stdin",
            file=sys.stderr,
        )
        password = args.password
    elif args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        try:
            password = getpass.getpass("Password: ")
            if getpass.getpass("Reenter password: ") != password:
                _error("the passwords do not match")
                return 1
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 1
    if not password:
        _error("the password is empty")
        return 1
    users[args.user] = hash_password(password)
    try:
        write_password_file(path, users)
    except OSError as e:
        _error(f"cannot write {path}: {e.strerror or e}")
        return 1
    return 0


# --------------------------------------------------------------------------
# The command table and main
# --------------------------------------------------------------------------


def _add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    from pipeline.cli import add_arguments

    add_arguments(p)


# The top-level modules of pyproject.toml's ``pipeline`` extra.
PIPELINE_EXTRA = ("pyspark", "pyarrow", "pandas", "matplotlib")


def _pipeline(args: argparse.Namespace) -> int:
    """PySpark jobs (pipeline/cli.py); needs the ``pipeline`` extra and Java.

    Without the extra: one line naming it, exit status 2, not a traceback (issue
    40); the jobs import PySpark and friends lazily, so the check covers the run.
    """
    try:
        # Both jobs need these: checked before the jobs reach Kafka and Redis.
        importlib.import_module("pyspark")
        importlib.import_module("pyarrow")
        from pipeline.cli import run

        return run(args)
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in PIPELINE_EXTRA:
            raise
        _error(
            f"devicemq pipeline needs {missing}, which is not installed: "
            "pip install 'devicemq[pipeline]' (and Java 17 on PATH)"
        )
        return 2


COMMANDS: dict[str, Command] = {
    "run": Command("run the MQTT broker until SIGTERM/SIGINT", _add_run_arguments, _run),
    "passwd": Command(
        "add, change or delete a user of a password file", _add_passwd_arguments, _passwd
    ),
    "sessions": _admin_command("sessions"),
    "blocked": _admin_command("blocked"),
    "retained": _admin_command("retained"),
    "queues": _admin_command("queues"),
    "client-ids": _admin_command("client-ids"),
    "owners": _admin_command("owners"),
    "services": Command(
        "status or stop: the embedded Redis and Kafka of a data dir",
        _add_services_arguments,
        _services,
    ),
    "loadtest": Command(
        "run a load scenario against a broker: p2p, fan-in, fan-out, fleet, ecq or group-queue",
        _add_loadtest_arguments,
        _loadtest,
    ),
    "pipeline": Command(
        "run a PySpark job over the Kafka topics: audit (nothing lost?) or traffic",
        _add_pipeline_arguments,
        _pipeline,
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="devicemq, an MQTT 3.1.1 and 5.0 broker")
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {__version__} ({describe_compiled()})"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(handler=command.handler)
    return parser


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``devicemq`` command line; return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except SystemExit as e:  # --help and --version print and "exit"
        return e.code if isinstance(e.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        code: int = args.handler(args)
    except ConfigError as e:
        _error(str(e))
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
