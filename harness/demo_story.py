"""`elaswave demo`: one elastic job lives through every kind of event ElasWave handles, in place.

The job is the GPT example (`examples/gpt/train.py`) as PP x DP x ZeRO-1 ranks under a Core,
each rank beside its agent (the training demo's processes, `harness.training`, with the chaos
harness's node and kill faults, `harness.chaos`). The story, each chapter fired once every live
worker has committed its step and the previous chapter's plan has been applied:

1. the job learns;
2. `kill`: one worker is SIGKILLed; its agent reports the exit and the survivors recover in place;
3. `straggler`: one worker's compute is stretched (`ELASWAVE_INJECT_SLOW_FILE`,
   `executor.slow_injection`; on CPU the clock is the
   agent's *simulated* frequency controller): the Core flags it from its step times against its
   stage peers, and the ElasWave policy migrates layers off its stage (Algorithm 1, §4.2) and
   up-clocks it (the DVFS planner, Algorithm 2, §4.3);
4. `preempt`: a cluster scheduler preempts a worker through the Core's scheduler API
   (`POST /api/v1/jobs/{job}/preempt`, the REST face of `SchedulerService.SignalPreemption`)
   with a deadline; it leaves at a step boundary, LEFT and never LOST;
5. `node`: a node's worth of ranks (workers and their agents) dies at once;
6. `join`: a spare worker joins and the layout returns (`join_spare`, see there).

Nothing is restarted. `harness.demo_report` then measures everything from the workers' results,
the Core's events and a fault-free run of the same script and seed, and writes the report.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.chaos import ChaosRun, ChaosScenario, Fault
from harness.control_plane import states
from harness.training import last_step, launch_job, live_members, wait_departures
from wire.worker_env import INJECT_SLOW_FILE_ENV

EventKind = Literal["kill", "straggler", "preempt", "node", "join"]


@dataclass(frozen=True)
class StoryConfig:
    pp: int = 2
    dp: int = 3
    layers: int = 4
    global_batch: int = 12
    micro_batches: int = 2
    # Room after the node loss for the spares to start (a Python process importing torch on a
    # loaded machine takes seconds), be taken in and train: the join fires right after the node.
    steps: int = 300
    # Ranks of each simulated node, as torchrun numbers a PP=2 x DP=3 job on three 2-rank nodes:
    # shard backups avoid a shard's own node (`Layout.rank_nodes`), so a node's loss is recovered
    # from memory.
    nodes: tuple[tuple[int, ...], ...] = ((0, 1), (2, 3), (4, 5))
    kill_rank: int = 4
    straggler_rank: int = 1
    slowdown: float = 3.0  # the straggler computes this many times slower at the nominal clock
    preempt_rank: int = 5
    preempt_deadline_s: float = 30.0
    node: int = 0  # index into `nodes`
    gap_steps: int = 6  # steps trained between the end of one chapter and the next event
    # The chapters to run, in story order (`bench.join` runs ("kill", "join")).
    chapters: tuple[EventKind, ...] = ("kill", "straggler", "preempt", "node", "join")
    timeout_s: float = 240.0

    def check(self) -> None:
        ranks = self.pp * self.dp
        if self.dp < 3 or self.pp < 2:
            raise ValueError("the story needs PP >= 2 and DP >= 3 (a stage keeps a rank through every loss)")
        if sorted(r for n in self.nodes for r in n) != list(range(ranks)):
            raise ValueError(f"nodes {self.nodes} must hold every rank 0..{ranks - 1} once")
        gone = {self.kill_rank, self.preempt_rank, *self.nodes[self.node]}
        for name, rank in (("kill", self.kill_rank), ("preempt", self.preempt_rank)):
            if not 0 <= rank < ranks:
                raise ValueError(f"{name} rank must be in 0..{ranks - 1}, got {rank}")
        if len(gone) != 2 + len(self.nodes[self.node]):
            raise ValueError("the killed, preempted and node ranks must be distinct")
        for stage in range(self.pp):
            if all(r in gone for r in range(stage * self.dp, (stage + 1) * self.dp)):
                raise ValueError(f"stage {stage} would lose every rank")
        if not self.slowdown > 1.0:
            raise ValueError(f"the straggler's slowdown must be > 1, got {self.slowdown}")
        if self.steps < 8 * self.gap_steps:
            raise ValueError(f"the story needs at least {8 * self.gap_steps} steps, got {self.steps}")


@dataclass
class StoryEvent:
    kind: EventKind
    ranks: tuple[int, ...]
    after_step: int = -1  # fired once every live worker committed this step
    fired_unix: float = 0.0
    detail: str = ""
    skipped: str = ""  # why it did not run (the join until the engine has a join mode)
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class StoryRecord:
    """What the run left behind, read before its processes stop."""

    cfg: StoryConfig
    workdir: Path
    events: list[StoryEvent]
    results: dict[int, dict[str, Any]]
    core_events: list[dict[str, Any]]
    final_states: dict[str, str]
    pids_before: dict[str, int]
    pids_after: dict[str, int]
    traces: dict[int, list[dict[str, Any]]]
    started_unix: float
    phase: str


class StoryRun(ChaosRun):
    """The chaos harness's processes with the demo's worker wrapper and a simulated clock."""

    def __init__(self, workdir: Path, cfg: StoryConfig) -> None:
        cfg.check()
        scenario = ChaosScenario(
            "demo",
            pp=cfg.pp,
            dp=cfg.dp,
            faults=(),
            steps=cfg.steps,
            layers=cfg.layers,
            global_batch=cfg.global_batch,
            micro_batches=cfg.micro_batches,
            nodes=cfg.nodes,
        )
        super().__init__(workdir, scenario, cfg.timeout_s)
        self.story = cfg
        self.spares = 0  # spare workers started by the join chapter
        # Flagged after 3 steps over 2x their stage peers' median: a loaded 2-core machine
        # jitters a healthy rank's compute, the injected 3x does not hide in it.
        self.core_env.update(ELASWAVE_FAILSLOW__RATIO="2.0", ELASWAVE_FAILSLOW__TRIGGER_STEPS="3")
        for rank in range(cfg.pp * cfg.dp):
            self.extra_env[rank][INJECT_SLOW_FILE_ENV] = str(self.slow_file(rank))

    def slow_file(self, rank: int) -> Path:
        return self.workdir / f"rank-{rank}.slow.json"

    def agent_args(self, rank: int) -> list[str]:
        # CPU: the clock is a number the agent publishes to its worker (agent.frequency), named so.
        return ["--frequency-controller", "simulated"]

    def live_committed(self, step: int) -> dict[str, Any]:
        """The job once every live worker has committed `step` and the last recovery's copies
        are re-seeded (no open re-protection window: ChaosRun.fire says why)."""
        return self.wait_for(
            f"every live worker to commit step {step} and the copies to be re-seeded",
            lambda j: all(last_step(m) >= step for m in live_members(j)) and j.get("backup_window") is None,
        )

    def events_since(self, seq: int = 0) -> list[dict[str, Any]]:
        assert self.http is not None
        got = self.http.get("/api/v1/jobs/demo/events", params={"since": seq, "limit": 10_000})
        return list(got.json()["events"])

    def settled(self, since_seq: int, what: str) -> dict[str, Any]:
        """Wait until a plan published after event `since_seq` is applied (the Core RUNNING again)."""
        while True:
            evs = self.events_since(since_seq)
            plans = [e["seq"] for e in evs if e["kind"] == "plan_published"]
            if plans and any(e["kind"] == "phase_running" and e["seq"] > plans[-1] for e in evs):
                return self.job()
            self._check_time(what)
            time.sleep(0.05)

    def next_step(self) -> int:
        """The step to fire the next event after: `gap_steps` past the furthest live commit."""
        live = [last_step(m) for m in live_members(self.job())]
        return max(live, default=0) + self.story.gap_steps


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def fire_kill(run: StoryRun, ev: StoryEvent) -> None:
    """A worker process killed with SIGKILL; its agent survives and reports the exit."""
    record = run.fire(Fault("kill", ev.after_step, ev.ranks))
    ev.fired_unix, ev.detail = record.fired_unix, f"kill -9 rank {list(ev.ranks)}"


def fire_straggler(run: StoryRun, ev: StoryEvent) -> None:
    """The rank's compute is stretched `slowdown` times from its next step on (simulated clock)."""
    run.live_committed(ev.after_step)
    (rank,) = ev.ranks
    tmp = run.slow_file(rank).with_suffix(".tmp")
    tmp.write_text(json.dumps({"slowdown": run.story.slowdown}))
    ev.fired_unix = time.time()
    tmp.replace(run.slow_file(rank))
    ev.detail = (
        f"rank {rank} computes {run.story.slowdown:g}x slower (simulated device: the agent's simulated "
        "clock controller, no real DVFS on CPU)"
    )
    ev.data["slowdown"] = run.story.slowdown


def fire_preempt(run: StoryRun, ev: StoryEvent) -> None:
    """The scheduler API: preempt one worker with a deadline (REST face of SignalPreemption)."""
    run.live_committed(ev.after_step)
    assert run.http is not None
    (rank,) = ev.ranks
    deadline = time.time() + run.story.preempt_deadline_s
    body = {"worker_ids": [f"rank-{rank}"], "deadline_unix": deadline, "reason": "spot reclaim (demo)"}
    ev.fired_unix = time.time()
    response = run.http.post(
        "/api/v1/jobs/demo/preempt", json=body, headers={"Authorization": f"Bearer {run.scheduler_token}"}
    )
    response.raise_for_status()
    ev.detail = f"POST /api/v1/jobs/demo/preempt rank-{rank}, deadline in {run.story.preempt_deadline_s:g} s"
    ev.data["deadline_unix"] = deadline


def fire_node(run: StoryRun, ev: StoryEvent) -> None:
    """Every worker *and agent* of one node killed at once: nobody is left to report the exits."""
    record = run.fire(Fault("node", ev.after_step, ev.ranks))
    ev.fired_unix, ev.detail = record.fired_unix, f"node {list(ev.ranks)}: workers and agents killed"


class JoinUnavailable(RuntimeError):
    """The engine cannot start a worker in join mode yet."""


def join_spare(run: StoryRun, ev: StoryEvent) -> None:
    """One spare worker per rank the story lost, started for the running job: each agent
    registers without a rank (a spare), each worker runs with `ELASWAVE_RANK=spare` and waits for
    the plan that takes it in (`Plan.joiners`); the Core puts each in a lost rank's place, so the
    layout returns to the fault-free one, and the joiners receive their blocks and shards in
    place from the live owners (issue 10, item 1)."""
    job = run.live_committed(ev.after_step)
    lost = sorted(m["rank"] for m in job["members"] if m["state"] in ("LOST", "LEFT") and m["rank"] >= 0)
    ev.fired_unix = time.time()
    for index in range(len(lost)):
        run.start_spare(index)
    run.spares = len(lost)
    ev.detail = f"{len(lost)} spare workers started (agents without a rank, ELASWAVE_RANK=spare) for lost ranks {lost}"
    ev.data["replaces"] = lost


FIRE = {
    "kill": fire_kill,
    "straggler": fire_straggler,
    "preempt": fire_preempt,
    "node": fire_node,
    "join": join_spare,
}


def story_events(cfg: StoryConfig) -> list[StoryEvent]:
    events = [
        StoryEvent("kill", (cfg.kill_rank,)),
        StoryEvent("straggler", (cfg.straggler_rank,)),
        StoryEvent("preempt", (cfg.preempt_rank,)),
        StoryEvent("node", cfg.nodes[cfg.node]),
        StoryEvent("join", ()),
    ]
    return [ev for ev in events if ev.kind in cfg.chapters]


def wait_effect(run: StoryRun, ev: StoryEvent, seq: int) -> None:
    """The chapter is over once the Core saw the event and its plan is applied."""
    if ev.kind == "straggler":
        worker = f"rank-{ev.ranks[0]}"
        while not any(e["kind"] == "worker_slow" and e["worker_id"] == worker for e in run.events_since(seq)):
            run._check_time(f"the Core to flag {worker} slow")
            time.sleep(0.05)
        say(f"the Core flagged {worker} SLOW")
    run.settled(seq, f"the plan for the {ev.kind} event to be applied")
    if ev.kind == "join":  # spares may register at different times: every one taken in
        job = run.wait_for(
            "every spare to be taken in",
            lambda j: (
                j["phase"] == "RUNNING"
                and sum(1 for m in j["members"] if m["worker_id"].startswith("spare-") and m["rank"] >= 0)
                == run.spares
            ),
        )
        ev.ranks = tuple(sorted(m["rank"] for m in job["members"] if m["worker_id"].startswith("spare-")))


def run_story(run: StoryRun) -> StoryRecord:
    cfg = run.story
    launch_job(run)
    job = run.live_committed(0)
    started = time.time()
    pids_before = {m["worker_id"]: m["pid"] for m in job["members"]}
    say(f"{run.workers} workers training; the story: {', '.join(cfg.chapters)}")
    events = story_events(cfg)
    for ev in events:
        ev.after_step = run.next_step() if ev.kind != "join" else run.next_step() - cfg.gap_steps + 3
        seq = max((e["seq"] for e in run.events_since()), default=0)
        try:
            FIRE[ev.kind](run, ev)
        except JoinUnavailable as exc:
            ev.skipped = str(exc)
            say(f"{ev.kind}: skipped: {exc}")
            continue
        say(f"{ev.kind} after step {ev.after_step}: {ev.detail}")
        wait_effect(run, ev, seq)
        ev.data["layout_after"] = run.job().get("layout")
        say(f"{ev.kind}: recovered in place; layout now {describe_layout(ev.data['layout_after'])}")
    gone = {r for ev in events if ev.kind in ("kill", "node") for r in ev.ranks}
    finishers = [r for r in range(cfg.pp * cfg.dp) if r not in gone]
    results = run.wait_results(finishers)  # the preempted worker writes its results as it leaves
    departing = [f"rank-{r}" for r in finishers]
    for index in range(run.spares):  # a joiner's results are keyed by the rank it was given
        path = run.spare_result_file(index)
        while not path.exists():
            run._check_time(f"results of spare {index}")
            time.sleep(0.1)
        spare = json.loads(path.read_text())
        results[int(spare["rank"])] = spare
        finishers.append(int(spare["rank"]))
        departing.append(f"spare-{index}")  # its worker id: the rank it took is not in its name
    wait_departures(run, departing)
    job = run.job()
    return StoryRecord(
        cfg,
        run.workdir,
        events,
        results,
        run.events_since(),
        states(job),
        pids_before,
        {m["worker_id"]: m["pid"] for m in job["members"]},
        {rank: step_trace(res) for rank, res in results.items()},
        started,
        job["phase"],
    )


def step_trace(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per committed step of one worker: its own compute, the injected stretch and the clock
    factor it used (the worker's results, `executor.worker`)."""
    slowed, factor = results.get("slowed_s", {}), results.get("clock_factor", {})
    return [
        {
            "step": int(step),
            "compute_s": s,
            "slowed_s": slowed.get(step, 0.0),
            "factor": factor.get(step, 1.0),
        }
        for step, s in sorted(results.get("compute_s", {}).items(), key=lambda kv: int(kv[0]))
    ]


def describe_layout(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "-"
    stages = "; ".join(
        f"stage {s['stage']} units {s['layer_start']}..{s['layer_stop'] - 1} ranks {s['ranks']}"
        for s in layout["stages"]
    )
    clocks = layout.get("frequencies_mhz") or []
    return stages + (f"; clocks {dict(map(tuple, clocks))} MHz (simulated)" if clocks else "")


def main_dir(out: str | None) -> Path:
    """Where report.json and the PNG go (created)."""
    path = Path(out) if out else Path(os.getcwd()) / "elaswave-demo"
    path.mkdir(parents=True, exist_ok=True)
    return path
