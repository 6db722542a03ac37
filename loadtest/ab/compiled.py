"""devicemq's hot modules compiled with mypyc, in a copy of a tree; the pure Python stays.

    python -m loadtest.ab.compiled [--out DIR] [--wheel] [ROOT]   # ROOT (default: this tree) -> DIR

copies ROOT's tracked files as they are on disk (uncommitted changes included)
into DIR (default ``<ROOT>/build/mypyc``, ignored by git) and compiles there
the hot modules, :data:`MODULES` (the list, and what is left out and why, is
broker/compiled.py's), with the C compiler. The copy then imports the compiled
modules first (each ``.so`` sits beside its ``.py``): run it with
``PYTHONPATH=DIR``. The tree itself is never touched, so it always runs as pure
Python: no ``.so`` beside the sources can go stale and hide an edit.

Two ways to compile:

- by default ``python -m mypyc MODULES`` in the copy, with this interpreter's
  mypy (a test dependency): what ``python -m loadtest.ab --head-compiled`` /
  ``--base-compiled`` use, also for an older revision without setup.py;
- ``--wheel``: the wheel an install builds (``pip wheel``, setup.py, with
  ``DEVICEMQ_COMPILE=1`` so it compiles or fails), from an interpreter with
  nothing installed (a bare venv in ``DIR/build``), as a fresh ``pip install .``
  builds it; its extension modules are unpacked into the copy. ``.ci/run``
  runs the unit tests on these: the compiled modules CI tests are the ones an
  install gets.

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
import zipfile
from collections.abc import Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from broker.compiled import MODULES

__all__ = [
    "MODULES",
    "CompileError",
    "compile_tree",
    "copy_tree",
    "missing",
    "not_compiled",
    "wheel_tree",
]

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


def wheel_tree(tree: Path, python: str = sys.executable) -> float:
    """Builds ``tree``'s wheel as an install does (``pip wheel``, compiled or
    failed), unpacks its extension modules into ``tree`` (a copy) and checks
    that ``tree`` then imports every one of :data:`MODULES` compiled; the
    seconds it took."""
    why = missing(python)
    if why is not None:
        raise CompileError(f"cannot compile: {why}")
    started = time.monotonic()
    bare, dist = tree / "build" / "wheel-python", tree / "build" / "wheel"
    for folder in (bare, dist):
        shutil.rmtree(folder, ignore_errors=True)
    # An interpreter with nothing installed: the build must find all it needs
    # in build-system.requires, as in a fresh venv (mypy reads the types of the
    # libraries from the interpreter's own site-packages too).
    made = subprocess.run(
        [python, "-m", "venv", "--without-pip", str(bare)],
        capture_output=True,
        check=False,
        timeout=300,
    )
    if made.returncode != 0:
        raise CompileError(f"python -m venv {bare}: {made.stderr.decode(errors='replace')}")
    log = tree / "mypyc-build.log"
    pip = [python, "-m", "pip", "--python", str(bare / "bin" / "python")]
    with open(log, "wb") as out:
        done = subprocess.run(
            [*pip, "wheel", "-v", "--no-deps", "--wheel-dir", str(dist), str(tree)],
            cwd=tree,
            env={**os.environ, "DEVICEMQ_COMPILE": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            timeout=TIMEOUT,
        )
    wheels = sorted(dist.glob("devicemq-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        raise CompileError("pip wheel failed:\n" + "\n".join(tail))
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in wheel.namelist():
            if name.endswith(tuple(EXTENSION_SUFFIXES)):
                wheel.extract(name, tree)
    why = not_compiled(tree, python)
    if why is not None:
        raise CompileError(why)
    counted = subprocess.run(
        [python, "-c", "from broker.compiled import describe; print(describe())"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        check=False,
        timeout=120,
    )
    said = counted.stdout.decode().strip()
    if f"{len(MODULES)} of {len(MODULES)}" not in said:
        raise CompileError(f"{wheels[0].name}: {said or counted.stderr.decode(errors='replace')}")
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
    p.add_argument(
        "--wheel",
        action="store_true",
        help="compile as an install does: pip wheel (setup.py) from a bare venv, unpacked",
    )
    args = p.parse_args(argv)
    root = args.root.resolve()
    out = (args.out or root / "build" / "mypyc").resolve()
    if out == root or root.is_relative_to(out):
        print(f"loadtest.ab.compiled: error: --out {out} would replace the tree", file=sys.stderr)
        return 2
    try:
        copy_tree(root, out)
        seconds = wheel_tree(out) if args.wheel else compile_tree(out)
    except (CompileError, OSError, subprocess.TimeoutExpired) as e:
        print(f"loadtest.ab.compiled: error: {e}", file=sys.stderr)
        return 1
    how = " (the wheel of an install)" if args.wheel else ""
    print(f"compiled {len(MODULES)} modules{how} in {seconds:.0f} s: PYTHONPATH={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
