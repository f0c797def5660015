"""Core configuration: pydantic-settings over `ELASWAVE_*` environment variables and a TOML file.

Precedence, highest first: explicit keyword arguments (the CLI), environment variables
(`ELASWAVE_GRPC_PORT=...`; nested fields with `__`, e.g. `ELASWAVE_FAILSLOW__RATIO=1.3`), the TOML
file named by `ELASWAVE_CONFIG` (or `--config`), then defaults. Everything is validated at start;
a bad value stops the Core with a one-line message naming the field (or the file, or the
environment variable) and what is wrong. A config file that was named but does not exist is an
error, not an empty configuration.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
import uuid
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from core_service.limits import MAX_SPARE_WORKERS, MAX_WORKERS_PER_JOB

JOB_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MIN_TOKEN_LENGTH = 16
PolicyName = Literal["elaswave", "elaswave-resize"]  # core_service.elaswave_policy.make_policy
POLICIES: tuple[str, ...] = get_args(PolicyName)


class ConfigError(ValueError):
    """The configuration is invalid; the message (one line) lists every problem, separated by '; '."""


ENV_SOURCE_FIELD = re.compile(r'field "(?P<field>[^"]+)" from source "(?P<source>[^"]+)"')


def check_worker_bounds(min_workers: int, max_workers: int) -> None:
    """min_workers <= max_workers when both are set (0 leaves a bound unset); ValueError if not."""
    if min_workers and max_workers and min_workers > max_workers:
        raise ValueError(f"min_workers {min_workers} is above max_workers {max_workers}")


class JobSpec(BaseModel):
    """A job the Core accepts agents and executors for."""

    name: str
    token: SecretStr = Field(description="per-job token agents and executors present")
    expected_workers: int = Field(default=0, ge=0, description="workers the job is launched with")
    spare_workers: int = Field(
        default=0,
        ge=0,
        le=MAX_SPARE_WORKERS,
        description="workers that may register beyond expected_workers (standbys for replacements)",
    )
    min_workers: int = Field(
        default=0,
        ge=0,
        le=MAX_WORKERS_PER_JOB,
        description="fewest ranks a plan may leave (0: no bound); below it the Core waits for spares",
    )
    max_workers: int = Field(
        default=0,
        ge=0,
        le=MAX_WORKERS_PER_JOB,
        description="most ranks a plan may have (0: the creation layout's ranks plus accepted offers)",
    )

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> JobSpec:
        check_worker_bounds(self.min_workers, self.max_workers)
        return self

    @field_validator("name")
    @classmethod
    def _name_is_safe(cls, value: str) -> str:
        if not JOB_NAME_PATTERN.match(value):
            raise ValueError(
                f"job name {value!r} must be 1-63 characters of letters, digits, '.', '_' or '-'"
            )
        return value


class FailSlowSettings(BaseModel):
    """Fail-slow detection: a worker is slow when its step time is an outlier among its stage peers
    for `trigger_steps` steps in a row, and counts as slow until it is within `clear_ratio` of them
    for `clear_steps` steps in a row (hysteresis: the two thresholds differ by a margin)."""

    ratio: float = Field(default=1.5, gt=1.0, description="step time / peer median that counts as slow")
    mad_k: float = Field(default=3.0, ge=0.0, description="also require time > median + k * MAD")
    trigger_steps: int = Field(default=5, ge=1, description="consecutive slow steps before flagging")
    clear_steps: int = Field(default=5, ge=1, description="consecutive normal steps before clearing")
    clear_ratio: float = Field(
        default=1.2,
        gt=1.0,
        description="a flagged worker's step time / peer median must fall to this to count as normal "
        "(capped at ratio: the clearing margin)",
    )
    window_steps: int = Field(
        default=8, ge=1, le=1024, description="a peer's reference time is its median over this many steps"
    )
    min_peers: int = Field(default=2, ge=2, description="peers (self included) needed to judge")


# Silence after which a worker is LOST even with its stream open, unless configured.
DEFAULT_HEARTBEAT_CEILING_S = 30.0


class CoreSettings(BaseSettings):
    """Settings of one Core process."""

    model_config = SettingsConfigDict(env_prefix="ELASWAVE_", env_nested_delimiter="__", extra="forbid")

    core_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    grpc_host: str = "127.0.0.1"
    advertise: str | None = Field(
        default=None,
        description="host[:port] agents and standbys are told to reach this Core's gRPC at (leader "
        "hints); default: the pod IP ($POD_IP), else grpc_host unless that is a wildcard address",
    )
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="0 picks a free port")
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, le=65535, description="0 picks a free port")
    registry_url: str = Field(default="memory://", description="memory:// or etcd://host:port[,host:port]")
    key_prefix: str = "/elaswave"
    scheduler_token: SecretStr | None = None
    dev_mode: bool = Field(default=False, description="allow a generated token; never in production")
    jobs: list[JobSpec] = Field(default_factory=list)
    allow_job_creation: bool = Field(default=True, description="POST /api/v1/jobs may create jobs")
    heartbeat_timeout_s: float = Field(
        default=2.0,
        gt=0.0,
        le=600.0,
        description="floor of each stream's adaptive heartbeat deadline (docs/failures.md): a worker "
        "silent this long is late; without a live stream on this Core it is LOST",
    )
    heartbeat_ceiling_s: float | None = Field(
        default=None,
        gt=0.0,
        le=3600.0,
        description="ceiling of the adaptive deadline; a worker silent this long is LOST even with "
        "its stream open (a hung agent whose lease someone else keeps); default: the larger of "
        "30 s and heartbeat_timeout_s",
    )
    heartbeat_phi: float = Field(
        default=8.0,
        gt=0.0,
        le=30.0,
        description="phi-accrual threshold: a stream is late once P(a gap this long) < 10^-phi",
    )
    heartbeat_window: int = Field(
        default=100, ge=4, le=10_000, description="inter-arrival gaps per stream the detector models"
    )
    gone_members_kept: int = Field(
        default=256,
        ge=1,
        le=MAX_WORKERS_PER_JOB,
        description="LOST and LEFT members a job keeps; older ones are compacted (their events stay)",
    )
    registrations_per_s: float = Field(
        default=50.0,
        gt=0.0,
        le=1e6,
        description="sustained rate of new worker registrations per job token (reconnects are free)",
    )
    registration_burst: int = Field(
        default=1_000, ge=1, le=MAX_WORKERS_PER_JOB, description="registrations a job token may make at once"
    )
    lease_ttl_s: float = Field(default=3.0, ge=1.0, le=600.0, description="liveness lease the Core holds")
    progress_persist_s: float = Field(
        default=5.0,
        gt=0.0,
        le=3600.0,
        description="a member's last step is stored at most this often (a new leader shows it)",
    )
    reconnect_grace_s: float = Field(default=5.0, gt=0.0, le=600.0, description="after a takeover")
    leader_ttl_s: float = Field(default=2.0, ge=1.0, le=60.0)
    apply_timeout_s: float = Field(default=30.0, gt=0.0, description="APPLYING -> RUNNING at the latest")
    events_kept: int = Field(default=10_000, ge=100)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = Field(default=None, description="set to require client certs (mTLS)")
    http_tls_cert: Path | None = Field(default=None, description="serve REST over HTTPS with this cert")
    http_tls_key: Path | None = None
    etcd_ca: Path | None = Field(default=None, description="CA of the etcd servers: connect with TLS")
    etcd_cert: Path | None = Field(default=None, description="client certificate for etcd (with etcd_key)")
    etcd_key: Path | None = None
    etcd_user: str | None = Field(default=None, description="etcd user (with etcd_password)")
    etcd_password: SecretStr | None = None
    read_access: Literal["open", "token"] = Field(
        default="open",
        description="REST reads of jobs and events and gRPC GetJobState: open, or scheduler token only",
    )
    max_workers_per_job: int = Field(
        default=MAX_WORKERS_PER_JOB,
        ge=1,
        le=MAX_WORKERS_PER_JOB,
        description="bound on the members of a job that does not declare expected_workers",
    )
    loop_stall_s: float | None = Field(
        default=None,
        gt=0.0,
        description="a leader whose event loop has not turned for this long gives its lease up "
        "(default: the leader TTL)",
    )
    failslow: FailSlowSettings = Field(default_factory=FailSlowSettings)
    policy: PolicyName = Field(
        default="elaswave",
        description="schedule-engine policy: elaswave (resize + re-partition + DVFS, ElasWave §4) or "
        "elaswave-resize (micro-batch resizing only, the ablation baseline)",
    )
    drop_replicas: bool = Field(
        default=False,
        description="let the elaswave policy drop a whole DP replica after a loss where its cost model "
        "predicts a faster step than thinning every stage (the dropped ranks hand their state over and "
        "leave; a join re-creates the replica). Off by default: it sends healthy workers away",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        config_file = os.environ.get("ELASWAVE_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_known(cls, value: Any) -> Any:
        if value not in POLICIES:
            raise ValueError(
                f"policy {value!r} is unknown: choose 'elaswave' (resize + layer re-partition + "
                "DVFS, the default) or 'elaswave-resize' (micro-batch resizing only, the baseline)"
            )
        return value

    @field_validator("registry_url")
    @classmethod
    def _registry_url_known(cls, value: str) -> str:
        if value != "memory://" and not value.startswith("etcd://"):
            raise ValueError(f"{value!r} is neither 'memory://' nor 'etcd://host:port[,host:port]'")
        return value

    @field_validator("key_prefix")
    @classmethod
    def _prefix_absolute(cls, value: str) -> str:
        if not value.startswith("/") or value.endswith("/"):
            raise ValueError(f"{value!r} must start with '/' and not end with '/'")
        return value

    @property
    def heartbeat_ceiling(self) -> float:
        """heartbeat_ceiling_s as resolved by validation (never None on a validated instance)."""
        ceiling = self.heartbeat_ceiling_s
        return max(DEFAULT_HEARTBEAT_CEILING_S, self.heartbeat_timeout_s) if ceiling is None else ceiling

    @model_validator(mode="after")
    def _security(self) -> CoreSettings:
        if self.scheduler_token is None and not self.dev_mode:
            raise ValueError(
                "scheduler_token is required (set ELASWAVE_SCHEDULER_TOKEN or scheduler_token in "
                "the config file); only dev_mode may run without one"
            )
        tokens = [("scheduler_token", self.scheduler_token)] + [
            (f"jobs[{job.name}].token", job.token) for job in self.jobs
        ]
        for name, token in tokens:
            if token is not None and len(token.get_secret_value()) < MIN_TOKEN_LENGTH and not self.dev_mode:
                raise ValueError(f"{name} is shorter than {MIN_TOKEN_LENGTH} characters")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if (self.http_tls_cert is None) != (self.http_tls_key is None):
            raise ValueError("http_tls_cert and http_tls_key must be given together")
        if (self.etcd_cert is None) != (self.etcd_key is None):
            raise ValueError("etcd_cert and etcd_key must be given together")
        if (self.etcd_user is None) != (self.etcd_password is None):
            raise ValueError("etcd_user and etcd_password must be given together")
        if self.etcd_user is not None and self.etcd_ca is None:
            raise ValueError("etcd_user needs etcd_ca: the password must not cross the network in plain text")
        if self.loop_stall_s is not None and self.loop_stall_s > self.leader_ttl_s:
            raise ValueError(
                f"loop_stall_s ({self.loop_stall_s}) must not exceed leader_ttl_s ({self.leader_ttl_s}): "
                "a stalled leader must be replaced as promptly as a dead one"
            )
        for name in (
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "http_tls_cert",
            "http_tls_key",
            "etcd_ca",
            "etcd_cert",
            "etcd_key",
        ):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {str(path)!r} is not a readable file")
        if self.lease_ttl_s < self.heartbeat_timeout_s:
            # The Core refreshes the leases it holds for agents on their heartbeats, so a shorter
            # lease declares a worker lost before its heartbeat is even late (and before ReportNow).
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must be >= heartbeat_timeout_s "
                f"({self.heartbeat_timeout_s})"
            )
        if self.heartbeat_ceiling_s is None:
            self.heartbeat_ceiling_s = max(DEFAULT_HEARTBEAT_CEILING_S, self.heartbeat_timeout_s)
        if self.heartbeat_ceiling_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"heartbeat_ceiling_s ({self.heartbeat_ceiling_s}) must be >= heartbeat_timeout_s "
                f"({self.heartbeat_timeout_s}), the floor of the adaptive deadline"
            )
        names = [job.name for job in self.jobs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"jobs listed twice: {', '.join(duplicates)}")
        return self


def load_settings(**overrides: Any) -> CoreSettings:
    """Builds and validates the settings; raises ConfigError naming every problem."""
    config_file = os.environ.get("ELASWAVE_CONFIG")
    if config_file and not Path(config_file).is_file():
        raise ConfigError(
            f"config file {config_file!r} (--config / ELASWAVE_CONFIG) does not exist or is not a file"
        )
    try:
        return CoreSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err["loc"]) or "settings"
            problems.append(f"{where}: {err['msg']}")
        raise ConfigError("invalid ElasWave Core configuration: " + "; ".join(problems)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {config_file!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {config_file!r} cannot be read: {exc.strerror or exc}") from None
    except SettingsError as exc:
        raise ConfigError(_settings_error_message(exc)) from None


def _settings_error_message(exc: SettingsError) -> str:
    """pydantic-settings says 'error parsing value for field "jobs" from source "EnvSettingsSource"';
    name the variable the user actually set, and why it did not parse."""
    match = ENV_SOURCE_FIELD.search(str(exc))
    cause = exc.__cause__
    why = f": {cause}" if cause is not None else ""
    if match is None:
        return f"invalid ElasWave Core configuration: {exc}{why}"
    field_name = match["field"]
    if match["source"] == "EnvSettingsSource":
        variable = f"ELASWAVE_{field_name.upper()}"
        kind = "JSON" if isinstance(cause, json.JSONDecodeError) else "a valid value"
        return f"environment variable {variable} (setting {field_name}) is not {kind}{why}"
    return f"setting {field_name} from {match['source']} does not parse{why}"
