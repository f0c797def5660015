"""podman and podman-compose, as tests/deploy/compose_scenario.py drives them: the compose file's
services brought up in order, containers found by their compose labels, the images' HEALTHCHECKs
run through the engine, and every container's log kept for the report.

podman 4.3 (Debian bookworm) runs HEALTHCHECKs on systemd timers, and there is no systemd in CI:
`podman healthcheck run` runs the image's check in the container and records its result in the
container's health state (healthy after a success; unhealthy after `retries` failures in a row),
which is what the engine's own timer would do. For the same reason podman-compose ignores
`depends_on: condition: service_healthy` on podman < 4.6, so `up` starts one service at a time
and waits for its health here, as Docker's engine does by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy/compose/compose.yaml"
CONTAINERS_CONF = ROOT / "scripts/containers/containers.conf"


def podman(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    result = subprocess.run(
        ["podman", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}")
    return result


def inspect(container: str) -> dict[str, Any]:
    return dict(json.loads(podman("inspect", container).stdout)[0])


def health_check(container: str) -> str:
    """Runs the container's HEALTHCHECK once through the engine; its health status after it."""
    podman("healthcheck", "run", container, timeout_s=60, check=False)
    return str(inspect(container)["State"]["Health"]["Status"])


def last_health_output(container: str) -> str:
    """What the container's last HEALTHCHECK printed (its reason when it failed)."""
    log = inspect(container)["State"]["Health"].get("Log") or [{}]
    return f"exit {log[-1].get('ExitCode')}: {log[-1].get('Output', '')}"


def wait_for(what: str, condition: Callable[[], Any], timeout_s: float, every_s: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def wait_healthy(container: str, timeout_s: float = 120) -> None:
    wait_for(f"{container} to be healthy", lambda: health_check(container) == "healthy", timeout_s, 2.0)


def podman_compose() -> str:
    """The venv's podman-compose (the dev extra), else one on the PATH."""
    beside = Path(sys.executable).with_name("podman-compose")
    found = str(beside) if beside.is_file() else shutil.which("podman-compose")
    assert found, "podman-compose is missing: `make install` installs it (the dev extra)"
    return found


class Compose:
    """One project of deploy/compose/compose.yaml under podman-compose, with its environment."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.project = project
        self.env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF), **env)

    def run(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        command = [
            podman_compose(),
            "--project-name",
            self.project,
            "--file",
            str(COMPOSE_FILE),
            *args,
        ]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=self.env, stdin=subprocess.DEVNULL
        )
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}")
        return result

    def up(self, service: str) -> list[str]:
        """Starts the service's containers (the images built already) and returns their names."""
        self.run("up", "--detach", "--no-build", "--no-deps", service)
        return self.containers(service)

    def containers(self, service: str | None = None) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        names = podman("ps", "--all", *filters, "--format", "{{.Names}}").stdout.split()
        return sorted(names)

    def save_logs(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name in self.containers():
            logs = podman("logs", name, check=False)
            (directory / f"{name}.log").write_text(logs.stdout + logs.stderr)

    def down(self) -> None:
        """Every container of the project and its volumes, whatever state they are in."""
        self.run("down", "--volumes", "--timeout", "5", timeout_s=180)
        for name in self.containers():  # one podman-compose lost track of
            podman("rm", "--force", "--volumes", "--time", "0", name, check=False)


def exit_code(container: str, timeout_s: float) -> int:
    """Waits for the container to exit; its exit code."""
    return int(podman("wait", container, timeout_s=timeout_s).stdout.strip())


def host_pid(container: str, command_part: str) -> int:
    """The host pid of the container's process whose command line contains `command_part`."""
    rows = podman("top", container, "hpid", "args").stdout.splitlines()[1:]
    for row in rows:
        pid, _, args = row.strip().partition(" ")
        args = args.strip()
        if command_part in args and not args.startswith("/run/podman-init"):  # not the init
            return int(pid)
    raise AssertionError(f"no process running {command_part!r} in {container}: {rows}")
