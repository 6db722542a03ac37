"""The hot modules that mypyc compiles, and which of them this process runs compiled.

:data:`MODULES` is the one list: ``setup.py`` compiles it into a wheel
(``pip install .``, ``pip wheel .``) when a C compiler is present, and
``python -m loadtest.ab.compiled`` into a copy of a tree. This module imports
the standard library only, so that ``setup.py`` can read it by path before
any of devicemq's dependencies are installed.

Why these modules: they are the in-memory p2p path of a profile (codec and
packets, the connection, the core's publish handling, routing, the outflow,
the ACL and limits) and the persistent path's store (the Redis store, its
record formats, the store feed). Left out, with what stops them:

- ``edge/server.py``: typeshed says ``Server.sockets`` is a tuple, uvloop
  returns a list; compiled code checks the declared type and raises;
- ``persistence/kafka_path.py``, ``persistence/consumer.py``: each subclasses
  an untyped aiokafka class, and the compiled subclass crashes the interpreter
  (a segmentation fault at the first use, mypy 2.4.1);
- ``broker/session.py``: ``broker/cluster.py``'s ``RemoteSession`` subclasses
  ``Session``, and a compiled class cannot be subclassed by Python code.

Compiled code checks declared types at run time (``x: Session`` assigned
``None`` raises ``TypeError``) and its classes take no new attributes, no
replaced methods and no weak references: the unit tests run both ways in CI.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

__all__ = ["MODULES", "compiled", "describe"]

MODULES = (
    "broker/acl.py",
    "broker/codec.py",
    "broker/connection.py",
    "broker/core.py",
    "broker/handlers/acks.py",
    "broker/handlers/publish.py",
    "broker/limits.py",
    "broker/message.py",
    "broker/outflow.py",
    "broker/packets.py",
    "broker/topics.py",
    "persistence/delivery_codec.py",
    "persistence/format.py",
    "persistence/redis_store.py",
    "persistence/store_feed.py",
)


def module_name(path: str) -> str:
    """``broker/core.py`` -> ``broker.core``."""
    return path.removesuffix(".py").replace("/", ".")


def compiled() -> list[str]:
    """The modules of :data:`MODULES` that an import finds compiled: an
    extension module beside the ``.py`` (an import prefers it). Looked up on
    disk, without importing them (``devicemq --version`` stays fast)."""
    found = []
    for path in MODULES:
        top, _, rest = path.partition("/")
        spec = importlib.util.find_spec(top)  # broker, persistence: nothing but a docstring
        if spec is None or not spec.submodule_search_locations:
            continue
        stem = rest.removesuffix(".py")
        for folder in spec.submodule_search_locations:
            if any(
                Path(folder, stem + suffix).is_file()
                for suffix in importlib.machinery.EXTENSION_SUFFIXES
            ):
                found.append(module_name(path))
                break
    return found


def describe() -> str:
    """One line for the log: how many of the hot modules run compiled."""
    count = len(compiled())
    if count == 0:
        return "pure Python: no hot module compiled with mypyc"
    return f"compiled with mypyc: {count} of {len(MODULES)} hot modules"
