"""TLS end to end (issue 24, item 5): a 2-node `elaswave run --core` job against a Core that
serves only TLS (gRPC with client certificates required, REST over HTTPS), with certificates
made here. The launchers' rendezvous and progress go over HTTPS, their agents' streams and the
workers' plan subscriptions over mTLS; the job trains like the single-process run. A launcher
without the CA bundle gets a clear error, and so does a plaintext gRPC client.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.core.procs import CoreProcess, new_token
from tests.core.test_mtls import make_pki
from tests.test_launcher import TINY, Launcher, _job_losses, _reference_losses
from tests.test_launcher_multinode import TINY_SLOW, _member_steps_remote, wait_until_waiting

pytestmark = pytest.mark.multiproc
STEPS = 80


@pytest.fixture
def tls_core(tmp_path: Path) -> Iterator[tuple[CoreProcess, str, Path]]:
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki)  # ca.crt, core.crt/key (SAN 127.0.0.1), client.crt/key
    token = new_token()
    env = {
        "ELASWAVE_TLS_CERT": str(pki / "core.crt"),
        "ELASWAVE_TLS_KEY": str(pki / "core.key"),
        "ELASWAVE_TLS_CLIENT_CA": str(pki / "ca.crt"),
        "ELASWAVE_HTTP_TLS_CERT": str(pki / "core.crt"),
        "ELASWAVE_HTTP_TLS_KEY": str(pki / "core.key"),
    }
    core = CoreProcess(tmp_path, "tls-core", "memory://", token, extra_env=env, https_ca=pki / "ca.crt")
    try:
        core.wait_leader()
        yield core, token, pki
    finally:
        core.stop()


def tls_flags(pki: Path) -> tuple[str, ...]:
    return (
        "--core-tls-ca",
        str(pki / "ca.crt"),
        "--core-tls-cert",
        str(pki / "client.crt"),
        "--core-tls-key",
        str(pki / "client.key"),
    )


@pytest.mark.timeout(300)
def test_two_nodes_train_through_a_tls_only_core_like_the_single_process_run(
    tls_core: tuple[CoreProcess, str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core, token, pki = tls_core
    monkeypatch.setenv("ELASWAVE_SCHEDULER_TOKEN", token)
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    shape = ("--nnodes", "2", "--nproc-per-node", "2", "--pp", "2")
    where = ("--core", f"127.0.0.1:{core.http_port}")

    # Plaintext clients of the TLS-only Core: refused with what to give, not left hanging.
    plain = Launcher(*where, *shape, "--node-id", "plain", script, cwd=tmp_path)
    assert plain.wait(timeout_s=120) == 1
    assert "cannot reach the Core's REST API at http://127.0.0.1" in plain.output
    assert "If the Core serves TLS, give its CA bundle" in plain.output
    with grpc.insecure_channel(core.grpc_address) as channel, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    script.write_text(TINY_SLOW)  # workers sleep a little per step: the kill lands mid-run
    run = (*where, *shape)
    nodes = [
        Launcher(*run, *tls_flags(pki), "--node-id", "node-a", script, "--steps", str(STEPS), cwd=tmp_path)
    ]
    wait_until_waiting(core, "tiny", "node-a", timeout_s=90)  # node-a is node 0
    # The second node names the files through the environment, as a pod spec would.
    monkeypatch.setenv("ELASWAVE_CORE_TLS_CA", str(pki / "ca.crt"))
    monkeypatch.setenv("ELASWAVE_CORE_TLS_CERT", str(pki / "client.crt"))
    monkeypatch.setenv("ELASWAVE_CORE_TLS_KEY", str(pki / "client.key"))
    nodes.append(Launcher(*run, "--node-id", "node-b", script, "--steps", str(STEPS), cwd=tmp_path))
    nodes[0].wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps_remote(core)) == 4 and min(s.values()) >= 3,
        timeout_s=180,
    )
    # A worker killed: the survivors take the Core's plan over mTLS, apply it and acknowledge it.
    run_dirs = [tmp_path / "elaswave-run" / "tiny" / f"node-{i}" for i in range(2)]
    record = json.loads((run_dirs[0] / "nodes.json").read_text())
    victim_rank = record["nodes"]["0"][1]
    victim = next(m for m in core.job("tiny")["members"] if m["rank"] == victim_rank)
    os.kill(victim["pid"], signal.SIGKILL)
    codes = [n.wait(timeout_s=240) for n in nodes]
    for node in nodes:
        assert f"job 'tiny' finished: {STEPS}/{STEPS} steps, 3 of 4 workers finished" in node.output, (
            node.output[-3000:]
        )
    assert codes == [0, 0]
    survivors = [r for r in range(4) if r != victim_rank]
    losses: dict[int, float] = {}
    for run_dir, ranks in zip(run_dirs, ([0, 1], [2, 3]), strict=True):
        losses |= _job_losses(run_dir, [r for r in ranks if r in survivors])
    reference = _reference_losses(script, STEPS)
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):  # recovered in place: the fault-free run's losses
        assert losses[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), (step, losses, reference)
    events = core.http.get("/api/v1/jobs/tiny/events", params={"limit": 10_000}).json()["events"]
    resumed = {e["worker_id"] for e in events if e["kind"] == "plan_resumed"}
    assert resumed == {f"rank-{r}" for r in survivors}, resumed  # every survivor reached the Core
