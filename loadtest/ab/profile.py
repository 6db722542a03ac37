"""``--profile``: where the head broker spends its CPU, sampled by py-spy.

After the rounds, the tool runs each scenario once more on a fresh head broker
(not counted in the medians: the sampler pauses the broker a hundred times a
second and takes CPU of its own on a machine the loader shares) and records
that broker's process with py-spy for the measured window::

    py-spy record -p PID -d SECONDS -r 100 --function --format raw -o FILE

The broker's process only: with persistence, the embedded Redis and Kafka
(Tansu) that ``devicemq run`` starts are processes of their own, not sampled.
``raw`` is one line per distinct stack, its frames root first, ``;`` between
them, and its sample count::

    <module> (<string>:1);main (app/cli.py:416);Outflow.pump (broker/outflow.py:347) 37

``--function`` names a frame by its function's first line, so one function is
one name. :func:`fold` turns that into each function's self samples (it was
the innermost frame) and inclusive samples (it was anywhere on the stack, a
recursion counted once), as shares of the samples; pure. py-spy leaves out
samples where the broker waited (no ``--idle``): the shares are of its busy
time.

py-spy reads another process's memory: that takes ptrace permission. Where it
is missing (:func:`attach_problem`: Yama's ``kernel.yama.ptrace_scope`` at 1
or 2 without ``CAP_SYS_PTRACE``, as for a non-root user on Ubuntu; at 3
nobody), or py-spy is not installed, or it fails, the tool says why in one
line and goes on without the profile.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.ab.plan import Scenario
from loadtest.ab.summary import RunRecord

__all__ = [
    "RATE",
    "FunctionShare",
    "Profile",
    "ProfileRun",
    "Recorder",
    "attach_problem",
    "fold",
    "format_profile",
    "format_runs",
    "py_spy_binary",
    "py_spy_version",
    "shorten",
    "system_attach_problem",
]

RATE = 100  # samples a second
BINARY_ENV = "DEVICEMQ_AB_PY_SPY"  # the py-spy to run, if not this venv's or PATH's
TOP = 10
CAP_SYS_PTRACE = 19  # bit of CapEff in /proc/PID/status
YAMA = Path("/proc/sys/kernel/yama/ptrace_scope")
# what comes before a module's package path in a file name py-spy did not shorten
_PREFIXES = (re.compile(r".*/(?:site|dist)-packages/"), re.compile(r".*/lib/python3\.\d+/"))
_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>.*):(?P<line>\d+)\)$")


@dataclass(frozen=True)
class FunctionShare:
    function: str  # as py-spy names it, its file shortened: "Outflow.pump (broker/outflow.py:347)"
    self_samples: int
    inclusive_samples: int
    samples: int  # of the whole profile

    @property
    def self_share(self) -> float:
        return self.self_samples / self.samples if self.samples else 0.0

    @property
    def inclusive_share(self) -> float:
        return self.inclusive_samples / self.samples if self.samples else 0.0


@dataclass(frozen=True)
class Profile:
    samples: int
    functions: tuple[FunctionShare, ...]  # every function seen, in no particular order
    # the frames every stack of a thread starts with where its stacks are more
    # than one (the process's entry, the event loop's run): on all of that
    # thread's samples, they rank no function
    entry: frozenset[str] = frozenset()

    def top_self(self, n: int = TOP) -> list[FunctionShare]:
        """The ``n`` functions with the most self samples (ties: by name)."""
        ranked = sorted(self.functions, key=lambda f: (-f.self_samples, f.function))
        return [f for f in ranked if f.self_samples][:n]

    def top_inclusive(self, n: int = TOP) -> list[FunctionShare]:
        """The ``n`` functions on the most stacks, :attr:`entry` frames left out
        (ties: by name)."""
        ranked = sorted(self.functions, key=lambda f: (-f.inclusive_samples, f.function))
        return [f for f in ranked if f.function not in self.entry][:n]


def shorten(frame: str, roots: Sequence[str | Path] = ()) -> str:
    """``frame`` (``name (file:line)``) with its file relative to the first of
    ``roots`` it lies in (a source tree: ``broker/outflow.py``), else after
    ``site-packages/`` or ``lib/python3.X/`` (``asyncio/events.py``); py-spy
    shortens most files so already. A frame of another shape is kept as is."""
    match = _FRAME.match(frame)
    if match is None:
        return frame
    file = match["file"]
    for root in roots:
        prefix = str(root).rstrip("/") + "/"
        if file.startswith(prefix):
            file = file[len(prefix) :]
            break
    else:
        for pattern in _PREFIXES:
            file = pattern.sub("", file, count=1)
    return f"{match['name']} ({file}:{match['line']})"


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def fold(raw: str, roots: Sequence[str | Path] = ()) -> Profile:
    """py-spy's raw output (collapsed stacks: ``frame;frame;... COUNT`` a line)
    as each function's self and inclusive samples; ValueError on a line of
    another shape. Files are shortened by :func:`shorten`."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    common: dict[str, list[str]] = {}  # a stack's first frame -> what all such stacks share
    stacks: Counter[str] = Counter()  # a first frame -> how many distinct stacks start so
    total = 0
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"line {number}: not 'frame;frame;... COUNT': {line[:120]!r}")
        samples = int(count)
        frames = [shorten(f, roots) for f in stack.split(";")]
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            anywhere[frame] += samples
        common[frames[0]] = _common_prefix(common.get(frames[0], frames), frames)
        stacks[frames[0]] += 1
    functions = tuple(
        FunctionShare(name, own[name], anywhere[name], total) for name in sorted(anywhere)
    )
    # a thread seen in one stack only has no entry apart from its work: none left out
    entry = frozenset(f for root, shared in common.items() if stacks[root] > 1 for f in shared)
    return Profile(total, functions, entry)


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def format_profile(profile: Profile, title: str, n: int = TOP, markdown: bool = False) -> str:
    """The top ``n`` by self samples, then the top ``n`` by inclusive samples,
    each with both shares; ``title`` above them (a Markdown paragraph, or a line)."""
    blocks = [title]
    for heading, rows in (
        (f"top {n} by self samples", profile.top_self(n)),
        (f"top {n} by inclusive samples, entry frames left out", profile.top_inclusive(n)),
    ):
        if markdown:
            lines = [f"| {heading} | self | inclusive |", "|---|---:|---:|"]
            lines += [
                f"| `{f.function}` | {_pct(f.self_share)} | {_pct(f.inclusive_share)} |"
                for f in rows
            ]
        else:
            width = max([len(heading), *(len(f.function) for f in rows)])
            lines = [f"{heading:<{width}}    self  inclusive"]
            lines += [
                f"{f.function:<{width}}  {_pct(f.self_share):>6}  {_pct(f.inclusive_share):>9}"
                for f in rows
            ]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


@dataclass(frozen=True)
class ProfileRun:
    """The profiled run of one scenario: its numbers (not counted) and profile,
    or why there is none."""

    scenario: Scenario
    record: RunRecord
    seconds: int
    profile: Profile | None
    problem: str | None = None


ABOUT = (
    "py-spy {version}at {rate} Hz over {what} of the measured window of one more head run per "
    "scenario, not counted above; the broker's process only (the embedded Redis and Kafka of "
    "a persistent run are processes of their own); shares of the samples where it was busy"
)


def format_runs(
    runs: Sequence[ProfileRun], version: str = "", n: int = TOP, markdown: bool = False
) -> str:
    """Every scenario's profile (or why it has none) under one line saying how
    they were taken; ``version``: py-spy's, if known."""
    seconds = sorted({run.seconds for run in runs})
    what = " or ".join(f"{s} s" for s in seconds) or "-"
    about = ABOUT.format(version=f"{version} " if version else "", rate=RATE, what=what)
    blocks = [f"Profile of the head broker ({about}):" if markdown else f"profile: {about}"]
    for run in runs:
        name = f"**{run.scenario.title}**" if markdown else run.scenario.title
        if run.profile is None:
            blocks.append(f"{name}: no profile: {run.problem}")
            continue
        speed = f"{run.record.delivered:,.0f} msg/s" if run.record.delivered else "no msg/s"
        title = f"{name}: {run.profile.samples:,} samples; that run: {speed}"
        blocks.append(format_profile(run.profile, title, n, markdown).rstrip("\n"))
    return "\n\n".join(blocks) + "\n"


def py_spy_version(binary: str) -> str:
    """``0.4.3``, or "" if py-spy does not say."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    words = done.stdout.decode(errors="replace").split()
    return words[-1] if done.returncode == 0 and words else ""


def py_spy_binary() -> str | None:
    """``$DEVICEMQ_AB_PY_SPY`` if set (None if it names no file), else py-spy
    beside this Python (its venv's ``bin``), else on PATH."""
    if os.environ.get(BINARY_ENV):
        named = os.environ[BINARY_ENV]
        return named if Path(named).is_file() else None
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file():
        return str(beside)
    return shutil.which("py-spy")


def attach_problem(
    binary: str | None, ptrace_scope: int | None, capabilities: int | None
) -> str | None:
    """Why py-spy cannot read a broker this process starts, or None if it can:
    ``ptrace_scope`` is Yama's setting (None: no Yama), ``capabilities`` this
    process's effective set (None: unknown). py-spy is the broker's sibling, not
    its ancestor: Yama at 1 ("only ancestors") and 2 ("only with
    CAP_SYS_PTRACE") both need the capability."""
    if binary is None:
        return f"py-spy not found (pip install -e '.[loadtest]', or set ${BINARY_ENV})"
    if ptrace_scope is None or ptrace_scope == 0:
        return None
    if ptrace_scope >= 3:
        return f"kernel.yama.ptrace_scope is {ptrace_scope}: no process may attach to another"
    if capabilities is not None and (capabilities >> CAP_SYS_PTRACE) & 1:
        return None
    return (
        f"kernel.yama.ptrace_scope is {ptrace_scope} and this process lacks CAP_SYS_PTRACE "
        "(run as root, or sysctl kernel.yama.ptrace_scope=0)"
    )


def system_attach_problem() -> str | None:
    """:func:`attach_problem` of this machine and process."""
    scope = None
    with contextlib.suppress(OSError, ValueError):
        scope = int(YAMA.read_text())
    capabilities = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                capabilities = int(line.split()[1], 16)
    return attach_problem(py_spy_binary(), scope, capabilities)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


class Recorder:
    """One py-spy recording of one process, started when the measured window
    opens (:meth:`start`), folded when it is over (:meth:`finish`)."""

    def __init__(self, binary: str, out: Path, roots: Iterable[str | Path] = ()) -> None:
        self.binary = binary
        self.out = out
        self.roots = list(roots)
        self.proc: subprocess.Popen[bytes] | None = None
        self.seconds = 0
        self.problem: str | None = None  # why there is no profile
        self.result: Profile | None = None  # the folded profile, once finished
        self._log = out.with_suffix(".log")

    def start(self, pid: int, seconds: int) -> None:
        self.seconds = seconds
        argv = [self.binary, "record", "-p", str(pid), "-d", str(seconds), "-r", str(RATE)]
        argv += ["--function", "--format", "raw", "-o", str(self.out)]
        try:
            with open(self._log, "wb") as log:
                self.proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
                )
        except OSError as e:
            self.problem = f"py-spy did not start: {e}"

    def finish(self, grace: float = 30.0) -> Profile | None:
        """Wait for py-spy (its duration and ``grace`` seconds more), then the
        folded profile (also kept as :attr:`result`); None with :attr:`problem`
        set if there is none."""
        proc = self.proc
        if proc is None:
            self.problem = self.problem or "py-spy never started: the window did not open"
            return None
        try:
            proc.wait(self.seconds + grace)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it has on Ctrl-C
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        output = ""
        with contextlib.suppress(OSError):
            output = self._log.read_text(errors="replace")
        if proc.returncode != 0:
            self.problem = f"py-spy failed ({proc.returncode}): {_last_line(output)}"
            return None
        try:
            profile = fold(self.out.read_text(errors="replace"), self.roots)
        except (OSError, ValueError) as e:
            self.problem = f"py-spy's output unreadable: {e}"
            return None
        if not profile.samples:
            self.problem = "py-spy recorded no samples (the broker was idle or gone)"
            return None
        self.result = profile
        return profile

    def stop(self) -> None:
        """End py-spy if it still runs (the run failed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
