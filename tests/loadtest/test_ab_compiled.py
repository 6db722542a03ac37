"""loadtest/ab/compiled.py without compiling: its list, its copy of the tree, its
refusals. (.ci/run compiles for real and runs tests/unit on the copy.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

from loadtest.ab.compiled import MODULES, copy_tree, main, not_compiled

ROOT = Path(__file__).resolve().parents[2]


def test_every_listed_module_is_a_source_file_of_the_tree() -> None:
    assert len(set(MODULES)) == len(MODULES)
    for name in MODULES:
        assert (ROOT / name).is_file(), name
    # Python subclasses these modules' classes; compiled, they could not (see the docstring).
    assert "broker/session.py" not in MODULES


def test_the_copy_holds_the_tracked_files_as_on_disk(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "broker").mkdir(parents=True)
    (repo / "broker" / "core.py").write_text("committed\n")
    (repo / ".gitignore").write_text("build/\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    (repo / "broker" / "core.py").write_text("edited, not committed\n")
    (repo / "untracked.py").write_text("")
    (repo / "build").mkdir()
    (repo / "build" / "old.so").write_text("")
    dest = tmp_path / "copy"
    dest.mkdir()
    (dest / "stale.so").write_text("")  # emptied first
    copy_tree(repo, dest)
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert files == [".gitignore", "broker/core.py"]
    assert (dest / "broker" / "core.py").read_text() == "edited, not committed\n"


def test_a_pure_tree_is_not_taken_for_a_compiled_one(tmp_path: Path) -> None:
    why = not_compiled(ROOT)
    assert why is not None and "not compiled there" in why
    assert not_compiled(tmp_path) is not None  # imports nothing from there


def test_the_copy_may_not_replace_the_tree(tmp_path: Path) -> None:
    assert main([str(tmp_path), "--out", str(tmp_path)]) == 2
    assert main([str(tmp_path / "a" / "b"), "--out", str(tmp_path / "a")]) == 2
