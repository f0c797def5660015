"""`elaswave demo`: an elastic training job under the Core, on one machine, on embedded defaults.

Every process is real and listens on loopback ports picked at random: a Core (in-memory
membership), the rendezvous store the executors build their groups on (its own process: a
store inside a training rank would die with it), and one agent per worker, each launching the
GPT example (`examples/gpt/train.py`, written against the public `elaswave.train` API like any
user's script) as one rank of a PP x DP x ZeRO-1 job. The layout comes from the script itself,
run once in describe mode, as `elaswave run` does. Mid-training one worker
is killed with SIGKILL. Nothing is restarted: the agent reports the exit, the Core re-plans
(micro-batch resizing, ElasWave §4.1, and a block migrated off the damaged stage when the
cost model says it pays, §4.2) and publishes the plan, the survivors roll back, take the plan from
`ExecutorService`, edit their groups in place, rebuild the lost optimizer shard from its ring
snapshot (§5), migrate the moved block (§6.2) and replay the step. The demo then checks the job against a fault-free
single-process run of the same script and seed (`python examples/gpt/train.py`): the same loss to fp32 round-off before the failure (the
DP reduction adds in another order than one process does), within 1e-4 mean relative deviation
after it, and every sample of every global batch processed exactly once
per stage; it exits non-zero if any check fails.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elaswave.worker_env import (
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
from harness.demo import Demo, states

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
        desc = describe(GPT_SCRIPT, self.script_args(), timeout_s=self.timeout_s)
        numel = tuple(u.numel for u in desc.units)
        return make_uniform_layout(
            len(numel), self.cfg.pp, self.cfg.dp, self.cfg.global_batch, self.cfg.micro_batches, numel
        )

    def start_store(self) -> int:
        from executor.store_server import StoreServer  # noqa: PLC0415

        self.store = StoreServer.start()
        self.standby_stores = []
        for _ in range(self.standbys):  # each announces the list so far (executor.store_server)
            peers = (self.store.address, *(s.address for s in self.standby_stores))
            self.standby_stores.append(StoreServer.start(peers=peers))
        return self.store.port

    def start_training(self, grpc_port: int, store_port: int, job_token: str, layout: Any) -> None:
        layout_file = self.workdir / "layout.json"
        layout_file.write_text(layout.to_json())
        cores = ",".join(self.core_addresses or [f"127.0.0.1:{grpc_port}"])
        for stage in layout.stages:
            for dp_rank, rank in enumerate(stage.ranks):
                env = dict(
                    os.environ,
                    PYTHONUNBUFFERED="1",
                    **{
                        TOKEN_ENV: job_token,
                        JOB_ENV: "demo",
                        RANK_ENV: str(rank),
                        CORE_ENV: cores,
                        STORE_ENV: ",".join(
                            [f"127.0.0.1:{store_port}", *(f"127.0.0.1:{s.port}" for s in self.standby_stores)]
                        ),
                        LAYOUT_ENV: str(layout_file),
                        TIMEOUT_ENV: "20",
                        RESULTS_ENV: str(self.result_file(rank)),
                    },
                )
                if self.cfg.checkpoint_dir is not None:
                    env[CHECKPOINT_DIR_ENV] = self.cfg.checkpoint_dir
                env.update(self.extra_env.get(rank, {}))
                worker = [sys.executable, str(GPT_SCRIPT), *self.script_args()]
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
                    "--",
                    *worker,
                ]
                self.agents[rank] = subprocess.Popen(agent, env=env)
                self.procs.append(self.agents[rank])

    def result_file(self, rank: int) -> Path:
        return self.workdir / f"rank-{rank}.json"

    def wait_results(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        while not all(self.result_file(r).exists() for r in ranks):
            self._check_time(f"results of ranks {[r for r in ranks if not self.result_file(r).exists()]}")
            time.sleep(0.1)
        return {r: json.loads(self.result_file(r).read_text()) for r in ranks}

    def stop(self) -> None:
        super().stop()
        for store in [self.store, *self.standby_stores]:
            if store is not None:
                store.stop()


def last_step(member: dict[str, Any]) -> int:
    """The last step a member reported (-1 before its first)."""
    return int((member.get("last_step") or {}).get("step", -1))


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


def run_train_demo(demo: TrainDemo) -> int:
    cfg = demo.cfg
    launch_job(demo)
    victim = f"rank-{cfg.victim_rank}"
    job = wait_committed(demo, cfg.kill_after_step)
    member = next(m for m in job["members"] if m["worker_id"] == victim)
    print(
        f"[demo] {demo.workers} workers training; kill -9 {victim} (pid {member['pid']}, stage "
        f"{member['stage']}) during step {last_step(member) + 1}"
    )
    killed_unix = time.time()
    os.kill(member["pid"], signal.SIGKILL)
    job = demo.wait_for(
        "the Core to re-plan and the survivors to resume",
        lambda j: j["plan_epoch"] >= 1 and j["phase"] == "RUNNING",
    )
    survivors = [r for r in range(demo.workers) if r != cfg.victim_rank]
    results = demo.wait_results(survivors)
    wait_departures(demo, [f"rank-{r}" for r in survivors])
    print(f"[demo] members now: {states(demo.job())}")
    return report(demo, killed_unix, results)


def wait_departures(demo: TrainDemo, workers: list[str], timeout_s: float = 15.0) -> None:
    """Bounded wait for finished workers' agents to say Leave; the checks report what is missing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        final = states(demo.job())
        if all(final.get(w) in ("LEFT", "LOST") for w in workers):
            return
        time.sleep(0.05)


def report(demo: TrainDemo, killed_unix: float, results: dict[int, dict[str, Any]]) -> int:
    cfg = demo.cfg
    assert demo.http is not None
    events = demo.http.get("/api/v1/jobs/demo/events").json()["events"]
    print_timeline(events, killed_unix, results)
    print_layout(demo.job().get("layout"))
    ref = fault_free_losses(demo)
    losses = job_losses(results)
    fail_step = min(r["step"] for res in results.values() for r in res["recoveries"])
    print(f"[demo] {'step':>4}  {'elastic job':>14}  {'fault-free':>14}  {'|diff|':>9}")
    for step in range(cfg.steps):
        note = "  <- replayed on the new layout" if step == fail_step else ""
        print(
            f"[demo] {step:>4}  {losses[step]:>14.9f}  {ref[step]:>14.9f}  {abs(losses[step] - ref[step]):>9.2e}{note}"
        )
    problems = check(cfg, results, losses, ref, fail_step) + check_membership(cfg, events, states(demo.job()))
    for problem in problems:
        print(f"[demo] CHECK FAILED: {problem}")
    if not problems:
        after = range(fail_step, cfg.steps)
        dev = sum(abs(losses[s] - ref[s]) / abs(ref[s]) for s in after) / len(after)
        before = max((abs(losses[s] - ref[s]) / abs(ref[s]) for s in range(fail_step)), default=0.0)
        print(
            f"[demo] checks passed: losses before the failure within {before:.1e} relative of the fault-free "
            f"run (fp32 round-off); mean relative deviation after it {dev:.1e} (<= {MAX_MEAN_REL_DEV:g}); every "
            "sample of every step from the failure on processed exactly once per stage; no snapshot checksum "
            "mismatch; no process restarted"
        )
    return 1 if problems else 0


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


def check(
    cfg: TrainDemoConfig,
    results: dict[int, dict[str, Any]],
    losses: dict[int, float],
    ref: list[float],
    fail_step: int,
) -> list[str]:
    problems: list[str] = []
    if sorted(losses) != list(range(cfg.steps)):
        problems.append(f"committed steps {sorted(losses)} are not 0..{cfg.steps - 1}")
        return problems
    for step in range(fail_step):
        rel = abs(losses[step] - ref[step]) / abs(ref[step])
        if not rel <= MAX_REL_DEV_BEFORE:
            problems.append(
                f"step {step} (before the failure) differs from the fault-free run by {rel:.1e} "
                f"relative (> {MAX_REL_DEV_BEFORE:g}, more than fp32 round-off)"
            )
    after = range(fail_step, cfg.steps)
    dev = sum(abs(losses[s] - ref[s]) / abs(ref[s]) for s in after) / len(after)
    if not math.isfinite(dev) or dev > MAX_MEAN_REL_DEV:
        problems.append(f"mean relative loss deviation after the failure {dev:.2e} > {MAX_MEAN_REL_DEV:g}")
    for step in range(cfg.steps):
        per_stage: dict[int, list[int]] = {}
        for rank, res in results.items():
            stage = rank // cfg.dp  # a rank keeps its stage under resizing
            per_stage.setdefault(stage, []).extend(res["samples"].get(str(step), []))
        # The victim's share of steps it committed before dying comes from the survivors' view:
        # only steps from the failure on must be covered by the survivors alone.
        if step < fail_step:
            continue
        expected = list(range(step * cfg.global_batch, (step + 1) * cfg.global_batch))
        for stage, samples in per_stage.items():
            if sorted(samples) != expected:
                problems.append(f"step {step}, stage {stage}: samples {sorted(samples)} != {expected}")
    for rank, res in results.items():
        if res["checksum_mismatches"]:
            problems.append(f"rank {rank}: snapshot checksum mismatches {res['checksum_mismatches']}")
    return problems


def check_membership(cfg: TrainDemoConfig, events: list[dict[str, Any]], final: dict[str, str]) -> list[str]:
    """The Core's view: only the victim was lost, once; nobody came back; the rest finished."""
    problems: list[str] = []
    victim = f"rank-{cfg.victim_rank}"
    lost = [e["worker_id"] for e in events if e["kind"] == "worker_lost"]
    if lost != [victim]:
        problems.append(f"workers lost {lost}, expected only {victim} once")
    rejoined = [e["worker_id"] for e in events if e["kind"] == "worker_rejoined"]
    if rejoined:
        problems.append(f"workers re-registered after leaving: {rejoined}")
    survivors = sorted(f"rank-{r}" for r in range(cfg.pp * cfg.dp) if r != cfg.victim_rank)
    finished = sorted(e["worker_id"] for e in events if e["kind"] == "worker_finished")
    if finished != survivors:
        problems.append(f"workers that finished their work {finished}, expected {survivors}")
    epochs = [e["data"].get("epoch") for e in events if e["kind"] == "plan_published"]
    if epochs != [1]:
        problems.append(f"plans published for epochs {epochs}, expected one (the failure's)")
    expected = {f"rank-{r}": "LEFT" for r in range(cfg.pp * cfg.dp)} | {victim: "LOST"}
    if final != expected:
        problems.append(f"final member states {final} != {expected}")
    return problems


def print_layout(layout: dict[str, Any] | None) -> None:
    """The layout the Core planned: which blocks each stage holds now, on which ranks (the ElasWave
    policy resizes micro-batches and may also migrate blocks between adjacent stages, §4.1-4.2)."""
    if layout is None:
        return
    stages = "; ".join(
        f"stage {s['stage']} units {s['layer_start']}..{s['layer_stop'] - 1} on ranks {s['ranks']}"
        for s in layout["stages"]
    )
    clocks = (
        f"; clocks {dict(map(tuple, layout['frequencies_mhz']))} MHz" if layout["frequencies_mhz"] else ""
    )
    print(f"[demo] layout now: {stages}{clocks}")


def print_timeline(
    events: list[dict[str, Any]], killed_unix: float, results: dict[int, dict[str, Any]]
) -> None:
    """Where the recovery time went (docs/architecture.md ("Promises and rules"), promise 2: itemised per component)."""
    lost = next((e for e in events if e["kind"] == "worker_lost"), None)
    published = next(
        (e for e in events if e["kind"].startswith("plan_published") or e["kind"] == "decision_publish"), None
    )
    recs = [r for res in results.values() for r in res["recoveries"]]
    print("[demo] recovery, itemised:")
    if lost is not None:
        print(
            f"[demo]   detect   {1e3 * (lost['time_unix'] - killed_unix):8.0f} ms  kill -9 -> Core marks "
            f"{lost['worker_id']} LOST ({lost['detail']})"
        )
    if lost is not None and published is not None:
        print(
            f"[demo]   plan     {1e3 * (published['time_unix'] - lost['time_unix']):8.0f} ms  LOST -> plan "
            f"published ({published['detail']})"
        )
    if recs:
        print(
            f"[demo]   edit     {1e3 * max(r['communicator_s'] for r in recs):8.0f} ms  communicator edit "
            f"(slowest survivor; rebuilt {sorted({g for r in recs for g in r['rebuilt']})})"
        )
        print(
            f"[demo]   apply    {1e3 * max(r['apply_s'] for r in recs):8.0f} ms  edit + shard remap from the "
            "ring snapshot + new layout (slowest survivor)"
        )
    resumed = [e for e in events if e["kind"] == "phase_running" and e["time_unix"] > killed_unix]
    if resumed:
        print(
            f"[demo]   total    {1e3 * (resumed[0]['time_unix'] - killed_unix):8.0f} ms  kill -9 -> every "
            "survivor committed a step on the new layout"
        )
    print("[demo] events:")
    for event in events:
        if event["kind"] in ("worker_running",) or event["kind"].startswith("plan_"):
            continue
        print(f"[demo]     #{event['seq']:<3} {event['kind']:<18} {event['worker_id']:<8} {event['detail']}")
