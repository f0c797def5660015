"""Bamboo trace parsing, the shipped traces and the Poisson generator."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.gen_traces import GENERATED_SEEDS, SHIPPED, TRACE_DIR, generate
from simulator.traces import TraceEvent, load_bamboo, parse_bamboo, poisson_device_failures, write_bamboo


def test_parse_sorts_skips_comments_and_round_trips(tmp_path: Path) -> None:
    events = parse_bamboo(["# spot trace", "", "2500,remove,a", "0,add,a", "0,add,b"])
    assert events == [
        TraceEvent(0.0, "add", "a"),
        TraceEvent(0.0, "add", "b"),
        TraceEvent(2.5, "remove", "a"),
    ]
    write_bamboo(events, tmp_path / "t.txt")
    assert load_bamboo(tmp_path / "t.txt") == events


@pytest.mark.parametrize(
    "line,msg",
    [
        ("1,add", "expected 'milliseconds,add|remove,nodeName'"),
        ("x,add,n", "milliseconds 'x' is not a number"),
        ("5,kill,n", "kind add|remove"),
        ("-5,add,n", "ms >= 0"),
    ],
)
def test_bad_lines_name_the_line(line: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg) as e:
        parse_bamboo(["0,add,a", line], "t.txt")
    assert "t.txt:2" in str(e.value)


def test_shipped_traces_are_what_the_generator_writes(tmp_path: Path) -> None:
    generate(tmp_path)
    for name in [*SHIPPED, *(f"spot_gen_s{s}.txt" for s in GENERATED_SEEDS)]:
        assert (tmp_path / name).read_text() == (TRACE_DIR / name).read_text()
    for name in SHIPPED:
        events = load_bamboo(TRACE_DIR / name)
        assert sum(1 for e in events if e.time_s == 0 and e.kind == "add") == SHIPPED[name][0]


def test_poisson_generator_is_seeded_and_alternates_per_device() -> None:
    a = poisson_device_failures(32, 0.1, 9, seed=3)
    assert a == poisson_device_failures(32, 0.1, 9, seed=3)
    assert a != poisson_device_failures(32, 0.1, 9, seed=4)
    for dev in {e.target for e in a}:
        kinds = [e.kind for e in a if e.target == dev]
        assert kinds[0] == "remove" and all(x != y for x, y in zip(kinds, kinds[1:], strict=False))
    no_repair = poisson_device_failures(1000, 0.1, 9, seed=0, repair_hours=None)
    assert all(e.kind == "remove" for e in no_repair)
    # About 1 - exp(-0.9) = 59 % of devices fail within 9 hours at 0.1 per device-hour.
    assert 0.54 < len(no_repair) / 1000 < 0.64


def test_spot_cluster_trace_is_seeded_bursty_and_replaced() -> None:
    from simulator.traces import spot_cluster_trace  # noqa: PLC0415

    a = spot_cluster_trace(seed=1)
    assert a == spot_cluster_trace(seed=1) and a != spot_cluster_trace(seed=2)
    removes = [e for e in a if e.kind == "remove"]
    adds = [e for e in a if e.kind == "add" and e.time_s > 0]
    times = [e.time_s for e in removes]
    assert len(times) > len(set(times))  # bursts: several nodes reclaimed at one instant
    assert len(adds) >= 0.8 * len(removes)  # reclaimed nodes are replaced (late ones after the end)
    assert max(e.time_s for e in a) == 11 * 3600
    # Over many seeds the preemption rate is bursts x mean burst (1.6 per hour by default).
    rates = [sum(e.kind == "remove" for e in spot_cluster_trace(seed=s)) / 11 for s in range(30)]
    assert 1.1 < sum(rates) / len(rates) < 2.1
    with pytest.raises(ValueError, match="mean_burst"):
        spot_cluster_trace(seed=0, mean_burst=0.5)
