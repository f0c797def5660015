"""A training process driven by the Core: `python -m executor.worker` (what an agent launches).

It builds its rank of the PP x DP x ZeRO engine from the job's layout, groups over the store that
no training rank hosts (executor.store_server), and runs the step-boundary protocol of
`executor.step_protocol`. What the engine's tests do by hand, the Core does here:

- a peer dies -> the survivors' collectives fail (a closed socket is seen in milliseconds), every
  survivor votes abort and rolls back to the last committed step;
- the agent beside the dead worker reports the exit, the Core plans (micro-batch resizing,
  elaswave.txt §4.1) and publishes the plan; the survivors receive it through
  `ExecutorService.SubscribePlans` (executor.plan_client), acknowledge RECEIVED, PAUSED and
  APPLIED, edit their groups in place, remap the lost shard from its ring snapshot, replay the
  step and acknowledge RESUMED after the first committed step under the new layout;
- a plan that arrives while a step is running aborts that step on every worker (the plan is the
  abort signal: it also releases survivors blocked on a hung rather than a dead peer);
- a planned departure (scheduler preemption through the Core, or SIGTERM of the agent, which
  reports a PreemptionNotice) is the same plan: the leaving worker rolls back with everyone at
  the boundary, sees that its rank is gone and exits 0 (its agent then says Leave: LEFT, not
  LOST). SIGTERM of the worker itself (the agent forwards it; Slurm signals every process) never
  kills it mid-step: if its agent reported the preemption (a drain notice in the control file,
  agent.control) it keeps training until the Core's plan lets it go, so the survivors never see
  it vanish; otherwise (a plain stop), or with no such plan within `--timeout`, it stops at the
  next step boundary and exits 143, which the survivors handle as a fail-stop.

Each committed step is reported to the agent over the local metrics socket. At the end the
worker writes its per-step losses, the samples it ran and its recovery timings as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

TOKEN_ENV = "ELASWAVE_JOB_TOKEN"
EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a SIGTERM'd process
EXIT_NO_PLAN = 75  # EX_TEMPFAIL: the step aborted and no plan came; the agent reports a failure


def link_peer(group: str, rank: int) -> int | None:
    """The other worker of a pipeline-link group ("link/a-b"), the one a failed link op names."""
    kind, _, members = group.partition("/")
    if kind != "link":
        return None
    ends = [int(x) for x in members.split("-")]
    others = [r for r in ends if r != rank]
    return others[0] if len(others) == 1 else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m executor.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--rank", type=int, required=True, help="this worker's global rank in the layout")
    p.add_argument("--core", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="Core gRPC address(es)")
    p.add_argument("--store", required=True, metavar="HOST:PORT", help="the rendezvous store (executor.store_server)")
    p.add_argument("--layout", required=True, type=Path, help="the job's initial layout (planners.Layout JSON)")
    p.add_argument("--steps", type=int, required=True, help="train until this many steps are committed")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks of the model (must match the layout)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=20.0, metavar="SECONDS",
                   help="bound on every collective, vote and plan wait")
    p.add_argument("--verify-every", type=int, default=2, help="check snapshot == live shard every N steps")
    p.add_argument("--out", type=Path, required=True, help="write the worker's results here (JSON)")
    args = p.parse_args(argv)
    if args.steps <= 0 or args.timeout <= 0 or args.rank < 0:
        p.error("--steps and --timeout must be positive and --rank >= 0")
    if ":" not in args.store:
        p.error(f"--store must be HOST:PORT, got {args.store!r}")
    return args


class CoreDrivenWorker:
    """One rank: engine + step protocol + plan subscription. See the module docstring."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch  # noqa: PLC0415 - keep `--help` fast

        from agent.control import ControlReader  # noqa: PLC0415
        from agent.local_metrics import StepMetricsClient  # noqa: PLC0415
        from executor.comm import Communicator, groups_for_stages  # noqa: PLC0415
        from executor.fabric.trainer_state import FabricParticipant  # noqa: PLC0415
        from executor.model import ModelConfig  # noqa: PLC0415
        from executor.plan_client import PlanClient  # noqa: PLC0415
        from executor.step_protocol import StepProtocol  # noqa: PLC0415
        from executor.store_server import connect_store  # noqa: PLC0415
        from executor.trainer import TrainConfig, Trainer  # noqa: PLC0415
        from planners.layout import Layout  # noqa: PLC0415

        torch.set_num_threads(1)
        self.args = args
        layout = Layout.from_json(args.layout.read_text())
        host, port = args.store.rsplit(":", 1)
        store = connect_store(host, int(port), timeout_s=args.timeout)
        self.comm = Communicator(store, args.rank, groups_for_stages([s.ranks for s in layout.stages]),
                                 timeout_s=args.timeout)
        cfg = TrainConfig(model=ModelConfig(num_layers=args.layers, dropout=args.dropout))
        self.trainer = Trainer(cfg, layout, args.rank, self.comm)
        self.participant = FabricParticipant(self.trainer, self.comm, verify_every=args.verify_every)
        self.proto = StepProtocol(self.comm, self.participant, timeout_s=args.timeout)
        self.metrics = StepMetricsClient.from_env()
        self.control = ControlReader.from_env()
        token = os.environ.get(TOKEN_ENV, "")
        self.plans = PlanClient(args.core.split(","), args.job, args.worker_id, token, on_plan=self._plan_arrived)
        self.results: dict[str, Any] = {"rank": args.rank, "worker_id": args.worker_id, "losses": {},
                                        "samples": {}, "recoveries": [], "failures": []}
        self.exit_code = 0
        self._sigterm_at: float | None = None  # monotonic time of the first SIGTERM

    def _on_sigterm(self, signum: int, frame: object) -> None:
        # A preemption notice, not a kill: the agent reports it and the Core's plan lets this
        # worker go at a step boundary (dying now would cost the survivors a fail-stop recovery).
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()
            # os.write, not print: a handler that prints while the main thread prints raises there.
            os.write(2, f"worker {self.args.worker_id}: SIGTERM; leaving at a step boundary (with the Core's plan "
                        f"if the agent reported a preemption, at most {self.args.timeout:g} s)\n".encode())

    def _leave_without_plan(self) -> bool:
        """After SIGTERM, whether to stop at this boundary with no plan: at once unless the agent
        reported a preemption (the Core then plans this worker out), else after `--timeout`."""
        if self._sigterm_at is None:
            return False
        try:
            reported = self.control is not None and self.control.draining is not None
        except ValueError:  # an unreadable control file: no report can be assumed
            reported = False
        return not reported or time.monotonic() - self._sigterm_at > self.args.timeout

    def _plan_arrived(self, plan: Any) -> None:
        # Runs on the subscription thread: a newer plan aborts the step in flight everywhere.
        if plan.epoch > self.proto.plan_epoch and self.proto.step is not None:
            self.comm.signal_abort(f"Core published plan epoch {plan.epoch}")

    def _report_peer(self, exc: Any, step: int) -> None:
        """A link op that failed on its peer's side (not on the abort flag) names that peer: the
        Core's collective-failure path (DESIGN.md §5) marks it lost if nothing else has, which is
        how a hung peer, one whose process and agent still look alive, gets planned out."""
        peer = link_peer(exc.group, self.args.rank)
        if peer is not None and " aborted: " not in str(exc):
            self.plans.report_peer_failure(peer, step, exc.group, exc.reason)

    def run(self) -> dict[str, Any]:
        from executor.comm import PeerFailure  # noqa: PLC0415
        from executor.plan_client import PlanTimeout  # noqa: PLC0415

        signal.signal(signal.SIGTERM, self._on_sigterm)
        # Restart system calls the signal interrupts: a SIGTERM must never fail a collective.
        signal.siginterrupt(signal.SIGTERM, False)
        self.plans.start(after_epoch=self.proto.plan_epoch)
        step, resumed_epoch = 0, None
        try:
            while step < self.args.steps:
                if self._leave_without_plan():
                    self.results["left_at_step"], self.exit_code = step, EXIT_TERMINATED
                    break  # no plan let this worker go: leave anyway, the survivors recover as from a fail-stop
                started = time.perf_counter()
                self.proto.begin_step(step)
                result = None
                try:
                    if self.plans.newest_epoch() > self.proto.plan_epoch:
                        # A plan is waiting: this step is the boundary where every worker takes it.
                        self.comm.signal_abort(f"plan epoch {self.plans.newest_epoch()} is waiting")
                    else:
                        result = self.trainer.train_step(step)
                except PeerFailure as exc:
                    self.proto.report_failure(exc)
                    self.results["failures"].append({"step": step, "group": exc.group, "error": str(exc)[:300]})
                    self._report_peer(exc, step)
                if self.proto.should_commit():
                    self.proto.commit()
                    self._committed(step, result, time.perf_counter() - started)
                    if resumed_epoch is not None:
                        self.plans.ack(resumed_epoch, "RESUMED", time.perf_counter() - started)
                        resumed_epoch = None
                    step += 1
                    continue
                self.proto.rollback()
                try:
                    if not self._recover(step):
                        break  # this worker is not in the new layout: it leaves
                except PlanTimeout as exc:
                    # Nothing the Core saw changed the job (no member lost): without a plan there is
                    # no layout to replay on. Fail visibly, with results, rather than hang.
                    self.results["fatal"], self.exit_code = str(exc), EXIT_NO_PLAN
                    break
                resumed_epoch = self.proto.plan_epoch
        finally:
            self.plans.close()
        self.results.update(committed_steps=step, plan_epoch=self.proto.plan_epoch,
                            checksum_mismatches=self.participant.checksum_mismatches,
                            verified_steps=list(self.participant.verified_steps))
        return self.results

    def _committed(self, step: int, result: Any, seconds: float) -> None:
        if result is None:
            raise RuntimeError(f"step {step} committed on rank {self.args.rank} without having run")
        self.results["samples"][step] = sorted(result.sample_ids)  # global ids the trainer actually fed
        if result is not None and result.loss is not None:
            self.results["losses"][step] = result.loss
        if self.metrics is not None:
            self.metrics.send(step=step, step_time_s=seconds, compute_time_s=seconds,
                              loss=None if result is None else result.loss,
                              samples=0 if result is None else result.samples_processed,
                              stage=self.trainer.stage, dp_rank=self.trainer.dp_index)

    def _recover(self, step: int) -> bool:
        """Wait for the Core's plan, apply it, and say so; False if this worker is not in it."""
        from planners.layout import Layout, Plan  # noqa: PLC0415

        t0 = time.perf_counter()
        published = self.plans.wait_plan(self.proto.plan_epoch, timeout_s=self.args.timeout)
        waited = time.perf_counter() - t0
        self.plans.ack(published.epoch, "RECEIVED", waited)
        new = Layout.from_json(published.layout_json)
        if self.args.rank not in new.ranks():
            # A planned departure, not a failed apply: a FAILED ack would make the Core re-plan.
            self.plans.ack(published.epoch, "PAUSED", 0.0)
            self.results["left_at_step"] = step
            print(f"worker {self.args.worker_id}: plan {published.epoch} has no rank {self.args.rank}; leaving at "
                  f"the boundary of step {step} ({'; '.join(published.reasons)})", flush=True)
            return False
        self.plans.ack(published.epoch, "PAUSED", 0.0)
        plan = Plan(published.epoch, self.trainer.layout, new, published.reasons, published.predicted_step_time_s)
        t1 = time.perf_counter()
        report = self.proto.apply_plan(plan)
        applied = time.perf_counter() - t1
        self.plans.ack(published.epoch, "APPLIED", applied)
        self.results["recoveries"].append({
            "step": step, "epoch": published.epoch, "plan_wait_s": waited, "apply_s": applied,
            "communicator_s": report.seconds, "rebuilt": list(report.rebuilt), "reused": list(report.reused),
            "reasons": list(published.reasons)})
        print(f"worker {self.args.worker_id}: plan {published.epoch} applied before replaying step {step} "
              f"(waited {waited * 1e3:.0f} ms, applied in {applied * 1e3:.0f} ms; rebuilt {list(report.rebuilt)}, "
              f"reused {len(report.reused)} groups)", flush=True)
        return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    worker = CoreDrivenWorker(args)
    results = worker.run()
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, sort_keys=True))
    tmp.replace(args.out)
    if worker.exit_code == 0 and results["committed_steps"] == args.steps:
        from agent.control import mark_finished  # noqa: PLC0415

        # The whole job is trained: the agent reports a finished worker, not a departure to plan for.
        mark_finished()
    sys.stdout.flush()
    # Skip interpreter teardown: a gloo group with an abandoned op (the dead peer's) would block
    # its destructor until the group timeout.
    os._exit(worker.exit_code)


if __name__ == "__main__":
    raise SystemExit(main())
