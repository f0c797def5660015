"""`elaswave run`: the launcher, with torchrun's habits.

    elaswave run [--nnodes N] [--nproc-per-node K] [--pp P] [--job NAME] [--checkpoint-dir DIR]
                 [--checkpoint-every N] [--resume DIR] [--timeout S] script.py [script args]
    elaswave run --core HOST:PORT[,HOST:PORT] --nnodes N ... script.py [script args]  # on every node

On one machine (no --core) it

1. runs `python script.py args` once in describe mode (`launcher_describe`): the script's
   `elaswave.train(...)` writes its model's units, measured costs and schedule, and exits;
2. lays the job out (`planners.placement`): stage boundaries by measured cost, DP per stage,
   each stage's ranks spread over the (simulated) nodes;
3. creates the job with that layout over REST on an embedded Core, which started with the
   rendezvous stores while the model was described (`launcher_session.LocalServices`), and starts
   one agent per rank, each launching `python script.py args` as that rank
   (`launcher_procs`), with the worker contract of `wire.worker_env` in its environment;
4. prints progress from the Core about once a second and exits when every worker has
   (`launcher_monitor`), 0 when the job completed;
5. on Ctrl-C or SIGTERM asks the workers to stop about two seconds of steps on (`ELASWAVE_STOP_FILE`), waits for
   them (bounded), tears everything down and prints how to resume.

`--nnodes N` without `--core` simulates N nodes here: node n runs ranks n*K .. n*K+K-1, and the
rank -> node map is in `<run dir>/nodes.json`. With `--core HOST:PORT[,...]` (every `elaswave
core`'s REST address) the same command on each of N nodes joins one job: the leading Core lays it
out and creates it, the launchers run its stores (the store on one node, its standby on another:
`store_keeper`), and each launcher runs its own node's ranks (`launcher_join`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from elaswave.launcher_control import (
    DEFAULT_WORKER_TIMEOUT_S,
    StopRequest,
    job_name,
)
from elaswave.launcher_tls import add_core_tls_arguments, core_tls_of
from wire import worker_env as we

if TYPE_CHECKING:
    from elaswave.launcher_join import Joined
    from elaswave.launcher_session import LocalServices
    from elaswave.store_keeper import StoreKeeper
    from planners.placement import Placement


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="launch a training script as an elastic PP x DP x ZeRO job (like torchrun)",
        description="Run a script that calls elaswave.train(...) as an elastic job: describe its model once, "
        "lay it out over --nnodes x --nproc-per-node workers in --pp stages, start an embedded Core, the "
        "rendezvous store and one agent per worker, and show progress until the job ends. Ctrl-C stops "
        "the job at a step boundary (checkpointing first when --checkpoint-dir is set).",
        epilog="example: elaswave run --nproc-per-node 4 --pp 2 --checkpoint-dir ckpt train.py --lr 3e-4",
    )
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes; without --core they are simulated on this machine (default 1)",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument(
        "--core",
        metavar="HOST:PORT[,HOST:PORT]",
        help="join a multi-node job through the Cores whose REST APIs are at HOST:PORT (their "
        "--http-port; give every Core sharing the registry, so that the job outlives any of them): run "
        "the same command on each of --nnodes nodes; needs $ELASWAVE_SCHEDULER_TOKEN",
    )
    parser.add_argument(
        "--store-host",
        metavar="HOST",
        help="with --core: the address the other nodes reach this node's rendezvous store at "
        "(default: this node's address on the route to the first Core)",
    )
    add_core_tls_arguments(parser)
    parser.add_argument(
        "--node-id",
        help="with --core: this node's name in the job, unique per node "
        "(default: host name and launcher pid)",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --core: seconds to wait for the other nodes to join (default 300)",
    )
    parser.add_argument("--job", help="job name (default: the script's name)")
    parser.add_argument(
        "--mem-per-worker",
        type=float,
        metavar="GIB",
        help="memory one worker may use (GiB): stage boundaries keep every worker within it, "
        "and a job that cannot fit is refused with what to change",
    )
    parser.add_argument("--resume", type=Path, metavar="DIR", help="resume from the latest checkpoint in DIR")
    parser.add_argument("--checkpoint-dir", type=Path, metavar="DIR", help="write checkpoints to DIR")
    parser.add_argument("--checkpoint-every", type=int, metavar="N", help="steps between checkpoints")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_WORKER_TIMEOUT_S,
        metavar="S",
        help=f"seconds any collective, vote or plan wait may take (default {DEFAULT_WORKER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="layout, logs and results of this run (default ./elaswave-run/<job>)",
    )
    parser.add_argument(
        "--describe-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds the script may take to describe its model (default 300)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds workers get to stop after Ctrl-C/SIGTERM before they are killed (default 60)",
    )
    parser.add_argument(
        "--tee", action="store_true", help="workers print to this terminal (default: to <run dir>/rank-R.log)"
    )
    parser.add_argument(
        "--cold-workers",
        action="store_true",
        help="start every worker as its own `python script.py` instead of forking it from this node's "
        "warm zygote (torch imported once; docs/engine.md, 'Warm starts')",
    )
    parser.add_argument(
        "--devices-per-node",
        type=int,
        metavar="N",
        help="accelerators per node: local rank i runs on device i (of $CUDA_VISIBLE_DEVICES or "
        "$ASCEND_RT_VISIBLE_DEVICES when set); default: the visible list's length",
    )
    parser.add_argument(
        "--share-devices",
        action="store_true",
        help="let a node run more workers than devices (rank i on device i mod N); collectives over gloo",
    )
    parser.add_argument("script", type=Path, help="the training script (calls elaswave.train)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(func=run)


class UsageError(ValueError):
    """A flag is wrong; the message says which and how to fix it."""


def check_args(args: argparse.Namespace) -> None:
    from elaswave.launcher_join import NODE_ID_PATTERN, SCHEDULER_TOKEN_ENV, parse_cores  # noqa: PLC0415

    if args.core is not None:
        try:
            parse_cores(args.core)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if not os.environ.get(SCHEDULER_TOKEN_ENV, "").strip():
            raise UsageError(
                f"--core needs the Core's scheduler token in ${SCHEDULER_TOKEN_ENV} (joining a job "
                "creates it); export it on every node"
            )
    elif args.node_id is not None or getattr(args, "store_host", None) is not None:
        flag = "--node-id" if args.node_id is not None else "--store-host"
        raise UsageError(f"{flag} names a node of a multi-node job: it needs --core")
    try:
        args.core_tls = core_tls_of(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.node_id is not None and not NODE_ID_PATTERN.fullmatch(args.node_id):
        raise UsageError(f"--node-id {args.node_id!r}: use 1-128 letters, digits, '.', '_', ':', '@' or '-'")
    for name in ("nnodes", "nproc_per_node", "pp"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    for name in ("timeout", "describe_timeout", "stop_timeout", "rendezvous_timeout"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if not args.script.is_file():
        raise UsageError(f"script {str(args.script)!r} does not exist (give the path of a Python file)")
    if args.resume is not None and not args.resume.is_dir():
        raise UsageError(f"--resume {str(args.resume)!r} is not a directory of checkpoints")
    if args.job is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", args.job):
        raise UsageError(
            f"--job {args.job!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except UsageError as exc:
        print(f"elaswave run: error: {exc}", file=sys.stderr)
        return we.EXIT_USAGE
    stop = StopRequest()
    stop.install()
    try:
        return _run(args, stop)
    except KeyboardInterrupt:
        print("[elaswave] stopped", file=sys.stderr)
        return 128 + (stop.signum or signal.SIGINT)


def _run(args: argparse.Namespace, stop: StopRequest) -> int:
    name = job_name(args)
    keeper = None
    local: LocalServices | None = None
    if (
        args.core is None
    ):  # the Core, the stores and the zygote start (each imports ~1 s) while the model is described
        from elaswave.launcher_procs import LaunchError  # noqa: PLC0415
        from elaswave.launcher_session import LocalServices  # noqa: PLC0415

        try:
            local = LocalServices.begin(args.run_dir or Path.cwd() / "elaswave-run" / name, args.cold_workers)
        except LaunchError as exc:
            print(f"elaswave run: error: {exc}", file=sys.stderr)
            return 1
    else:  # this node's zygote and store start while the model is described
        from elaswave.launcher_join import JoinError, default_node_id  # noqa: PLC0415

        args.node_id = args.node_id or default_node_id()
        try:
            keeper = start_node_stores(args, name)
        except JoinError as exc:
            print(f"elaswave run: error: {exc}", file=sys.stderr)
            return exc.exit_code
    print(
        f"[elaswave] describing the model: python {args.script} {shlex.join(args.script_args)}".rstrip(),
        flush=True,
    )
    try:
        return _describe_and_launch(args, stop, name, keeper, local)
    finally:
        if local is not None:  # stopped by the session already, unless it never began
            local.stop()
        if keeper is not None and keeper.zygote is not None:  # likewise
            keeper.zygote.stop()
            shutil.rmtree(keeper.zygote.socket.parent, ignore_errors=True)


def _describe_and_launch(
    args: argparse.Namespace,
    stop: StopRequest,
    name: str,
    keeper: StoreKeeper | None,
    local: LocalServices | None,
) -> int:
    from elaswave.launcher_describe import DescribeError, describe  # noqa: PLC0415
    from planners.described_model import unit_costs  # noqa: PLC0415
    from planners.placement import PlacementError, plan_placement  # noqa: PLC0415

    try:
        # forked from this node's zygote (`LocalServices`, or `start_node_stores` on a joined node)
        warm = local.warm if local is not None else keeper.zygote if keeper is not None else None
        spawn = warm.fork if warm is not None else None
        desc = describe(args.script, args.script_args, args.describe_timeout, spawn=spawn)
    except DescribeError as exc:
        if keeper is not None:
            keeper.stop()
        print(f"elaswave run: error: {exc}", file=sys.stderr)
        return 1
    joined = None
    if keeper is not None:
        from elaswave.launcher_join import JoinError, join_job, placement_of  # noqa: PLC0415
        from elaswave.launcher_procs import LaunchError  # noqa: PLC0415

        try:
            keeper.started()
            print(
                f"[elaswave] joining job {name!r} through the Core(s) at {args.core} with this node's "
                f"store(s) {', '.join(keeper.own())}: waiting up to {args.rendezvous_timeout:g} s for all "
                f"{args.nnodes} nodes",
                flush=True,
            )
            joined = join_job(
                args, name, desc.to_json(), os.environ["ELASWAVE_SCHEDULER_TOKEN"].strip(), keeper.own()
            )
        except (JoinError, LaunchError) as exc:
            keeper.stop()
            print(f"elaswave run: error: {exc}", file=sys.stderr)
            return exc.exit_code if isinstance(exc, JoinError) else 1
        keeper.adopt(joined.store_address.split(","))
        placement = placement_of(joined)
        if joined.spare_worker_ids:
            print(
                f"[elaswave] job {name!r} is running: this node ({joined.node_id}) joins it with spare "
                f"workers {list(joined.spare_worker_ids)}, each taken in by the Core's plan where the job "
                f"needs it; store at {joined.store_address}",
                flush=True,
            )
        else:
            print(
                f"[elaswave] joined as node {joined.node_index} of {args.nnodes} ({joined.node_id}): ranks "
                f"{list(joined.ranks)}; store at {joined.store_address}",
                flush=True,
            )
    else:
        try:
            placement = plan_placement(
                unit_costs(desc),
                global_batch=desc.global_batch,
                micro_batches=desc.micro_batches,
                nnodes=args.nnodes,
                nproc_per_node=args.nproc_per_node,
                pp=args.pp,
                mem_cap_bytes=mem_cap_bytes(args),
            )
        except PlacementError as exc:
            print(f"elaswave run: error: {exc}", file=sys.stderr)
            return we.EXIT_USAGE
    try:
        return _launch(args, stop, name, desc, placement, joined, keeper, local)
    finally:
        if keeper is not None:  # after the session's teardown: its agents stopped first
            keeper.stop()


def _launch(
    args: argparse.Namespace,
    stop: StopRequest,
    name: str,
    desc: we.ModelDescription,
    placement: Placement,
    joined: Joined | None,
    keeper: StoreKeeper | None,
    local: LocalServices | None,
) -> int:
    print(
        f"[elaswave] {len(desc.units)} units, {sum(u.numel for u in desc.units):,} parameters, global batch "
        f"{desc.global_batch} in {desc.micro_batches} micro-batches, {desc.steps} steps",
        flush=True,
    )
    print(f"[elaswave] layout: {placement.reason}", flush=True)
    for warning in placement.warnings:
        print(f"[elaswave] WARNING: {warning}", file=sys.stderr, flush=True)
    from elaswave.device_map import DeviceMapError, worker_device_env  # noqa: PLC0415

    try:  # one device per local rank (docs/accelerators.md); refused before anything starts
        nodes_ranks = {n: placement.ranks_on_node(n) for n in range(args.nnodes)}
        args.device_env = worker_device_env(
            nodes_ranks,
            getattr(args, "devices_per_node", None),
            os.environ,
            getattr(args, "share_devices", False),
        )
    except DeviceMapError as exc:
        print(f"elaswave run: error: {exc}", file=sys.stderr)
        return we.EXIT_USAGE
    if local is not None:
        run_dir = local.run_dir
        local.launched = True
    else:  # several nodes of one job may share a working directory (simulated nodes, a shared home)
        from elaswave.launcher_session import prepare_run_dir  # noqa: PLC0415

        assert joined is not None
        node = f"node-{joined.node_index}" if joined.node_index >= 0 else f"node-{joined.node_id}"
        run_dir = prepare_run_dir(args.run_dir or Path.cwd() / "elaswave-run" / name / node)
    (run_dir / "layout.json").write_text(placement.layout.to_json())
    (run_dir / "description.json").write_text(desc.to_json())
    nodes = {str(n): list(placement.ranks_on_node(n)) for n in range(args.nnodes)}
    record: dict[str, object] = {
        "rank_node": list(placement.rank_node),
        "nodes": nodes,
        "exposed_stages": list(placement.exposed_stages),
    }
    if joined is not None:
        record |= {"this_node": joined.node_index, "node_ids": joined.nodes}
    (run_dir / "nodes.json").write_text(json.dumps(record, indent=1))
    print(
        f"[elaswave] run directory {run_dir} (layout.json, nodes.json, rank-R.log, rank-R.json)", flush=True
    )
    from elaswave.launcher_session import Session  # noqa: PLC0415 - httpx only once we launch

    with tempfile.TemporaryDirectory(prefix="ew-") as sockets:  # short: Unix socket paths <= 107 bytes
        session = Session(args, name, desc, placement, run_dir, Path(sockets), stop, joined, keeper, local)
        stop.graceful = True
        try:
            return session.run()
        finally:
            session.teardown()


def start_node_stores(args: argparse.Namespace, name: str) -> StoreKeeper:
    """This node's rendezvous store(s) for a job joined through the Cores, started in the
    background: one, or the store and its standby where the job has one node; the rendezvous
    keeps those the job uses. Raises JoinError when this node's address cannot be told."""
    from elaswave.launcher_join import store_host  # noqa: PLC0415
    from elaswave.launcher_procs import LaunchError, WarmWorkers  # noqa: PLC0415
    from elaswave.launcher_session import warm_env  # noqa: PLC0415
    from elaswave.store_keeper import StoreKeeper  # noqa: PLC0415

    log_dir = (args.run_dir or Path.cwd() / "elaswave-run" / name).resolve() / f"stores-{args.node_id}"
    log_dir.mkdir(parents=True, exist_ok=True)
    # This node's zygote first: the stores, the describe run and the workers are forked from it.
    # The keeper holds it until the session takes it over (`Session.run`); `_run` stops it.
    zygote = None
    if not args.cold_workers:
        try:
            zygote = WarmWorkers.begin(
                Path(tempfile.mkdtemp(prefix="ew-z-")), warm_env(), log_dir / "zygote.log"
            )
        except LaunchError as exc:  # optional: everything then starts cold
            print(f"[elaswave] no worker zygote ({exc}): processes start cold", file=sys.stderr, flush=True)
    keeper = StoreKeeper(warm_env(), log_dir, host=store_host(args), zygote=zygote)
    keeper.begin(1 if args.nnodes > 1 else 2)  # `keeper.started()` waits for them
    return keeper


def mem_cap_bytes(args: argparse.Namespace) -> float | None:
    return None if args.mem_per_worker is None else float(args.mem_per_worker) * 2**30
