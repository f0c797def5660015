"""`elaswave core`: run one Core (leader or standby)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from core_service.config import ConfigError, CoreSettings, load_settings
from core_service.logfmt import configure as configure_logging

EPILOG = """\
Settings come from (highest first) these flags, ELASWAVE_* environment variables (for example
ELASWAVE_SCHEDULER_TOKEN, ELASWAVE_REGISTRY_URL, ELASWAVE_HEARTBEAT_TIMEOUT_S) and a TOML file
(--config or ELASWAVE_CONFIG) whose keys are the same names without the prefix:

    scheduler_token = "..."            # required unless --dev
    registry_url = "etcd://127.0.0.1:2379"
    [[jobs]]
    name = "llama"
    token = "..."                      # per-job token for agents and executors
    expected_workers = 8

Examples:
    # a single Core on one machine, in-memory membership, development tokens
    elaswave core --dev
    # two Cores sharing etcd; whichever wins the election leads, the other stands by
    ELASWAVE_SCHEDULER_TOKEN=$(cat sched.token) elaswave core --registry etcd://10.0.0.5:2379
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "core",
        help="run the ElasWave Core (control plane)",
        description="Run one ElasWave Core: gRPC API for agents, executors and schedulers, REST API "
        "and /metrics over HTTP, failure detection and the schedule engine. Several Cores sharing "
        "an etcd registry elect one leader; the others stand by and take over when it dies.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="TOML configuration file (must exist)")
    parser.add_argument("--grpc-host", help="address for the gRPC server (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, help="gRPC port, 0 = any free port (default 50051)")
    parser.add_argument(
        "--advertise",
        help="host[:port] clients reach this Core's gRPC at, carried in leader hints "
        "(default: $POD_IP, else --grpc-host unless it is a wildcard address)",
    )
    parser.add_argument("--http-host", help="address for the REST API and /metrics (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, help="HTTP port, 0 = any free port (default 8080)")
    parser.add_argument(
        "--registry",
        dest="registry_url",
        help="membership registry: memory:// (default) or etcd://host:port[,host:port]",
    )
    parser.add_argument("--core-id", help="name of this Core in elections and events (default host-random)")
    parser.add_argument(
        "--heartbeat-timeout",
        dest="heartbeat_timeout_s",
        type=float,
        help="seconds; floor of each stream's adaptive heartbeat deadline: a worker silent this long "
        "is late, and lost if no stream of it is open (default 2.0)",
    )
    parser.add_argument(
        "--heartbeat-ceiling",
        dest="heartbeat_ceiling_s",
        type=float,
        help="seconds; a worker silent this long is lost even with its stream open (default max(30, "
        "--heartbeat-timeout))",
    )
    parser.add_argument(
        "--lease-ttl",
        dest="lease_ttl_s",
        type=float,
        help="seconds; liveness lease the Core holds for agents without their own (default 3)",
    )
    parser.add_argument(
        "--leader-ttl",
        dest="leader_ttl_s",
        type=float,
        help="seconds; leadership lease, a standby takes over this long after a crash (default 2)",
    )
    parser.add_argument(
        "--dev",
        dest="dev_mode",
        action="store_true",
        default=None,
        help="development mode: a random scheduler token is generated and printed",
    )
    parser.add_argument(
        "--ready-file", type=Path, help="write {core_id, grpc_port, http_port} as JSON here once serving"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)  # client-supplied values cannot forge log lines
    if args.config:
        os.environ["ELASWAVE_CONFIG"] = str(args.config)
    overrides = {
        name: getattr(args, name)
        for name in (
            "grpc_host",
            "grpc_port",
            "advertise",
            "http_host",
            "http_port",
            "registry_url",
            "core_id",
            "heartbeat_timeout_s",
            "heartbeat_ceiling_s",
            "lease_ttl_s",
            "leader_ttl_s",
            "dev_mode",
        )
    }
    try:
        settings = load_settings(**overrides)
    except ConfigError as exc:
        # One line, exit status 2: a configuration mistake is the operator's to fix, not a crash.
        print("elaswave core: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    if settings.scheduler_token is None:
        import secrets

        from pydantic import SecretStr

        token = secrets.token_urlsafe(24)
        settings.scheduler_token = SecretStr(token)
        print(f"elaswave core: --dev: scheduler token for this run: {token}", file=sys.stderr)
    return asyncio.run(_serve(settings, args.ready_file))


async def _serve(settings: CoreSettings, ready_file: Path | None) -> int:
    from core_service.core import Core, PortTaken

    core = Core(settings)
    try:
        await core.start()
    except PortTaken as exc:
        # One line naming the setting and the port, exit status 1; nothing is left running.
        print(f"elaswave core: {exc}", file=sys.stderr)
        await core.stop()
        return 1
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, core.request_stop)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        ready = {"core_id": settings.core_id, "grpc_port": core.grpc_port, "http_port": core.http_port}
        tmp.write_text(json.dumps(ready))
        tmp.replace(ready_file)
    await core.serve_forever()
    await core.stop()
    return 0
