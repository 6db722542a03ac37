"""The Docker image's build, without Docker: the wheel built from the build context.

The Dockerfile's build stage runs ``pip wheel .`` on what ``.dockerignore`` lets
into the context, and its runtime stage installs that wheel and runs
``python -c "import uvloop, prometheus_client, app.serve"``. Here the same
context (``tests/deploy/dockerignore.py`` applies the ``.dockerignore`` rules to
a copy of the tree) is built by ``pip wheel --no-deps`` (with build isolation,
as in the image: the venv's own setuptools, 65.5 here, is older than
pyproject.toml's ``setuptools>=68``, so pip fetches setuptools from the package
index or its cache, as ``.ci/run``'s own ``pip install`` does), installed with
``pip install --no-deps --target``, and its ``devicemq`` console script and the
Dockerfile's import line are run from it.
The dependencies come from the test's own environment; they are PyPI wheels the
image installs unchanged.

Issue 40: with 282301f's ``.dockerignore`` (``app/`` not re-included) the wheel
had no ``app`` package and ``docker compose up --build`` failed at that step.

Not the real image: Debian has a daemonless builder here (``buildah``, also
``podman``; ``apt-cache policy buildah``), but the image starts ``FROM
python:3.11-slim``, which only a container registry serves, and this CI
reaches none. What the image adds over this test is the base image, the
``useradd`` and the admin token's directory.
"""

from __future__ import annotations

import configparser
import fnmatch
import os
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO
from tests.deploy.dockerignore import DockerIgnore, context_files, copy_context

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
BUILD_TIMEOUT = 180
PIP_INSTALL = (sys.executable, "-m", "pip", "install", "--no-deps", "--no-index")


def _packages_in_tree(root: Path) -> set[str]:
    """The packages pyproject.toml's package discovery finds in ``root``."""
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set()
    for init in root.rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(root).parts)
        if package and any(fnmatch.fnmatchcase(package, p) for p in include):
            found.add(package)
    return found


def _package_data_in_tree(root: Path) -> set[str]:
    """The files pyproject.toml's package-data globs name in ``root``."""
    files = set()
    for package, globs in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        base = root.joinpath(*package.split("."))
        for pattern in globs:
            files |= {p.relative_to(root).as_posix() for p in base.glob(pattern) if p.is_file()}
    return files


def _dockerfile_import_check() -> str:
    """The ``python -c "..."`` the Dockerfile's runtime stage runs on the installed wheel."""
    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    match = re.search(r'python -c "(import [^"]+)"', text)
    assert match, "the Dockerfile no longer checks its imports with python -c"
    return match.group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``pip wheel`` builds from the Docker build context of the tree."""
    tmp = tmp_path_factory.mktemp("image-build")
    context = tmp / "context"
    copy_context(REPO, context)
    assert (context / "pyproject.toml").exists(), "pyproject.toml not in the build context"
    out = tmp / "wheels"
    # Not compiled here (minutes): .ci/run's "mypyc build" step builds the
    # compiled wheel; tests/deploy/test_wheel_compile.py the cases that are not.
    env = {**os.environ, "DEVICEMQ_COMPILE": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), "."],
        cwd=context,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = out.glob("devicemq-*.whl")
    return built


def test_the_build_context_holds_every_package_and_its_data() -> None:
    """Every package and package-data file of the tree is in the Docker build context."""
    sent = set(context_files(REPO))
    for package in sorted(_packages_in_tree(REPO)):
        init = package.replace(".", "/") + "/__init__.py"
        assert init in sent, f".dockerignore leaves {package} out of the image"
    missing = sorted(_package_data_in_tree(REPO) - sent)
    assert not missing, f".dockerignore leaves package data out: {missing}"
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in sent)
    assert not any(f.startswith((".git/", ".venv/", "tests/")) for f in sent)


def test_the_wheel_holds_every_package_and_its_data(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = configparser.ConfigParser()
        scripts.read_string(archive.read(entry_points).decode())
    for package in sorted(_packages_in_tree(REPO)):
        init = package.replace(".", "/") + "/__init__.py"
        assert init in names, f"the image's wheel has no {package} package"
    missing = sorted(_package_data_in_tree(REPO) - names)
    assert not missing, f"the image's wheel lacks package data: {missing}"
    target = scripts["console_scripts"]["devicemq"]
    assert target == PYPROJECT["project"]["scripts"]["devicemq"] == "app.cli:main"
    module = target.split(":")[0].replace(".", "/") + ".py"
    assert module in names, f"the devicemq console script's {module} is not in the wheel"


def test_the_installed_wheel_runs_the_console_script_and_the_dockerfile_check(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [*PIP_INSTALL, "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The installed copy first on the path, the checkout nowhere (an editable
    # install of it would otherwise hide a package the wheel lacks: each module's
    # file is checked below).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEVICEMQ_", "PYTHON"))}
    env["PYTHONPATH"] = str(site)
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()

    script = site / "bin" / "devicemq"
    assert script.exists(), "pip installed no devicemq console script"
    shown = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "usage: devicemq" in shown.stdout

    check = _dockerfile_import_check()
    modules = [m.strip() for m in check.removeprefix("import ").split(",")]
    ours = [m for m in modules if m.split(".")[0] in _top_level_packages()]
    assert "app.serve" in ours
    where = "; ".join(f"print({m}.__file__)" for m in [*ours, "app.cli"])
    program = f"{check}; import app.cli; {where}; app.cli.main"
    ran = subprocess.run(
        [sys.executable, "-c", program],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, f"python -c {shlex.quote(check)}:\n{ran.stderr[-3000:]}"
    for module, path in zip([*ours, "app.cli"], ran.stdout.split(), strict=True):
        assert Path(path).is_relative_to(site), f"{module} imported from {path}, not the wheel"


def _top_level_packages() -> set[str]:
    return {p.split(".")[0] for p in _packages_in_tree(REPO)}


# ---------------------------------------------------------------- the matcher


@pytest.mark.parametrize(
    ("pattern", "path", "excluded"),
    [
        ("*", "README.md", True),
        ("*", "broker/core.py", True),  # through its parent directory
        ("*.md", "docs/x.md", False),  # "*" does not cross "/"
        ("docs/*.md", "docs/x.md", True),
        ("**/*.pyc", "a.pyc", True),  # "**/" is zero directories too
        ("**/*.pyc", "a/b/c.pyc", True),
        ("**/__pycache__", "app/__pycache__/cli.cpython-311.pyc", True),
        ("/broker/", "broker/core.py", True),  # leading and trailing "/" dropped
        ("br?ker", "broker", True),
        ("b[a-r]oker", "broker", True),
        ("a/**", "a/b/c", True),
        ("a/**/c", "a/c", True),
        ("a/**/c", "a/b/d/c", True),
        ("# a comment", "# a comment", False),
    ],
)
def test_dockerignore_patterns(pattern: str, path: str, excluded: bool) -> None:
    assert DockerIgnore(pattern).excluded(path) is excluded


def test_dockerignore_exceptions_and_the_last_match_wins() -> None:
    rules = DockerIgnore("*\n!broker/\n!README.md\n**/__pycache__\n")
    assert not rules.excluded("broker/core.py")
    assert not rules.excluded("README.md")
    assert rules.excluded("broker/__pycache__/core.pyc")
    assert rules.excluded("app/cli.py")
    assert not rules.may_hold_exceptions("app")
    deep = DockerIgnore("*\n!persistence/lua/*.lua\n")  # the walk enters persistence/
    assert deep.may_hold_exceptions("persistence") and not deep.excluded("persistence/lua/a.lua")
    assert deep.excluded("persistence/store.py")
    again = DockerIgnore("!broker\n*\n")  # an exception before the pattern it excepts
    assert again.excluded("broker/core.py")
    with pytest.raises(ValueError, match="illegal exclusion"):
        DockerIgnore("!\n")


def test_282301fs_dockerignore_left_app_out(tmp_path: Path) -> None:
    """The regression, on the matcher: 282301f's rules keep broker/ but not app/."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "cli.py").write_text("")
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "core.py").write_text("")
    (tmp_path / ".dockerignore").write_text(
        "*\n!pyproject.toml\n!README.md\n!broker/\n!persistence/\n!pipeline/\n!loadtest/\n"
        "**/__pycache__\n**/*.pyc\n"
    )
    assert context_files(tmp_path) == ["broker/core.py"]
