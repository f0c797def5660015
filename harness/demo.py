"""`elaswave demo`: ElasWave end to end on one machine, on embedded defaults.

By default the story of `harness.demo_story`: a Core, agents, and a PP x DP x ZeRO-1 job of the
GPT example that lives through a kill, a straggler, a preemption, a node's loss and a join, all in
place, then the report of `harness.demo_report` (report.json, demo.png, a summary table).
`--control-plane` runs the control plane alone: a Core with in-memory membership, a job created
through the REST API, a few agents each launching a dummy worker, one worker killed with SIGKILL
and the Core seen to declare it lost. Every process is real; everything listens on loopback ports
picked at random.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from harness.control_plane import Demo, states


def register(subparsers: argparse._SubParsersAction) -> None:
    from harness.demo_story import StoryConfig  # noqa: PLC0415 - light: no torch at import

    s = StoryConfig()
    parser = subparsers.add_parser(
        "demo",
        help="run the end-to-end demo on this machine",
        description="Start a Core (in-memory membership), the executors' rendezvous store and one agent per "
        "worker of a PP x DP x ZeRO-1 training job of the GPT example, and take it through every kind of event "
        "in place: a kill, a straggler (simulated clock on CPU), a preemption through the scheduler API, a "
        "node's loss and a join; then write report.json and demo.png, measured against a fault-free run of "
        "the same seed (about a minute on 2 cores). --control-plane: dummy workers, the Core's detection only (~10 s).",
    )
    parser.add_argument(
        "--control-plane",
        action="store_true",
        help="run the control-plane demo with dummy workers instead of training",
    )
    parser.add_argument(
        "--workers", type=int, default=3, help="control-plane demo: agents/workers (default 3)"
    )
    parser.add_argument("--pp", type=int, default=s.pp, help=f"pipeline stages (default {s.pp})")
    parser.add_argument(
        "--dp", type=int, default=s.dp, help=f"data-parallel ranks per stage (default {s.dp})"
    )
    parser.add_argument("--steps", type=int, default=s.steps, help=f"training steps (default {s.steps})")
    parser.add_argument(
        "--out",
        default="elaswave-demo",
        metavar="DIR",
        help="where report.json and demo.png go (default ./elaswave-demo)",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="give up after this many seconds")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.control_plane:
        return run_story_demo(args)
    with tempfile.TemporaryDirectory(prefix="elaswave-demo-") as tmp:
        demo = Demo(Path(tmp), args.workers, args.timeout)
        try:
            return _run(demo)
        finally:
            demo.stop()


def run_story_demo(args: argparse.Namespace) -> int:
    """The whole story (harness.demo_story), then the report measured from it (harness.demo_report)."""
    from harness.chaos import fault_free_run  # noqa: PLC0415
    from harness.demo_output import plot, summary_lines  # noqa: PLC0415
    from harness.demo_report import build_report, problems  # noqa: PLC0415
    from harness.demo_story import StoryConfig, StoryRun, run_story, say  # noqa: PLC0415

    started = time.monotonic()
    try:
        cfg = StoryConfig(pp=args.pp, dp=args.dp, steps=args.steps, timeout_s=args.timeout)
        cfg.check()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as exc:
        print(f"elaswave demo: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="elaswave-demo-") as tmp:
        story = StoryRun(Path(tmp), cfg)
        try:
            record = run_story(story)
        finally:
            story.stop()
        say("the fault-free run: the same script and seed in one process (losses, final checkpoint)")
        ref_losses, ref_ckpt = fault_free_run(story)
        report = build_report(record, ref_losses, ref_ckpt)
    found = problems(report, record)
    report["problems"] = found
    report["wall_s"] = time.monotonic() - started
    (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    plot(report, out / "demo.png")
    for line in summary_lines(report):
        say(line)
    for problem in found:
        say(f"CHECK FAILED: {problem}")
    say(f"report: {out / 'report.json'}; figure: {out / 'demo.png'}; {report['wall_s']:.0f} s")
    if not found:
        say("checks passed: no process restarted, the state and the loss curve are the fault-free run's")
    return 1 if found else 0


def _run(demo: Demo) -> int:
    info = demo.start_core()
    print(
        f"[demo] Core up: gRPC 127.0.0.1:{info['grpc_port']}, REST http://127.0.0.1:{info['http_port']}/api/v1/jobs"
    )
    token = demo.create_job()
    print("[demo] job 'demo' created through POST /api/v1/jobs")
    demo.start_agents(info["grpc_port"], token)
    job = demo.wait_for(
        "every worker to run",
        lambda j: len(j["members"]) == demo.workers and all(s == "RUNNING" for s in states(j).values()),
    )
    print(f"[demo] {demo.workers} agents registered, workers stepping: {states(job)}")
    victim = job["members"][-1]
    print(f"[demo] kill -9 worker pid {victim['pid']} ({victim['worker_id']})")
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    job = demo.wait_for("the Core to see the kill", lambda j: states(j)[victim["worker_id"]] == "LOST")
    seen_after = time.monotonic() - killed_at
    lost = next(m for m in job["members"] if m["worker_id"] == victim["worker_id"])
    print(
        f"[demo] Core marked {victim['worker_id']} LOST after {seen_after * 1000:.0f} ms: {lost['lost_reason']}"
    )
    print(f"[demo] members now: {states(job)}")
    assert demo.http is not None
    events = demo.http.get("/api/v1/jobs/demo/events").json()["events"]
    print("[demo] events:")
    for event in events:
        print(f"    #{event['seq']:<3} {event['kind']:<18} {event['worker_id']:<10} {event['detail']}")
    return 0
