"""``python -m tests.model``: the model checker's long mode.

Runs seeds (from ``--seed``, else random ones) against fresh processes until
``--minutes`` are up (or ``--runs`` are done), prints one line per run and a
summary: operations executed, faults injected by kind, messages checked. On a
violation it prints the seed, the violation and a shrunk sequence of
operations (delta debugging, ``--shrink-minutes``), and where the broker logs
are; the exit status is 1.
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.model.ops import SCENARIOS, make_plan
from tests.model.runner import Result, run_plan, shrink


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.model", description=__doc__)
    parser.add_argument("--minutes", type=float, default=60.0, help="time to run seeds for")
    parser.add_argument("--seed", type=int, help="first seed (then seed+1, ...); default random")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1)
    parser.add_argument("--ops", type=int, default=80, help="operations per run")
    parser.add_argument("--runs", type=int, help="stop after this many runs")
    parser.add_argument("--scenario", choices=SCENARIOS, help="force one scenario")
    parser.add_argument(
        "--application",
        choices=("drawn", "on", "off"),
        default="drawn",
        help="APPLICATION sessions for some subscribers: as the seed draws, always, never",
    )
    parser.add_argument("--shrink-minutes", type=float, default=5.0)
    parser.add_argument(
        "--shrink-kind", help="the violation kind to shrink for (default: the first one's)"
    )
    parser.add_argument("--keep-going", action="store_true", help="continue after a failure")
    parser.add_argument("--dir", type=Path, help="where runs keep their files")
    parser.add_argument("--keep", action="store_true", help="keep the files of passing runs too")
    parser.add_argument(
        "--ignore",
        default="",
        help="violation kinds to record but not report, comma-separated (e.g. dup,lost)",
    )
    args = parser.parse_args(argv)
    ignore = frozenset(k for k in args.ignore.split(",") if k)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: where every thread is
    # kill <pid>: as Ctrl-C, the run in progress stops its brokers, Redis and Kafka (its
    # teardown, by PID) before the checker exits; the default would leave them running.
    signal.signal(signal.SIGTERM, _exit_on_term)

    root = args.dir or Path(tempfile.mkdtemp(prefix="devicemq-model-"))
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.minutes * 60
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    started = time.monotonic()
    totals = Totals()
    failures: list[tuple[Result, str]] = []
    runs = 0
    print(f"model checker: replicas {args.replicas}, {args.ops} ops per run, files in {root}")
    while time.monotonic() < deadline and (args.runs is None or runs < args.runs):
        application = {"drawn": None, "on": True, "off": False}[args.application]
        plan = make_plan(seed, args.replicas, args.ops, args.scenario, application)
        directory = root / f"seed-{seed}"
        result = run_plan(plan, directory, log=lambda s: None, ignore=ignore)
        runs += 1
        totals.add(result)
        status = "FAIL" if result.failed else ("ERROR" if result.error else "ok")
        print(
            f"seed {seed} ({plan.scenario}): {status} in {result.seconds:.0f} s, "
            f"{result.executed} ops, {result.published} published, {result.checked} checked, "
            f"faults {result.faults or '-'}"
            + (f" [{'; '.join(result.notes)}]" if result.notes else ""),
            flush=True,
        )
        if result.error:
            print(f"  infrastructure error: {result.error}", flush=True)
        if result.failed:
            elapsed = (time.monotonic() - started) / 60
            report = describe_failure(result, elapsed)
            print(report, flush=True)
            shrunk_text = ""
            if args.shrink_minutes > 0:
                print(f"shrinking (up to {args.shrink_minutes:g} min)...", flush=True)
                shrunk, best = shrink(
                    plan,
                    {args.shrink_kind or result.violations[0].kind},
                    directory / "shrink",
                    args.shrink_minutes * 60,
                    log=lambda s: print(s, flush=True),
                    ignore=ignore,
                )
                shrunk_text = "\n".join(f"    {op}" for op in shrunk.ops)
                print(f"shrunk to {len(shrunk.ops)} operations (plus the final drain):")
                print(shrunk_text)
                if best is not None:
                    print("  which gave:")
                    for v in best.violations[:5]:
                        print(f"    {v}")
                    print(f"  broker logs: {', '.join(str(p) for p in best.logs)}")
            failures.append((result, shrunk_text))
            if not args.keep_going:
                break
        elif not result.error and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
        seed += 1
    print(totals.summary(runs, time.monotonic() - started))
    for result, _ in failures:
        print(
            f"FAILED: seed {result.plan.seed} --replicas {result.plan.replicas}: "
            f"{result.violations[0]}"
        )
    return 1 if failures else 0


def describe_failure(result: Result, minutes: float) -> str:
    plan = result.plan
    lines = [
        f"VIOLATION with seed {plan.seed} after {minutes:.1f} min "
        f"(reproduce: python -m tests.model --seed {plan.seed} --replicas {plan.replicas} "
        f"--ops {len(plan.ops)} --runs 1"
        + (f" --scenario {plan.scenario}" if plan.scenario else "")
        + (" --application on" if plan.application else " --application off")
        + ")",
        plan.describe(),
    ]
    for v in result.violations[:10]:
        lines.append(f"  {v}")
    lines.append(f"  after {result.executed} operations; broker logs:")
    lines.extend(f"    {p}" for p in result.logs)
    lines.append("  operations:")
    lines.extend(f"    {i:3d} {op}" for i, op in enumerate(plan.ops[: result.executed]))
    return "\n".join(lines)


class Totals:
    def __init__(self) -> None:
        self.ops = 0
        self.faults: dict[str, int] = {}
        self.published = 0
        self.acked = 0
        self.receipts = 0
        self.checked = 0
        self.delivered = 0
        self.excused: dict[str, int] = {}
        self.failed = 0
        self.errors = 0

    def add(self, r: Result) -> None:
        self.ops += r.executed
        for k, v in r.faults.items():
            self.faults[k] = self.faults.get(k, 0) + v
        for k, v in r.excused.items():
            self.excused[k] = self.excused.get(k, 0) + v
        self.published += r.published
        self.acked += r.acked
        self.receipts += r.receipts
        self.checked += r.checked
        self.delivered += r.delivered
        self.failed += r.failed
        self.errors += bool(r.error)

    def summary(self, runs: int, seconds: float) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        excused = ", ".join(f"{k} {v}" for k, v in sorted(self.excused.items())) or "none"
        return (
            f"summary: {runs} runs in {seconds / 60:.1f} min, {self.failed} failed, "
            f"{self.errors} infrastructure errors\n"
            f"  operations executed: {self.ops}\n"
            f"  faults injected: {faults}\n"
            f"  messages published: {self.published} ({self.acked} acknowledged), "
            f"receipts: {self.receipts}\n"
            f"  owed deliveries checked: {self.checked} ({self.delivered} delivered; "
            f"excused: {excused})"
        )


if __name__ == "__main__":
    sys.exit(main())
