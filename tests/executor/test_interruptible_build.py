"""Gloo's rendezvous cannot be interrupted, so a group build waits for it on a helper thread
(`executor.comm.interruptible`). A member that announced itself and then died, or left for a
newer plan, used to hold the others inside gloo for (size - 1) x the group timeout: seen in the
cascading chaos run as a 100 s recovery (5 peers x 20 s) where the second kill landed inside the
first recovery's rendezvous. Now the epoch's abort or a newer plan ends the wait at once."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
from torch.distributed import TCPStore

from executor.comm import Communicator, PeerFailure
from executor.comm.errors import Interrupted
from executor.comm.interruptible import call_interruptibly, calls_interruptibly

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


def test_calls_run_at_most_so_many_at_once_in_order_and_all_results_come_back() -> None:
    lock = threading.Lock()
    running, peak, started = [0], [0], []

    def call(name: str) -> str:
        with lock:
            started.append(name)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return name.upper()

    names = ["a", "b", "c", "d", "e"]
    got = calls_interruptibly({n: partial(call, n) for n in names}, lambda: None, 0.01, 2)
    assert got == {n: n.upper() for n in names}
    assert peak[0] == 2 and started[:2] == ["a", "b"] and sorted(started) == names


def test_the_first_failing_call_ends_the_wait_and_later_calls_never_start() -> None:
    started: list[str] = []
    release = threading.Event()

    def slow() -> None:
        started.append("slow")
        release.wait(60)

    def boom() -> None:
        started.append("boom")
        raise RuntimeError("connect refused")

    def late() -> None:
        started.append("late")

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="connect refused"):
        calls_interruptibly({"slow": slow, "boom": boom, "late": late}, lambda: None, 0.01, 2)
    assert time.monotonic() - t0 < BOUND_S
    assert "late" not in started
    release.set()
