"""Rendezvous stores for the engine tests, forked from one zygote per test process, as
`elaswave run` forks a job's stores (elaswave/store_keeper.py, docs/engine.md "Warm starts"):
each store is up in milliseconds instead of importing torch for a second or more of CPU. The
zygote (`elaswave.launcher_procs.WarmWorkers`) starts with the first store a test process asks
for and dies with that process; a store it cannot fork starts cold."""

from __future__ import annotations

import atexit
import os
import tempfile
from pathlib import Path

from elaswave.launcher_procs import WarmWorkers
from executor.store_server import StoreServer

_zygote: WarmWorkers | None = None


def start_store(peers: tuple[str, ...] = ()) -> StoreServer:
    """A store server on loopback (`StoreServer.start`), forked from this process's zygote."""
    return StoreServer.start(peers=peers, spawn=_warm_workers().fork, env=os.environ)


def _warm_workers() -> WarmWorkers:
    global _zygote
    if _zygote is None or _zygote.process.poll() is not None:
        where = Path(tempfile.mkdtemp(prefix="ew-zs-"))  # short: a socket path is <= 107 bytes
        _zygote = WarmWorkers.begin(where, os.environ, where / "zygote.log")
        atexit.register(_zygote.stop)
    return _zygote
