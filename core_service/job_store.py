"""Rendezvous stores the Core hosts for jobs formed by `elaswave run --core` (core_service.rendezvous).

Every executor of a job builds its communication groups over one `TCPStore` (docs/architecture.md ("Processes")). On one
machine the launcher runs it; across nodes it must outlive any node, so the Core hosts it: one
`executor.store_server` child process per job, bound to the Core's REST interface (the address
the nodes reached the Core at), started when the job's last node joins.

Why the Core and not the first node to join: a store on node 0 dies with node 0 and takes every
survivor's rendezvous with it, so losing that one node would end the job however well the
layout spreads the stages. Hosting it here costs the Core one process per running job (it
imports torch: about 200 MB and a few seconds to start), hence `MAX_STORES`. Each job gets a
standby store too, in its own process: a store that dies (killed, out of memory) costs the
workers one in-place move of their groups, not the job, and the Core starts a new standby. What it does not do yet: a standby Core
taking over does not inherit the stores (they die with the Core that started them), so a Core
failover ends the jobs whose groups still need their store.

A store stops when its job is gone from the table, when every member of the job has been gone
(LEFT or LOST) for `GONE_GRACE_S`, when no worker registered within `UNCLAIMED_S`, or with the
Core: the child gets SIGTERM when the Core process dies (Linux parent-death signal, armed by the
child itself so that the Core never forks with a Python `preexec_fn` while gRPC threads run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

from core_service.seams import CoreState

log = logging.getLogger(__name__)

MAX_STORES = 32
STORE_START_S = 60.0  # the child imports torch before it binds
WATCH_INTERVAL_S = 5.0
GONE_GRACE_S = 30.0  # every member gone this long: the job is over
UNCLAIMED_S = 600.0  # no worker ever registered: the nodes gave up
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class StoreError(RuntimeError):
    """A store could not be started; the message says why."""


class JobStores:
    """The stores this Core runs: per job a primary and a standby (separate processes), with a
    task that ends them with the job and replaces one that dies while the job lives. Workers
    get the list (`host:port,standby`), move their groups to the next store when theirs dies
    (`executor.worker_recovery`), and re-read the list that a replacement writes into the
    stores still alive (`executor.store_server.STORES_KEY`)."""

    def __init__(self, core: CoreState) -> None:
        self.core = core
        self.procs: dict[str, list[asyncio.subprocess.Process]] = {}
        self.ports: dict[str, list[int]] = {}  # job -> the ports of procs[job], in the workers' order
        self.replaced: dict[str, int] = {}  # job -> stores replaced so far
        self._watchers: dict[str, asyncio.Task[None]] = {}

    async def start(self, job: str) -> int:
        """Start the job's store and its standby on the Core's REST interface; returns the
        primary's port (both: `ports[job]`). At most `STORE_START_S` each; raises StoreError
        (the Core serves too many, or a child failed), leaving nothing running."""
        if job in self.procs:
            raise StoreError(f"job {job!r} already has a store")
        if len(self.procs) >= MAX_STORES:
            raise StoreError(f"this Core already runs {MAX_STORES} job stores; wait for a job to end")
        primary, port = await self._spawn(job, ())
        try:
            standby, standby_port = await self._spawn(job, (self._address(port),))
        except StoreError:
            _terminate(primary)
            raise
        self.procs[job], self.ports[job] = [primary, standby], [port, standby_port]
        self.replaced[job] = 0
        self._watchers[job] = asyncio.ensure_future(self._watch(job, self.procs[job]))
        log.info(
            "rendezvous stores for job %s: %s", job, ", ".join(self._address(p) for p in self.ports[job])
        )
        return port

    def _address(self, port: int) -> str:
        return f"{self.core.settings.http_host}:{port}"

    async def _spawn(self, job: str, peers: tuple[str, ...]) -> tuple[asyncio.subprocess.Process, int]:
        # Forked from the event loop's thread, which lives as long as the Core: the child's
        # parent-death signal is tied to the forking thread, not the process.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "core_service.job_store",
            "--host",
            self.core.settings.http_host,
            "--parent",
            str(os.getpid()),
            *(["--announce-to", ",".join(peers)] if peers else []),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert proc.stdout is not None
        try:
            line = (
                (await asyncio.wait_for(proc.stdout.readline(), STORE_START_S))
                .decode(errors="replace")
                .strip()
            )
        except TimeoutError:
            line = ""
        if not line.startswith("PORT "):
            _terminate(proc)
            raise StoreError(
                f"the rendezvous store for job {job!r} did not start within {STORE_START_S:g} s "
                f"({'said ' + repr(line) if line else 'no port announced'}); see the Core's log"
            )
        return proc, int(line.split()[1])

    def stop(self, job: str) -> None:
        """End the job's stores (no wait: the children exit on SIGTERM within their own bounds)."""
        task = self._watchers.pop(job, None)
        if task is not None:
            task.cancel()
        self.ports.pop(job, None)
        for proc in self.procs.pop(job, []):
            _terminate(proc)

    async def _replace_dead(self, job: str, procs: list[asyncio.subprocess.Process]) -> None:
        """Drop the stores that exited and start one standby per loss, announced to the rest."""
        ports = self.ports[job]
        for i in reversed([i for i, p in enumerate(procs) if p.returncode is not None]):
            log.warning(
                "rendezvous store %s of job %s exited; starting a new standby", self._address(ports[i]), job
            )
            del procs[i], ports[i]
        while len(procs) < 2:
            try:
                proc, port = await self._spawn(job, tuple(self._address(p) for p in ports))
            except StoreError as exc:
                log.error("job %s: no new standby store: %s", job, exc)
                return
            procs.append(proc)
            ports.append(port)
            self.replaced[job] += 1

    async def _watch(self, job: str, procs: list[asyncio.subprocess.Process]) -> None:
        started = gone_since = time.monotonic()
        try:
            while any(p.returncode is None for p in procs):
                waits = [asyncio.ensure_future(p.wait()) for p in procs if p.returncode is None]
                _, pending = await asyncio.wait(
                    waits, timeout=WATCH_INTERVAL_S, return_when=asyncio.FIRST_COMPLETED
                )
                for task in pending:
                    task.cancel()
                record = self.core.table.jobs.get(job)
                now = time.monotonic()
                if record is None:
                    break
                if record.live_members():
                    gone_since = now
                    if any(p.returncode is not None for p in procs):
                        await self._replace_dead(job, procs)
                    continue
                over = now - gone_since > GONE_GRACE_S if record.members else now - started > UNCLAIMED_S
                if over:  # every worker left or was lost, or none ever came
                    break
        finally:
            for proc in procs:
                _terminate(proc)
            if self.procs.get(job) is procs:
                del self.procs[job]
                self.ports.pop(job, None)
                self._watchers.pop(job, None)
            log.info("rendezvous stores for job %s stopped", job)


def _terminate(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)


def _arm_parent_death(parent: int) -> None:
    """SIGTERM to this process when the Core dies; exit now if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A job's rendezvous store, run by the Core")
    parser.add_argument("--host", required=True)
    parser.add_argument("--parent", type=int, required=True, help="the Core's pid")
    parser.add_argument("--announce-to", default="", help="HOST:PORT,... the job's live stores")
    args = parser.parse_args(argv)
    _arm_parent_death(args.parent)
    from executor.store_server import main as serve  # noqa: PLC0415 - torch only in the child

    return serve(["--host", args.host, "--port", "0", "--announce-to", args.announce_to])


if __name__ == "__main__":
    sys.exit(main())
