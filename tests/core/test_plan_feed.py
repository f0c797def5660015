"""The plan feed that wakes SubscribePlans streams: woken by a notify, bounded by its timeout,
and a subscriber cancelled while it waits (its stream closed) breaks nothing for the others."""

from __future__ import annotations

import asyncio
import time

from core_service.executor_service import PlanFeed


def test_waiters_wake_on_notify_and_time_out_without_one() -> None:
    async def scenario() -> tuple[float, float, bool]:
        feed = PlanFeed()
        t0 = time.monotonic()
        await feed.wait("job", timeout_s=0.1)  # nobody notifies
        timed_out = time.monotonic() - t0
        waiters = [asyncio.create_task(feed.wait("job", timeout_s=30.0)) for _ in range(3)]
        other = asyncio.create_task(feed.wait("other-job", timeout_s=30.0))
        await asyncio.sleep(0.05)
        t1 = time.monotonic()
        await feed.notify("job")
        await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
        woken = time.monotonic() - t1
        still_waiting = not other.done()  # another job's notify does not wake it
        other.cancel()
        return timed_out, woken, still_waiting

    timed_out, woken, still_waiting = asyncio.run(scenario())
    assert 0.09 <= timed_out < 5.0
    assert woken < 5.0 and still_waiting


def test_a_cancelled_subscriber_leaves_the_feed_working() -> None:
    async def scenario() -> None:
        feed = PlanFeed()
        for _ in range(20):  # cancelled as a closed stream cancels it, at varying points
            doomed = asyncio.create_task(feed.wait("job", timeout_s=30.0))
            survivor = asyncio.create_task(feed.wait("job", timeout_s=30.0))
            await asyncio.sleep(0)
            doomed.cancel()
            await feed.notify("job")
            await asyncio.wait_for(survivor, 5.0)  # raises if the survivor was not woken
            results = await asyncio.gather(doomed, return_exceptions=True)
            assert isinstance(results[0], asyncio.CancelledError | type(None))

    asyncio.run(scenario())
