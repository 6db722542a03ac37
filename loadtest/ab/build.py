"""A revision built once: its files, and a venv whose Python imports them first.

``build(repo, "bfd873c")`` resolves the revision to its full sha and keeps, in
``<cache>/<sha>/`` (``$DEVICEMQ_AB_CACHE``, else ``$XDG_CACHE_HOME/devicemq-ab``,
else ``~/.cache/devicemq-ab``):

- ``tree/``: the revision's files (``git archive``: an export, not a
  registered worktree, so that deleting the cache leaves nothing behind in the
  repository);
- ``venv/``: ``python -m venv --without-pip`` of the running interpreter, with
  one ``.pth`` file that puts ``tree/`` on ``sys.path`` and then adds the
  running environment's site-packages: the revision runs against the very
  dependencies the head uses (the same packages, so a comparison measures the
  code, not a library upgrade). This takes well under a second; a venv with
  pip and ``pip install --no-deps -e`` took 22 s here and needs setuptools
  from the network for its build isolation;
- ``built.json``: written last; a cache without it, or whose record does not
  match this interpreter and this recipe, or whose Python does not import the
  tree, is rebuilt.

A revision runs as pure Python from its files. :func:`compiled` makes a copy of
a tree (a revision's or the working tree) with the hot modules compiled by
mypyc (``loadtest.ab.compiled``), run by this interpreter with ``PYTHONPATH``
set to it: a revision's is kept in ``<cache>/<sha>.mypyc/``, the working
tree's is made again each time in ``<cache>/working-tree.mypyc/``.

The revision's own entry point (``[project.scripts] devicemq`` of its
pyproject.toml: ``broker.cli:main`` in November 2026, ``app.cli:main`` later)
is what :meth:`Tree.command` runs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuildError", "Tree", "build", "cache_root", "compiled", "resolve", "working_tree"]

# Bump when what a build produces changes: caches of an older recipe are rebuilt.
RECIPE = 1
CACHE_ENV = "DEVICEMQ_AB_CACHE"
_PTH = "devicemq-ab.pth"


class BuildError(RuntimeError):
    """A revision could not be resolved or built."""


@dataclass(frozen=True)
class Tree:
    """A source tree of devicemq and the Python that runs it."""

    label: str  # for people: "bfd873c", "working tree /work/x (HEAD 282301f, modified)"
    root: Path
    python: str
    pythonpath: str | None  # PYTHONPATH to set; None: cleared (the venv knows its tree)
    entry: str  # "module:function" of the devicemq command
    sha: str | None = None

    def command(self, *args: str) -> list[str]:
        """argv of ``devicemq ARGS...`` of this tree."""
        module, _, function = self.entry.partition(":")
        code = f"import sys; from {module} import {function} as m; sys.exit(m())"
        return [self.python, "-c", code, *args]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of its processes: this one's, without DEVICEMQ_*
        settings (each side gets only those the tool sets) and PYTHONPATH."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("DEVICEMQ_") and k != "PYTHONPATH"
        }
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        env.update(extra or {})
        return env


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "devicemq-ab"


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, check=False, timeout=120
        )
    except FileNotFoundError:
        raise BuildError("git is not installed (the A/B tool checks revisions out)") from None


def resolve(repo: Path, rev: str) -> str:
    """The full sha of commit ``rev`` in ``repo``."""
    done = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if done.returncode != 0:
        raise BuildError(f"{rev!r} is not a commit of the repository at {repo}")
    return done.stdout.decode().strip()


def entry_point(root: Path) -> str:
    """``module:function`` of the tree's ``devicemq`` command."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())
        entry = project["project"]["scripts"]["devicemq"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise BuildError(f"{root}: no [project.scripts] devicemq in pyproject.toml ({e})") from None
    if not isinstance(entry, str) or ":" not in entry:
        raise BuildError(f"{root}: [project.scripts] devicemq is not module:function")
    return entry


def working_tree(root: Path, repo: Path | None = None) -> Tree:
    """A tree as it is on disk (uncommitted changes included), run by this Python."""
    root = root.resolve()
    if not (root / "broker").is_dir():
        raise BuildError(f"{root} is not a devicemq source tree (no broker/)")
    label = f"working tree {root}"
    sha = None
    head = _git(repo or root, "rev-parse", "HEAD")
    if head.returncode == 0:
        sha = head.stdout.decode().strip()
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        changed = dirty.returncode == 0 and dirty.stdout.strip()
        label += f" (HEAD {sha[:7]}{', with uncommitted changes' if changed else ''})"
    return Tree(label, root, sys.executable, str(root), entry_point(root), sha)


def _site_dirs() -> list[str]:
    """Where this interpreter's packages live (a venv's own site-packages, or the
    system's and the user's)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def _record(sha: str) -> dict[str, object]:
    return {
        "recipe": RECIPE,
        "sha": sha,
        "python": sys.executable,
        "version": sys.version,
        "site": _site_dirs(),
    }


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _imports_tree(python: Path, root: Path, entry: str) -> str | None:
    """Why ``python`` does not import the tree's packages from ``root`` (and its
    entry point), or None when it does."""
    module, _, function = entry.partition(":")
    code = (
        f"import broker, {module}; getattr({module}, {function!r}); "
        "import sys; print(broker.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        done = subprocess.run(
            [str(python), "-c", code],
            capture_output=True,
            env=env,
            cwd=root.parent,
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit status {done.returncode}"
    where = done.stdout.decode().strip()
    if not Path(where).resolve().is_relative_to(root.resolve()):
        return f"it imports broker from {where}"
    return None


def _cached(dest: Path, sha: str, label: str) -> tuple[Tree | None, str]:
    """The build in ``dest`` if it is sound, else why not."""
    try:
        record = json.loads((dest / "built.json").read_text())
    except (OSError, ValueError):
        return None, "no built.json"
    if record != _record(sha):
        return None, "built for another interpreter, environment or recipe"
    root, python = dest / "tree", _venv_python(dest / "venv")
    try:
        entry = entry_point(root)
    except BuildError as e:
        return None, str(e)
    why = _imports_tree(python, root, entry)
    if why is not None:
        return None, why
    return Tree(label, root, str(python), None, entry, sha), ""


def _export(repo: Path, sha: str, into: Path) -> None:
    done = _git(repo, "archive", "--format=tar", sha)
    if done.returncode != 0:
        raise BuildError(f"git archive {sha}: {done.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(into, filter="data")


def _make_venv(venv: Path, tree: Path) -> None:
    """A venv of this interpreter without pip, whose one .pth puts ``tree`` first
    and then this interpreter's site-packages (their .pth files included)."""
    done = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True,
        check=False,
        timeout=300,
    )
    if done.returncode != 0:
        raise BuildError(f"python -m venv: {done.stderr.decode(errors='replace').strip()}")
    (own,) = venv.glob("lib/python3*/site-packages")
    lines = [str(tree)] + [f"import site; site.addsitedir({d!r})" for d in _site_dirs()]
    (own / _PTH).write_text("\n".join(lines) + "\n")


def build(repo: Path, rev: str, cache: Path | None = None) -> tuple[Tree, bool]:
    """The tree of ``rev`` and its Python, built into the cache unless a sound build
    is there; also whether it was built now (False: reused)."""
    sha = resolve(repo, rev)
    label = rev if rev.startswith(sha[:7]) else f"{rev} ({sha[:7]})"
    cache = cache or cache_root()
    dest = cache / sha
    tree, _ = _cached(dest, sha, label)
    if tree is not None:
        return tree, False
    cache.mkdir(parents=True, exist_ok=True)
    # Built beside, under a name of its own, then renamed into place: a build cut
    # short leaves no half a cache, and two builds of one sha cannot mix.
    work = cache / f".{sha}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir()
        _export(repo, sha, work / "tree")
        _make_venv(work / "venv", dest / "tree")  # the .pth names the final place
        (work / "built.json").write_text(json.dumps(_record(sha), indent=1) + "\n")
        if dest.exists():
            shutil.rmtree(dest)  # broken or stale (checked above)
        try:
            work.rename(dest)
        except OSError:
            if not dest.exists():
                raise
            # another run built it meanwhile: use that one
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tree, why = _cached(dest, sha, label)
    if tree is None:
        raise BuildError(f"{rev}: built into {dest}, but it does not run: {why}")
    return tree, True


def compiled(tree: Tree, cache: Path | None = None) -> tuple[Tree, bool]:
    """A copy of ``tree`` with its hot modules compiled (``loadtest.ab.compiled``),
    reused from the cache for a revision built before; also whether it was
    compiled now."""
    from loadtest.ab import compiled as mypyc

    cache = cache or cache_root()
    revision = tree.pythonpath is None  # a cached build of a commit (else the working tree)
    dest = cache / (f"{tree.sha}.mypyc" if revision and tree.sha else "working-tree.mypyc")
    stamp = dest / "compiled.json"
    record = {"recipe": RECIPE, "sha": tree.sha, "modules": list(mypyc.MODULES)}
    label = f"{tree.label}, compiled"
    made = Tree(label, dest, sys.executable, str(dest), tree.entry, tree.sha)
    if revision:
        try:
            reusable = json.loads(stamp.read_text()) == record
        except (OSError, ValueError):
            reusable = False
        if reusable and mypyc.not_compiled(dest) is None:
            return made, False
    try:
        if revision:
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(tree.root, dest)
        else:
            mypyc.copy_tree(tree.root, dest)
        mypyc.compile_tree(dest)
    except (mypyc.CompileError, OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{tree.label}: {e}") from None
    stamp.write_text(json.dumps(record) + "\n")
    return made, True
