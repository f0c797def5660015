"""The agent's settings: one frozen dataclass, validated once, built from the command line.

Bad settings raise ``ValueError`` naming the flag and what is wrong, before anything starts.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from agent.frequency import CHOICES, DEFAULT_CLOCK_RANGE, ClockRange, parse_clock_range
from wire.local_protocol import TOKEN_ENV  # noqa: E402 - the one definition of the contract

# sun_path of struct sockaddr_un is 108 bytes on Linux, including the terminating NUL.
_MAX_UNIX_PATH_BYTES = 107
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
# Job and worker names, as the Core accepts them (they also end up in etcd keys and file names).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, flag: str) -> Address:
    """``host:port`` or ``[v6]:port`` -> Address; ValueError naming ``flag`` otherwise."""
    text = text.strip()
    match = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\s]+):(\d+)", text)
    if not match:
        raise ValueError(f"{flag}: expected host:port, got {text!r}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 0 < port < 65536:
        raise ValueError(f"{flag}: port {port} in {text!r} is outside 1..65535")
    return Address(host, port)


def parse_address_list(text: str, flag: str) -> tuple[Address, ...]:
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError(f"{flag}: expected at least one host:port, got {text!r}")
    return tuple(parse_address(item, flag) for item in items)


def default_metrics_socket(job: str, worker_id: str) -> Path:
    """``$XDG_RUNTIME_DIR/elaswave/<job>.<worker>.metrics.sock`` (or under /tmp/elaswave-<uid>)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "elaswave" if runtime else Path(f"/tmp/elaswave-{os.getuid()}")
    name = f"{_SAFE_NAME.sub('_', job)}.{_SAFE_NAME.sub('_', worker_id)}.metrics.sock"
    return base / name


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path | None = None
    key: Path | None = None


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs; times in seconds, sizes in bytes."""

    job: str
    worker_id: str
    cores: tuple[Address, ...]
    worker_command: tuple[str, ...] = ()
    worker_pid: int | None = None
    worker_zygote: Path | None = None  # the node's warm zygote's socket (agent.zygote)
    stage: int = -1
    dp_rank: int = -1
    rank: int = -1
    heartbeat_interval_s: float = 0.5
    probe_interval_s: float = 5.0
    register_timeout_s: float = 5.0
    rpc_timeout_s: float = 2.0
    leave_timeout_s: float = 2.0
    grace_s: float = 30.0
    notice_file: Path | None = None
    notice_poll_s: float = 0.1
    metrics_socket: Path | None = None
    peers: tuple[Address, ...] = ()
    peer_timeout_s: float = 0.5
    job_token_file: Path | None = None
    tls: TlsFiles | None = None
    etcd: Address | None = None
    etcd_prefix: str = "/elaswave"
    lease_ttl_s: int = 3
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    frequency_controller: str = "auto"
    clock_range: ClockRange = parse_clock_range(DEFAULT_CLOCK_RANGE)
    npu_smi_set: str | None = None
    control_file: Path | None = None
    drain_grace_s: float = 10.0
    # A Core that has sent nothing for this long (not even the echo the agent asks for halfway)
    # accepts bytes but does not answer (its loop hangs): the agent moves to another Core.
    # Default: three heartbeat intervals, at least 3 s.
    core_silence_s: float | None = None

    def __post_init__(self) -> None:
        _require_name(self.job, "--job")
        _require_name(self.worker_id, "--worker-id")
        if not self.cores:
            raise ValueError("--core: at least one Core address is required")
        if bool(self.worker_command) == (self.worker_pid is not None):
            raise ValueError("give exactly one of --pid PID or a worker command after '--'")
        if self.worker_pid is not None and self.worker_pid <= 0:
            raise ValueError(f"--pid: must be a positive process id, got {self.worker_pid}")
        for flag, value in (("--stage", self.stage), ("--dp-rank", self.dp_rank), ("--rank", self.rank)):
            if value < -1:
                raise ValueError(f"{flag}: must be >= -1 (-1 = unknown), got {value}")
        for flag, seconds in self._positive_durations():
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{flag}: must be a positive number of seconds, got {seconds}")
        for flag, seconds in (("--grace", self.grace_s), ("--drain-grace", self.drain_grace_s)):
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"{flag}: must be >= 0 seconds, got {seconds}")
        if self.frequency_controller not in CHOICES:
            raise ValueError(
                f"--frequency-controller: expected one of {', '.join(CHOICES)}, "
                f"got {self.frequency_controller!r}"
            )
        if self.npu_smi_set is not None and "{mhz}" not in self.npu_smi_set:
            raise ValueError(f"--npu-smi-set: the command must contain {{mhz}}, got {self.npu_smi_set!r}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl: must be a whole number of seconds >= 1, got {self.lease_ttl_s}")
        if self.silence_bound_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"core_silence_s ({self.core_silence_s}) must exceed the heartbeat interval "
                f"({self.heartbeat_interval_s}): the echo of a heartbeat must have time to come back"
            )
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff: the cap must not be below the initial delay")
        if not self.etcd_prefix.startswith("/") or self.etcd_prefix.endswith("/"):
            raise ValueError(
                f"--etcd-prefix: must start with '/' and not end with '/', got {self.etcd_prefix!r}"
            )
        if len(os.fsencode(str(self.socket_path))) > _MAX_UNIX_PATH_BYTES:
            raise ValueError(
                f"--metrics-socket: {self.socket_path} is longer than the {_MAX_UNIX_PATH_BYTES} bytes "
                "a Unix socket path may have; pass a shorter path"
            )

    @property
    def silence_bound_s(self) -> float:
        """Seconds of silence from the Core after which the agent moves to another Core."""
        if self.core_silence_s is not None:
            return self.core_silence_s
        return max(3.0, 3 * self.heartbeat_interval_s)

    def _positive_durations(self) -> list[tuple[str, float]]:
        return [
            ("--heartbeat-interval", self.heartbeat_interval_s),
            ("--probe-interval", self.probe_interval_s),
            ("--register-timeout", self.register_timeout_s),
            ("--rpc-timeout", self.rpc_timeout_s),
            ("core_silence_s", self.silence_bound_s),
            ("--leave-timeout", self.leave_timeout_s),
            ("--peer-timeout", self.peer_timeout_s),
            ("notice poll", self.notice_poll_s),
            ("backoff initial", self.backoff_initial_s),
        ]

    @property
    def socket_path(self) -> Path:
        return self.metrics_socket or default_metrics_socket(self.job, self.worker_id)

    @property
    def control_path(self) -> Path:
        """The worker's control file (``wire.local_protocol``): ``--control-file``, else beside the socket."""
        if self.control_file is not None:
            return self.control_file
        name = self.socket_path.name
        for suffix in (".metrics.sock", ".sock"):
            name = name.removesuffix(suffix)
        return self.socket_path.with_name(f"{name}.control.json")

    @property
    def alive_key(self) -> str:
        return f"{self.etcd_prefix}/jobs/{self.job}/alive/{self.worker_id}"


def _require_name(value: str, flag: str) -> None:
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"{flag}: must be 1-128 letters, digits or '._:@-', starting with a letter or "
            f"digit, got {value!r}"
        )


def load_job_token(token_file: Path | None) -> str | None:
    """The job token: the file's first line when a file is given, else $ELASWAVE_JOB_TOKEN.

    Read at every connection attempt so a rotated token file is picked up without a restart.
    """
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--job-token-file: cannot read {token_file}: {exc.strerror}") from exc
        if not token:
            raise ValueError(f"--job-token-file: {token_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    return token or None
