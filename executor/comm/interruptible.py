"""A blocking call that the caller can stop waiting for: gloo's group rendezvous.

Gloo connects to every peer inside its constructor, one peer after another, each bounded by the
group timeout, and nothing interrupts it. A member that announced itself (the communicator's
`joined` keys) and then died, or left for a newer plan, would hold the others there for up to
(size - 1) x timeout. The constructor releases the GIL, so it can run on a helper thread while
the caller keeps checking what would end its wait (a newer plan, the epoch's abort); a call the
caller stops waiting for ends on its thread by itself, bounded by its own timeout."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def call_interruptibly(call: Callable[[], T], check: Callable[[], None], poll_s: float, name: str) -> T:
    """`call()` on a daemon thread named `name`; its result, or what it raised, once it returns.

    Blocks until then, calling `check()` every `poll_s` seconds: what `check` raises is raised
    here at once, and the call is left to finish (or fail) unobserved."""
    return calls_interruptibly({name: call}, check, poll_s, 1)[name]


def calls_interruptibly(
    calls: Mapping[str, Callable[[], T]], check: Callable[[], None], poll_s: float, at_once: int
) -> dict[str, T]:
    """Every `calls[name]()` on a daemon thread named `name`, at most `at_once` running at a
    time, started in the mapping's order (each as soon as an earlier one returns); their results
    by name once all have returned.

    Blocks until then, calling `check()` every `poll_s` seconds: what `check` raises, or the first
    call's error, is raised here at once; the calls still running are left to finish (or fail)
    unobserved, and those not started never start."""
    if at_once < 1:
        raise ValueError(f"at_once must be >= 1, got {at_once}")
    results: dict[str, T] = {}
    failed: list[BaseException] = []
    finished: queue.SimpleQueue[str] = queue.SimpleQueue()
    pending = list(calls)

    def run(name: str) -> None:
        try:
            results[name] = calls[name]()
        except BaseException as exc:  # noqa: BLE001 - raised again on the waiting thread
            failed.append(exc)
        finally:
            finished.put(name)

    def start() -> None:
        name = pending.pop(0)
        threading.Thread(target=run, args=(name,), daemon=True, name=name).start()

    running = 0
    while pending and running < at_once:
        start()
        running += 1
    while running:
        try:
            finished.get(timeout=poll_s)
        except queue.Empty:
            check()
            continue
        running -= 1
        if failed:
            raise failed[0]
        if pending:
            start()
            running += 1
    return results
