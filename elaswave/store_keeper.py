"""A job's rendezvous stores on this node: started by its launcher, replaced after every loss.

No Core runs a store (docs/control-plane.md): the stores run beside the job, so that losing any
Core, the leader included, costs the job nothing. On one machine the keeper starts the store and
its standby; a launcher joining a multi-node job (`elaswave run --core`) starts one store here
(two where the job has one node), offers them to the rendezvous, keeps those the job took (the
store on one node, its standby on another: `core_service.rendezvous.pick_stores`) and stops the
rest (`adopt`).

The workers are given the job's list (`ELASWAVE_STORE=host:port,host:port`) and move their groups
to the next store that answers when theirs dies (`executor.worker_recovery`). Without a new
standby the second loss would end the job, so the keeper watches the stores it started and, when
one exits, starts a replacement here with `--announce-to` the job's stores still alive: the
replacement writes the new list into them and into itself (`executor.store_server.STORES_KEY`),
and the workers re-read it before every plan and every few steps. Replacements start in one
thread that lives as long as the keeper (forked from the node's zygote, a store is up in
milliseconds; started cold, it imports torch: a few seconds), so the launcher's
progress loop never waits for them; one thread for all because a child's parent-death signal
(`LocalStore`) fires when the thread that forked it ends, not the process.

A store on another node is lost with that node, and its launcher with it: so the same thread
probes the job's other stores (a TCP connect, every `PROBE_S`) and, once one has not answered
`PROBE_MISSES` times in a row, drops it from the list; once every worker of the other nodes is
gone too (`others_gone`, set by the launcher from the Core's view: no launcher is left there to
replace its store), it starts a standby here in its place.
The launcher tells the leading Core every new list (`PUT /api/v1/jobs/<job>/stores`), which
stores it in the job's spec in the registry.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from pathlib import Path

from elaswave.launcher_procs import LOOPBACK, LaunchError, LocalStore, WarmWorkers
from executor.store_process import accepts_connections

STANDBYS = 1
START_S = 60.0  # one store's start (it imports torch)
PROBE_S = 2.0  # between probes of the job's stores on other nodes
PROBE_TIMEOUT_S = 2.0
PROBE_MISSES = 2  # probes in a row a store did not answer: it is gone


class StoreKeeper:
    """Starts stores (`start`), keeps the job's (`adopt`), replaces any that exits (`poll`,
    non-blocking), stops them."""

    def __init__(
        self, env: Mapping[str, str], log_dir: Path, host: str = LOOPBACK, zygote: WarmWorkers | None = None
    ) -> None:
        """`env`: the stores' environment (the zygote's, so that it forks them); `zygote`: this
        node's, to fork stores from (None: each starts cold; the launcher may set it later)."""
        self.env, self.log_dir, self.host = dict(env), log_dir, host
        self.zygote = zygote
        self.stores: list[LocalStore] = []  # the ones this keeper runs
        self.job_stores: list[str] = []  # the job's list, in the workers' order (some on other nodes)
        self.replaced = 0
        self._lock = threading.Lock()
        self._news: list[str] = []  # lines for `poll` to return: replacements ready or failed
        self._requests: queue.Queue[tuple[tuple[str, ...], int] | None] = queue.Queue()
        self._pending = 0  # replacements asked for and not yet started or given up
        self._misses: dict[str, int] = {}  # another node's store -> probes in a row it missed
        self.others_gone = threading.Event()  # every worker of the job's other nodes is gone
        self._thread = threading.Thread(target=self._serve, name="store-keeper", daemon=True)
        self._first = 1 + STANDBYS  # stores `begin` starts
        self._up = threading.Event()  # they are up (or one failed: `_failed`)
        self._failed: LaunchError | None = None

    def start(self, count: int = 1 + STANDBYS) -> str:
        """`count` stores here, each announced to the ones before; returns their address list
        (the job's, until `adopt` says otherwise). Blocks until they are up (`begin`, `started`)."""
        self.begin(count)
        return self.started()

    def begin(self, count: int = 1 + STANDBYS) -> None:
        """Start `count` stores in the keeper's thread and return at once (a launcher describes
        its model meanwhile); `started` waits for them."""
        if count < 1:
            raise ValueError(f"a job needs at least one store, asked for {count}")
        self._first = count
        self._thread.start()

    def started(self, timeout_s: float = 2 * START_S) -> str:
        """The address list once `begin`'s stores are up; raises LaunchError if one failed."""
        if not self._up.wait(timeout_s):
            raise LaunchError(f"the rendezvous stores did not start within {timeout_s:g} s")
        if self._failed is not None:
            raise self._failed
        return self.addresses()

    def _start_first(self) -> None:
        try:
            first = LocalStore.start(self.env, self.log_dir / "store.log", host=self.host, zygote=self.zygote)
            with self._lock:
                self.stores.append(first)
            for _ in range(self._first - 1):
                store = self._new(tuple(s.address for s in self.stores))
                with self._lock:
                    self.stores.append(store)
            with self._lock:
                self.job_stores = [s.address for s in self.stores]
        except LaunchError as exc:
            self._failed = exc
        finally:
            self._up.set()

    def own(self) -> list[str]:
        with self._lock:
            return [s.address for s in self.stores]

    def adopt(self, job_stores: list[str]) -> list[str]:
        """The job's stores as the rendezvous chose them: this node's that are not among them
        stop. Returns the addresses stopped."""
        with self._lock:
            unused = [s for s in self.stores if s.address not in job_stores]
            self.stores = [s for s in self.stores if s.address in job_stores]
            self.job_stores = list(job_stores)
        for store in unused:
            store.stop()
        return [s.address for s in unused]

    def addresses(self) -> str:
        with self._lock:
            return ",".join(self.job_stores)

    def poll(self) -> str | None:
        """Replace a store of this node that exited (in the background); a line to print, or None."""
        with self._lock:
            if self._news:
                return self._news.pop(0)
            dead = [s for s in self.stores if s.process.poll() is not None]
            if not dead or self._pending:
                return None
            for store in dead:
                self.stores.remove(store)
                if store.address in self.job_stores:
                    self.job_stores.remove(store.address)
            peers = tuple(self.job_stores)
            self._pending += 1
            self._requests.put((peers, len(dead)))
        gone = ", ".join(f"{s.address} (status {s.process.returncode})" for s in dead)
        return f"rendezvous store {gone} exited; the workers go on with {', '.join(peers) or 'none'}, a new standby is starting"

    def _serve(self) -> None:
        self._start_first()
        while True:
            try:
                request = self._requests.get(timeout=PROBE_S)
            except queue.Empty:
                self._probe_others()
                continue
            if request is None:
                return
            try:
                self._replace(*request)
            finally:
                with self._lock:
                    self._pending -= 1

    def _probe_others(self) -> None:
        """Drop the job's stores on other nodes that stopped answering; below a store and its
        standby, start one here (on the keeper's thread: see the module note)."""
        with self._lock:
            mine = {s.address for s in self.stores}
            others = [a for a in self.job_stores if a not in mine]
            short = 1 + STANDBYS - len(self.job_stores)
        gone = [a for a in others if not self._answers(a)]
        if not gone:
            if short > 0 and self.job_stores and self.others_gone.is_set() and not self._pending:
                self._replace(tuple(self.job_stores), short)  # a loss seen before the node was
            return
        with self._lock:
            for address in gone:
                if address in self.job_stores:
                    self.job_stores.remove(address)
            peers = tuple(self.job_stores)
            short = 1 + STANDBYS - len(peers)
            self._news.append(
                f"rendezvous store {', '.join(gone)} on another node does not answer; the job's stores "
                f"are {', '.join(peers) or 'none'}"
                + (
                    ", a new standby is starting here"
                    if short > 0 and peers and self.others_gone.is_set()
                    else ""
                )
            )
        if short > 0 and peers and self.others_gone.is_set():
            self._replace(peers, short)

    def _answers(self, address: str) -> bool:
        if accepts_connections(address, PROBE_TIMEOUT_S):
            self._misses.pop(address, None)
            return True
        self._misses[address] = self._misses.get(address, 0) + 1
        return self._misses[address] < PROBE_MISSES

    def _replace(self, peers: tuple[str, ...], count: int) -> None:
        for _ in range(count):
            try:
                store = self._new(peers)
            except LaunchError as exc:
                with self._lock:
                    self._news.append(f"no new standby store: {exc}")
                return
            with self._lock:
                self.stores.append(store)
                self.job_stores.append(store.address)
                self.replaced += 1
                peers = tuple(self.job_stores)
                self._news.append(
                    f"new standby store on {store.address}; the job's stores are {', '.join(peers)}"
                )

    def _new(self, peers: tuple[str, ...]) -> LocalStore:
        return LocalStore.start(
            self.env, self.log_dir / "store-standby.log", peers=peers, host=self.host, zygote=self.zygote
        )

    def stop(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=60.0)
        with self._lock:
            stores, self.stores = self.stores, []
        for store in stores:
            store.stop()
