"""``elaswave agent``: run the agent daemon beside one training worker."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.config import TOKEN_ENV, AgentConfig, TlsFiles, parse_address, parse_address_list
from agent.frequency import CHOICES, DEFAULT_CLOCK_RANGE, parse_clock_range
from wire import core_tls
from wire.local_protocol import CONTROL_ENV

DESCRIPTION = f"""\
Run the ElasWave agent beside one training worker. The agent watches the worker process (its
exit is reported to the Core at once), probes host, worker, accelerators and links to peers,
forwards the executor's per-step metrics, turns SIGTERM or a preemption notice file into a
preemption report, and keeps one authenticated gRPC stream to the leading ElasWave Core
(reconnecting across --core addresses with backoff). With --etcd it also holds its own liveness
lease in etcd.

Give the worker either as a command after '--' (the agent launches it, exports
ELASWAVE_METRICS_SOCKET, {CONTROL_ENV}, ELASWAVE_JOB and ELASWAVE_WORKER_ID to it, and exits
with its status) or as --pid of a running process.

Core commands: SetFrequency goes to the clock controller chosen by --frequency-controller (the
log line 'frequency_controller' and every device probe say which one is active); the result,
applied or refused with the reason, is in the next device probe. Drain writes a drain notice to
the worker's control file ({CONTROL_ENV}; the worker stops at its next step boundary),
SIGTERMs a worker still running after --drain-grace and SIGKILLs it --grace later, then leaves.
ReportNow sends heartbeat, probes, memory and the last step metrics at once.

Signals: SIGTERM = preemption (report, forward SIGTERM to a launched worker, wait up to --grace,
then leave); SIGINT = clean shutdown (stop a launched worker, leave).
Exit status: the worker's (128 + signal when it was killed), 0 when the agent was stopped first,
2 for bad flags.
The job token comes from --job-token-file or ${TOKEN_ENV} (never put it on the command line).
"""

EPILOG = """\
example:
  ELASWAVE_JOB_TOKEN=s3cret elaswave agent --job llama7b --worker-id w3 \\
      --core core-a:7070,core-b:7070 --rank 4 --stage 1 --dp-rank 0 --etcd etcd-0:2379 \\
      -- python train.py --config llama7b.yaml
"""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="run the agent daemon beside one training worker",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_agent)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    who = parser.add_argument_group("identity")
    who.add_argument("--job", required=True, help="job name (required)")
    who.add_argument("--worker-id", required=True, help="this worker's id inside the job (required)")
    who.add_argument(
        "--stage", type=int, default=-1, help="pipeline stage of the worker; -1 = unknown (default)"
    )
    who.add_argument(
        "--dp-rank", type=int, default=-1, help="data-parallel rank in the stage; -1 = unknown (default)"
    )
    who.add_argument(
        "--rank",
        type=int,
        default=-1,
        help="global training rank of the worker in the job's layout; -1 = none (default)",
    )

    worker = parser.add_argument_group("worker")
    worker.add_argument("--pid", type=int, help="watch this running process instead of launching a command")
    worker.add_argument(
        "--zygote",
        type=Path,
        metavar="SOCKET",
        help="fork the worker from this node's warm zygote (python -m agent.zygote), torch already "
        "imported; a command it cannot fork starts cold, as without this flag",
    )
    worker.add_argument(
        "command", nargs="*", metavar="-- COMMAND", help="worker command to launch, after '--'"
    )

    core = parser.add_argument_group("core link")
    core.add_argument(
        "--core",
        required=True,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="Core addresses, tried in turn; a standby's leader hint is followed (required)",
    )
    core.add_argument("--job-token-file", type=Path, help=f"file holding the job token (else ${TOKEN_ENV})")
    core.add_argument(
        "--tls-ca",
        type=Path,
        help=f"PEM CA bundle: use TLS to the Core (default ${core_tls.CA_ENV}; without one: plaintext)",
    )
    core.add_argument(
        "--tls-cert",
        type=Path,
        help=f"PEM client certificate for mTLS (needs --tls-ca, --tls-key; default ${core_tls.CERT_ENV})",
    )
    core.add_argument(
        "--tls-key", type=Path, help=f"PEM client private key for mTLS (default ${core_tls.KEY_ENV})"
    )
    core.add_argument(
        "--heartbeat-interval",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="seconds between heartbeats (default 0.5)",
    )
    core.add_argument(
        "--register-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds to wait for the Core's RegisterAck (default 5); with only one Core, at least 30: a stalled Core would read the dropped stream as this worker's failure",
    )
    core.add_argument(
        "--rpc-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds any single write or etcd call may take (default 2)",
    )
    core.add_argument(
        "--leave-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds to spend delivering Leave on shutdown (default 2)",
    )

    probing = parser.add_argument_group("probes and metrics")
    probing.add_argument(
        "--probe-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="seconds between host/process/device/interconnect reports (default 5)",
    )
    probing.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="peer to probe by TCP connect latency; repeat for several (default none)",
    )
    probing.add_argument(
        "--peer-timeout",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="seconds before a peer probe counts as failed (default 0.5)",
    )
    probing.add_argument(
        "--metrics-socket",
        type=Path,
        help="Unix datagram socket for step metrics (default "
        "$XDG_RUNTIME_DIR/elaswave/<job>.<worker>.metrics.sock, or /tmp/elaswave-<uid>/...)",
    )

    preempt = parser.add_argument_group("preemption")
    preempt.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds between SIGTERM and the worker's forced end (default 30, as Kubernetes/Slurm)",
    )
    preempt.add_argument(
        "--notice-file",
        type=Path,
        help="report preemption when this file appears (or exists at start); its content may be "
        "a deadline in unix seconds, else now + --grace (default: no file watched)",
    )

    clock = parser.add_argument_group("device clock (DVFS) and drain")
    clock.add_argument(
        "--frequency-controller",
        default="auto",
        choices=CHOICES,
        help="who applies SetFrequency: nvml (NVIDIA), npu-smi (Ascend), simulated (CPU runs), "
        "none; auto = nvml on CUDA hosts, npu-smi on Ascend hosts, simulated on CPU hosts "
        "(default auto)",
    )
    clock.add_argument(
        "--clock-range",
        default=DEFAULT_CLOCK_RANGE,
        metavar="MIN:NOMINAL:MAX",
        help="MHz range of the simulated and npu-smi controllers; SetFrequency outside it is "
        f"refused, 0 restores NOMINAL (default {DEFAULT_CLOCK_RANGE}: 910B, ElasWave §5)",
    )
    clock.add_argument(
        "--npu-smi-set",
        metavar="COMMAND",
        help="command that sets one Ascend device's AI core clock, with {id} and {mhz} "
        "placeholders (default: none, npu-smi requests are refused)",
    )
    clock.add_argument(
        "--control-file",
        type=Path,
        help=f"file the agent writes the clock factor and drain notice to, exported as "
        f"${CONTROL_ENV} (default: beside the metrics socket, <job>.<worker>.control.json)",
    )
    clock.add_argument(
        "--drain-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds a drained worker has to stop at a step boundary before SIGTERM (default 10)",
    )

    lease = parser.add_argument_group("etcd liveness lease")
    lease.add_argument(
        "--etcd", metavar="HOST:PORT", help="hold the liveness lease in this etcd (default: the Core does)"
    )
    lease.add_argument("--etcd-prefix", default="/elaswave", help="key prefix (default /elaswave)")
    lease.add_argument(
        "--lease-ttl",
        type=int,
        default=3,
        metavar="SECONDS",
        help="lease time-to-live in whole seconds, refreshed every TTL/3 (default 3)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default INFO)",
    )


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files of the flags, else of the environment (wire.core_tls: what a launcher hands
    its agents); None: plaintext. ValueError names what is missing."""
    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        env = core_tls.from_env()
        return None if env is None else TlsFiles(env.ca, env.cert, env.key)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        raise ValueError("--tls-cert/--tls-key need --tls-ca")
    return TlsFiles(args.tls_ca, args.tls_cert, args.tls_key)


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """AgentConfig from parsed flags; ValueError names the flag that is wrong."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    tls = _tls_files(args)
    return AgentConfig(
        job=args.job,
        worker_id=args.worker_id,
        cores=parse_address_list(args.core, "--core"),
        worker_command=tuple(command),
        worker_pid=args.pid,
        worker_zygote=args.zygote,
        stage=args.stage,
        dp_rank=args.dp_rank,
        rank=args.rank,
        heartbeat_interval_s=args.heartbeat_interval,
        probe_interval_s=args.probe_interval,
        register_timeout_s=args.register_timeout,
        rpc_timeout_s=args.rpc_timeout,
        leave_timeout_s=args.leave_timeout,
        grace_s=args.grace,
        notice_file=args.notice_file,
        metrics_socket=args.metrics_socket,
        peers=tuple(parse_address(peer, "--peer") for peer in args.peer),
        peer_timeout_s=args.peer_timeout,
        job_token_file=args.job_token_file,
        tls=tls,
        etcd=parse_address(args.etcd, "--etcd") if args.etcd else None,
        etcd_prefix=args.etcd_prefix,
        lease_ttl_s=args.lease_ttl,
        frequency_controller=args.frequency_controller,
        clock_range=parse_clock_range(args.clock_range),
        npu_smi_set=args.npu_smi_set,
        control_file=args.control_file,
        drain_grace_s=args.drain_grace,
    )


def run_agent(args: argparse.Namespace) -> int:
    from agent.daemon import Agent
    from agent.logs import setup_logging

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"elaswave agent: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    try:
        return asyncio.run(Agent(config).run())
    except ValueError as exc:  # the worker could not be started or watched, socket in use, ...
        print(f"elaswave agent: error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m agent ...``: the same subcommand without the rest of the elaswave CLI."""
    parser = argparse.ArgumentParser(prog="elaswave")
    register(parser.add_subparsers(dest="command_name", required=True))
    args = parser.parse_args(["agent", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
