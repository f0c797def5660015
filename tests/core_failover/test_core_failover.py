"""A Core failover in the middle of a 2-node `elaswave run --core` job (issue 24, item 1).

Every process is real and on loopback: one etcd (tests/etcd_server.py), two `elaswave core`
processes on it, two launchers (one simulated node each) given both Cores' addresses, their
agents, workers and the job's stores (node-a's launcher runs the store, node-b's the standby).
The leading Core is SIGKILLed while the job trains: the standby leads, the job trains on in
place (no plan, no worker process started again), and its final parameters and every step's loss
equal the fault-free single-process run. The second test then loses node-a whole (launcher,
agents, workers and the store, all SIGKILLed): node-b's workers move to the standby store and
the job finishes on node-b's ranks, again equal to the fault-free run; node-b's launcher starts
a new standby store beside it and the leading Core stores the job's new store list.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch

import elaswave
from tests.core.procs import CoreProcess, CoreTimeouts, new_token, wait_until
from tests.pacing import release
from tests.test_launcher import Launcher, _job_losses, _reference_losses, tiny_variant
from tests.test_launcher_multinode import TINY_SLOW, wait_until_waiting

pytestmark = [pytest.mark.multiproc, pytest.mark.etcd]
STEPS = 300
# Steps of at least 0.1 s (a sleep in the workers' on_step): the job outlives a failover (the
# leader lease is 2 s) by far, and 300 steps keep fp32 round-off (DP=2 sums the batch in halves)
# within the tolerances below.
SCRIPT = tiny_variant("sleep(0.03)", "sleep(0.1)", TINY_SLOW)


@pytest.fixture
def cores(tmp_path: Path, etcd_registry_url: str) -> Iterator[tuple[CoreProcess, CoreProcess, str]]:
    """Two Cores on one etcd; the first leads. Heartbeats may be late by seconds on a loaded
    2-core machine: the timeout is generous, the leader lease short."""
    token = new_token()
    knobs: CoreTimeouts = {"heartbeat_timeout_s": 6.0, "lease_ttl_s": 6.0, "leader_ttl_s": 2.0}
    first = CoreProcess(tmp_path, "core-a", etcd_registry_url, token, **knobs)
    first.wait_leader(timeout_s=30)
    second = CoreProcess(tmp_path, "core-b", etcd_registry_url, token, **knobs)
    try:
        yield first, second, token
    finally:
        second.stop()
        first.stop()


class Workers:
    """The training processes under the launchers, watched in a thread: every pid ever seen."""

    def __init__(self, launchers: list[Launcher], script: Path) -> None:
        self.launchers, self.script = launchers, str(script)
        self.seen: dict[int, str] = {}  # pid -> its rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def current(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for launcher in self.launchers:
            try:
                tree = psutil.Process(launcher.proc.pid).children(recursive=True)
            except psutil.Error:
                continue
            for proc in tree:
                try:
                    cmd, env = proc.cmdline(), proc.environ()
                except psutil.Error:
                    continue
                # `python tiny.py`, not its agent (`elaswave.cli agent ... -- python tiny.py`) nor
                # the describe run (no rank)
                if cmd[1:2] == [self.script] and "ELASWAVE_RANK" in env:
                    found[proc.pid] = env["ELASWAVE_RANK"]
        return found

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            self.seen.update(self.current())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _steps(core: CoreProcess) -> dict[str, int]:
    try:
        members = core.job("tiny")["members"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {m["worker_id"]: int((m.get("last_step") or {}).get("step", -1)) for m in members}


def _start_job(
    tmp_path: Path, first: CoreProcess, second: CoreProcess, monkeypatch: pytest.MonkeyPatch, token: str
) -> tuple[list[Launcher], Path, Workers]:
    monkeypatch.setenv("ELASWAVE_SCHEDULER_TOKEN", token)
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    both = f"127.0.0.1:{first.http_port},127.0.0.1:{second.http_port}"
    # Cold workers: `Workers` tells a rank's process by its argv and environment in /proc, which a
    # worker forked from the zygote does not keep (docs/engine.md, "Warm starts").
    flags = ("--core", both, "--nnodes", "2", "--nproc-per-node", "2", "--pp", "2", "--cold-workers")
    common = ("--checkpoint-dir", tmp_path / "ckpt", "--timeout", "60", script, "--steps", str(STEPS))
    a = Launcher(*flags, "--node-id", "node-a", *common, cwd=tmp_path)
    wait_until_waiting(first, "tiny", "node-a", timeout_s=90)  # node-a is node 0: it runs the store
    b = Launcher(*flags, "--node-id", "node-b", *common, cwd=tmp_path)
    a.wait_for(
        "every worker to commit step 3",
        lambda: len(s := _steps(first)) == 4 and min(s.values()) >= 3,
        timeout_s=180,
    )
    workers = Workers([a, b], script)
    wait_until(lambda: len(workers.seen) == 4, 30, "the four worker processes")
    return [a, b], script, workers


def _fail_over(first: CoreProcess, second: CoreProcess, nodes: list[Launcher]) -> int:
    """SIGKILL the leading Core once it lists the job's stores (the store on node-a, the standby
    on node-b, beside their launchers); the standby leads and knows them from etcd. Returns the
    furthest step committed before."""
    stores = first.job("tiny")["stores"]
    assert stores == [f"127.0.0.1:{_store_port(node)}" for node in nodes], stores
    at = max(_steps(first).values())
    first.kill()
    second.wait_leader(timeout_s=60)
    assert second.job("tiny")["stores"] == stores
    return at


def _store_port(launcher: Launcher) -> int:
    """The port of the one store a launcher runs."""
    (store,) = (c for c in psutil.Process(launcher.proc.pid).children(recursive=True) if _runs_store(c))
    return next(c.laddr.port for c in store.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


def _final_state_equals_the_reference(tmp_path: Path, script: Path, losses: dict[int, float]) -> None:
    reference = _reference_losses(script, STEPS, state_out=tmp_path / "reference.pt")
    assert sorted(losses) == list(range(STEPS))
    for step in range(STEPS):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4, abs=1e-6), step
    final = elaswave.load_model_state(tmp_path / "ckpt")
    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert final.keys() == expected.keys()
    worst = max(float((final[k] - expected[k]).abs().max()) for k in final)
    assert worst <= 1e-5, worst


@pytest.mark.timeout(420)
def test_the_job_trains_on_in_place_when_the_leading_core_is_killed(
    cores: tuple[CoreProcess, CoreProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, token = cores
    nodes, script, workers = _start_job(tmp_path, first, second, monkeypatch, token)
    try:
        at = _fail_over(first, second, nodes)
        nodes[0].wait_for(
            "the workers to step on under the new leader",
            lambda: min(_steps(second).values(), default=-1) > at + 5,
            timeout_s=120,
        )
        release(script)
        codes = [n.wait(timeout_s=240) for n in nodes]
    finally:
        workers.close()
    for node in nodes:
        assert f"job 'tiny' finished: {STEPS}/{STEPS} steps, 4 of 4 workers finished" in node.output, (
            node.output[-3000:]
        )
    assert codes == [0, 0]
    assert sorted(workers.seen.values()) == ["0", "1", "2", "3"], workers.seen  # no worker restarted
    job = second.job("tiny")
    assert job["plan_epoch"] == 0 and job["phase"] == "COMPLETED"  # no plan: in place, as if nothing
    assert {m["state"] for m in job["members"]} == {"LEFT"}
    run_dirs = [tmp_path / "elaswave-run" / "tiny" / f"node-{i}" for i in range(2)]
    losses = _job_losses(run_dirs[0], [0, 1]) | _job_losses(run_dirs[1], [2, 3])
    _final_state_equals_the_reference(tmp_path, script, losses)


@pytest.mark.timeout(480)
def test_the_stores_node_lost_after_a_failover_leaves_the_job_on_the_standby_store(
    cores: tuple[CoreProcess, CoreProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, token = cores
    nodes, script, workers = _start_job(tmp_path, first, second, monkeypatch, token)
    try:
        at = _fail_over(first, second, nodes)
        nodes[1].wait_for(
            "the workers to step on under the new leader",
            lambda: min(_steps(second).values(), default=-1) > at + 5,
            timeout_s=120,
        )
        store_a = second.job("tiny")["stores"][0]
        survivors = {pid for pid, rank in workers.current().items() if rank in ("2", "3")}
        node_a = psutil.Process(nodes[0].proc.pid)
        lost = [node_a, *node_a.children(recursive=True)]
        assert any(_runs_store(p) for p in lost)  # the job's store is here
        for proc in lost:  # the whole node at once: launcher, agents, workers and the store
            proc.kill()
        nodes[1].wait_for(
            "the Core to store node-b's new standby",
            lambda: len(stores := second.job("tiny")["stores"]) == 2 and store_a not in stores,
            timeout_s=240,
        )
        release(script)
        code = nodes[1].wait(timeout_s=300)
    finally:
        workers.close()
    out = nodes[1].output
    assert code == 0, out[-4000:]
    assert f"job 'tiny' finished: {STEPS}/{STEPS} steps, 2 of 4 workers finished" in out, out[-3000:]
    assert {pid for pid, rank in workers.seen.items() if rank in ("2", "3")} == survivors  # in place
    job = second.job("tiny")
    assert job["phase"] == "COMPLETED" and job["plan_mode"] == "in_place"
    # node-b's launcher saw node-a's store gone, started a new standby beside it, and the Core
    # stored the job's new list in etcd
    assert len(job["stores"]) == 2 and store_a not in job["stores"], job["stores"]
    assert "on another node does not answer" in out and "new standby store on" in out
    run_dir = tmp_path / "elaswave-run" / "tiny" / "node-1"
    for rank in (2, 3):  # each moved its groups to the standby store, node-b's own
        moves = json.loads((run_dir / f"rank-{rank}.json").read_text())["store_moves"]
        assert len(moves) >= 1, moves
    losses = _job_losses(run_dir, [2, 3])  # one rank of each stage: every step's loss
    _final_state_equals_the_reference(tmp_path, script, losses)


def _runs_store(process: psutil.Process) -> bool:
    """Whether `process` is a store server (a zygote's child shows its command as one string)."""
    try:
        return "executor.store_server" in " ".join(process.cmdline())
    except psutil.Error:
        return False
