"""The job's rendezvous stores on one machine: the store, a standby, and a new standby after every loss.

The workers are given the list (`ELASWAVE_STORE=host:port,host:port`) and move their groups to the
next store that answers when theirs dies (`executor.worker_recovery`). Without a new standby the
second loss would end the job, so the keeper watches the store processes and, when one exits,
starts a replacement with `--announce-to` the stores still alive: the replacement writes the new
list into them and into itself (`executor.store_server.STORES_KEY`), and the workers re-read it
before every plan and every few steps. Replacements start in one thread that lives as long as
the keeper (a store imports torch: a few seconds), so the launcher's progress loop never waits
for them; one thread for all because a child's parent-death signal (`LocalStore`) fires when the
thread that forked it ends, not the process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from pathlib import Path

from elaswave.launcher_procs import LaunchError, LocalStore

STANDBYS = 1


class StoreKeeper:
    """Starts the stores (`start`), replaces any that exits (`poll`, non-blocking), stops them."""

    def __init__(self, env: Mapping[str, str], run_dir: Path) -> None:
        self.env, self.run_dir = dict(env), run_dir
        self.stores: list[LocalStore] = []
        self.replaced = 0
        self._lock = threading.Lock()
        self._news: list[str] = []  # lines for `poll` to return: replacements ready or failed
        self._requests: queue.Queue[tuple[tuple[str, ...], int] | None] = queue.Queue()
        self._pending = 0  # replacements asked for and not yet started or given up
        self._thread = threading.Thread(target=self._serve, name="store-keeper", daemon=True)

    def start(self) -> str:
        """The store and its standby; returns the address list the workers get."""
        self.stores.append(LocalStore.start(self.env, self.run_dir / "store.log"))
        for _ in range(STANDBYS):
            self.stores.append(self._new(tuple(s.address for s in self.stores)))
        self._thread.start()
        return self.addresses()

    def addresses(self) -> str:
        with self._lock:
            return ",".join(s.address for s in self.stores)

    def poll(self) -> str | None:
        """Replace a store that exited (in the background); returns a line to print, or None."""
        with self._lock:
            if self._news:
                return self._news.pop(0)
            dead = [s for s in self.stores if s.process.poll() is not None]
            if not dead or self._pending:
                return None
            for store in dead:
                self.stores.remove(store)
            peers = tuple(s.address for s in self.stores)
            self._pending += 1
            self._requests.put((peers, len(dead)))
        gone = ", ".join(f"{s.address} (status {s.process.returncode})" for s in dead)
        return f"rendezvous store {gone} exited; the workers go on with {', '.join(peers) or 'none'}, a new standby is starting"

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            try:
                self._replace(*request)
            finally:
                with self._lock:
                    self._pending -= 1

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
                self.replaced += 1
                peers = tuple(s.address for s in self.stores)
                self._news.append(
                    f"new standby store on {store.address}; the job's stores are {', '.join(peers)}"
                )

    def _new(self, peers: tuple[str, ...]) -> LocalStore:
        return LocalStore.start(self.env, self.run_dir / "store-standby.log", peers=peers)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=60.0)
        with self._lock:
            stores, self.stores = self.stores, []
        for store in stores:
            store.stop()
