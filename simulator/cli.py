"""`elaswave simulate`: replay a Bamboo trace or Poisson failures for every policy.

elaswave simulate --trace simulator/traces/spot_a.txt --job llama2-34b --out out/sim
elaswave simulate --poisson 0.1 --hours 9 --job chameleon-7b --policies chameleon,recycle,oobleck --out out/c
elaswave simulate --trace t.txt --cost torchft_model=paper --cost checkpoint_interval_s=600 --out out/p
elaswave simulate --trace t.txt --costs simulator/cost_files/measured_cpu.json --out out/m
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm import tqdm

from simulator.cluster import cluster_timeline
from simulator.costs import describe, load_costs, parse_overrides
from simulator.engine import run_policy
from simulator.jobs import JOBS, job
from simulator.policies import SIM_POLICIES
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
        help="simulated hours (default: the trace's last event; 9 for --poisson)",
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
        "--spares",
        choices=("swap", "idle"),
        default="swap",
        help="swap: a waiting spare takes a preempted slot at once (a join, priced); idle: spares never do",
    )
    p.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a recovery cost (simulator.costs.RecoveryCosts), e.g. torchft_model=paper, "
        "detection_s=5, checkpoint_interval_s=600; repeatable",
    )
    p.add_argument(
        "--costs",
        type=Path,
        default=None,
        metavar="FILE",
        help="recovery costs from a cost file (simulator/cost_files/paper_scale.json, or one "
        "`python -m bench.calibrate` wrote); --cost overrides it",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory for summary.csv, timeline.csv, events.csv, throughput.png",
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in policies if x not in SIM_POLICIES]
    if bad or not policies:
        return _fail(f"--policies: unknown {bad}; choose from {', '.join(SIM_POLICIES)}")
    if args.hours is not None and args.hours <= 0:
        return _fail("--hours must be > 0")
    spec = job(args.job)
    try:
        costs = parse_overrides(args.cost, load_costs(args.costs) if args.costs is not None else None)
        if args.trace is not None:
            events = load_bamboo(args.trace)
            source = f"trace {args.trace.name}"
        else:
            repair = args.repair_hours if args.repair_hours > 0 else None
            events = poisson_device_failures(
                spec.shape.num_devices, args.poisson, args.hours or 9.0, args.seed, repair
            )
            source = f"Poisson {args.poisson}/device-hour, seed {args.seed}"
        cluster = cluster_timeline(events, spec, args.spares)
    except (OSError, ValueError) as e:
        return _fail(str(e))
    horizon = (
        args.hours * 3600 if args.hours else (cluster.trace_end_s if args.trace is not None else 9 * 3600.0)
    )
    if horizon <= 0:
        return _fail(f"{source} has no event after t=0: give --hours")
    runs = []
    with _progress(len(policies) * len(cluster.changes)) as tick:
        for policy in policies:
            runs.append(run_policy(policy, spec, cluster.changes, horizon, costs, on_event=tick))
            if not sys.stderr.isatty():
                print(f"simulate: {policy} done ({len(runs)}/{len(policies)})", file=sys.stderr, flush=True)
    config: dict[str, object] = {
        "job": spec.name,
        "source": source,
        "horizon_h": round(horizon / 3600, 4),
        "trace_end_h": round(cluster.trace_end_s / 3600, 4),
        "seed": args.seed,
        "spares": args.spares,
        "costs_file": str(args.costs) if args.costs is not None else "defaults (paper scale)",
    } | describe(costs)
    title = (
        f"{spec.name}: {source}, {horizon / 3600:.2f} h, spares {args.spares}, "
        f"TorchFT model {costs.torchft_model}"
    )
    paths = write_outputs(runs, cluster, config, args.out, title)
    print(title)
    print(
        f"preemptions of running nodes {cluster.preemptions_of_running}, absorbed by spares "
        f"{cluster.absorbed_by_spares}; cluster changes {len(cluster.changes) - 1}"
    )
    print(format_table(summary_rows(runs, cluster, config)))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


class _progress:
    """A tqdm bar on a terminal; elsewhere one line per policy (printed by `main`)."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, desc="simulate", unit="event") if sys.stderr.isatty() else None

    def __enter__(self):  # noqa: ANN204 - returns the per-event callback
        return self.bar.update if self.bar is not None else (lambda: None)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _fail(message: str) -> int:
    print(f"elaswave simulate: {message}", file=sys.stderr)
    return 2
