"""devicemq's hot modules compiled with mypyc, in a copy of a tree; the pure Python stays.

    python -m loadtest.ab.compiled [--out DIR] [ROOT]   # ROOT (default: this tree) -> DIR

copies ROOT's tracked files as they are on disk (uncommitted changes included)
into DIR (default ``<ROOT>/build/mypyc``, ignored by git) and compiles
:data:`MODULES` there with mypyc (it ships with mypy, a test dependency) and
the C compiler. The copy then imports the compiled modules first (each
``.so`` sits beside its ``.py``): run it with ``PYTHONPATH=DIR``. The tree
itself is never touched, so it always runs as pure Python: no ``.so`` beside
the sources can go stale and hide an edit. ``.ci/run`` runs the unit tests of
the compiled modules in such a copy when a compiler is present;
``python -m loadtest.ab --head-compiled`` / ``--base-compiled`` measure it.

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

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MODULES", "CompileError", "compile_tree", "copy_tree", "missing", "not_compiled"]

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
# A module whose file shows whether the compiled build is what gets imported.
PROBE = "broker.core"
TIMEOUT = 1800.0  # a loaded 2-core machine took 9 minutes


class CompileError(RuntimeError):
    """The modules could not be compiled, or the copy does not import them."""


def missing(python: str = sys.executable) -> str | None:
    """What a build needs and this machine lacks (mypyc, a C compiler, the
    Python headers), or None."""
    done = subprocess.run(
        [python, "-c", "import mypyc.build"], capture_output=True, check=False, timeout=120
    )
    if done.returncode != 0:
        return f"{python} has no mypyc (pip install mypy)"
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        return "no C compiler (cc, gcc or clang) on PATH"
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not include.is_file():
        return f"no {include} (the Python development headers)"
    return None


def copy_tree(root: Path, dest: Path) -> None:
    """``root``'s files that git tracks, as on disk, into ``dest`` (emptied first)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=False, timeout=120
    )
    if listed.returncode != 0:
        raise CompileError(f"git ls-files in {root}: {listed.stderr.decode(errors='replace')}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in listed.stdout.decode().split("\0"):
        source = root / name
        if name and source.is_file():  # a file deleted but not yet staged is left out
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def compile_tree(tree: Path, python: str = sys.executable) -> float:
    """Compiles :data:`MODULES` in ``tree`` (a copy: the ``.so`` files land beside
    the sources) and checks that ``tree`` then imports them; the seconds it took."""
    why = missing(python)
    if why is not None:
        raise CompileError(f"cannot compile: {why}")
    started = time.monotonic()
    log = tree / "mypyc-build.log"
    with open(log, "wb") as out:
        done = subprocess.run(
            [python, "-m", "mypyc", *MODULES],
            cwd=tree,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            timeout=TIMEOUT,
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise CompileError("mypyc failed:\n" + "\n".join(tail))
    why = not_compiled(tree, python)
    if why is not None:
        raise CompileError(why)
    return time.monotonic() - started


def not_compiled(tree: Path, python: str = sys.executable) -> str | None:
    """Why ``python`` with ``PYTHONPATH=tree`` does not import the compiled
    :data:`PROBE` of ``tree``, or None."""
    try:
        done = subprocess.run(
            [python, "-c", f"import {PROBE} as m; print(m.__file__)"],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree)},
            capture_output=True,
            check=False,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    where = done.stdout.decode().strip()
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        return f"{tree} does not import: {lines[-1] if lines else done.returncode}"
    if not (where.endswith(".so") and Path(where).resolve().is_relative_to(tree.resolve())):
        return f"{tree} imports {PROBE} from {where}, not compiled there"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    here = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(
        prog="python -m loadtest.ab.compiled",
        description="a copy of a devicemq tree with its hot modules compiled by mypyc",
    )
    p.add_argument("root", nargs="?", type=Path, default=here, help="the tree (default: this)")
    p.add_argument("--out", type=Path, help="the copy (default ROOT/build/mypyc)")
    args = p.parse_args(argv)
    root = args.root.resolve()
    out = (args.out or root / "build" / "mypyc").resolve()
    if out == root or root.is_relative_to(out):
        print(f"loadtest.ab.compiled: error: --out {out} would replace the tree", file=sys.stderr)
        return 2
    try:
        copy_tree(root, out)
        seconds = compile_tree(out)
    except (CompileError, OSError, subprocess.TimeoutExpired) as e:
        print(f"loadtest.ab.compiled: error: {e}", file=sys.stderr)
        return 1
    print(f"compiled {len(MODULES)} modules in {seconds:.0f} s: PYTHONPATH={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
