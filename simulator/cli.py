"""`elaswave simulate`: replay a Bamboo trace or Poisson failures for every policy.

elaswave simulate --trace simulator/traces/spot_a.txt --job llama2-34b --out out/sim
elaswave simulate --poisson 0.1 --hours 9 --job chameleon-7b --policies chameleon,recycle,oobleck --out out/c
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from tqdm import tqdm

from planners.chameleon.state import MttrModel
from simulator.engine import SIM_POLICIES, dead_device_timeline, run_policy
from simulator.jobs import JOBS, job
from simulator.report import format_table, summary_rows, write_outputs
from simulator.traces import load_bamboo, poisson_device_failures


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="trace-driven simulation of recovery policies at paper scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace", type=Path, help="Bamboo trace: one 'milliseconds,add|remove,nodeName' per line"
    )
    src.add_argument("--poisson", type=float, metavar="RATE", help="failures per device-hour (seeded)")
    p.add_argument(
        "--hours",
        type=float,
        default=None,
        help="simulated hours (default: the trace's last event rounded up to an hour, or 9)",
    )
    p.add_argument("--job", default="llama2-34b", choices=sorted(JOBS))
    p.add_argument(
        "--policies", default=",".join(SIM_POLICIES), help=f"comma list of {', '.join(SIM_POLICIES)}"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repair-hours", type=float, default=1.0, help="Poisson mode: mean repair time (0: never)"
    )
    p.add_argument(
        "--out", type=Path, required=True, help="directory for summary.csv, timeline.csv, throughput.png"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in policies if x not in SIM_POLICIES]
    if bad or not policies:
        print(
            f"elaswave simulate: --policies: unknown {bad}; choose from {', '.join(SIM_POLICIES)}",
            file=sys.stderr,
        )
        return 2
    spec = job(args.job)
    try:
        if args.trace is not None:
            events = load_bamboo(args.trace)
            hours = args.hours or math.ceil(max((e.time_s for e in events), default=1.0) / 3600)
            source = f"trace {args.trace.name}"
        else:
            hours = args.hours or 9.0
            repair = args.repair_hours if args.repair_hours > 0 else None
            events = poisson_device_failures(spec.shape.num_devices, args.poisson, hours, args.seed, repair)
            source = f"Poisson {args.poisson}/device-hour, seed {args.seed}"
    except (OSError, ValueError) as e:
        print(f"elaswave simulate: {e}", file=sys.stderr)
        return 2
    if hours <= 0:
        print("elaswave simulate: --hours must be > 0", file=sys.stderr)
        return 2
    horizon = hours * 3600
    timeline = dead_device_timeline(events, spec)
    changes = max(len(timeline) - 1, 1)
    gap = (
        horizon / changes
        if args.trace is not None
        else 3600 / max(args.poisson * spec.shape.num_devices, 1e-9)
    )
    mttr = MttrModel()
    runs = []
    with tqdm(total=len(policies) * len(timeline), desc="simulate", unit="event", disable=None) as bar:
        for policy in policies:
            runs.append(run_policy(policy, spec, timeline, horizon, gap, mttr, on_event=bar.update))
    title = f"{spec.name}: {source}, {hours:g} h"
    paths = write_outputs(runs, mttr, args.out, title)
    print(title)
    print(format_table(summary_rows(runs, mttr)))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
