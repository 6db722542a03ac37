"""Authentication's set-up, at the composition root: the files and the chain.

The broker's :class:`~broker.auth.Authenticator` and
:class:`~broker.acl.Authorizer` decide; they do no set-up of their own. Here,
once at start, is what reaches outside the process: ``auth.initial_user``
writes the password file when it is missing, the password and ACL files are
read (a bad one is a :class:`ConfigError` naming the setting), and
``auth.chain``'s members are built (:func:`broker.external_auth.build_chain`:
their key files read, the HTTP service's address checked). ``app/serve.py``
passes what :func:`open_authentication` returns into ``Broker``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from broker.acl import CACHE_SIZE, AclError, Authorizer, read_acl
from broker.auth import (
    Authenticator,
    BlockingRunner,
    PasswordFileError,
    check_username,
    hash_password,
    read_password_file,
    write_password_file,
)
from broker.config import AuthSettings, ConfigError, Settings
from broker.external_auth import build_chain

__all__ = [
    "create_initial_password_file",
    "open_authentication",
    "open_authenticator",
    "open_authorizer",
]

log = logging.getLogger("devicemq.auth")


def open_authentication(
    settings: Settings, clock: Callable[[], float] = time.monotonic
) -> tuple[Authenticator, Authorizer]:
    """The broker's authenticator and authorizer, their files read and chain built."""
    authenticator = open_authenticator(settings.auth, clock)
    authorizer = open_authorizer(settings.auth.acl_file, clock, grants=bool(authenticator.chain))
    return authenticator, authorizer


def open_authenticator(
    settings: AuthSettings,
    clock: Callable[[], float] = time.monotonic,
    run_blocking: BlockingRunner | None = None,
) -> Authenticator:
    """An :class:`Authenticator` for ``settings``: auth.chain built, then the password
    file written if ``auth.initial_user`` asks and read."""
    chain = build_chain(settings, clock)
    users = None
    if settings.password_file:
        create_initial_password_file(settings)
        try:
            users = read_password_file(settings.password_file)
        except PasswordFileError as e:
            raise ConfigError(str(e), name="auth.password_file") from None
    return Authenticator(settings, clock, run_blocking, users=users, chain=chain)


def open_authorizer(
    path: str,
    clock: Callable[[], float] = time.monotonic,
    cache_size: int = CACHE_SIZE,
    grants: bool = False,
) -> Authorizer:
    """An :class:`Authorizer` with the ACL file at ``path`` read ("": none)."""
    acl = None
    if path:
        try:
            acl = read_acl(Path(path))
        except AclError as e:
            raise ConfigError(str(e), name="auth.acl_file") from None
    return Authorizer(path, clock, cache_size, grants, acl=acl)


def create_initial_password_file(settings: AuthSettings) -> bool:
    """``auth.initial_user``: write the password file with that one user when it does
    not exist yet; True if it was written. An existing file is never touched.

    So a deployment configured only through its environment (docker-compose.yml)
    starts with authentication on: DEVICEMQ_AUTH_INITIAL_PASSWORD comes from the
    operator, only its hash reaches the disk.
    """
    if not settings.password_file or not settings.initial_user:
        return False
    path = Path(settings.password_file)
    if path.exists():
        log.info("%s exists: auth.initial_user %r not written", path, settings.initial_user)
        return False
    try:
        check_username(settings.initial_user)
    except ValueError as e:
        raise ConfigError(str(e), name="auth.initial_user") from None
    if not settings.initial_password:
        raise ConfigError(
            "empty: the initial user needs a password (DEVICEMQ_AUTH_INITIAL_PASSWORD)",
            name="auth.initial_password",
        )
    try:
        write_password_file(path, {settings.initial_user: hash_password(settings.initial_password)})
    except OSError as e:
        raise ConfigError(
            f"cannot create {path}: {e.strerror or e}", name="auth.password_file"
        ) from None
    log.info("created %s with user %r (auth.initial_user)", path, settings.initial_user)
    return True
