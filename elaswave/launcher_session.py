"""One `elaswave run` on one machine once the layout is known: start, watch, stop, tear down.

Alone (no `--core`) it starts an embedded Core and the store and runs every rank; joined to a
multi-node job (`launcher_join`) it follows the leading Core among the remote ones, keeps this
node's share of the job's stores (`store_keeper`), runs this node's ranks only, and asks the
Core to stop the whole job on Ctrl-C.

`Session.run` blocks until every agent has exited (each ends with its worker, whose every wait
is bounded by `ELASWAVE_TIMEOUT_S`), or, after a stop request, at most `--stop-timeout` seconds
more; `Session.teardown` then stops whatever is left, each process bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from elaswave.core_rest import CoreClient
from elaswave.launcher_control import resume_command
from elaswave.launcher_describe import clean_env, tail
from elaswave.launcher_join import SCHEDULER_TOKEN_ENV, rest_verify, stop_job, stopped_by_the_core
from elaswave.launcher_monitor import Monitor, outcome, write_stop_file
from elaswave.launcher_procs import LOOPBACK, Agents, CoreStart, LaunchError, LocalCore, RankSpec, WarmWorkers
from elaswave.store_keeper import StoreKeeper
from planners.described_model import job_model
from wire import worker_env as we

if TYPE_CHECKING:
    from elaswave.launcher_control import StopRequest
    from elaswave.launcher_join import Joined
    from planners.placement import Placement

POLL_S = 0.25
LOG_TAIL_LINES = 15
MAX_FAILED_LOGS = 3
STOP_RETRY_S = 1.0  # the Core refuses a stop before the first committed step: ask again


@dataclass
class LocalServices:
    """The embedded Core, the rendezvous stores and the worker zygote of a one-machine run,
    started before the model is described: each is a process that imports for about a second,
    and none needs the layout until the job is created."""

    run_dir: Path
    stores: StoreKeeper
    core: CoreStart
    created: Path | None  # the outermost directory `begin` made for the run directory
    warm: WarmWorkers | None = None  # None: --cold-workers
    sockets: Path | None = None  # the zygote's short directory (Unix socket paths <= 107 bytes)
    launched: bool = False  # the job was created: the run directory is the run's record

    @classmethod
    def begin(cls, run_dir: Path, cold_workers: bool = False) -> LocalServices:
        """Prepare `run_dir` (`prepare_run_dir`), start the zygote (unless `cold_workers`), the
        stores (in the keeper's thread, forked from the zygote once it is up) and the Core;
        returns at once. Raises LaunchError, with whatever started stopped, when a process cannot
        be spawned."""
        run_dir = run_dir.resolve()
        missing = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
        created = missing[-1] if missing else None
        run_dir = prepare_run_dir(run_dir)
        warm, sockets = None, None
        if not cold_workers:  # first: the stores are forked from it once it has imported torch
            sockets = Path(tempfile.mkdtemp(prefix="ew-z-"))
            try:
                warm = WarmWorkers.begin(sockets, warm_env(), run_dir / "zygote.log")
            except LaunchError:
                stop_local_services(None, sockets, None, None, created)
                raise
        stores = StoreKeeper(warm_env(), run_dir, zygote=warm)
        stores.begin()
        try:
            core = CoreStart.begin(run_dir, clean_env())
        except LaunchError:
            stop_local_services(warm, sockets, stores, None, created)
            raise
        return cls(run_dir, stores, core, created, warm, sockets)

    def stop(self) -> None:
        """The zygote, the stores, then the Core (the session's teardown order); safe to call
        again. Before the job was launched (the model could not be described or laid out), the
        directories `begin` made go too: nothing of the run is left behind."""
        created = None if self.launched else self.created
        stop_local_services(self.warm, self.sockets, self.stores, self.core, created)


def stop_local_services(
    warm: WarmWorkers | None,
    sockets: Path | None,
    stores: StoreKeeper | None,
    core: CoreStart | None,
    created: Path | None,
) -> None:
    """Stop whichever of a one-machine run's services were started, in the session's teardown
    order, and remove `created` (the directories made for a run that never launched)."""
    if warm is not None:
        warm.stop()
    if sockets is not None:
        shutil.rmtree(sockets, ignore_errors=True)
    if stores is not None:
        stores.stop()
    if core is not None:
        core.stop()
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)


def warm_env() -> dict[str, str]:
    """The zygote's environment: what its workers' environments share at import time."""
    return clean_env() | {"PYTHONUNBUFFERED": "1"}


def prepare_run_dir(path: Path) -> Path:
    """Create the run directory; files a previous run of the launcher left there are removed."""
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    for pattern in (
        "rank-*.json",
        "rank-*.log",
        "stop.json",
        "stop.json.tmp",
        "layout.json",
        "nodes.json",
        "core.json",
        "core.log",
        "store.log",
    ):
        for stale in path.glob(pattern):
            if stale.is_file():
                stale.unlink()
    return path


class Session:
    def __init__(
        self,
        args: argparse.Namespace,
        job: str,
        desc: we.ModelDescription,
        placement: Placement,
        run_dir: Path,
        socket_dir: Path,
        stop: StopRequest,
        joined: Joined | None = None,
        stores: StoreKeeper | None = None,
        local: LocalServices | None = None,
    ) -> None:
        self.args, self.job, self.desc, self.placement = args, job, desc, placement
        self.run_dir, self.socket_dir, self.stop, self.joined = run_dir, socket_dir, stop, joined
        self.core: LocalCore | None = None
        # the store, its standby, a new standby after a loss (a joined node's share of them)
        self.stores: StoreKeeper | None = stores if local is None else local.stores
        self.local = local
        self.http: httpx.Client | None = None  # the Core's REST API, local or remote
        self.core_address = self.store_address = ""  # gRPC, store: HOST:PORT
        self.agents = Agents()
        self.warm: WarmWorkers | None = None  # this node's worker zygote, once started
        self.stop_file = run_dir / "stop.json"
        self._stop_asked_at = 0.0
        self._core_stop_accepted = False
        self._stores_asked_at = 0.0
        self._stores_told_list = ""  # the store list the Core stored last (joined jobs)

    def run(self) -> int:
        try:
            # Started before the model was described (`LocalServices.begin`, or a joined node's
            # `start_node_stores`); None: --cold-workers, or a joined node's zygote failed to start.
            if self.local is not None:
                self.warm = self.local.warm
            elif self.stores is not None:
                self.warm = self.stores.zygote
            token = self._start()
            self._start_agents(token)
        except LaunchError as exc:
            print(f"elaswave run: error: {exc}", file=sys.stderr)
            return 1
        return self._watch()

    def _start(self) -> str:
        if self.joined is not None:  # the Core created the job; the nodes' launchers run its stores
            self.http = CoreClient(
                list(self.joined.rest_urls), timeout=5.0, verify=rest_verify(self.joined.tls)
            )
            self.core_address, self.store_address = self.joined.grpc_address, self.joined.store_address
            return self.joined.token
        # The launcher started the Core and the stores before it described the model.
        assert self.local is not None and self.stores is not None
        self.core = self.local.core.ready()
        layout = self.placement.layout
        cap = None if self.args.mem_per_worker is None else float(self.args.mem_per_worker) * 2**30
        model = job_model(self.desc, layout, cap)  # the describe run: offers to this job are judged
        token = self.core.create_job(self.job, len(layout.ranks()), layout.to_json(), model)
        self.http = self.core.http
        self.core_address = f"{LOOPBACK}:{self.core.grpc_port}"
        # The workers try these in order: the standby takes over in place if the store dies.
        self.store_address = self.stores.started()
        first, standby = self.store_address.split(",", 1)
        print(
            f"[elaswave] Core up (gRPC {self.core_address}, REST {self.core.http.base_url}"
            f"/api/v1/jobs/{self.job}), store on {first} (standby {standby})",
            flush=True,
        )
        return token

    def node_ranks(self) -> set[int]:
        """The ranks this launcher runs: every rank alone, its node's joined to a multi-node job."""
        if self.joined is None:
            return set(self.placement.layout.ranks())
        return set(self.joined.ranks)

    def worker_env(self, token: str, rank: int, name: str = "") -> dict[str, str]:
        """The worker contract (`wire.worker_env`) for `rank` (< 0: a spare named `name`);
        the agent adds its worker id."""
        args = self.args
        env = clean_env() | {
            we.TOKEN_ENV: token,
            we.JOB_ENV: self.job,
            we.RANK_ENV: we.SPARE if rank < 0 else str(rank),
            we.CORE_ENV: self.core_address,
            we.STORE_ENV: self.store_address,
            we.LAYOUT_ENV: str(self.run_dir / "layout.json"),
            we.DESCRIPTION_ENV: str(self.run_dir / "description.json"),
            we.RESULTS_ENV: str(self.run_dir / f"{name or f'rank-{rank}'}.json"),
            we.TIMEOUT_ENV: f"{args.timeout:g}",
            we.STOP_FILE_ENV: str(self.stop_file),
            "PYTHONUNBUFFERED": "1",
        }
        if self.joined is not None and self.joined.tls is not None:
            env |= self.joined.tls.env()  # the agent's stream and the worker's plans: TLS too
        if args.checkpoint_dir is not None:
            env[we.CHECKPOINT_DIR_ENV] = str(args.checkpoint_dir.resolve())
        if args.checkpoint_every is not None:
            env[we.CHECKPOINT_EVERY_ENV] = str(args.checkpoint_every)
        if args.resume is not None:
            env[we.RESUME_ENV] = str(args.resume.resolve())
        # the launcher's device mapping (elaswave.device_map): this rank's device ordinal
        env |= getattr(args, "device_env", {}).get(rank, {})
        return env

    def _start_agents(self, token: str) -> None:
        worker_cmd = [sys.executable, str(self.args.script), *self.args.script_args]
        zygote = self.warm.ready() if self.warm is not None else None
        mine = self.node_ranks()
        spares = self.joined.spare_worker_ids if self.joined is not None else ()
        for k, worker_id in enumerate(spares):  # a node that came after the job formed
            spec = RankSpec(-1 - k, -1, -1, -1, worker_id)
            log = None if self.args.tee else self.run_dir / f"{worker_id}.log"
            env = self.worker_env(token, spec.rank, worker_id)
            self.agents.start(
                spec, self.job, self.core_address, self.socket_dir, worker_cmd, env, log, zygote
            )
        for stage in self.placement.layout.stages:
            for dp_rank, rank in enumerate(stage.ranks):
                if rank not in mine:
                    continue
                spec = RankSpec(rank, stage.stage, dp_rank, self.placement.rank_node[rank])
                log = None if self.args.tee else self.run_dir / f"rank-{rank}.log"
                self.agents.start(
                    spec,
                    self.job,
                    self.core_address,
                    self.socket_dir,
                    worker_cmd,
                    self.worker_env(token, rank),
                    log,
                    zygote,
                )
        where = "this terminal" if self.args.tee else f"{self.run_dir}/rank-R.log"
        print(
            f"[elaswave] {len(self.agents.procs)} workers started (one agent each); their output goes to "
            f"{where}",
            flush=True,
        )

    def _watch(self) -> int:
        assert self.http is not None
        monitor = Monitor(
            self.http,
            self.job,
            len(self.placement.layout.ranks()),
            self.desc.steps,
            self.desc.global_batch,
            sys.stdout,
        )
        stop_deadline: float | None = None
        while self.agents.running():
            if self.core is not None and self.core.process.poll() is not None:
                print(
                    f"elaswave run: error: the embedded Core exited (status {self.core.process.returncode}); "
                    f"see {self.run_dir / 'core.log'}",
                    file=sys.stderr,
                )
                return 1
            monitor.poll()
            if self.stores is not None and self.joined is not None and monitor.snapshot.members:
                # every worker of the other nodes gone: no launcher there replaces its stores
                local = {spec.name for spec in self.agents.specs.values()}
                if not [m for m in monitor.snapshot.live if m["worker_id"] not in local]:
                    self.stores.others_gone.set()
            replaced = self.stores.poll() if self.stores is not None else None
            if replaced is not None:
                print(f"[elaswave] {replaced}", flush=True)
            self._publish_stores()
            if self.stop.signum is not None and stop_deadline is None:
                stop_deadline = time.monotonic() + self.args.stop_timeout
                self._request_stop(monitor.snapshot.step(monitor.snapshot.live), monitor.slowest_step_s())
            elif stop_deadline is not None:
                self._retry_core_stop()
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                print(
                    f"[elaswave] workers {self.agents.running()} did not stop within {self.args.stop_timeout:g} s; "
                    "stopping them now",
                    file=sys.stderr,
                    flush=True,
                )
                break
            monitor.show()
            time.sleep(POLL_S)
        monitor.poll()  # agents exit after their Leave is stored: the Core's view is final
        monitor.show(interval_s=0.0)
        stop_signal = self.stop.signum
        if stop_signal is None and self.joined is not None and stopped_by_the_core(monitor.events):
            # Another node's Ctrl-C or an operator stopped the job: end as if SIGTERM'd here.
            stop_signal = signal.SIGTERM
        result = outcome(
            self.job,
            self.agents.exit_codes(),
            monitor.events,
            monitor.snapshot,
            self.desc.steps,
            stop_signal,
            world=monitor.world,
            local_workers=frozenset(spec.name for spec in self.agents.specs.values()),
        )
        for rank in result.failed_ranks[:MAX_FAILED_LOGS]:
            self._show_log(rank)
        print(f"[elaswave] {result.summary}", file=sys.stderr if result.exit_code else sys.stdout, flush=True)
        refused = self._refused_plan()
        if refused:
            print(f"[elaswave] the job cannot go on in place: {refused}", file=sys.stderr, flush=True)
        if stop_signal is not None or refused:
            self._print_resume()
        return result.exit_code

    def _publish_stores(self) -> None:
        """A joined node's store list changed (a store replaced here): tell the leading Core,
        which stores it with the job in the registry (at most once per STOP_RETRY_S while it
        does not take it; a node joining later is given this list)."""
        if self.joined is None or self.stores is None or self.http is None:
            return
        now = self.stores.addresses()
        if now == self._stores_told_list or time.monotonic() - self._stores_asked_at < STOP_RETRY_S:
            return
        if not self._stores_told_list:  # the rendezvous stored the first list
            self._stores_told_list = self.store_address
            if now == self._stores_told_list:
                return
        self._stores_asked_at = time.monotonic()
        try:
            response = self.http.put(
                f"/api/v1/jobs/{self.job}/stores",
                json={"stores": now.split(",")},
                headers={"Authorization": f"Bearer {os.environ.get(SCHEDULER_TOKEN_ENV, '').strip()}"},
            )
        except httpx.HTTPError:
            return
        if response.status_code == 200:
            self._stores_told_list = now

    def _request_stop(self, committed: int, step_time_s: float | None) -> None:
        if self.joined is not None:  # through the Core, so that the stop reaches every node
            self._stop_asked_at = 0.0
            self._core_stop_accepted = False
            self._retry_core_stop()
            return
        stop_after = committed + we.steps_ahead(step_time_s)
        write_stop_file(self.stop_file, stop_after)
        print(
            f"[elaswave] asked the workers to stop after step {stop_after} ({self.stop_file}); waiting up to "
            f"{self.args.stop_timeout:g} s",
            file=sys.stderr,
            flush=True,
        )

    def _retry_core_stop(self) -> None:
        """Ask the Core to stop the job until it accepts (at most once per STOP_RETRY_S); the
        caller's --stop-timeout bounds the whole stop."""
        if (
            self.joined is None
            or self._core_stop_accepted
            or time.monotonic() - self._stop_asked_at < STOP_RETRY_S
        ):
            return
        first = self._stop_asked_at == 0.0
        self._stop_asked_at = time.monotonic()
        assert self.http is not None
        accepted, said = stop_job(self.http, self.job, os.environ.get(SCHEDULER_TOKEN_ENV, "").strip())
        self._core_stop_accepted = accepted
        if accepted:
            print(
                f"[elaswave] asked the Core to stop job {self.job!r} on every node: {said}; waiting up to "
                f"{self.args.stop_timeout:g} s",
                file=sys.stderr,
                flush=True,
            )
        elif first:
            print(
                f"[elaswave] the Core did not take the stop yet ({said}); asking again every "
                f"{STOP_RETRY_S:g} s for up to {self.args.stop_timeout:g} s",
                file=sys.stderr,
                flush=True,
            )

    def _refused_plan(self) -> str | None:
        """What a worker said when it could not apply the Core's plan in place (None if none did)."""
        for path in sorted(self.run_dir.glob("rank-*.json")):
            try:
                results = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if "resume_from" in results:
                return str(results.get("fatal", "a plan the engine cannot apply"))
        return None

    def _show_log(self, rank: int) -> None:
        name = self.agents.specs[rank].name
        log = self.run_dir / f"{name}.log"
        if log.exists() and log.stat().st_size:
            text = log.read_text(errors="replace")
            print(
                f"[elaswave] {name} exited with status {self.agents.procs[rank].poll()}; {log} ends with:\n"
                + tail(text, LOG_TAIL_LINES),
                file=sys.stderr,
                flush=True,
            )

    def _print_resume(self) -> None:

        if self.args.checkpoint_dir is not None:
            print(
                f"[elaswave] resume with: {resume_command(self.args, self.args.checkpoint_dir)}", flush=True
            )
        elif self.args.resume is not None:
            print(
                f"[elaswave] no --checkpoint-dir was given; if the script checkpoints to {self.args.resume}, "
                f"resume with: {resume_command(self.args, self.args.resume)}",
                flush=True,
            )
        else:
            print(
                "[elaswave] no --checkpoint-dir was given, so the launcher knows of no checkpoint to resume "
                "from; pass --checkpoint-dir DIR next time",
                flush=True,
            )

    def teardown(self) -> None:
        """Agents first (they still need the Core to say Leave), then the store, the Core last."""
        self.agents.stop()
        if self.warm is not None:
            self.warm.stop()
        if self.joined is not None and self.http is not None:
            self.http.close()  # a local Core's client closes with it
        if self.stores is not None:
            self.stores.stop()
        if self.core is not None:
            self.core.stop()
