"""`elaswave run --core`: nodes join one job through a running Core (core_service.rendezvous).

Every process is real and on loopback: an `elaswave core` with an in-memory registry, and for
the end-to-end tests two launchers in their own processes, each one simulated node. The REST
tests post descriptions straight to the rendezvous and launch no worker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from core_service.rendezvous import LEASE_S
from elaswave.launcher_control import next_job_name, resume_command
from tests.core.procs import CoreProcess, create_job, new_token
from tests.pacing import paced_on_step, release
from tests.test_launcher import FAKE, TINY, Launcher, _env, _job_losses, _reference_losses, tiny_variant
from wire import worker_env as we

pytestmark = pytest.mark.multiproc
UNITS = [("embed", 4096, 1e-5), ("block0", 1024, 1e-4), ("block1", 1024, 1e-4), ("head", 4096, 2e-5)]


@pytest.fixture
def core(tmp_path: Path) -> Iterator[tuple[CoreProcess, str]]:
    token = new_token()
    proc = CoreProcess(tmp_path, "core", "memory://", token)
    proc.wait_leader()
    try:
        yield proc, token
    finally:
        proc.stop()


def description(units: list[tuple[str, int, float]] = UNITS, **overrides: Any) -> dict[str, Any]:
    desc = we.ModelDescription(
        units=tuple(
            we.UnitDescription(name, numel, 4 * numel, cost, 2 * cost, 64) for name, numel, cost in units
        ),
        global_batch=8,
        micro_batches=2,
        dataset_len=64,
        steps=6,
        fingerprints={"embed": "abc"},
    )
    return json.loads(desc.to_json()) | overrides


def store_of(node_id: str) -> str:
    """The store a node offers in these REST tests (nothing listens there: no worker runs)."""
    return f"127.0.0.1:{10000 + sum(map(ord, node_id))}"


def join_body(node_id: str, **overrides: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "stores": [store_of(node_id)],
        "session": f"session-{node_id}",
        "nnodes": 2,
        "nproc_per_node": 2,
        "pp": 2,
        "description": description(),
        "timeout_s": 30.0,
        "poll_s": 30.0,
    } | overrides


def post_join(
    core: CoreProcess, token: str | None, job: str, body: dict[str, Any], client_timeout_s: float = 60.0
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(
        f"http://127.0.0.1:{core.http_port}/api/v1/rendezvous/{job}",
        json=body,
        headers=headers,
        timeout=client_timeout_s,
    )


class Waiting:
    """A node's rendezvous request waiting in a thread."""

    def __init__(self, core: CoreProcess, token: str, job: str, body: dict[str, Any]) -> None:
        self.response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._post, args=(core, token, job, body), daemon=True)
        self._thread.start()

    def _post(self, core: CoreProcess, token: str, job: str, body: dict[str, Any]) -> None:
        self.response = post_join(core, token, job, body)

    def result(self, timeout_s: float = 60.0) -> httpx.Response:
        self._thread.join(timeout_s)
        assert self.response is not None, "the waiting node got no answer"
        return self.response


def wait_until_waiting(core: CoreProcess, job: str, node: str, timeout_s: float = 10.0) -> None:
    """Until the Core's log says `node` joined `job` (the first node is then the first in order)."""
    deadline = time.monotonic() + timeout_s
    while f"rendezvous {job}: node {node} joined" not in core.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"node {node} never joined:\n{core.log()}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------- REST refusals


@pytest.mark.timeout(60)
def test_the_rendezvous_needs_the_scheduler_token_and_a_readable_request(
    core: tuple[CoreProcess, str],
) -> None:
    proc, token = core
    assert post_join(proc, None, "j", join_body("a")).status_code == 401
    assert post_join(proc, "x" * 32, "j", join_body("a")).status_code == 403
    bad = post_join(proc, token, "j", join_body("a", description={"units": []}))
    assert bad.status_code == 422 and "not a model description" in json.dumps(bad.json()["detail"])
    too_deep = post_join(proc, token, "j", join_body("a", pp=5))
    assert too_deep.status_code == 422 and "--pp 5 needs at least 5 units" in json.dumps(
        too_deep.json()["detail"]
    )
    assert post_join(proc, token, "j", join_body("a", nnodes=0)).status_code == 422
    assert proc.http.get("/api/v1/jobs/j").status_code == 404  # nothing was created


@pytest.mark.timeout(60)
def test_a_wait_that_expires_is_408_and_withdraws_the_node(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    started = time.monotonic()
    alone = post_join(proc, token, "j", join_body("a", timeout_s=1.0))
    assert alone.status_code == 408 and time.monotonic() - started < 10
    assert "only 1 of 2 nodes joined within 1 s (a); 1 never came" in alone.json()["detail"]
    assert proc.http.get("/api/v1/jobs/j").status_code == 404


@pytest.mark.timeout(60)
def test_a_node_that_stops_asking_is_withdrawn(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    waiting = post_join(proc, token, "j", join_body("a", poll_s=0.2))
    assert waiting.status_code == 202, waiting.text
    assert waiting.json() == {"job": "j", "joined": ["a"], "nnodes": 2, "missing": 1}
    again = post_join(proc, token, "j", join_body("a", poll_s=0.2))  # the same node asking again
    assert again.status_code == 202 and again.json()["joined"] == ["a"]
    impostor = post_join(proc, token, "j", join_body("a", session="another-session", poll_s=0.2))
    assert impostor.status_code == 409 and "node 'a' has joined job 'j' already" in impostor.json()["detail"]
    time.sleep(LEASE_S + 1)  # a stops asking: its launcher went away
    b = post_join(proc, token, "j", join_body("b", poll_s=0.2))
    assert b.status_code == 202 and b.json()["joined"] == ["b"], b.text


@pytest.mark.timeout(90)
def test_nodes_that_differ_are_refused_and_the_others_form_the_job(core: tuple[CoreProcess, str]) -> None:
    proc, token = core
    first = Waiting(proc, token, "j", join_body("a"))
    wait_until_waiting(proc, "j", "a")
    other_units = [*UNITS[:1], ("block0", 2048, 1e-4), *UNITS[2:]]
    refusals = {
        "unit 1 is 'block0' with 2048 parameters here but 'block0' with 1024": join_body(
            "b", description=description(other_units)
        ),
        "global_batch is 16 here but 8": join_body("b", description=description(global_batch=16)),
        "the initial weights of units ['embed'] differ": join_body(
            "b", description=description(fingerprints={})
        ),
        "--pp 1 here but 2 on node 'a'": join_body("b", pp=1),
        "--nnodes 3 here but 2": join_body("b", nnodes=3),
        "node 'a' has joined job 'j' already": join_body("a", session="another-session"),
    }
    for message, body in refusals.items():
        response = post_join(proc, token, "j", body)
        assert response.status_code == 409 and message in response.json()["detail"], (message, response.text)
    # The same command on the second node forms the job; both get the same layout.
    second = post_join(
        proc, token, "j", join_body("b", description=description([(n, s, 3 * c) for n, s, c in UNITS]))
    )  # other measured times: the first node's are used
    a, b = first.result().json(), second.json()
    assert second.status_code == 200, second.text
    assert (a["node_index"], a["ranks"], b["node_index"], b["ranks"]) == (0, [0, 1], 1, [2, 3])
    assert a["layout"] == b["layout"] and a["rank_node"] == b["rank_node"] == [0, 0, 1, 1]
    # The job's store on node a, its standby on node b: losing one node never takes both.
    assert a["token"] == b["token"] and a["stores"] == b["stores"] == [store_of("a"), store_of("b")]
    for stage in a["layout"]["stages"]:  # losing either node leaves every stage a rank
        assert {a["rank_node"][r] for r in stage["ranks"]} == {0, 1}
    job = proc.job("j")
    assert job["expected_workers"] == 4 and job["layout"]["stages"] == a["layout"]["stages"]
    # A node that comes after the job formed joins the running job with spare workers (no agent
    # registered here, so the job has room), if it runs the same command and model.
    for message, body in {
        "a node joining a running job must run the same command": join_body("c", pp=1),
        "the initial weights of units ['embed'] differ": join_body(
            "c", description=description(fingerprints={})
        ),
    }.items():
        response = post_join(proc, token, "j", body)
        assert response.status_code == 409 and message in response.json()["detail"], (message, response.text)
    late = post_join(proc, token, "j", join_body("c")).json()
    assert late["role"] == "spare" and late["ranks"] == [] and late["node_index"] == -1
    assert late["spare_worker_ids"] == ["c-spare-0", "c-spare-1"] and late["token"] == a["token"]
    assert late["stores"] == a["stores"] and late["layout"] == a["layout"]
    again = post_join(proc, token, "j", join_body("c"))
    assert again.json() == late  # the node's next poll gets the same answer
    create_job(proc, token, "taken")
    taken = post_join(proc, token, "taken", join_body("a"))
    assert taken.status_code == 409 and "already exists" in taken.json()["detail"]


# ------------------------------------------------------------------------------ the launcher


def _run(*args: str | Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elaswave.cli", "run", *map(str, args)],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.mark.timeout(90)
def test_the_launcher_refuses_core_without_a_token_or_an_address(tmp_path: Path) -> None:
    env = _env()
    env.pop("ELASWAVE_SCHEDULER_TOKEN", None)
    no_token = _run("--core", "127.0.0.1:1", "--nnodes", "2", FAKE, cwd=tmp_path, env=env)
    assert no_token.returncode == 64 and "--core needs the Core's scheduler token" in no_token.stderr
    env["ELASWAVE_SCHEDULER_TOKEN"] = new_token()
    bad = _run("--core", "somewhere", FAKE, cwd=tmp_path, env=env)
    assert bad.returncode == 64 and "give the Core's REST address as HOST:PORT" in bad.stderr
    lonely = _run("--node-id", "n1", FAKE, cwd=tmp_path, env=env)
    assert (
        lonely.returncode == 64
        and "--node-id names a node of a multi-node job: it needs --core" in lonely.stderr
    )
    nobody = _run("--core", "127.0.0.1:1", "--nnodes", "2", FAKE, cwd=tmp_path, env=env)
    assert (
        nobody.returncode == 1 and "cannot reach the Core's REST API at http://127.0.0.1:1" in nobody.stderr
    )


def _two_nodes(
    proc: CoreProcess, tmp_path: Path, *script_args: str, text: str = TINY
) -> tuple[Launcher, Launcher]:
    script = tmp_path / "tiny.py"
    script.write_text(text)
    flags = ("--core", f"127.0.0.1:{proc.http_port}", "--nnodes", "2", "--nproc-per-node", "2", "--pp", "2")
    first = Launcher(*flags, "--node-id", "node-a", script, *script_args, cwd=tmp_path)
    wait_until_waiting(proc, "tiny", "node-a", timeout_s=60)  # node-a is node 0
    return first, Launcher(*flags, "--node-id", "node-b", script, *script_args, cwd=tmp_path)


@pytest.mark.timeout(240)
def test_two_nodes_train_one_job_like_the_single_process_run_through_a_store_loss(
    core: tuple[CoreProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes form one job through the Core; node-a's launcher runs its store, node-b's the
    standby. The store is killed at step 3: the workers move to the standby in place and node-a's
    launcher starts a new standby, whose address the workers learn from the store; that store is
    killed too, and the job still trains like the single-process run."""
    proc, token = core
    monkeypatch.setenv("ELASWAVE_SCHEDULER_TOKEN", token)
    # Slow steps: a new standby (a process importing torch, seconds on a loaded machine) is up
    # well before the job ends.
    slow = tiny_variant("sleep(0.03)", "sleep(0.15)", TINY_SLOW)
    nodes = _two_nodes(proc, tmp_path, "--steps", str(STORE_LOSS_STEPS), text=slow)
    nodes[0].wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps_remote(proc)) == 4 and min(s.values()) >= 3,
        timeout_s=150,
    )
    # the job's store and its standby, each in its own process beside its node's launcher, forked
    # from that node's zygote (which each joined launcher starts before its describe run)
    first, standby = _node_stores(nodes[0])[0], _node_stores(nodes[1])[0]
    for store in (first, standby):
        parent = store.parent()
        assert parent is not None and _runs(parent, "agent.zygote"), store.cmdline()
    assert proc.job("tiny")["stores"] == [f"127.0.0.1:{_listening_port(p)}" for p in (first, standby)]
    first_address = f"127.0.0.1:{_listening_port(first)}"
    first.kill()
    at = max(_member_steps_remote(proc).values())
    nodes[0].wait_for(
        "a new standby store, announced in the standby",
        lambda: len(listed := _store_list(standby)) == 2 and first_address not in listed,
        timeout_s=150,
    )
    ready = max(_member_steps_remote(proc).values())
    nodes[0].wait_for(
        "every worker 10 steps on (it re-reads the store list every 8)",
        lambda: min(_member_steps_remote(proc).values(), default=-1) >= max(at, ready) + 10,
        timeout_s=150,
    )
    killed_at = max(_member_steps_remote(proc).values())
    standby.kill()
    nodes[0].wait_for(  # each commit votes through the store: a commit now is one on the new store
        "every worker to commit on the new store",
        lambda: min(_member_steps_remote(proc).values(), default=-1) >= killed_at + 2,
        timeout_s=150,
    )
    release(tmp_path / "tiny.py")
    codes = [n.wait(timeout_s=180) for n in nodes]
    for node in nodes:
        assert (
            f"job 'tiny' finished: {STORE_LOSS_STEPS}/{STORE_LOSS_STEPS} steps, 4 of 4 workers finished"
            in (node.output)
        ), node.output[-3000:]
    assert codes == [0, 0]
    run_dirs = [tmp_path / "elaswave-run" / "tiny" / f"node-{i}" for i in range(2)]
    records = [json.loads((d / "nodes.json").read_text()) for d in run_dirs]
    assert [r["this_node"] for r in records] == [0, 1] and records[0]["rank_node"] == records[1]["rank_node"]
    assert [n["node_id"] for n in records[0]["node_ids"]] == ["node-a", "node-b"]
    layout = json.loads((run_dirs[0] / "layout.json").read_text())
    assert layout == json.loads((run_dirs[1] / "layout.json").read_text())
    for stage in layout["stages"]:  # each stage has a rank on each node: no node loss empties one
        assert sorted(records[0]["rank_node"][r] for r in stage["ranks"]) == [0, 1]
    for d, ranks in zip(run_dirs, ([0, 1], [2, 3]), strict=True):  # each node ran its own ranks only
        assert sorted(int(p.stem.split("-")[1]) for p in d.glob("rank-*.json")) == ranks
        for result in d.glob("rank-*.json"):  # every worker moved to the standby, then to the new one
            assert len(json.loads(result.read_text())["store_moves"]) == 2, result
    losses = _job_losses(run_dirs[0], [0, 1]) | _job_losses(run_dirs[1], [2, 3])
    reference = _reference_losses(tmp_path / "tiny.py", STORE_LOSS_STEPS)
    assert sorted(losses) == list(range(STORE_LOSS_STEPS))
    for step in range(STORE_LOSS_STEPS):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), (step, losses, reference)
    assert {m["state"] for m in proc.job("tiny")["members"]} == {"LEFT"}


@pytest.mark.timeout(240)
def test_ctrl_c_on_one_node_stops_the_job_on_every_node(
    core: tuple[CoreProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, token = core
    monkeypatch.setenv("ELASWAVE_SCHEDULER_TOKEN", token)
    first, second = _two_nodes(proc, tmp_path, "--steps", "100000")
    first.wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps_remote(proc)) == 4 and min(s.values()) >= 3,
        timeout_s=150,
    )
    os.kill(first.proc.pid, signal.SIGINT)
    codes = first.wait(timeout_s=90), second.wait(timeout_s=90)
    assert codes == (128 + signal.SIGINT, 128 + signal.SIGTERM), first.output[-3000:] + second.output[-3000:]
    assert "asked the Core to stop job 'tiny' on every node" in first.output
    assert "event: checkpoint_requested" in second.output and "stopped on request" in second.output
    steps = {
        json.loads(p.read_text())["committed_steps"]
        for p in tmp_path.glob("elaswave-run/tiny/node-*/rank-*.json")
    }
    assert len(steps) == 1 and 3 <= steps.pop() < 100000  # every rank left at the same boundary


STORE_LOSS_STEPS = 150


def _store_list(store: psutil.Process) -> list[str]:
    """The job's store list as `store` holds it (executor.store_server.STORES_KEY)."""
    from executor.store_server import STORES_KEY, connect_store  # noqa: PLC0415 - torch

    client = connect_store("127.0.0.1", _listening_port(store), timeout_s=5.0)
    # none until a replacement announced itself (the launchers start the first two apart)
    return client.get(STORES_KEY).decode().split(",") if client.check([STORES_KEY]) else []


def _listening_port(store: psutil.Process) -> int:
    return next(c.laddr.port for c in store.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


def _node_stores(launcher: Launcher) -> list[psutil.Process]:
    """The store processes a launcher runs, oldest first."""
    children = psutil.Process(launcher.proc.pid).children(recursive=True)  # forked by its zygote
    return sorted((c for c in children if _runs(c, "executor.store_server")), key=lambda c: c.create_time())


def _member_steps_remote(proc: CoreProcess) -> dict[str, int]:
    try:
        members = proc.job("tiny")["members"]
    except (httpx.HTTPError, ValueError):
        return {}
    return {m["worker_id"]: int((m.get("last_step") or {}).get("step", -1)) for m in members}


def test_the_resume_command_of_a_joined_node_names_a_new_job() -> None:
    ns = argparse.Namespace(
        nnodes=2,
        nproc_per_node=2,
        pp=2,
        job=None,
        core="10.0.0.5:8080",
        checkpoint_dir=None,
        checkpoint_every=None,
        timeout=20.0,
        script=Path("train.py"),
        script_args=[],
    )
    assert resume_command(ns, Path("ck")) == (
        "elaswave run --nnodes 2 --nproc-per-node 2 --pp 2 --resume ck --core "
        "10.0.0.5:8080 --job train-2 train.py"
    )
    assert next_job_name("train-2") == "train-3" and next_job_name("x" * 63) == "x" * 61 + "-2"


def _runs(process: psutil.Process, module: str) -> bool:
    """Whether `process` is alive (not a zombie waiting to be reaped) and runs `module`."""
    try:
        # a zygote's child shows its command as one string (agent.zygote sets its title)
        return process.status() != psutil.STATUS_ZOMBIE and module in " ".join(process.cmdline())
    except psutil.Error:
        return False


# Slow steps (a sleep in the script's on_step): the replacement node has time to start (its
# describe run, the rendezvous, agents and workers importing torch) while the job still trains.
TINY_SLOW = tiny_variant(
    "steps=args.steps, optimizer=elaswave.AdamW(lr=1e-2))",
    "steps=args.steps, optimizer=elaswave.AdamW(lr=1e-2),\n                        "
    + paced_on_step(0.03)
    + ")",
)  # (the single-process reference needs no sleep; `tests.pacing.release` ends the slow steps)
SPARE_STEPS = 500


@pytest.mark.timeout(300)
def test_a_node_that_comes_back_joins_the_running_job_with_spares(
    core: tuple[CoreProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes form a PP=2 x DP=2 job; node-b's launcher dies (its agents stop its workers) and
    the job goes on with node-a's ranks. A third node, started with the same command, finds the
    job running: its workers join as spares, the Core takes them in where node-b's ranks were
    (fresh ranks 4 and 5), they receive their state in place, and the job finishes like the
    single-process run with every worker LEFT and the job COMPLETED."""
    proc, token = core
    monkeypatch.setenv("ELASWAVE_SCHEDULER_TOKEN", token)
    script = tmp_path / "tiny.py"
    # slower still: node-c's launcher, its store, agents and workers start while the job trains,
    # which takes half a minute on a loaded 2-core machine
    script.write_text(tiny_variant("sleep(0.03)", "sleep(0.1)", TINY_SLOW))
    flags = ("--core", f"127.0.0.1:{proc.http_port}", "--nnodes", "2", "--nproc-per-node", "2", "--pp", "2")
    a = Launcher(*flags, "--node-id", "node-a", script, "--steps", str(SPARE_STEPS), cwd=tmp_path)
    wait_until_waiting(proc, "tiny", "node-a", timeout_s=60)
    b = Launcher(*flags, "--node-id", "node-b", script, "--steps", str(SPARE_STEPS), cwd=tmp_path)
    a.wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps_remote(proc)) == 4 and min(s.values()) >= 3,
        timeout_s=150,
    )
    b.kill()  # its agents get SIGINT (they die with their launcher) and stop their workers
    a.wait_for(
        "the job to go on without node-b's ranks",
        lambda: proc.job("tiny")["plan_epoch"] >= 1 and proc.job("tiny")["phase"] == "RUNNING",
        timeout_s=120,
    )
    c = Launcher(*flags, "--node-id", "node-c", script, "--steps", str(SPARE_STEPS), cwd=tmp_path)
    c.wait_for(
        "the spares to be taken in",
        lambda: sorted(m["rank"] for m in proc.job("tiny")["members"] if "spare" in m["worker_id"]) == [4, 5],
        timeout_s=150,
    )
    release(script)
    codes = [a.wait(timeout_s=200), c.wait(timeout_s=60)]
    assert "joins it with spare workers ['node-c-spare-0', 'node-c-spare-1']" in c.output, c.output[-3000:]
    assert codes == [0, 0], a.output[-3000:] + c.output[-3000:]
    job = proc.job("tiny")
    assert job["phase"] == "COMPLETED"
    node_a, node_c = (
        tmp_path / "elaswave-run" / "tiny" / "node-0",
        tmp_path / "elaswave-run" / "tiny" / "node-node-c",
    )
    spares = [json.loads((node_c / f"node-c-spare-{k}.json").read_text()) for k in range(2)]
    assert sorted(s["rank"] for s in spares) == [4, 5] and all(s["joined"]["step"] > 3 for s in spares)
    losses = _job_losses(node_a, [0, 1])
    for spare in spares:
        for step, loss in spare["losses"].items():
            losses.setdefault(int(step), loss)
    reference = _reference_losses(script, SPARE_STEPS)
    assert sorted(losses) == list(range(SPARE_STEPS))
    for step in range(SPARE_STEPS):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), (step, losses[step], reference[step])


@pytest.mark.timeout(240)
def test_a_node_whose_workers_are_preempted_exits_3_and_the_job_goes_on(
    core: tuple[CoreProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both of node-a's workers are preempted through the scheduler API: node-a's launcher says
    its workers left a job that goes on and exits EXIT_LEFT_RUNNING_JOB (3), never 0 ("done");
    node-b trains to the end and exits 0 (issue 27, item 2)."""
    from elaswave.launcher_monitor import EXIT_COMPLETED, EXIT_LEFT_RUNNING_JOB  # noqa: PLC0415

    proc, token = core
    monkeypatch.setenv("ELASWAVE_SCHEDULER_TOKEN", token)
    script = tmp_path / "tiny.py"
    script.write_text(TINY_SLOW)
    flags = ("--core", f"127.0.0.1:{proc.http_port}", "--nnodes", "2", "--nproc-per-node", "2", "--pp", "2")
    first = Launcher(*flags, "--node-id", "node-a", script, "--steps", "200", cwd=tmp_path)
    wait_until_waiting(proc, "tiny", "node-a", timeout_s=60)
    second = Launcher(*flags, "--node-id", "node-b", script, "--steps", "200", cwd=tmp_path)
    first.wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps_remote(proc)) == 4 and min(s.values()) >= 3,
        timeout_s=150,
    )
    record = json.loads((tmp_path / "elaswave-run" / "tiny" / "node-0" / "nodes.json").read_text())
    node_a = [f"rank-{r}" for r in record["nodes"]["0"]]
    response = httpx.post(
        f"http://127.0.0.1:{proc.http_port}/api/v1/jobs/tiny/preempt",
        json={"worker_ids": node_a, "deadline_unix": time.time() + 30, "reason": "spot reclaim (test)"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert response.status_code == 202, response.text
    code_a = first.wait(timeout_s=120)
    release(script)
    assert code_a == EXIT_LEFT_RUNNING_JOB, first.output[-3000:]
    assert (
        "this node's workers left job 'tiny'" in first.output and "goes on with 2 worker(s)" in first.output
    )
    assert "finished:" not in first.output
    assert second.wait(timeout_s=180) == EXIT_COMPLETED, second.output[-3000:]
    assert "job 'tiny' finished: 200/200 steps, 2 of 4 workers finished" in second.output


@pytest.mark.timeout(90)
def test_offers_to_a_rendezvous_job_are_judged_and_bounded_per_host(core: tuple[CoreProcess, str]) -> None:
    """A job formed by the rendezvous (what `elaswave run --core` does) carries its nodes' model
    description as its model: its scale table answers, an offer is judged by FlexTrain (eq. 16)
    and admits only what the chosen configuration uses, and an offer for a host whose offered
    devices are not used yet is refused with the reason (issue 27, item 3)."""
    import grpc  # noqa: PLC0415

    from wire.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: PLC0415

    proc, token = core
    # A global batch of 64 in 8 micro-batches (micro-batches of 4 on DP=2): DP can grow to 16.
    model = description(global_batch=64, micro_batches=8)
    first = Waiting(proc, token, "j", join_body("a", description=model))
    wait_until_waiting(proc, "j", "a")
    assert post_join(proc, token, "j", join_body("b", description=model)).status_code == 200
    assert first.result().status_code == 200
    job = proc.job("j")
    assert job["scale_table"]["rows"], job["scale_table"]  # the model is registered
    auth = [("authorization", f"Bearer {token}")]
    with grpc.insecure_channel(proc.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        table = scheduler.GetScaleTable(
            scheduler_pb2.GetScaleTableRequest(job="j"), metadata=auth, timeout=20
        )
        largest = max(row.devices for row in table.rows)

        def offer(devices: int, host: str) -> scheduler_pb2.OfferResourcesResponse:
            request = scheduler_pb2.OfferResourcesRequest(
                job="j", devices=devices, hosts=[host], expected_duration_s=24 * 3600
            )
            return scheduler.OfferResources(request, metadata=auth, timeout=30)

        huge = offer(65_536, "h1")
        assert "membership-only" not in huge.reason
        assert huge.accepted and "scale to" in huge.reason, huge.reason
        assert 0 < huge.admitted_workers <= largest - 4  # what the chosen configuration adds
        again = offer(2, "h1")
        assert not again.accepted and again.admitted_workers == 0
        assert f"host 'h1' already has {huge.admitted_workers} offered device(s)" in again.reason
        short = offer(2, "h2")  # judged on its own: another host, the same rule
        assert "membership-only" not in short.reason
    assert proc.job("j")["offered_workers"] == huge.admitted_workers + short.admitted_workers


@pytest.mark.timeout(60)
def test_an_offer_to_a_job_that_cannot_use_more_devices_is_refused_with_why(
    core: tuple[CoreProcess, str],
) -> None:
    """A global batch of 8 in micro-batches of 2 allows DP 4 at most: FlexTrain's scale table has
    nothing above the current 4 devices, so even 65,536 offered devices are refused."""
    import grpc  # noqa: PLC0415

    from wire.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: PLC0415

    proc, token = core
    first = Waiting(proc, token, "j", join_body("a"))
    wait_until_waiting(proc, "j", "a")
    assert post_join(proc, token, "j", join_body("b")).status_code == 200
    assert first.result().status_code == 200
    with grpc.insecure_channel(proc.grpc_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        request = scheduler_pb2.OfferResourcesRequest(job="j", devices=65_536, hosts=["h1"])
        answer = scheduler.OfferResources(
            request, metadata=[("authorization", f"Bearer {token}")], timeout=30
        )
    assert not answer.accepted and answer.admitted_workers == 0
    assert answer.reason == "no scale-table entry above the current allocation fits"
    assert proc.job("j")["offered_workers"] == 0


@pytest.mark.timeout(240)
def test_both_stores_lost_at_once_the_workers_find_the_replacement_through_the_core(
    core: tuple[CoreProcess, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-node `--core` job runs its store and standby; both are SIGKILLed at once, so no
    worker can learn the replacement's address from a store. The launcher starts replacements
    and reports them to the Core; the workers, finding every store they know gone, ask the Core
    for the job's list (`ExecutorService.GetJobStores`), move there in place, and the job trains
    like the single-process run."""
    proc, token = core
    monkeypatch.setenv("ELASWAVE_SCHEDULER_TOKEN", token)
    script = tmp_path / "tiny.py"
    script.write_text(tiny_variant("sleep(0.03)", "sleep(0.1)", TINY_SLOW))
    flags = ("--core", f"127.0.0.1:{proc.http_port}", "--nnodes", "1", "--nproc-per-node", "2", "--pp", "2")
    node = Launcher(*flags, "--node-id", "node-a", script, "--steps", str(STORE_LOSS_STEPS), cwd=tmp_path)
    node.wait_for(
        "every worker to commit step 3",
        lambda: len(s := _member_steps_remote(proc)) == 2 and min(s.values()) >= 3,
        timeout_s=150,
    )
    first = proc.job("tiny")["stores"]
    stores = _node_stores(node)
    assert [f"127.0.0.1:{_listening_port(p)}" for p in stores] == first
    at = max(_member_steps_remote(proc).values())
    for store in stores:
        store.kill()
    node.wait_for(
        "every worker to commit on a replacement store",
        lambda: min(_member_steps_remote(proc).values(), default=-1) >= at + 3,
        timeout_s=180,
    )
    release(script)
    assert node.wait(timeout_s=120) == 0, node.output[-3000:]
    run_dir = tmp_path / "elaswave-run" / "tiny" / "node-0"
    for rank in (0, 1):
        moves = json.loads((run_dir / f"rank-{rank}.json").read_text())["store_moves"]
        assert moves and moves[0] not in first, (moves, first)  # a store the Core listed later
    events = proc.http.get("/api/v1/jobs/tiny/events").json()["events"]
    modes = [e["data"]["mode"] for e in events if e["kind"] == "plan_published"]
    assert modes and set(modes) == {"in_place"}, modes  # the failed step replayed in place, no RESTORE
    losses, reference = _job_losses(run_dir, [1]), _reference_losses(script, STORE_LOSS_STEPS)
    assert sorted(losses) == list(range(STORE_LOSS_STEPS))
    for step in range(STORE_LOSS_STEPS):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), (step, losses[step], reference[step])
