"""setup.py: when an install compiles the hot modules with mypyc, and when it
must not.

The compiled case is .ci/run's "mypyc build" step (``python -m
loadtest.ab.compiled --wheel``): the wheel built from a bare venv with
``DEVICEMQ_COMPILE=1``, its extension modules checked to import, then
tests/unit run on them; it takes minutes. Here the cases that must not
compile, each a few seconds: no working C compiler (``CC`` names a missing
one), the operator's ``DEVICEMQ_COMPILE=0``, and an editable install. They
build with ``--no-build-isolation``: this venv's mypy and a setuptools that
builds wheels itself (>= 70.1; the venv's 65.5 needs the ``wheel`` package)
fetched once into a folder put on ``PYTHONPATH`` (from the package index or
pip's cache, as tests/deploy/test_image_build.py's build does); setup.py
decides the same with or without isolation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO
from tests.deploy.dockerignore import context_files, copy_context

TIMEOUT = 300
PIP = (sys.executable, "-m", "pip")


@pytest.fixture(scope="module")
def setuptools_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("setuptools")
    got = subprocess.run(
        [*PIP, "install", "--no-deps", "--target", str(target), "setuptools>=70.1"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert got.returncode == 0, (got.stdout + got.stderr)[-3000:]
    return target


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A copy of the sources an install builds from (the Docker build context)."""
    dest = tmp_path / "src"
    copy_context(REPO, dest)
    assert (dest / "setup.py").is_file()
    return dest


def _env(setuptools_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEVICEMQ_", "PYTHON"))}
    return {**env, "PYTHONPATH": str(setuptools_path), **extra}


def _pip_wheel(
    setuptools_path: Path, source: Path, out: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PIP, "wheel", "-v", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), "."],
        cwd=source,
        env=_env(setuptools_path, **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def _refused(setuptools_path: Path, source: Path, tmp_path: Path, said: str, **env: str) -> None:
    """The build fails, says ``said`` and leaves no wheel."""
    built = _pip_wheel(setuptools_path, source, tmp_path / "out", **env)
    assert built.returncode != 0
    assert said in built.stdout + built.stderr
    assert not list((tmp_path / "out").glob("*.whl"))


def _extensions(names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(tuple(EXTENSION_SUFFIXES))]


def _pure_wheel(out: Path) -> list[str]:
    (wheel,) = out.glob("devicemq-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert _extensions(names) == []
    return names


def test_without_a_c_compiler_the_install_is_pure_python(
    setuptools_path: Path, source: Path, tmp_path: Path
) -> None:
    built = _pip_wheel(setuptools_path, source, tmp_path / "out", CC=str(tmp_path / "no-such-cc"))
    said = built.stdout + built.stderr
    assert built.returncode == 0, said[-3000:]
    assert "devicemq build: the pure Python, not compiled: the C compiler" in said
    names = _pure_wheel(tmp_path / "out")
    assert "broker/core.py" in names and "broker/compiled.py" in names


def test_compile_required_without_a_c_compiler_fails_and_says_why(
    setuptools_path: Path, source: Path, tmp_path: Path
) -> None:
    _refused(
        setuptools_path,
        source,
        tmp_path,
        "DEVICEMQ_COMPILE=1 but cannot compile: the C compiler",
        CC=str(tmp_path / "no-such-cc"),
        DEVICEMQ_COMPILE="1",
    )


def test_the_operator_opts_out(setuptools_path: Path, source: Path, tmp_path: Path) -> None:
    built = _pip_wheel(setuptools_path, source, tmp_path / "out", DEVICEMQ_COMPILE="0")
    said = built.stdout + built.stderr
    assert built.returncode == 0, said[-3000:]
    assert "DEVICEMQ_COMPILE=0: the pure Python, not compiled" in said
    _pure_wheel(tmp_path / "out")


def test_a_value_it_does_not_know_stops_the_build(
    setuptools_path: Path, source: Path, tmp_path: Path
) -> None:
    _refused(
        setuptools_path,
        source,
        tmp_path,
        "DEVICEMQ_COMPILE='yes': use auto, 0 (pure Python) or 1",
        DEVICEMQ_COMPILE="yes",
    )


def test_an_optimisation_level_it_does_not_know_stops_the_build(
    setuptools_path: Path, source: Path, tmp_path: Path
) -> None:
    _refused(
        setuptools_path,
        source,
        tmp_path,
        "DEVICEMQ_COMPILE_OPT_LEVEL='fast': use 0, 1, 2 or 3",
        DEVICEMQ_COMPILE="1",
        DEVICEMQ_COMPILE_OPT_LEVEL="fast",
    )


def test_an_editable_install_never_compiles(
    setuptools_path: Path, source: Path, tmp_path: Path
) -> None:
    """``pip install -e .`` builds this way (PEP 660): setuptools would build the
    extensions in place, a .so beside each .py hiding every later edit."""
    out = tmp_path / "out"
    out.mkdir()
    program = (
        "import sys; from setuptools import build_meta; "
        "print(build_meta.build_editable(sys.argv[1]))"
    )
    built = subprocess.run(
        [sys.executable, "-c", program, str(out)],
        cwd=source,
        env=_env(
            setuptools_path, DEVICEMQ_COMPILE="1"
        ),  # even when asked to: an editable install cannot be
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    assert "compiling" not in built.stderr
    (wheel,) = out.glob("devicemq-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert _extensions(archive.namelist()) == []
    in_tree = [str(p) for p in source.rglob("*") if p.name.endswith(tuple(EXTENSION_SUFFIXES))]
    assert in_tree == []


def test_the_image_is_built_compiled() -> None:
    """The Dockerfile's build stage has a C compiler, its context setup.py, and
    its wheel compiles where it can, the build argument DEVICEMQ_COMPILE=1
    making it a must (not built here: no Docker engine in CI)."""
    build_stage = (REPO / "Dockerfile").read_text(encoding="utf-8").split("\nFROM ")[1]
    assert "apt-get install -y --no-install-recommends gcc" in build_stage
    assert "ARG DEVICEMQ_COMPILE=auto" in build_stage
    assert 'DEVICEMQ_COMPILE="$DEVICEMQ_COMPILE" pip wheel' in build_stage
    assert "setup.py" in context_files(REPO)
