"""deploy/helm/elaswave rendered by the real Helm (installed by scripts/install-system-deps.sh)
and every rendered manifest validated against the Kubernetes 1.33 schemas (kubernetes-validate,
strict: unknown fields are errors); then what the chart promises is checked on the manifests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from agent.config import AgentConfig
from core_service.config import CoreSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/elaswave"
KUBERNETES = "1.33"
TOKEN = "helm-test-token-0123456789"
# `elaswave agent --grace` as the launcher starts agents.
AGENT_GRACE_S = AgentConfig.grace_s  # the dataclass field's default


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("helm")
    assert binary, "helm is missing: run `make system-deps` (scripts/install-system-deps.sh installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def render(*sets: str, token: bool = True) -> list[dict[str, Any]]:
    flags = [f"--set={s}" for s in ((f"auth.schedulerToken={TOKEN}",) if token else ()) + sets]
    result = helm("template", "ew", str(CHART), "--namespace", "train", *flags)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def refused(*sets: str) -> str:
    result = helm("template", "ew", str(CHART), *[f"--set={s}" for s in sets])
    assert result.returncode != 0, f"helm rendered {sets}"
    return result.stderr


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked by hand in its test
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_helm_lint_passes() -> None:
    result = helm("lint", "--strict", str(CHART), f"--set=auth.schedulerToken={TOKEN}")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("etcd.enabled=false", "etcd.externalEndpoints={etcd-a:2379,etcd-b:2379}"),
        ("etcd.replicas=3", "core.replicas=3", "core.serviceMonitor.enabled=true"),
        (
            "worker.enabled=false",
            "tls.enabled=true",
            "tls.existingSecret=core-tls",
            "tls.requireClientCerts=true",
        ),
        (
            "worker.accelerator.name=nvidia.com/gpu",
            "worker.accelerator.perNode=8",
            "worker.checkpoint.enabled=true",
            "worker.checkpoint.claimName=ckpt",
        ),
        ("auth.existingSecret=ops-tokens",),
        (
            "tls.enabled=true",
            "tls.existingSecret=core-tls",
            "tls.requireClientCerts=true",
            "tls.clientSecret=worker-tls",
        ),
    ],
    ids=[
        "defaults",
        "external-etcd",
        "ha-etcd-servicemonitor",
        "tls-no-workers",
        "gpus-checkpoints",
        "existing-secret",
        "tls-with-workers",
    ],
)
def test_every_rendered_manifest_is_a_valid_kubernetes_object(sets: tuple[str, ...]) -> None:
    docs = render(*sets, token="auth.existingSecret=ops-tokens" not in sets)
    validate_all(docs)
    core = by_kind(docs, "StatefulSet")["ew-elaswave-core"]
    env = {e["name"]: e for e in core["spec"]["template"]["spec"]["containers"][0]["env"]}
    secret = env["ELASWAVE_SCHEDULER_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
    assert secret == ("ops-tokens" if "auth.existingSecret=ops-tokens" in sets else "ew-elaswave-auth")
    assert ("ew-elaswave-auth" in by_kind(docs, "Secret")) == ("auth.existingSecret=ops-tokens" not in sets)
    registry = env["ELASWAVE_REGISTRY_URL"]["value"]
    if "etcd.enabled=false" in sets:
        assert registry == "etcd://etcd-a:2379,etcd-b:2379" and "ew-elaswave-etcd" not in by_kind(
            docs, "StatefulSet"
        )
    else:
        etcd = by_kind(docs, "StatefulSet")["ew-elaswave-etcd"]
        hosts = [f"ew-elaswave-etcd-{i}.ew-elaswave-etcd:2379" for i in range(etcd["spec"]["replicas"])]
        assert registry == "etcd://" + ",".join(hosts)
    if "tls.enabled=true" in sets:
        assert env["ELASWAVE_TLS_CERT"]["value"] == "/etc/elaswave/tls/tls.crt"
        assert env["ELASWAVE_TLS_CLIENT_CA"]["value"] == "/etc/elaswave/tls/ca.crt"
        assert env["ELASWAVE_HTTP_TLS_CERT"]["value"] == "/etc/elaswave/tls/tls.crt"  # REST: HTTPS
        volumes = {v["name"]: v for v in core["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "core-tls"
        probe = core["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
        assert probe["scheme"] == "HTTPS"
    if "tls.clientSecret=worker-tls" in sets:
        pod = by_kind(docs, "StatefulSet")["ew-elaswave-worker"]["spec"]["template"]["spec"]
        node_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
        assert node_env["ELASWAVE_CORE_TLS_CA"] == mounts["core-ca"] + "/ca.crt"
        assert node_env["ELASWAVE_CORE_TLS_CERT"] == mounts["client-tls"] + "/tls.crt"
        assert node_env["ELASWAVE_CORE_TLS_KEY"] == mounts["client-tls"] + "/tls.key"
        # The worker pods get the Core's CA only, never its key.
        assert volumes["core-ca"]["secretName"] == "core-tls" and volumes["core-ca"]["items"] == [
            {"key": "ca.crt", "path": "ca.crt"}
        ]
        assert volumes["client-tls"]["secretName"] == "worker-tls"
    if "core.serviceMonitor.enabled=true" in sets:
        monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
        metrics = by_kind(docs, "Service")["ew-elaswave-core-metrics"]
        labels = metrics["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    if "worker.accelerator.perNode=8" in sets:
        node = by_kind(docs, "StatefulSet")["ew-elaswave-worker"]["spec"]["template"]["spec"]["containers"][0]
        assert node["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert "--checkpoint-dir /checkpoints/gpt --checkpoint-every 50" in node["args"][0]


def test_cores_lead_through_readiness_and_workers_leave_within_their_grace() -> None:
    docs = render()
    sets, services = by_kind(docs, "StatefulSet"), by_kind(docs, "Service")
    core = sets["ew-elaswave-core"]
    pod = core["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert core["spec"]["replicas"] == 2
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"  # only the leader is ready
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"  # every replica is alive
    # The leader-only Service routes to ready pods only; the headless one names every Core.
    assert not services["ew-elaswave-core"]["spec"].get("publishNotReadyAddresses")
    assert services["ew-elaswave-core-headless"]["spec"]["publishNotReadyAddresses"] is True
    assert services["ew-elaswave-core"]["spec"]["selector"] == core["spec"]["selector"]["matchLabels"]
    advertise = {e["name"]: e.get("value") for e in container["env"]}["ELASWAVE_ADVERTISE"]
    assert advertise == "$(POD_NAME).ew-elaswave-core-headless.$(POD_NAMESPACE).svc"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["labelSelector"]["matchLabels"] == core["spec"]["selector"]["matchLabels"]

    worker = sets["ew-elaswave-worker"]
    wpod = worker["spec"]["template"]["spec"]
    args = wpod["containers"][0]["args"][0]
    assert wpod["terminationGracePeriodSeconds"] == AGENT_GRACE_S + 10
    assert args.startswith(
        "exec python /usr/local/lib/elaswave/preemptible.py elaswave run"
    )  # SIGTERM preempts the node
    assert re.search(r"--stop-timeout 50\b", args)
    assert '--core "$(elaswave-find-leader ew-elaswave-core:8080 300)"' in args
    assert re.search(r"--nnodes 2 --nproc-per-node 2 --pp 2", args) and worker["spec"]["replicas"] == 2
    spread = wpod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert (
        spread["podAffinityTerm"]["labelSelector"]["matchLabels"] == worker["spec"]["selector"]["matchLabels"]
    )
    assert worker["spec"]["podManagementPolicy"] == "Parallel"

    budgets = by_kind(docs, "PodDisruptionBudget")
    assert {
        n: b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for n, b in budgets.items()
    } == {
        "ew-elaswave-core": "core",
        "ew-elaswave-worker": "worker",
    }
    for statefulset in sets.values():
        spec = statefulset["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["resources"]["requests"] and c["resources"]["limits"]


@pytest.mark.parametrize(
    "sets, says",
    [
        (("core.replicas=1",), "minimum: got 1, want 2"),
        ((), "schedulerToken"),
        ((f"auth.schedulerToken={TOKEN}", "images.core.tag=latest"), "images/core/tag"),
        ((f"auth.schedulerToken={TOKEN}", "etcd.enabled=false"), "externalEndpoints"),
        ((f"auth.schedulerToken={TOKEN}", "core.bogus=1"), "bogus"),
        (
            (
                f"auth.schedulerToken={TOKEN}",
                "tls.enabled=true",
                "tls.existingSecret=t",
                "tls.requireClientCerts=true",
            ),
            "set tls.clientSecret",
        ),
    ],
    ids=["one-core", "no-token", "latest-tag", "no-etcd", "unknown-value", "mtls-workers-without-cert"],
)
def test_bad_values_are_refused_with_the_reason(sets: tuple[str, ...], says: str) -> None:
    assert says in refused(*sets)


def test_values_yaml_validates_and_templates_use_only_defined_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate({**values, "auth": {**values["auth"], "schedulerToken": TOKEN}}, schema)
    for template in (CHART / "templates").iterdir():
        for path in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()):
            node: Any = values
            for key in path.split("."):
                assert isinstance(node, dict) and key in node, (
                    f"{template.name}: .Values.{path} is not in values.yaml"
                )
                node = node[key]


def test_every_core_setting_the_chart_sets_is_one_the_core_reads() -> None:
    docs = render(
        "tls.enabled=true", "tls.existingSecret=t", "tls.requireClientCerts=true", "worker.enabled=false"
    )
    container = by_kind(docs, "StatefulSet")["ew-elaswave-core"]["spec"]["template"]["spec"]["containers"][0]
    names = [e["name"] for e in container["env"] if e["name"].startswith("ELASWAVE_")]
    unknown = [n for n in names if n.removeprefix("ELASWAVE_").lower() not in CoreSettings.model_fields]
    assert len(names) >= 12 and unknown == []
