"""The A/B tool's pure parts: the order of the runs, the medians, the ratios and
their flag, the table (loadtest/ab/plan.py, loadtest/ab/summary.py)."""

from __future__ import annotations

import re

import pytest

from loadtest.ab.cli import parser, summaries
from loadtest.ab.current import BEGIN, END, goals_table, replace_block
from loadtest.ab.plan import (
    APPLICATION_SUBSCRIBERS,
    Sizes,
    Timing,
    make_scenario,
    schedule,
    sides_for,
)
from loadtest.ab.summary import (
    FLAG_BELOW,
    RunRecord,
    SideSummary,
    compare,
    cores_between,
    format_table,
    paired_ratios,
    record_from_result,
    summarize_side,
)
from loadtest.scenarios import make_plan

SIZES, TIMING = Sizes(), Timing()


def _run(
    side: str,
    delivered: float,
    *,
    round_: int = 0,
    scenario: str = "p2p-memory",
    p99: float = 10.0,
    broker: float = 1.0,
    ok: bool = True,
) -> RunRecord:
    return RunRecord(
        round=round_,
        scenario=scenario,
        side=side,
        ok=ok,
        error=None if ok else "check failed",
        delivered=delivered,
        acked=delivered,
        p50_ms=p99 / 2,
        p99_ms=p99,
        cores={"broker": broker, "redis": 0.0, "kafka": 0.0},
    )


def test_rounds_alternate_the_order_of_the_sides() -> None:
    memory = make_scenario("p2p-memory", SIZES, TIMING)
    persistent = make_scenario("p2p-persistent", SIZES, TIMING)
    order = [
        (r, s.name, side)
        for r, s, side in schedule(3, [memory, persistent], ["base", "head", "mosquitto"])
    ]
    assert order == [
        (0, "p2p-memory", "base"),
        (0, "p2p-memory", "head"),
        (0, "p2p-memory", "mosquitto"),
        (0, "p2p-persistent", "base"),  # Mosquitto sits out the persistent scenarios
        (0, "p2p-persistent", "head"),
        (1, "p2p-memory", "mosquitto"),
        (1, "p2p-memory", "head"),
        (1, "p2p-memory", "base"),
        (1, "p2p-persistent", "head"),
        (1, "p2p-persistent", "base"),
        (2, "p2p-memory", "base"),
        (2, "p2p-memory", "head"),
        (2, "p2p-memory", "mosquitto"),
        (2, "p2p-persistent", "base"),
        (2, "p2p-persistent", "head"),
    ]
    # over two rounds every side's mean position is the same: a linear drift cancels
    two = schedule(2, [memory], ["base", "head", "mosquitto"])
    positions: dict[str, list[int]] = {}
    for r in range(2):
        for i, (_, _, side) in enumerate(x for x in two if x[0] == r):
            positions.setdefault(side, []).append(i)
    assert {side: sum(p) for side, p in positions.items()} == {
        "base": 2,
        "head": 2,
        "mosquitto": 2,
    }
    assert sides_for(persistent, ["base", "head", "mosquitto"]) == ["base", "head"]


def test_scenarios_are_presets_of_the_loaders_own() -> None:
    sizes = Sizes(memory_pairs=7, persistent_pairs=3, fan_in=(9, 2), fan_out=(1, 8), devices=40)
    memory = make_scenario("p2p-memory", sizes, TIMING).config.resolved()
    assert (memory.scenario, memory.pairs, memory.persistent, memory.qos) == ("p2p", 7, False, 1)
    assert memory.rate == 0 and memory.drain == TIMING.drain
    persistent = make_scenario("p2p-persistent", sizes, TIMING)
    assert persistent.persistent and persistent.config.resolved().persistent
    assert persistent.config.drain == TIMING.persistent_drain
    fan_in = make_scenario("fan-in", sizes, TIMING).config.resolved()
    assert (fan_in.publishers, fan_in.subscribers, fan_in.persistent) == (9, 2, False)
    # paced (two subscribers cannot take what 100 unthrottled publishers offer)
    assert fan_in.rate == 20.0 and make_scenario("fan-in", sizes, TIMING).paced
    unpaced = make_scenario("fan-in", Sizes(fan_in_rate=0), TIMING)
    assert not unpaced.paced and unpaced.config.rate == 0
    fan_out = make_scenario("fan-out", sizes, TIMING).config.resolved()
    assert (fan_out.publishers, fan_out.subscribers) == (1, 8)
    fleet = make_scenario("fleet", sizes, TIMING)
    assert fleet.paced and fleet.persistent
    f = fleet.config.resolved()
    assert (f.pairs, f.rate, f.payload_size, f.qos, f.persistent) == (40, 1.0, 62, 1, True)
    with pytest.raises(ValueError, match="unknown scenario"):
        make_scenario("p2p", sizes, TIMING)


def test_sizes_and_timing_from_the_command_line() -> None:
    args = parser().parse_args(
        [
            "--base",
            "main",
            "--scenario",
            "fleet",
            "--devices",
            "25",
            "--fan-in",
            "10x3",
            "--duration",
            "4",
            "--drain",
            "5",
        ]
    )
    assert (args.devices, args.fan_in, args.scenario) == (25, (10, 3), ["fleet"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--base", "main", "--fan-out", "10"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--base", "main", "--head", "x", "--head-tree", "."])
    with pytest.raises(SystemExit):  # --base is required
        parser().parse_args([])


def test_medians_leave_out_failed_runs() -> None:
    runs = [
        _run("head", 100.0, p99=30.0),
        _run("head", 300.0, p99=10.0),
        _run("head", 200.0, p99=20.0),
        _run("head", 5.0, ok=False),
    ]
    s = summarize_side("head", runs)
    assert (s.runs, s.failed) == (3, 1)
    assert (s.delivered, s.delivered_min, s.delivered_max) == (200.0, 100.0, 300.0)
    assert s.p99_ms == 20.0
    # 1 core for 200 msg/s: 5,000 us per message; in + out = 400 per core
    assert s.us_per_message == 5000.0
    assert s.per_core == 400.0
    assert summarize_side("base", [_run("base", 1.0, ok=False)]).delivered is None


def test_ratio_below_095_is_flagged() -> None:
    base = summarize_side("base", [_run("base", 1000.0)])
    for head_rate, flagged in ((949.0, True), (950.0, False), (1200.0, False)):
        c = compare(summarize_side("head", [_run("head", head_rate)]), base, paced=False)
        assert c.rate == pytest.approx(head_rate / 1000)
        assert c.speed == c.rate
        assert c.flagged is flagged, head_rate
    assert FLAG_BELOW == 0.95


def test_a_paced_scenario_compares_the_cost_per_message() -> None:
    # the same rate on both sides (it is the offer); the head needs 10% more CPU
    base = summarize_side("base", [_run("base", 1000.0, broker=0.10)])
    head = summarize_side("head", [_run("head", 1000.0, broker=0.11)])
    c = compare(head, base, paced=True)
    assert c.rate == 1.0
    assert c.cost == pytest.approx(1.1)
    assert c.speed == pytest.approx(1 / 1.1)
    assert c.flagged
    assert not compare(base, head, paced=True).flagged
    # a side that falls behind the offer is slower, however cheap each message was
    behind = summarize_side("head", [_run("head", 900.0, broker=0.08)])
    c = compare(behind, base, paced=True)
    assert c.cost is not None and c.cost < 1
    assert c.speed == pytest.approx(0.9) and c.flagged


def test_the_table() -> None:
    memory = make_scenario("p2p-memory", SIZES, TIMING)
    fleet = make_scenario("fleet", Sizes(devices=50), TIMING)
    records = [
        _run("base", 1000.0, round_=0),
        _run("head", 900.0, round_=0),
        _run("mosquitto", 2000.0, round_=0),
        _run("base", 1100.0, round_=1),
        _run("head", 800.0, round_=1),
        _run("mosquitto", 2100.0, round_=1),
        _run("base", 50.0, scenario="fleet"),
        _run("head", 50.0, scenario="fleet", ok=False),
    ]
    results = summaries([memory, fleet], ["base", "head", "mosquitto"], records)
    assert [list(sides) for _, sides, _ in results] == [
        ["base", "head", "mosquitto"],
        ["base", "head"],
    ]
    assert [(c.side, c.reference) for c in results[0][2]] == [
        ("head", "base"),
        ("head", "mosquitto"),
        ("base", "mosquitto"),
    ]
    table = format_table([(s.title, s.paced, sides, cs) for s, sides, cs in results])
    lines = table.splitlines()
    base_row = next(line for line in lines if line.startswith("p2p 200 pairs, clean"))
    assert "1,050" in base_row and "1,000..1,100" in base_row
    head_row = lines[lines.index(base_row) + 1]
    assert "head" in head_row and "850" in head_row and "800..900" in head_row
    ratio_row = next(line for line in lines if "head/base" in line)
    assert "0.81x" in ratio_row and "speed 0.81x !" in ratio_row
    mosquitto_row = next(line for line in lines if "head/mosquitto" in line)
    assert "0.41x" in mosquitto_row and "!" not in mosquitto_row  # a goal, not a regression
    # the fleet's head run failed: said so, and no ratio is made up
    fleet_rows = lines[lines.index(next(x for x in lines if x.startswith("fleet 50"))) :]
    assert "failed" in fleet_rows[1]
    assert "speed -" in fleet_rows[2]
    markdown = format_table(
        [(s.title, s.paced, sides, cs) for s, sides, cs in results], markdown=True
    ).splitlines()
    assert markdown[0].startswith("| scenario | side | msg/s |")
    assert markdown[1].startswith("|---|---|---:|")
    # the header, then 3 sides and 3 ratios of p2p-memory, 2 sides and 1 ratio of fleet
    assert sum(1 for line in markdown if line.startswith("| ")) == 1 + 6 + 3
    assert any("| head/base | 0.81x | speed 0.81x ! |" in line for line in markdown)
    # an interrupted session: a side that never ran
    (_, sides, comparisons) = summaries([fleet], ["base", "head"], records[6:7])[0]
    table = format_table([(fleet.title, True, sides, comparisons)])
    assert "not run" in table.splitlines()[2]


def test_cores_by_role_over_the_window() -> None:
    start = (10.0, {"broker": 5.0, "redis": 1.0, "kafka": 2.0})
    end = (12.0, {"broker": 7.0, "redis": 1.5, "kafka": 2.2})
    assert cores_between(start, end) == pytest.approx({"broker": 1.0, "redis": 0.25, "kafka": 0.1})
    assert cores_between(None, end) == {}
    assert cores_between(end, start) == {}


def test_a_run_whose_check_failed_is_not_counted() -> None:
    result = {
        "check": {
            "ok": False,
            "acked": 10,
            "delivered": 9,
            "lost": 1,
            "duplicates": 0,
            "out_of_order": 0,
            "rejected": 0,
        },
        "latency_ms": {"e2e": {"p50": 1.0, "p99": 2.0}},
        "errors": [],
        "rates": {"delivered": 9.0, "acked": 10.0},
        "cpu": {"other_cores": 0.1, "client_cores": 0.2},
    }
    record = record_from_result(0, "p2p-memory", "head", result, {"broker": 0.5})
    assert not record.ok and record.error is not None and "1 lost" in record.error
    assert summarize_side("head", [record]).delivered is None
    assert isinstance(summarize_side("head", [record]), SideSummary)


def test_a_side_gets_settings_of_its_own() -> None:
    """Same code on both sides, one setting apart (the embedded Kafka's storage)."""
    args = parser().parse_args(
        [
            "--base",
            "HEAD",
            "--head-setting",
            "persistence.embedded_kafka_storage=s3",
            "--head-setting",
            "mqtt.max_inflight=5",
        ]
    )
    assert dict(args.head_setting) == {
        "DEVICEMQ_PERSISTENCE_EMBEDDED_KAFKA_STORAGE": "s3",
        "DEVICEMQ_MQTT_MAX_INFLIGHT": "5",
    }
    assert args.base_setting == []
    with pytest.raises(SystemExit):
        parser().parse_args(["--base", "HEAD", "--base-setting", "no-equals-sign"])


def test_the_application_fan_in_is_the_fan_in_with_application_subscribers() -> None:
    sizes = Sizes(fan_in=(9, 1), fan_in_rate=30.0)
    plain = make_scenario("fan-in", sizes, TIMING)
    app = make_scenario("fan-in-application", sizes, TIMING)
    c = app.config.resolved()
    assert (c.scenario, c.publishers, c.subscribers, c.rate, c.qos) == ("fan-in", 9, 1, 30.0, 1)
    assert c.persistent and app.persistent and app.paced and not plain.settings
    assert c.drain == TIMING.persistent_drain
    assert app.settings == {"DEVICEMQ_APPLICATION_CLIENT_IDS": APPLICATION_SUBSCRIBERS}
    # the expression matches the loader's subscribers, not its publishers
    plan = make_plan(c)
    assert all(re.match(APPLICATION_SUBSCRIBERS, s.client_id) for s in plan.subscribers)
    assert not any(re.match(APPLICATION_SUBSCRIBERS, p.client_id) for p in plan.publishers)


def test_the_application_fan_in_is_paired_with_the_fan_in_round_by_round() -> None:
    records = [
        _run("head", 2000, scenario="fan-in", round_=0),
        _run("head", 1800, scenario="fan-in-application", round_=0),
        _run("head", 1000, scenario="fan-in", round_=1),
        _run("head", 900, scenario="fan-in-application", round_=1),
        _run("base", 2000, scenario="fan-in", round_=0),
        _run("base", 100, scenario="fan-in-application", round_=0, ok=False),  # lost some
    ]
    ratios = paired_ratios(records, "fan-in-application", "fan-in")
    assert ratios == {"head": [pytest.approx(0.9), pytest.approx(0.9)]}


def test_the_goals_table_says_each_goal_met_or_not_and_replaces_its_block() -> None:
    memory = make_scenario("p2p-memory", SIZES, TIMING)
    persistent = make_scenario("p2p-persistent", SIZES, TIMING)
    records = [
        _run("base", 1000.0),
        _run("head", 1100.0),
        _run("mosquitto", 1300.0),
        _run("base", 100.0, scenario="p2p-persistent", p99=200.0),
        _run("head", 110.0, scenario="p2p-persistent", p99=250.0),
    ]
    results = summaries([memory, persistent], ["base", "head", "mosquitto"], records)
    table = goals_table(results, "`the command`")
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line[:2] == "| "}
    assert "1.10x | yes" in rows["in memory, p2p: >= 1.0x the base"]
    assert "0.85x | **no**" in rows["in memory, p2p: >= 0.9x Mosquitto"]
    assert "1.10x | **no**" in rows["persistent, p2p: >= 1.2x the base"]
    tail = rows["persistent, p2p: p99 no worse than the base's"]
    assert "250.0 ms | 200.0 ms | 1.25x | **no**" in tail
    assert not any(name.startswith("fan-") for name in rows)  # not run: not claimed
    text = f"# B\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n"
    written = replace_block(text, table)
    assert "old table" not in written and table in written
    assert written.startswith("# B\n\nbefore\n") and written.endswith(f"{END}\nafter\n")
    assert replace_block(written, table) == written  # regenerated in place
    with pytest.raises(ValueError):
        replace_block("# no markers\n", table)
