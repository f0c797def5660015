"""deploy/compose/compose.yaml, without a container engine: interpolated the way `docker compose`
does and validated against the Compose specification's schema (vendored by check-jsonschema),
then checked for what the deployment needs: etcd, two Cores electing through it, and N worker
nodes whose launchers join one job at a Core."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import fields
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
AGENT_GRACE_S = next(f.default for f in fields(AgentConfig) if f.name == "grace_s")


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
    spec = load({"ELASWAVE_SCHEDULER_TOKEN": TOKEN, "WORKERS": "3"})
    services = spec["services"]
    assert set(services) == {"etcd", "core-a", "core-b", "worker"}
    assert services["etcd"]["healthcheck"]["test"][1] == "etcdctl"
    cores = [services["core-a"], services["core-b"]]
    for core in cores:
        env = core["environment"]
        assert env["ELASWAVE_REGISTRY_URL"] == "etcd://etcd:2379"  # shared: one leader elected
        assert env["ELASWAVE_SCHEDULER_TOKEN"] == TOKEN
        assert core["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert core["build"]["target"] in dockerfile_targets(core["build"]["dockerfile"])
        assert core["read_only"] is True and core["cap_drop"] == ["ALL"]
    assert {c["environment"]["ELASWAVE_CORE_ID"] for c in cores} == {"core-a", "core-b"}
    for core in cores:  # every ELASWAVE_ variable names a setting the Core reads
        names = [
            n.removeprefix("ELASWAVE_").lower() for n in core["environment"] if n.startswith("ELASWAVE_")
        ]
        assert len(names) >= 6 and [n for n in names if n not in CoreSettings.model_fields] == []
    assert [c["environment"]["ELASWAVE_ADVERTISE"] for c in cores] == ["core-a", "core-b"]

    worker = services["worker"]
    args = [str(a) for a in worker["command"]]
    assert args[:3] == ["run", "--core", "core-a:8080"]
    assert args[args.index("--nnodes") + 1] == str(worker["deploy"]["replicas"]) == "3"
    script = args[-1]
    assert (ROOT / script.removeprefix("/opt/elaswave-examples/")).is_file(), script
    assert worker["environment"]["ELASWAVE_SCHEDULER_TOKEN"] == TOKEN
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
