"""``python -m loadtest.ab --profile`` (loadtest/ab/profile.py): py-spy's raw
stacks folded into the top functions, pure; then py-spy for real, on a tiny
Python process (tests/loadtest/data/py_spy_target.py) and on the head broker
of a short A/B run, where this machine lets it attach."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.ab.cli import main, parser
from loadtest.ab.current import BEGIN, END
from loadtest.ab.plan import Sizes, Timing, make_scenario
from loadtest.ab.profile import (
    BINARY_ENV,
    Profile,
    ProfileRun,
    Recorder,
    attach_problem,
    fold,
    format_profile,
    format_runs,
    py_spy_binary,
    shorten,
    system_attach_problem,
)
from loadtest.ab.summary import RunRecord

DATA = Path(__file__).parent / "data"
TARGET = DATA / "py_spy_target.py"
# handwritten in py-spy's raw format: a;b;c 6 is the stack a -> b -> c, sampled 6 times
RAW = """\
a (app/m.py:1);b (broker/x.py:5);c (broker/y.py:9) 6
a (app/m.py:1);b (broker/x.py:5) 2

a (app/m.py:1);b (broker/x.py:5);e (/usr/lib/python3.11/asyncio/events.py:80);b (broker/x.py:5) 1
a (app/m.py:1);f (broker/x.py:30) 1
"""


def _shares(profile: Profile) -> dict[str, tuple[int, int]]:
    return {f.function: (f.self_samples, f.inclusive_samples) for f in profile.functions}


def test_self_and_inclusive_samples_of_each_function() -> None:
    profile = fold(RAW)
    assert profile.samples == 10
    assert _shares(profile) == {
        "a (app/m.py:1)": (0, 10),
        "b (broker/x.py:5)": (3, 9),  # on a recursive stack once, innermost there too
        "c (broker/y.py:9)": (6, 6),
        "e (asyncio/events.py:80)": (0, 1),  # the standard library's path shortened
        "f (broker/x.py:30)": (1, 1),
    }
    assert [(f.function, f.self_share) for f in profile.top_self()] == [
        ("c (broker/y.py:9)", 0.6),
        ("b (broker/x.py:5)", 0.3),
        ("f (broker/x.py:30)", 0.1),
    ]
    # a starts every stack of its thread: left out of the inclusive ranking
    assert profile.entry == {"a (app/m.py:1)"}
    assert [(f.function, f.inclusive_share) for f in profile.top_inclusive()] == [
        ("b (broker/x.py:5)", 0.9),
        ("c (broker/y.py:9)", 0.6),
        ("e (asyncio/events.py:80)", 0.1),
        ("f (broker/x.py:30)", 0.1),
    ]
    assert [f.function for f in profile.top_inclusive(2)] == [
        "b (broker/x.py:5)",
        "c (broker/y.py:9)",
    ]


def test_a_real_recording_of_two_threads() -> None:
    """The fixture py-spy wrote (its header: py_spy_target.py): the main thread
    was seen in one stack, so none of its frames is left out as an entry; the
    second thread's start (threading's bootstrap, then ``background``) is."""
    profile = fold((DATA / "py-spy-raw.txt").read_text())
    assert profile.samples == 119
    top = profile.top_self()
    assert [(f.function, f.self_samples) for f in top] == [
        ("squares (py_spy_target.py:16)", 61),
        ("sort_back (py_spy_target.py:27)", 32),
        ("sort_back.<locals>.<lambda> (py_spy_target.py:28)", 17),
        ("background (py_spy_target.py:31)", 9),
    ]
    assert sum(f.self_share for f in top) == pytest.approx(1.0)
    assert profile.entry == {
        "Thread._bootstrap (threading.py:988)",
        "Thread._bootstrap_inner (threading.py:1028)",
        "Thread.run (threading.py:971)",
        "background (py_spy_target.py:31)",
    }
    assert [(f.function, f.inclusive_samples) for f in profile.top_inclusive()] == [
        ("<module> (py_spy_target.py:1)", 61),
        ("outer (py_spy_target.py:23)", 61),
        ("squares (py_spy_target.py:16)", 61),
        ("sort_back (py_spy_target.py:27)", 49),
        ("sort_back.<locals>.<lambda> (py_spy_target.py:28)", 17),
    ]


def test_files_are_shortened_to_the_tree_or_the_package() -> None:
    assert shorten("pump (/work/x/broker/outflow.py:7)", ["/work/x"]) == (
        "pump (broker/outflow.py:7)"
    )
    assert shorten("pump (/work/x/broker/outflow.py:7)", [Path("/work/x/")]) == (
        "pump (broker/outflow.py:7)"
    )
    assert shorten("send (/v/lib/python3.11/site-packages/redis/client.py:3)") == (
        "send (redis/client.py:3)"
    )
    assert shorten("run (/usr/lib/python3.11/asyncio/runners.py:86)") == (
        "run (asyncio/runners.py:86)"
    )
    assert shorten("<module> (<string>:1)") == "<module> (<string>:1)"
    assert shorten("pump (broker/outflow.py:7)", ["/work/x"]) == "pump (broker/outflow.py:7)"
    assert shorten("a frame of another shape") == "a frame of another shape"


def test_a_line_of_another_shape_is_an_error() -> None:
    with pytest.raises(ValueError, match=re.escape("line 2: not 'frame;frame;... COUNT'")):
        fold("a (m.py:1) 3\na (m.py:1);b (m.py:2)\n")
    assert fold("").samples == 0


def test_the_tables_markdown_and_text() -> None:
    profile = fold(RAW)
    markdown = format_profile(profile, "**title**", n=2, markdown=True)
    assert markdown == (
        "**title**\n\n"
        "| top 2 by self samples | self | inclusive |\n|---|---:|---:|\n"
        "| `c (broker/y.py:9)` | 60.0% | 60.0% |\n"
        "| `b (broker/x.py:5)` | 30.0% | 90.0% |\n\n"
        "| top 2 by inclusive samples, entry frames left out | self | inclusive |\n"
        "|---|---:|---:|\n"
        "| `b (broker/x.py:5)` | 30.0% | 90.0% |\n"
        "| `c (broker/y.py:9)` | 60.0% | 60.0% |\n"
    )
    text = format_profile(profile, "title", n=1).splitlines()
    assert text[2].split() == ["top", "1", "by", "self", "samples", "self", "inclusive"]
    assert text[3].split() == ["c", "(broker/y.py:9)", "60.0%", "60.0%"]


def test_each_scenarios_profile_or_why_it_has_none() -> None:
    sizes, timing = Sizes(), Timing()
    memory = make_scenario("p2p-memory", sizes, timing)
    persistent = make_scenario("p2p-persistent", sizes, timing)
    runs = [
        ProfileRun(memory, RunRecord(2, memory.name, "head", delivered=30_000.0), 10, fold(RAW)),
        ProfileRun(persistent, RunRecord(2, persistent.name, "head"), 10, None, "py-spy failed"),
    ]
    text = format_runs(runs, "0.4.3", markdown=True)
    assert text.startswith(
        "Profile of the head broker (py-spy 0.4.3 at 100 Hz over 10 s of the measured window "
    )
    assert "the broker's process only" in text
    assert "**p2p 200 pairs, clean**: 10 samples; that run: 30,000 msg/s\n\n" in text
    assert "| `c (broker/y.py:9)` | 60.0% | 60.0% |" in text
    assert text.endswith("**p2p 100 pairs, persistent**: no profile: py-spy failed\n")


def test_whether_py_spy_may_attach() -> None:
    ptrace = 1 << 19
    assert attach_problem(None, 0, ptrace) == (
        f"py-spy not found (pip install -e '.[loadtest]', or set ${BINARY_ENV})"
    )
    assert attach_problem("py-spy", None, None) is None  # no Yama
    assert attach_problem("py-spy", 0, 0) is None
    assert attach_problem("py-spy", 1, ptrace) is None
    assert attach_problem("py-spy", 2, ptrace | 1) is None
    problem = attach_problem("py-spy", 1, ptrace - 1)  # every capability below it
    assert problem is not None and "ptrace_scope is 1" in problem
    assert "CAP_SYS_PTRACE" in problem
    assert attach_problem("py-spy", 2, None) is not None
    problem = attach_problem("py-spy", 3, ptrace)
    assert problem is not None and "ptrace_scope is 3" in problem


def test_profile_takes_optional_seconds() -> None:
    base = ["--base", "main"]
    assert parser().parse_args(base).profile is None
    assert parser().parse_args([*base, "--profile"]).profile == 0  # the whole window
    assert parser().parse_args([*base, "--profile", "3", "--rounds", "1"]).profile == 3
    with pytest.raises(SystemExit):
        parser().parse_args([*base, "--profile", "0"])


def test_profile_scenario_needs_profile_and_a_scenario_that_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    usage = "--profile-scenario: give --profile, and only scenarios that run (--scenario)"
    assert main(["--base=HEAD", "--profile-scenario=p2p-memory"]) == 2
    assert usage in capsys.readouterr().err
    assert main(["--base=HEAD", "--scenario=fan-out", "--profile", "--profile-scenario=fleet"]) == 2
    assert usage in capsys.readouterr().err


# ---------------------------------------------------------------- py-spy for real


def _needs_py_spy() -> str:
    binary = py_spy_binary()
    if binary is None:
        pytest.skip(f"py-spy not found: none beside {sys.executable} nor on PATH")
    return binary


def _needs_attach() -> str:
    binary = _needs_py_spy()
    problem = system_attach_problem()
    if problem:
        pytest.skip(f"py-spy cannot attach to another process here: {problem}")
    return binary


@pytest.fixture
def target() -> Iterator[subprocess.Popen[str]]:
    """py_spy_target.py for 30 s, at work (it said "ready")."""
    proc = subprocess.Popen(
        [sys.executable, str(TARGET), "30"], stdout=subprocess.PIPE, text=True, cwd=DATA
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _line_of(text: str) -> int:
    return next(
        n for n, line in enumerate(TARGET.read_text().splitlines(), 1) if line.startswith(text)
    )


@pytest.mark.timeout(60)
def test_py_spy_records_a_running_python_process(
    tmp_path: Path, target: subprocess.Popen[str]
) -> None:
    recorder = Recorder(_needs_attach(), tmp_path / "raw.txt", [DATA])
    recorder.start(target.pid, 1)
    profile = recorder.finish()
    assert profile is not None, recorder.problem
    assert recorder.result is profile and recorder.problem is None
    assert profile.samples >= 20  # 100 Hz for a second, two busy threads, a loaded machine
    names = {f.function for f in profile.functions}
    squares = f"squares (py_spy_target.py:{_line_of('def squares')})"  # --function: its def
    assert squares in names
    assert f"sort_back (py_spy_target.py:{_line_of('def sort_back')})" in names
    assert squares in [f.function for f in profile.top_self(3)]


@pytest.mark.timeout(60)
def test_a_recording_py_spy_cannot_make_says_why(tmp_path: Path) -> None:
    """py-spy refuses a process that is no Python (or one it may not read):
    no profile, and py-spy's own last line as the reason."""
    recorder = Recorder(_needs_py_spy(), tmp_path / "raw.txt")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        recorder.start(sleeper.pid, 1)
        assert recorder.finish() is None
    finally:
        sleeper.kill()
        sleeper.wait(10)
    assert recorder.problem is not None and recorder.problem.startswith("py-spy failed (")
    assert recorder.result is None


def _ab(tmp_path: Path, *more: str) -> list[str]:
    (tmp_path / "B.md").write_text(f"# Benchmarks\n\n{BEGIN}\nold\n{END}\n\nthe log\n")
    return [
        "--base=HEAD",
        "--scenario=p2p-memory",
        "--memory-pairs=3",
        "--rounds=1",
        "--warmup=1",
        f"--cache-dir={tmp_path / 'cache'}",
        f"--workdir={tmp_path / 'work'}",
        f"--json={tmp_path / 'ab.json'}",
        f"--current-table={tmp_path / 'B.md'}",
        "--quiet",
        *more,
    ]


@pytest.mark.timeout(150)
def test_an_ab_run_profiles_the_head_broker_below_the_goals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _needs_attach()
    code = main(_ab(tmp_path, "--duration=2", "--profile"))
    printed = capsys.readouterr().out
    assert code in (0, 3), printed  # 3: a ratio flagged, which this test does not judge
    document = json.loads((tmp_path / "ab.json").read_text())
    # the profiled run is one more, not among the counted ones
    assert [(r["side"], r["round"]) for r in document["runs"]] == [("base", 0), ("head", 0)]
    profiled = document["profile"]["scenarios"]["p2p-memory"]
    assert profiled["problem"] is None and profiled["seconds"] == 2
    assert profiled["run"]["side"] == "head" and profiled["run"]["ok"]
    assert profiled["samples"] > 0
    functions = [f["function"] for f in profiled["top_self"] + profiled["top_inclusive"]]
    assert 0 < len(profiled["top_self"]) <= 10 and 0 < len(profiled["top_inclusive"]) <= 10
    # the broker's own modules, named relative to the tree; no absolute path
    assert any("(broker/" in f for f in functions), functions
    assert not any(" (/" in f for f in functions), functions
    assert "profile: py-spy " in printed and "top 10 by self samples" in printed
    written = (tmp_path / "B.md").read_text()
    block = written[written.index(BEGIN) : written.index(END)]
    assert block.index("| goal |") < block.index("Profile of the head broker (py-spy ")
    assert "| top 10 by self samples | self | inclusive |" in block
    assert written.endswith(f"{END}\n\nthe log\n")


@pytest.mark.timeout(150)
def test_an_ab_run_whose_py_spy_fails_goes_on_without_a_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$DEVICEMQ_AB_PY_SPY`` names a program that exits 1 at once, as py-spy
    does when it may not attach: the runs and the table are made all the same.
    Of two scenarios, ``--profile-scenario`` picks the one profiled."""
    monkeypatch.setenv(BINARY_ENV, "/bin/false")
    more = ["--duration=1", "--scenario=fan-out", "--fan-out=1x2", "--profile"]
    code = main(_ab(tmp_path, *more, "--profile-scenario=fan-out"))
    printed = capsys.readouterr().out
    assert code in (0, 3), printed
    document = json.loads((tmp_path / "ab.json").read_text())
    assert all(r["ok"] for r in document["runs"]) and len(document["runs"]) == 4
    assert list(document["profile"]["scenarios"]) == ["fan-out"]
    profiled = document["profile"]["scenarios"]["fan-out"]
    assert profiled["problem"] == "py-spy failed (1): no output"
    assert profiled["run"]["ok"] and profiled["run"]["delivered"] > 0
    assert "**fan-out 1x2, clean**: no profile: py-spy failed (1): no output" in (
        (tmp_path / "B.md").read_text()
    )
    assert "fan-out 1x2, clean: no profile: py-spy failed (1)" in printed
