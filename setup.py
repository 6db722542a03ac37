"""devicemq's build: the metadata is pyproject.toml's; this adds the hot modules
compiled with mypyc (``MODULES`` in broker/compiled.py) to a wheel when it can.

``DEVICEMQ_COMPILE``, read here at build time only:

- unset or ``auto``: compile when mypyc (build-system.requires brings it), a
  working C compiler (``CC``, else the one Python was built with) and the
  Python headers are there; otherwise, or if compiling fails, the wheel holds
  the pure Python and the build says why (a warning, never a failure);
- ``0``: never compile (the pure Python);
- ``1``: compile, or fail the build (CI and the Dockerfile: a build that
  should be compiled and is not is noticed).

``DEVICEMQ_COMPILE_OPT_LEVEL`` (``0`` to ``3``, default ``3``): the C compiler's
optimisation of the compiled modules. The same code either way; CI builds at
``0``, which compiles in a fraction of the time, to test what compiling does to
the code, not how fast it runs (the benchmarks build at ``3``).

An editable install (``pip install -e .``) never compiles: a ``.so`` beside
its ``.py`` would hide every later edit of the source. Only the commands that
build a wheel or an install compile (mypyc type-checks the tree first, which
the metadata steps do not need).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
VARIABLE = "DEVICEMQ_COMPILE"
OPT_VARIABLE = "DEVICEMQ_COMPILE_OPT_LEVEL"
COMPILING_COMMANDS = {"bdist_wheel", "build", "build_ext", "install", "bdist"}
EDITABLE_COMMANDS = {"editable_wheel", "develop"}
# Where mypyc writes its C (git ignores build/); build/mypyc is loadtest.ab.compiled's.
C_DIR = "build/mypyc-c"
# The shared library of the compiled modules: devicemq__mypyc.<abi>.so at the top level.
GROUP = "devicemq"


def say(text: str) -> None:
    print(f"devicemq build: {text}", file=sys.stderr, flush=True)


def hot_modules() -> list[str]:
    """broker/compiled.py's MODULES, read by path: devicemq's dependencies are
    not installed while it builds."""
    spec = importlib.util.spec_from_file_location("_devicemq_compiled", HERE / "broker/compiled.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.MODULES)


def opt_level() -> str:
    value = os.environ.get(OPT_VARIABLE, "3").strip() or "3"
    if value not in {"0", "1", "2", "3"}:
        raise SystemExit(f"{OPT_VARIABLE}={value!r}: use 0, 1, 2 or 3 (the default)")
    return value


def mode() -> str:
    value = os.environ.get(VARIABLE, "auto").strip().lower() or "auto"
    if value not in {"auto", "0", "1"}:
        raise SystemExit(f"{VARIABLE}={value!r}: use auto, 0 (pure Python) or 1 (compile or fail)")
    return value


def missing() -> str | None:
    """What compiling needs and this build lacks, or None."""
    if importlib.util.find_spec("mypyc") is None:
        return "no mypyc (it ships with mypy)"
    from distutils.ccompiler import new_compiler  # setuptools' own copy
    from distutils.errors import CCompilerError, DistutilsError
    from distutils.sysconfig import customize_compiler

    compiler: Any = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.c"
        probe.write_text("#include <Python.h>\nint devicemq_probe(void) { return 0; }\n")
        try:
            compiler.compile(
                [str(probe)], output_dir=tmp, include_dirs=[sysconfig.get_paths()["include"]]
            )
        except (CCompilerError, DistutilsError, OSError) as e:
            cc = " ".join(compiler.compiler_so[:1]) if hasattr(compiler, "compiler_so") else "cc"
            return f"the C compiler ({cc}) cannot build against Python.h: {e}"
    return None


def ext_modules() -> list[Any]:
    commands = set(sys.argv[1:])
    if commands & EDITABLE_COMMANDS or not commands & COMPILING_COMMANDS:
        return []
    wanted = mode()
    if wanted == "0":
        say(f"{VARIABLE}=0: the pure Python, not compiled")
        return []
    why = missing()
    if why is not None:
        if wanted == "1":
            raise SystemExit(f"devicemq build: {VARIABLE}=1 but cannot compile: {why}")
        say(f"the pure Python, not compiled: {why}")
        return []
    from mypyc.build import mypycify

    modules = hot_modules()
    level = opt_level()
    say(f"compiling {len(modules)} hot modules with mypyc at -O{level} (a minute or more)")
    try:
        return list(mypycify(modules, target_dir=C_DIR, group_name=GROUP, opt_level=level))
    except (SystemExit, Exception) as e:
        if wanted == "1":
            raise
        say(f"the pure Python, not compiled: mypyc failed ({e!r})")
        return []


class BuildExt(build_ext):
    """Without ``DEVICEMQ_COMPILE=1``, a C compile that fails leaves the pure Python."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:
            if mode() == "1":
                raise
            say(f"the pure Python, not compiled: building the extensions failed ({e})")
            for output in self.get_outputs():
                Path(output).unlink(missing_ok=True)
            self.extensions = []
            self.distribution.ext_modules = []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": BuildExt})
