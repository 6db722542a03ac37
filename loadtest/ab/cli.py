"""``python -m loadtest.ab --base REV [options]``: two builds of devicemq, side by side.

    python -m loadtest.ab --base main                      # the working tree against main
    python -m loadtest.ab --base bfd873c --scenario p2p-memory --rounds 2 --mosquitto
    python -m loadtest.ab --base main --head HEAD~1 --scenario fleet --devices 2000
    python -m loadtest.ab --base HEAD --head-compiled      # mypyc-compiled against pure Python
    python -m loadtest.ab --base main --scenario fan-in --scenario fan-in-application --fan-in 100x1
                                      # APPLICATION sessions against in memory, same load

The base (and ``--head REV``) is built once into a cache (``loadtest.ab.build``);
the head is by default the working tree this package is in, uncommitted changes
included. Every run starts a fresh broker (``loadtest.ab.brokers``), waits for it
to be ready, runs one scenario with this tree's loader (the same loader for every
side) and stops it. Rounds alternate the sides' order (``loadtest.ab.plan``).
``fan-in-application`` is ``fan-in`` with APPLICATION subscribers: run with
``fan-in``, each side's ratio of the two, round by round, is printed below the
table.

Exit status: 0 when every run completed and its per-message check passed and
nothing was flagged; 3 when a head/base speed ratio is flagged (below 0.95);
1 when a run failed (the broker did not start, the loader failed, or a message
was lost, duplicated or reordered); 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from loadtest.ab import brokers, profile
from loadtest.ab.build import BuildError, Tree, build, cache_root, compiled, working_tree
from loadtest.ab.current import goals_table, replace_block
from loadtest.ab.plan import (
    DEFAULT_SCENARIOS,
    SCENARIOS,
    Scenario,
    Sizes,
    Timing,
    make_scenario,
    schedule,
    sides_for,
)
from loadtest.ab.summary import (
    Comparison,
    RunRecord,
    SideSummary,
    compare,
    cores_between,
    format_table,
    paired_ratios,
    record_from_result,
    summarize_side,
)

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[2]
# Median busy cores used by neither server nor loader above which the report warns.
NOISY_OTHER_CORES = 0.25


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text}")
    return value


def _shape(text: str) -> tuple[int, int]:
    pubs, sep, subs = text.lower().partition("x")
    if not (sep and pubs.isdigit() and subs.isdigit() and int(pubs) and int(subs)):
        raise argparse.ArgumentTypeError(f"expected PUBLISHERSxSUBSCRIBERS, e.g. 100x2: {text!r}")
    return int(pubs), int(subs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.ab",
        description="devicemq at two revisions (and Mosquitto) under the same load, "
        "each run on a fresh broker, rounds alternating; prints medians and ratios",
    )
    p.add_argument("--base", required=True, metavar="REV", help="the revision compared against")
    head = p.add_mutually_exclusive_group()
    head.add_argument("--head", metavar="REV", help="a revision (default: the working tree)")
    head.add_argument(
        "--head-tree", metavar="PATH", type=Path, help="a source tree as it is on disk"
    )
    for side in ("base", "head"):
        p.add_argument(
            f"--{side}-compiled",
            action="store_true",
            help=f"the {side} with its hot modules compiled by mypyc, in a copy "
            "(loadtest/ab/compiled.py; needs a C compiler)",
        )
    p.add_argument(
        "--mosquitto",
        action="store_true",
        help="also run each in-memory scenario against Mosquitto, as a third side",
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        metavar="NAME",
        help=f"one of {', '.join(SCENARIOS)}; repeatable (default: "
        f"{' and '.join(DEFAULT_SCENARIOS)})",
    )
    p.add_argument("--rounds", type=_positive, default=2, help="runs of each side (default 2)")
    sizes, timing = Sizes(), Timing()
    g = p.add_argument_group("sizes")
    g.add_argument(
        "--memory-pairs", type=_positive, default=sizes.memory_pairs, help="p2p-memory (200)"
    )
    g.add_argument(
        "--persistent-pairs",
        type=_positive,
        default=sizes.persistent_pairs,
        help="p2p-persistent (100)",
    )
    g.add_argument(
        "--fan-in", type=_shape, default=sizes.fan_in, metavar="PxS", help="fan-in (100x2)"
    )
    g.add_argument(
        "--fan-in-rate",
        type=float,
        default=sizes.fan_in_rate,
        metavar="MSG_S",
        help="fan-in: msg/s per publisher (20; paced: compared by CPU per message)",
    )
    g.add_argument(
        "--fan-out", type=_shape, default=sizes.fan_out, metavar="PxS", help="fan-out (1x100)"
    )
    g.add_argument(
        "--devices",
        type=_positive,
        default=sizes.devices,
        help="fleet: devices, each a publisher at 1 msg/s and its persistent subscriber (1000)",
    )
    g = p.add_argument_group("load")
    g.add_argument("--duration", type=float, default=timing.duration, help="measured seconds (10)")
    g.add_argument("--warmup", type=float, default=timing.warmup, help="seconds before (3)")
    g.add_argument(
        "--drain",
        type=float,
        default=None,
        help="longest wait for stragglers (15; persistent scenarios 60)",
    )
    g.add_argument("--mqtt", choices=("3.1.1", "5"), default="3.1.1")
    g.add_argument("--inflight", type=_positive, default=10, help="per publisher (10)")
    g.add_argument("--processes", type=_positive, default=1, help="loader processes (1)")
    g.add_argument("--seed", type=int, default=1, help="first seed; one per round and scenario")
    g.add_argument(
        "--profile",
        nargs="?",
        type=_positive,
        const=0,
        metavar="SECONDS",
        help="after the rounds, one more head run per scenario (not counted) whose broker "
        f"py-spy samples at {profile.RATE} Hz for SECONDS of the measured window (default: "
        "all of it); its top 10 functions are printed, and written below the goals' table "
        "(loadtest/ab/profile.py)",
    )
    g.add_argument(
        "--profile-scenario",
        action="append",
        choices=SCENARIOS,
        metavar="NAME",
        help="with --profile: profile this scenario only; repeatable (default: every scenario run)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write every run and the summary as JSON")
    g.add_argument(
        "--markdown",
        metavar="FILE",
        help="write the table as Markdown (for BENCHMARKS.md or a commit message)",
    )
    g.add_argument(
        "--current-table",
        metavar="FILE",
        help="write the goals' table (loadtest/ab/current.py) between the current-table "
        "markers of FILE (BENCHMARKS.md); run with --base bfd873c --mosquitto and the "
        "goals' scenarios",
    )
    g.add_argument("--cache-dir", type=Path, help=f"built revisions (default {cache_root()})")
    g.add_argument(
        "--workdir",
        type=Path,
        help="where each run's broker keeps its data and log, removed after it "
        "(default: the system's temporary directory)",
    )
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    g = p.add_argument_group("settings of one side (same code, another setting)")
    for side in ("base", "head"):
        g.add_argument(
            f"--{side}-setting",
            action="append",
            type=_setting,
            default=[],
            metavar="NAME=VALUE",
            help=f"a devicemq setting of the {side} side, e.g. "
            "persistence.embedded_kafka_storage=s3 (as DEVICEMQ_*); repeatable",
        )
    return p


def _setting(text: str) -> tuple[str, str]:
    """``persistence.embedded_kafka_storage=s3`` as its variable and value."""
    name, eq, value = text.partition("=")
    if not eq or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE")
    return "DEVICEMQ_" + name.strip().replace(".", "_").upper(), value


def _scenarios(args: argparse.Namespace) -> list[Scenario]:
    sizes = Sizes(
        memory_pairs=args.memory_pairs,
        persistent_pairs=args.persistent_pairs,
        fan_in=args.fan_in,
        fan_in_rate=args.fan_in_rate,
        fan_out=args.fan_out,
        devices=args.devices,
    )
    timing = Timing(duration=args.duration, warmup=args.warmup)
    if args.drain is not None:
        timing = replace(timing, drain=args.drain, persistent_drain=args.drain)
    names = list(dict.fromkeys(args.scenario or DEFAULT_SCENARIOS))
    return [
        make_scenario(
            name,
            sizes,
            timing,
            mqtt=args.mqtt,
            inflight=args.inflight,
            processes=args.processes,
        )
        for name in names
    ]


class _Session:
    """The runs of one invocation, and what they recorded."""

    def __init__(
        self,
        trees: dict[str, Tree],
        show: bool,
        workdir: Path | None,
        settings: dict[str, dict[str, str]] | None = None,
    ) -> None:
        self.trees = trees
        self.settings = settings or {}
        self.show = show
        self.workdir = workdir
        self.records: list[RunRecord] = []

    def say(self, text: str) -> None:
        if self.show:
            print(text, file=sys.stderr, flush=True)

    def run(self, round_: int, scenario: Scenario, side: str, seed: int) -> RunRecord:
        record = self._measure(round_, scenario, side, seed)
        self.records.append(record)
        return record

    def run_profiled(
        self, round_: int, scenario: Scenario, seed: int, seconds: int
    ) -> profile.ProfileRun:
        """A run of the head, not counted, whose broker py-spy records for
        ``seconds`` from the start of the measured window."""
        binary = profile.py_spy_binary() or "py-spy"  # found before the rounds
        workdir = Path(tempfile.mkdtemp(prefix="devicemq-ab-profile-", dir=self.workdir))
        try:
            recorder = profile.Recorder(binary, workdir / "py-spy.txt", [self.trees["head"].root])
            record = self._measure(round_, scenario, "head", seed, (recorder, seconds))
            problem = recorder.problem
            if recorder.result is None and problem is None:
                problem = f"the run failed before py-spy finished: {record.error}"
            return profile.ProfileRun(scenario, record, seconds, recorder.result, problem)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _measure(
        self,
        round_: int,
        scenario: Scenario,
        side: str,
        seed: int,
        recording: tuple[profile.Recorder, int] | None = None,
    ) -> RunRecord:
        from loadtest.runner import LoadTestError, run_load

        workdir = Path(tempfile.mkdtemp(prefix=f"devicemq-ab-{side}-", dir=self.workdir))
        record = RunRecord(round_, scenario.name, side)
        try:
            if side == "mosquitto":
                broker = brokers.start_mosquitto(workdir)
            else:
                broker = brokers.start_devicemq(
                    side,
                    self.trees[side],
                    scenario.persistent,
                    workdir,
                    settings={**scenario.settings, **self.settings.get(side, {})},
                )
            try:
                config = replace(scenario.config, port=broker.port, seed=seed, label=side)
                window: dict[str, tuple[float, dict[str, float]]] = {}

                def sample(elapsed: float, phase: str, *_: int) -> None:
                    # the runner samples its own CPU figures on the same transitions
                    if phase == "measure" and "start" not in window:
                        window["start"] = brokers.cpu_seconds(broker.pid)
                        if recording is not None:
                            recording[0].start(broker.pid, recording[1])
                    elif phase == "drain" and "end" not in window:
                        window["end"] = brokers.cpu_seconds(broker.pid)

                result = run_load(config, label=side, progress=self.show, on_progress=sample)
                cores = cores_between(window.get("start"), window.get("end"))
                record = record_from_result(round_, scenario.name, side, result, cores)
                if recording is not None:  # before the broker stops
                    recording[0].finish()
            finally:
                if recording is not None:
                    recording[0].stop()
                broker.stop()
        except (brokers.BrokerError, LoadTestError, OSError) as e:
            record.error = f"{type(e).__name__}: {e}"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return record


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _progress_line(done: int, total: int, record: RunRecord) -> str:
    head = f"[{done}/{total}] round {record.round + 1} {record.scenario} {record.side}: "
    return head + _run_text(record)


def _run_text(record: RunRecord) -> str:
    if record.error and not record.delivered:
        return f"FAILED: {record.error.splitlines()[0]}"
    cores = record.server_cores
    text = (
        f"{record.delivered:,.0f} msg/s, p50 {_ms(record.p50_ms)} ms, p99 {_ms(record.p99_ms)} ms, "
    )
    text += "server cores unknown" if cores is None else f"server {cores:.2f} cores"
    if record.error:
        text += f"; FAILED: {record.error}"
    return text


def _profile_line(run: profile.ProfileRun) -> str:
    head = f"[profile] {run.scenario.name} head (not counted): {_run_text(run.record)}; "
    if run.profile is None:
        return head + f"no profile: {run.problem}"
    return head + f"py-spy {run.profile.samples:,} samples"


def summaries(
    scenarios: Sequence[Scenario], sides: Sequence[str], records: Sequence[RunRecord]
) -> list[tuple[Scenario, dict[str, SideSummary], list[Comparison]]]:
    """Per scenario, each side's medians and the comparisons: head against base,
    and each devicemq side against Mosquitto when it ran."""
    out = []
    for scenario in scenarios:
        by_side = {
            side: summarize_side(
                side, [r for r in records if r.scenario == scenario.name and r.side == side]
            )
            for side in sides_for(scenario, sides)
        }
        comparisons = [compare(by_side["head"], by_side["base"], scenario.paced)]
        if "mosquitto" in by_side:
            comparisons += [
                compare(by_side[s], by_side["mosquitto"], scenario.paced, flag=False)
                for s in ("head", "base")
            ]
        out.append((scenario, by_side, comparisons))
    return out


def _document(
    args: argparse.Namespace,
    trees: dict[str, Tree],
    built: dict[str, bool],
    order: list[tuple[int, Scenario, str]],
    records: list[RunRecord],
    results: list[tuple[Scenario, dict[str, SideSummary], list[Comparison]]],
) -> dict[str, Any]:
    return {
        "sides": {
            name: {
                "label": tree.label,
                "sha": tree.sha,
                "root": str(tree.root),
                "built_now": built.get(name),
            }
            for name, tree in trees.items()
        }
        | ({"mosquitto": {"binary": brokers.mosquitto_binary()}} if args.mosquitto else {}),
        "devicemq_settings": brokers.SETTINGS,
        "rounds": args.rounds,
        "order": [[r, s.name, side] for r, s, side in order],
        "scenarios": {
            scenario.name: {
                "title": scenario.title,
                "paced": scenario.paced,
                "persistent_broker": scenario.persistent,
                "load": asdict(scenario.config),
                "sides": {side: asdict(summary) for side, summary in sides.items()},
                "comparisons": [asdict(c) for c in comparisons],
            }
            for scenario, sides, comparisons in results
        },
        "runs": [r.as_dict() for r in records],
    }


def _profile_document(runs: Sequence[profile.ProfileRun], problem: str | None) -> dict[str, Any]:
    """--json's account of --profile: each scenario's run and top functions."""

    def shares(functions: Sequence[profile.FunctionShare]) -> list[dict[str, Any]]:
        return [
            {
                "function": f.function,
                "self": round(f.self_share, 4),
                "inclusive": round(f.inclusive_share, 4),
            }
            for f in functions
        ]

    return {
        "problem": problem,
        "rate_hz": profile.RATE,
        "scenarios": {
            run.scenario.name: {
                "run": run.record.as_dict(),
                "seconds": run.seconds,
                "problem": run.problem,
                "samples": run.profile.samples if run.profile else 0,
                "top_self": shares(run.profile.top_self()) if run.profile else [],
                "top_inclusive": shares(run.profile.top_inclusive()) if run.profile else [],
            }
            for run in runs
        },
    }


# scenario -> the one it is measured against, round by round, on the same side
PAIRED = {"fan-in-application": "fan-in"}


def _paired_lines(scenarios: Sequence[Scenario], records: Sequence[RunRecord]) -> list[str]:
    """A line per side for each scenario run together with its reference
    (``fan-in-application`` with ``fan-in``): delivered msg/s over the
    reference's, per round and the median."""
    names = {s.name for s in scenarios}
    lines = []
    for scenario, reference in PAIRED.items():
        if scenario not in names or reference not in names:
            continue
        for side, ratios in paired_ratios(records, scenario, reference).items():
            each = ", ".join(f"{r:.2f}" for r in ratios)
            lines.append(
                f"{scenario} / {reference}, {side}: {statistics.median(ratios):.2f}x "
                f"(delivered msg/s, median of the rounds: {each})"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        scenarios = _scenarios(args)
        for scenario in scenarios:
            scenario.config.resolved()  # checks the options
    except ValueError as e:
        print(f"loadtest.ab: error: {e}", file=sys.stderr)
        return 2
    if args.profile_scenario and (
        args.profile is None or not set(args.profile_scenario) <= {s.name for s in scenarios}
    ):
        print(
            "loadtest.ab: error: --profile-scenario: give --profile, and only scenarios "
            "that run (--scenario)",
            file=sys.stderr,
        )
        return 2
    if args.current_table:
        try:  # before any run: the file must have the table's place
            replace_block(Path(args.current_table).read_text(), "")
        except (OSError, ValueError) as e:
            print(f"loadtest.ab: error: --current-table: {e}", file=sys.stderr)
            return 2
    sides = ["base", "head"] + (["mosquitto"] if args.mosquitto else [])
    if args.mosquitto and brokers.mosquitto_binary() is None:
        print("loadtest.ab: error: --mosquitto: no mosquitto binary found", file=sys.stderr)
        return 2
    show = not args.quiet
    trees: dict[str, Tree] = {}
    built: dict[str, bool] = {}
    try:
        started = time.monotonic()
        head = None if args.head else working_tree(args.head_tree or REPO, REPO)  # checked first
        trees["base"], built["base"] = build(REPO, args.base, args.cache_dir)
        if head is None:
            trees["head"], built["head"] = build(REPO, args.head, args.cache_dir)
        else:
            trees["head"] = head
        for side in ("base", "head"):
            if getattr(args, f"{side}_compiled"):
                if not args.quiet:
                    print(f"{side}: compiling with mypyc (minutes)", file=sys.stderr, flush=True)
                trees[side], built[side] = compiled(trees[side], args.cache_dir)
        spent = time.monotonic() - started
    except BuildError as e:
        print(f"loadtest.ab: error: {e}", file=sys.stderr)
        return 2
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    settings = {"base": dict(args.base_setting), "head": dict(args.head_setting)}
    session = _Session(trees, show, args.workdir, settings)
    for name, tree in trees.items():
        how = {True: "built now", False: "cached", None: "as on disk"}[built.get(name)]
        session.say(f"{name}: {tree.label}, {how} ({tree.root})")
    session.say(f"builds ready in {spent:.1f} s")
    order = schedule(args.rounds, scenarios, sides)
    # --profile: a reason there will be none, known before any run
    no_profile = None if args.profile is None else profile.system_attach_problem()
    if no_profile:
        session.say(f"profile: none: {no_profile}")
    profiled: list[profile.ProfileRun] = []
    interrupted = False
    try:
        for i, (round_, scenario, side) in enumerate(order, 1):
            seed = args.seed + 1000 * round_ + scenarios.index(scenario)
            record = session.run(round_, scenario, side, seed)
            session.say(_progress_line(i, len(order), record))
        if args.profile is not None and no_profile is None:
            whole = max(1, int(args.duration))  # py-spy takes whole seconds
            seconds = min(args.profile or whole, whole)
            chosen = args.profile_scenario or [s.name for s in scenarios]
            for scenario in [s for s in scenarios if s.name in chosen]:
                seed = args.seed + 1000 * args.rounds + scenarios.index(scenario)
                profiled.append(session.run_profiled(args.rounds, scenario, seed, seconds))
                session.say(_profile_line(profiled[-1]))
    except KeyboardInterrupt:  # the runs done so far are still worth a table
        interrupted = True
        print(f"interrupted after {len(session.records)} of {len(order)} runs", file=sys.stderr)
    results = summaries(scenarios, sides, session.records)
    labels = {
        side: trees[side].label + "".join(f" {k}={v}" for k, v in sorted(settings[side].items()))
        for side in ("base", "head")
    }
    print(
        f"base: {labels['base']}\nhead: {labels['head']}\n"
        f"{args.rounds} round(s), order reversed every other round; "
        f"{args.duration:g} s measured after {args.warmup:g} s warm-up per run\n"
    )
    rows = [(s.title, s.paced, sides_, cs) for s, sides_, cs in results]
    print(format_table(rows))
    paired = _paired_lines(scenarios, session.records)
    if paired:
        print("\n" + "\n".join(paired))
    profiles = ""
    if no_profile:
        profiles = f"Profile of the head broker: none: {no_profile}.\n"
        print(f"\nprofile: none: {no_profile}")
    elif profiled:
        binary = profile.py_spy_binary()
        version = profile.py_spy_version(binary) if binary else ""
        profiles = profile.format_runs(profiled, version, markdown=True)
        print("\n" + profile.format_runs(profiled, version), end="")
    if args.markdown:
        command = "python -m loadtest.ab " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.markdown).write_text(
            f"`{command}`\n\nbase: {labels['base']}; head: {labels['head']}; "
            f"{args.rounds} round(s) of {args.duration:g} s\n\n"
            + format_table(rows, markdown=True)
            + "\n"
        )
    busy = [s.other_cores for _, sides_, _ in results for s in sides_.values() if s.other_cores]
    if args.current_table:
        command = "python -m loadtest.ab " + " ".join(argv if argv is not None else sys.argv[1:])
        header = (
            f"`{command}`: base {labels['base']}, head {labels['head']}, "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}; {args.rounds} round(s) of "
            f"{args.duration:g} s, medians; other processes up to "
            f"{max(busy, default=0.0):.2f} cores busy"
        )
        table = goals_table(results, header) + (f"\n{profiles}" if profiles else "")
        path = Path(args.current_table)
        path.write_text(replace_block(path.read_text(), table))
        print(f"\n{table}")
    if busy and max(busy) > NOISY_OTHER_CORES:
        print(
            f"\nnote: other processes kept up to {max(busy):.2f} of the machine's cores busy "
            "during the measured windows: the ratios are noisy; more rounds, or a quieter "
            "machine, narrow them"
        )
    failures = [r for r in session.records if not r.ok]
    for record in failures:
        print(f"failed: round {record.round + 1} {record.scenario} {record.side}: {record.error}")
    for run in profiled:  # not counted, but a message lost is lost
        if not run.record.ok:
            failures.append(run.record)
            print(f"failed: the profiled run of {run.scenario.name}: {run.record.error}")
    if args.json:
        document = _document(args, trees, built, order, session.records, results)
        if args.profile is not None:
            document["profile"] = _profile_document(profiled, no_profile)
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    if interrupted:
        return 130
    if failures:
        return 1
    flagged = any(c.flagged for _, _, cs in results for c in cs)
    return 3 if flagged else 0
