"""The documents a reader walks: README.md as the front door, docs/ behind it.

Every relative link of README.md, docs/*.md and BENCHMARKS.md resolves to a
file of the repository and, with ``#anchor``, to a heading of it (GitHub's
anchors); README stays short and links the architecture; every subcommand of
the ``devicemq`` command (its subparsers and the choices of its positional
arguments, walked from app/cli.py's parser) is named in the CLI's own help and
in README's "Command line".
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from app import cli

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([REPO / "README.md", REPO / "BENCHMARKS.md", *(REPO / "docs").glob("*.md")])

FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where links are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text: lower case, what is
    neither a word character, a hyphen nor a space dropped, spaces made hyphens; a
    repeated one gets -1, -2, ..."""
    found: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link's text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def broken_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}: {target}"
        if not linked.exists() or REPO not in (linked, *linked.parents):
            problems.append(f"{where}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            problems.append(f"{where}: no heading with that anchor")
    return problems


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\n## What is guaranteed, and what is not\n\n## A\n")
    page = docs / "b.md"
    page.write_text(
        "[ok](a.md#what-is-guaranteed-and-what-is-not) [again](a.md#a-1) [web](https://x.y/z)\n"
        "[gone](missing.md) [no anchor](a.md#nothing) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert broken_links(page) == [
            "docs/b.md: missing.md: no such file",
            "docs/b.md: a.md#nothing: no heading with that anchor",
        ]
    finally:
        REPO = saved


def test_anchors_follow_github() -> None:
    text = (
        "# devicemq\n## Device queues: the exclusive compacted queue ($ECQ)\n"
        "## One command for all of them: `devicemq run --workers N`\n"
        "## Comparing speed with another revision (A/B)\n## Metrics\n## Metrics\n"
    )
    assert anchors(text) == {
        "devicemq",
        "device-queues-the-exclusive-compacted-queue-ecq",
        "one-command-for-all-of-them-devicemq-run---workers-n",
        "comparing-speed-with-another-revision-ab",
        "metrics",
        "metrics-1",
    }


def test_readme_is_a_short_front_door() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 450
    assert "](docs/ARCHITECTURE.md)" in readme
    contents = readme.split("## Contents\n", 1)[1].split("\n## ", 1)[0]
    sections = anchors("\n".join(re.findall(r"^## .*$", readme, re.MULTILINE)))
    listed = set(re.findall(r"\]\(#([^)]+)\)", contents))
    assert sections - {"contents"} <= listed


# --------------------------------------------------------------------------
# The command line: its help and README's synopsis name every subcommand
# --------------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser) -> set[str]:
    """What a ``devicemq COMMAND`` takes next: its subparsers' names, or the choices
    of its positional arguments (loadtest's scenarios, services' actions, ...)."""
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names |= set(action.choices)
        elif not action.option_strings and action.choices is not None:
            names |= {str(choice) for choice in action.choices}
    return names


def commands() -> dict[str, tuple[str, set[str]]]:
    """Each command of ``devicemq``: its one-line help and its subcommands."""
    (top,) = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help or "" for choice in top._choices_actions}
    return {name: (helps[name], subcommands(p)) for name, p in top.choices.items()}


def named_in(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_the_cli_help_names_every_subcommand() -> None:
    """``devicemq --help`` shows one line per command: it names what the command
    takes (it named no loadtest scenario but p2p, fan-in, fan-out, nor sessions'
    messages and rewind)."""
    missing = [
        f"{name} {sub}"
        for name, (line, subs) in commands().items()
        for sub in sorted(subs)
        if not named_in(line, sub)
    ]
    assert missing == []


def test_readmes_command_line_names_every_command_and_subcommand() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Command line\n", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        words = line.split(maxsplit=2)
        if len(words) >= 2 and words[0] == "devicemq":
            rows[words[1]] = rows.get(words[1], "") + " " + (words[2] if len(words) > 2 else "")
    missing = []
    for name, (_line, subs) in commands().items():
        if name not in rows:
            missing.append(name)
            continue
        missing += [f"{name} {sub}" for sub in sorted(subs) if not named_in(rows[name], sub)]
    assert missing == []


def test_the_old_name_of_the_group_queue_scenario_still_runs_it() -> None:
    parser = argparse.ArgumentParser()
    from loadtest.cli import add_arguments

    add_arguments(parser)
    assert parser.parse_args(["shared-queue"]).scenario == "group-queue"
    assert parser.parse_args(["group-queue"]).scenario == "group-queue"
    with pytest.raises(SystemExit):
        parser.parse_args(["shared"])
