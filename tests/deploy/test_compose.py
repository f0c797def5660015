"""deploy/compose/compose.yaml, without a container engine: interpolated the way `docker compose`
does and validated against the Compose specification's schema (vendored by check-jsonschema),
then checked for what the deployment needs: etcd, two Cores electing through it, and N worker
nodes whose launchers join one job at a Core."""

from __future__ import annotations

import json
import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agent.config import AgentConfig
from core_service.config import CoreSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy/compose/compose.yaml"
VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")
TOKEN = "compose-test-token-0123456789"
# `elaswave agent --grace`, as the launcher starts agents.
AGENT_GRACE_S = AgentConfig.grace_s  # the dataclass field's default


def interpolate(text: str, env: dict[str, str]) -> str:
    """${VAR}, ${VAR:-default} and ${VAR:?error}, as Compose interpolates them."""

    def value(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if env.get(name):
            return env[name]
        if op == ":-":
            return arg
        raise ValueError(f"{name} is not set: {arg}" if op == ":?" else f"{name} is not set")

    return VARIABLE.sub(value, text)


def load(env: dict[str, str]) -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env))


def compose_schema() -> dict[str, Any]:
    path = resources.files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json"
    return json.loads(path.read_text())


@pytest.mark.parametrize("workers", ["2", "3"])
def test_the_compose_file_follows_the_compose_specification(workers: str) -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [
        f"{'/'.join(map(str, e.path))}: {e.message}"
        for e in validator.iter_errors(load({"ELASWAVE_SCHEDULER_TOKEN": TOKEN, "WORKERS": workers}))
    ]
    assert errors == []


def test_the_scheduler_token_is_required() -> None:
    with pytest.raises(ValueError, match="ELASWAVE_SCHEDULER_TOKEN is not set"):
        load({})


def test_etcd_two_electing_cores_and_n_worker_nodes_joining_one_job() -> None:
    ports = {"ETCD_CLIENT_PORT": "23790", "CORE_A_HTTP_PORT": "18080", "CORE_B_HTTP_PORT": "18081"}
    spec = load({"ELASWAVE_SCHEDULER_TOKEN": TOKEN, "WORKERS": "3", **ports})
    services = spec["services"]
    assert set(services) == {"etcd", "core-a", "core-b", "worker"}
    assert services["etcd"]["healthcheck"]["test"][1] == "etcdctl"
    assert "--listen-client-urls=http://127.0.0.1:23790" in services["etcd"]["command"]
    # One host's loopback is the network: nothing listens on any other address.
    for name, service in services.items():
        assert service["network_mode"] == "host" and "ports" not in service, name
        assert service["init"] is True, name  # SIGTERM reaches the entrypoint; zombies are reaped
    assert "0.0.0.0" not in COMPOSE.read_text()
    cores = [services["core-a"], services["core-b"]]
    for core in cores:
        env = core["environment"]
        assert env["ELASWAVE_REGISTRY_URL"] == "etcd://127.0.0.1:23790"  # shared: one leader elected
        assert env["ELASWAVE_SCHEDULER_TOKEN"] == TOKEN
        assert (
            env["ELASWAVE_HTTP_HOST"] == env["ELASWAVE_GRPC_HOST"] == env["ELASWAVE_ADVERTISE"] == "127.0.0.1"
        )
        assert core["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert core["build"]["target"] in dockerfile_targets(core["build"]["dockerfile"])
        assert core["read_only"] is True and core["cap_drop"] == ["ALL"]
    assert {c["environment"]["ELASWAVE_CORE_ID"] for c in cores} == {"core-a", "core-b"}
    for core in cores:  # every ELASWAVE_ variable names a setting the Core reads
        names = [
            n.removeprefix("ELASWAVE_").lower() for n in core["environment"] if n.startswith("ELASWAVE_")
        ]
        assert len(names) >= 6 and [n for n in names if n not in CoreSettings.model_fields] == []
    assert [c["environment"]["ELASWAVE_HTTP_PORT"] for c in cores] == ["18080", "18081"]
    grpc = {c["environment"]["ELASWAVE_GRPC_PORT"] for c in cores}
    assert len(grpc) == 2  # two Cores on one host's loopback: distinct ports

    worker = services["worker"]
    args = [str(a) for a in worker["command"]]
    assert args[:3] == [
        "run",
        "--core",
        "127.0.0.1:18080,127.0.0.1:18081",
    ]  # every Core: it follows the leader
    assert args[args.index("--nnodes") + 1] == str(worker["deploy"]["replicas"]) == "3"
    assert worker["deploy"]["mode"] == "replicated"  # podman-compose scales only with it said
    script = next(a for a in args if a.endswith(".py"))
    assert (ROOT / script.removeprefix("/opt/elaswave-examples/")).is_file(), script
    assert args[args.index(script) + 1 :] == ["--steps", "40"]
    assert worker["environment"]["ELASWAVE_SCHEDULER_TOKEN"] == TOKEN
    assert worker["environment"]["GLOO_SOCKET_IFNAME"] == "lo"
    # Checkpoints on storage every node sees: one volume (or host directory) for all of them.
    checkpoint_dir = args[args.index("--checkpoint-dir") + 1]
    assert worker["volumes"] == [f"checkpoints:{checkpoint_dir}"] and "checkpoints" in spec["volumes"]
    assert (ROOT / worker["build"]["dockerfile"]).is_file()
    # SIGTERM preempts the node's agents, whose workers get the agent's 30 s grace.
    assert int(worker["stop_grace_period"].removesuffix("s")) > AGENT_GRACE_S


def dockerfile_targets(dockerfile: str) -> set[str]:
    text = (ROOT / dockerfile).read_text()
    return set(re.findall(r"^FROM \S+ AS (\S+)", text, re.M))


def test_the_readme_commands_name_real_services() -> None:
    """The commands in the file's header (and the README) act on services the file defines."""
    header = [
        line.lstrip("# ").strip() for line in COMPOSE.read_text().splitlines() if line.startswith("#   ")
    ]
    services = set(load({"ELASWAVE_SCHEDULER_TOKEN": TOKEN})["services"])
    for line in header:
        words = shlex.split(line.split("#")[0])
        if words[:3] == ["docker", "compose", "kill"]:
            assert words[3] in services, line
