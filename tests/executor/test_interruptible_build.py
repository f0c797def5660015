"""Gloo's rendezvous cannot be interrupted, so a group build waits for it on a helper thread
(`executor.comm.interruptible`). A member that announced itself and then died, or left for a
newer plan, used to hold the others inside gloo for (size - 1) x the group timeout: seen in the
cascading chaos run as a 100 s recovery (5 peers x 20 s) where the second kill landed inside the
first recovery's rendezvous. Now the epoch's abort or a newer plan ends the wait at once."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed import TCPStore

from executor.comm import Communicator, PeerFailure
from executor.comm.errors import Interrupted
from executor.comm.interruptible import call_interruptibly

GROUP_TIMEOUT_S = 30.0
BOUND_S = 5.0  # far below the group timeout, generous on a loaded machine


def test_the_result_or_the_error_of_the_call_comes_back() -> None:
    assert call_interruptibly(lambda: 7, lambda: None, 0.01, "t") == 7

    def boom() -> int:
        raise RuntimeError("connect failed")

    with pytest.raises(RuntimeError, match="connect failed"):
        call_interruptibly(boom, lambda: None, 0.01, "t")


def test_what_the_check_raises_ends_the_wait_while_the_call_still_blocks() -> None:
    release, checks = threading.Event(), []

    def check() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise Interrupted("building 'world'", "plan epoch 2 is published")

    t0 = time.monotonic()
    with pytest.raises(Interrupted, match="epoch 2"):
        call_interruptibly(lambda: release.wait(60), check, 0.01, "t")
    assert time.monotonic() - t0 < BOUND_S
    release.set()


def test_a_member_that_announced_itself_and_died_fails_the_build_at_the_abort_not_the_timeout() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def announce_then_die() -> None:
        store.set("ew/e0/world/joined/1", "1")  # worker 1 announces itself for the build...
        time.sleep(0.5)
        store.set("ew/e0/abort", "2: worker 1 lost")  # ...and is found dead before it connects

    threading.Thread(target=announce_then_die, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="worker 1 lost"):
        Communicator(store, 0, {"world": (0, 1)}, timeout_s=GROUP_TIMEOUT_S)
    assert time.monotonic() - t0 < BOUND_S
