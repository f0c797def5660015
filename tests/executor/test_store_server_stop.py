"""A store server stops at once on SIGTERM, however many signals come and on whichever thread.

A cold store gets two SIGTERMs when a job ends: the parent-death signal (the launcher's keeper
thread that started it exits) and the launcher's own. A handler that took a lock
(`threading.Event.set`) deadlocked when the second signal landed inside the first's handler, and
the launcher waited 10 s before it killed the store, on about one `elaswave run` in three. Here a
real store with a connected client (so TCPStore's threads run) gets bursts of signals; it must
exit with status 0 well inside the launcher's grace, every time.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from executor.store_server import StoreServer
from tests.executor.stores import start_store

pytestmark = pytest.mark.multiproc

BURSTS = 6
SIGNALS_PER_BURST = 40
EXIT_WITHIN_S = 3.0  # the launcher waits 10 s before it kills a store


@pytest.mark.timeout(120)
def test_a_store_signalled_again_while_it_handles_a_signal_still_exits_at_once() -> None:
    for burst in range(BURSTS):
        # the launcher's stores are forked from its zygote; a cold one (its `--parent` set) once
        server = StoreServer.start() if burst == 0 else start_store()
        client = server.connect()
        client.set("key", "value")  # TCPStore's server threads are busy with a live client
        signals = (signal.SIGTERM, signal.SIGINT) if burst % 2 else (signal.SIGTERM,)
        for k in range(SIGNALS_PER_BURST):
            try:
                os.kill(server.process.pid, signals[k % len(signals)])
            except ProcessLookupError:
                break  # it already exited
        started = time.monotonic()
        try:
            code = server.process.wait(timeout=EXIT_WITHIN_S)
        finally:
            server.stop(timeout_s=5.0)
        assert code == 0, f"burst {burst}: the store exited with status {code}"
        assert time.monotonic() - started < EXIT_WITHIN_S
        del client
