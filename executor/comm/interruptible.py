"""A blocking call that the caller can stop waiting for: gloo's group rendezvous.

Gloo connects to every peer inside its constructor, one peer after another, each bounded by the
group timeout, and nothing interrupts it. A member that announced itself (the communicator's
`joined` keys) and then died, or left for a newer plan, would hold the others there for up to
(size - 1) x timeout. The constructor releases the GIL, so it can run on a helper thread while
the caller keeps checking what would end its wait (a newer plan, the epoch's abort); a call the
caller stops waiting for ends on its thread by itself, bounded by its own timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_interruptibly(call: Callable[[], T], check: Callable[[], None], poll_s: float, name: str) -> T:
    """`call()` on a daemon thread named `name`; its result, or what it raised, once it returns.

    Blocks until then, calling `check()` every `poll_s` seconds: what `check` raises is raised
    here at once, and the call is left to finish (or fail) unobserved."""
    result: list[T] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 - raised again on the waiting thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name=name).start()
    while not done.wait(poll_s):
        check()
    if failed:
        raise failed[0]
    return result[0]
