"""The demo's training job: a Core, the rendezvous store and GPT-example ranks beside their agents.

Every process is real and listens on loopback ports picked at random: a Core (in-memory
membership), the rendezvous store the executors build their groups on (its own process: a
store inside a training rank would die with it), and one agent per worker, each launching the
GPT example (`examples/gpt/train.py`, written against the public `elaswave.train` API like any
user's script) as one rank of a PP x DP x ZeRO-1 job. The layout comes from the script itself,
run once in describe mode, as `elaswave run` does. `TrainDemo` starts these processes;
`fault_free_losses` runs the same script and seed in one process, the reference every layout
must match (the same loss to fp32 round-off: only the DP reduction's summation order differs).
The demo's story (`harness.demo_story`), the chaos runs (`harness.chaos`) and the end-to-end
tests build on them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elaswave.launcher_procs import WarmWorkers
from harness.control_plane import Demo, states
from wire.worker_env import (
    CHECKPOINT_DIR_ENV,
    CORE_ENV,
    JOB_ENV,
    LAYOUT_ENV,
    RANK_ENV,
    RESULTS_ENV,
    STORE_ENV,
    TIMEOUT_ENV,
    TOKEN_ENV,
)

GPT_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "train.py"

MAX_MEAN_REL_DEV = 1e-4  # the engine's promise with placement-invariant RNG (docs/architecture.md ("Promises and rules"), promise 4)
# Before the failure only the summation order differs from one process: fp32 round-off.
MAX_REL_DEV_BEFORE = 1e-6


@dataclass(frozen=True)
class TrainDemoConfig:
    pp: int = 2
    dp: int = 3
    layers: int = 4
    global_batch: int = 12
    micro_batches: int = 2
    steps: int = 12
    kill_after_step: int = 4  # kill once every worker has committed this step
    victim_rank: int = 4  # stage 1 (stage-major numbering: stage p holds ranks p*dp .. p*dp+dp-1)
    dropout: float = 0.1
    checkpoint_dir: str | None = None  # workers checkpoint here (and answer operators' requests)
    # Backups checked every this many committed steps: these jobs are short, and their consistency
    # checks count the mismatches found (a launched job's default, 50, would check none).
    verify_every: int = 2

    def check(self) -> None:
        if not 0 <= self.victim_rank < self.pp * self.dp:
            raise ValueError(f"victim rank must be in 0..{self.pp * self.dp - 1}, got {self.victim_rank}")
        if self.dp < 2:
            raise ValueError("the demo needs DP >= 2 so the victim's stage keeps a rank and its snapshot")
        if not 0 <= self.kill_after_step < self.steps - 1:
            raise ValueError(f"kill step must be in 0..{self.steps - 2}, got {self.kill_after_step}")


class TrainDemo(Demo):
    """The training job's processes on top of the control-plane demo's Core and agents."""

    def __init__(self, workdir: Path, cfg: TrainDemoConfig, timeout_s: float) -> None:
        super().__init__(workdir, cfg.pp * cfg.dp, timeout_s)
        cfg.check()
        self.cfg = cfg
        self.store: Any = None  # executor.store_server.StoreServer once started
        self.agents: dict[int, subprocess.Popen[bytes]] = {}  # by rank: tests signal one agent
        self.extra_env: dict[int, dict[str, str]] = {}  # by rank: e.g. a fault to inject
        self.standby_stores: list[Any] = []  # started with the store when `standbys` > 0
        self.standbys = 0
        self.core_addresses: list[str] = []  # gRPC of every Core (HA); empty: the one started
        # Workers forked from a zygote, as `elaswave run` starts them (agent.zygote); False: each
        # worker is a fresh interpreter (a test that reads a worker's /proc environment).
        self.warm_workers = True
        self._zygote: WarmWorkers | None = None
        self._zygote_dir: Path | None = None
        self._launched: tuple[int, int, str] = (0, 0, "")  # gRPC port, store port, job token

    def start_core(self) -> dict[str, Any]:
        self._begin_zygote()  # it imports torch while the Core starts and the model is described
        return super().start_core()

    def _begin_zygote(self) -> None:
        if self.warm_workers and self._zygote is None:
            # a short directory: a socket's path is limited to ~100 bytes
            self._zygote_dir = Path(tempfile.mkdtemp(prefix="ew-z-"))
            env = dict(os.environ, PYTHONUNBUFFERED="1")  # the workers' import-time environment
            self._zygote = WarmWorkers.begin(self._zygote_dir, env, self.workdir / "zygote.log")

    def zygote_args(self) -> list[str]:
        """`--zygote SOCKET` for an agent once the zygote accepts workers; none (cold) otherwise."""
        self._begin_zygote()
        socket = self._zygote.ready(timeout_s=30.0) if self._zygote is not None else None
        return ["--zygote", str(socket)] if socket is not None else []

    def script_args(self) -> list[str]:
        c = self.cfg
        return [
            "--steps",
            str(c.steps),
            "--layers",
            str(c.layers),
            "--dropout",
            str(c.dropout),
            "--global-batch",
            str(c.global_batch),
            "--micro-batches",
            str(c.micro_batches),
            "--verify-every",
            str(c.verify_every),
        ]

    def layout(self) -> Any:
        """The script's units as its describe run reports them, split evenly over the stages
        (ranks stage-major: the victim's stage is known in advance)."""
        from elaswave.launcher_describe import describe  # noqa: PLC0415 - torch only when run
        from planners.layout import make_uniform_layout  # noqa: PLC0415

        if not GPT_SCRIPT.is_file():
            raise FileNotFoundError(
                f"the GPT example is not at {GPT_SCRIPT}: run the demo from a source checkout"
            )
        self._begin_zygote()  # the describe run is forked from it, as under `elaswave run`
        spawn = self._zygote.fork if self._zygote is not None else None
        desc = describe(GPT_SCRIPT, self.script_args(), timeout_s=self.timeout_s, spawn=spawn)
        numel = tuple(u.numel for u in desc.units)
        return make_uniform_layout(
            len(numel), self.cfg.pp, self.cfg.dp, self.cfg.global_batch, self.cfg.micro_batches, numel
        )

    def start_store(self) -> int:
        from executor.store_server import StoreServer  # noqa: PLC0415

        # Forked from the workers' zygote, as `elaswave run` starts them (elaswave.store_keeper).
        spawn = self._zygote.fork if self._zygote is not None else None
        env = dict(os.environ, PYTHONUNBUFFERED="1")  # the zygote's import-time environment
        self.store = StoreServer.start(spawn=spawn, env=env)
        self.standby_stores = []
        for _ in range(self.standbys):  # each announces the list so far (executor.store_server)
            peers = (self.store.address, *(s.address for s in self.standby_stores))
            self.standby_stores.append(StoreServer.start(peers=peers, spawn=spawn, env=env))
        return self.store.port

    def _worker_env(self, rank: str, results: Path) -> dict[str, str]:
        """The worker contract (`wire.worker_env`) for `rank` (a number, or "spare")."""
        grpc_port, store_port, job_token = self._launched
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            **{
                TOKEN_ENV: job_token,
                JOB_ENV: "demo",
                RANK_ENV: rank,
                CORE_ENV: ",".join(self.core_addresses or [f"127.0.0.1:{grpc_port}"]),
                STORE_ENV: ",".join(
                    [f"127.0.0.1:{store_port}", *(f"127.0.0.1:{s.port}" for s in self.standby_stores)]
                ),
                LAYOUT_ENV: str(self.workdir / "layout.json"),
                TIMEOUT_ENV: "20",
                RESULTS_ENV: str(results),
            },
        )
        if self.cfg.checkpoint_dir is not None:
            env[CHECKPOINT_DIR_ENV] = self.cfg.checkpoint_dir
        return env

    def start_spare(self, index: int) -> subprocess.Popen[bytes]:
        """A spare worker (growth) for the running job: its agent registers it without a rank and
        its worker (`ELASWAVE_RANK=spare`) waits for the plan that takes it in (`Plan.joiners`)."""
        worker_id = f"spare-{index}"
        env = self._worker_env("spare", self.spare_result_file(index))
        env.update(self.extra_env.get(-1 - index, {}))
        cores = env[CORE_ENV]
        agent = [
            *(sys.executable, "-m", "elaswave.cli", "agent", "--job", "demo", "--worker-id", worker_id),
            *("--core", cores, "--metrics-socket", str(self.workdir / f"{worker_id}.sock")),
            *("--log-level", "WARNING", *self.zygote_args(), *self.agent_args(-1)),
            *("--", *self.worker_command(-1)),
        ]
        proc = subprocess.Popen(agent, env=env)
        self.procs.append(proc)
        return proc

    def spare_result_file(self, index: int) -> Path:
        return self.workdir / f"spare-{index}.json"

    def start_training(self, grpc_port: int, store_port: int, job_token: str, layout: Any) -> None:
        self._launched = (grpc_port, store_port, job_token)
        layout_file = self.workdir / "layout.json"
        layout_file.write_text(layout.to_json())
        cores = ",".join(self.core_addresses or [f"127.0.0.1:{grpc_port}"])
        zygote = self.zygote_args()
        for stage in layout.stages:
            for dp_rank, rank in enumerate(stage.ranks):
                env = self._worker_env(str(rank), self.result_file(rank))
                env.update(self.extra_env.get(rank, {}))
                worker = self.worker_command(rank)
                agent = [
                    sys.executable,
                    "-m",
                    "elaswave.cli",
                    "agent",
                    "--job",
                    "demo",
                    "--worker-id",
                    f"rank-{rank}",
                    "--rank",
                    str(rank),
                    "--stage",
                    str(stage.stage),
                    "--dp-rank",
                    str(dp_rank),
                    "--core",
                    cores,
                    "--metrics-socket",
                    str(self.workdir / f"rank-{rank}.sock"),
                    "--log-level",
                    "WARNING",
                    *zygote,
                    *self.agent_args(rank),
                    "--",
                    *worker,
                ]
                self.agents[rank] = subprocess.Popen(agent, env=env)
                self.procs.append(self.agents[rank])

    def worker_command(self, rank: int) -> list[str]:
        """What rank `rank`'s agent launches: the GPT example as one rank (a subclass may wrap it)."""
        return [sys.executable, str(GPT_SCRIPT), *self.script_args()]

    def agent_args(self, rank: int) -> list[str]:
        """Extra options for rank `rank`'s agent (none here)."""
        return []

    def result_file(self, rank: int) -> Path:
        return self.workdir / f"rank-{rank}.json"

    def wait_results(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        while not all(self.result_file(r).exists() for r in ranks):
            self._check_time(f"results of ranks {[r for r in ranks if not self.result_file(r).exists()]}")
            time.sleep(0.1)
        return {r: json.loads(self.result_file(r).read_text()) for r in ranks}

    def stop(self) -> None:
        super().stop()
        if self._zygote is not None:  # after the agents: it kills any worker still running
            self._zygote.stop()
            self._zygote = None
        if self._zygote_dir is not None:
            shutil.rmtree(self._zygote_dir, ignore_errors=True)
        for store in [self.store, *self.standby_stores]:
            if store is not None:
                store.stop()


def last_step(member: dict[str, Any]) -> int:
    """The last step a member reported (-1 before its first)."""
    return int((member.get("last_step") or {}).get("step", -1))


def live_members(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The job view's members that neither were lost nor left."""
    return [m for m in job["members"] if m["state"] not in ("LOST", "LEFT")]


def create_job_with_layout(demo: TrainDemo, layout: Any) -> str:
    assert demo.http is not None
    body = {"name": "demo", "expected_workers": demo.workers, "layout": json.loads(layout.to_json())}
    response = demo.http.post(
        "/api/v1/jobs", json=body, headers={"Authorization": f"Bearer {demo.scheduler_token}"}
    )
    response.raise_for_status()
    return response.json()["token"]


def launch_job(demo: TrainDemo) -> dict[str, Any]:
    """Core, job with its layout, store, and one agent + worker per rank; the Core's ports."""
    cfg = demo.cfg
    info = demo.start_core()
    print(
        f"[demo] Core up: gRPC 127.0.0.1:{info['grpc_port']}, REST http://127.0.0.1:{info['http_port']}/api/v1/jobs"
    )
    layout = demo.layout()
    token = create_job_with_layout(demo, layout)
    store_port = demo.start_store()
    print(
        f"[demo] job 'demo': PP={cfg.pp} x DP={cfg.dp} x ZeRO-1 (interleaved), {cfg.layers} blocks, global batch "
        f"{cfg.global_batch} in {cfg.micro_batches} micro-batches, {cfg.steps} steps; store on port {store_port}"
    )
    demo.start_training(info["grpc_port"], store_port, token, layout)
    return info


def wait_committed(demo: TrainDemo, step: int) -> dict[str, Any]:
    """The job as the Core shows it once every worker has committed `step`."""
    return demo.wait_for(
        f"every worker to commit step {step}",
        lambda j: len(j["members"]) == demo.workers and all(last_step(m) >= step for m in j["members"]),
    )


def wait_departures(demo: TrainDemo, workers: list[str], timeout_s: float = 15.0) -> None:
    """Bounded wait for finished workers' agents to say Leave; the checks report what is missing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        final = states(demo.job())
        if all(final.get(w) in ("LEFT", "LOST") for w in workers):
            return
        time.sleep(0.05)


def fault_free_losses(demo: TrainDemo, checkpoint_dir: Path | None = None) -> list[float]:
    """The same script and seed in one process (no launcher environment): the reference; with
    `checkpoint_dir`, its final checkpoint is written there too."""
    from elaswave.launcher_describe import clean_env  # noqa: PLC0415

    out = demo.workdir / "fault_free_losses.json"
    ckpt = [] if checkpoint_dir is None else ["--checkpoint-dir", str(checkpoint_dir)]
    subprocess.run(
        [sys.executable, str(GPT_SCRIPT), *demo.script_args(), "--losses-out", str(out), *ckpt],
        env=clean_env(),
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=demo.timeout_s,
    )
    losses = json.loads(out.read_text())
    return [float(losses[str(s)]) for s in range(demo.cfg.steps)]


def job_losses(results: dict[int, dict[str, Any]]) -> dict[int, float]:
    losses: dict[int, float] = {}
    for res in results.values():
        for step, loss in res["losses"].items():
            losses.setdefault(int(step), loss)
    return losses
