"""A Core whose event loop stops turning says where it was (core_service.loop_watch).

Stepped by hand first (the report's timing and its once-per-stall rule), then a real Core on its
own loop, held by a busy call for real: the log names the call and /metrics shows the lag.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from core_service.config import load_settings
from core_service.loop_watch import LoopWatch
from tests.core.core_thread import CoreThread
from tests.core.procs import wait_until

HOLD_S = 1.6


def _where_the_loop_is(watch: LoopWatch, now: float) -> str | None:
    return watch.check(now)


def test_a_stall_is_reported_once_with_the_loop_thread_first(caplog: pytest.LogCaptureFixture) -> None:
    turned = [100.0]
    watch = LoopWatch(lambda: turned[0], threading.get_ident(), "c0", report_after_s=1.0)
    with caplog.at_level(logging.WARNING, logger="elaswave.core.loop"):
        assert watch.check(100.9) is None  # within the bound
        report = _where_the_loop_is(watch, 101.2)
        assert report is not None and report.startswith("core c0: event loop silent for 1.20 s")
        first_thread = report.split("\n", 2)[1]
        assert "(event loop)" in first_thread and "MainThread" in first_thread
        assert "in _where_the_loop_is" in report  # this thread's own frames, innermost first
        assert watch.check(103.0) is None  # the same stall: not reported again
        turned[0] = 103.1
        assert watch.check(103.2) is None
        assert "event loop turned again after 3.10 s" in caplog.text
        assert watch.check(104.2) is not None  # a new stall is a new report
    assert watch.reports == 2
    with pytest.raises(ValueError, match="report_after_s and poll_s must be > 0"):
        LoopWatch(lambda: 0.0, 0, "c0", report_after_s=0.0)


@pytest.fixture
def core() -> Iterator[CoreThread]:
    thread = CoreThread(load_settings(dev_mode=True, core_id="held", grpc_port=0, http_port=0))
    assert thread.run(thread.core.wait_leader(10), 15)
    yield thread
    thread.stop()


def _hold_the_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _lag_sum(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    found = re.search(r"^elaswave_core_loop_lag_seconds_sum (\S+)$", text, re.MULTILINE)
    assert found, "the loop-lag histogram is not exported"
    return float(found.group(1))


@pytest.mark.timeout(60)
def test_a_core_held_by_a_busy_call_names_it_and_exports_the_lag(
    core: CoreThread, caplog: pytest.LogCaptureFixture
) -> None:
    watch = core.core.loop_watch
    assert watch is not None
    with httpx.Client(base_url=core.http_url, timeout=10) as http:
        before = _lag_sum(http)
        with caplog.at_level(logging.WARNING, logger="elaswave.core.loop"):
            core.loop.call_soon_threadsafe(_hold_the_loop, HOLD_S)
            wait_until(lambda: "turned again" in caplog.text, 15, "the loop to turn again")
        assert watch.reports == 1
        report = next(r.getMessage() for r in caplog.records if "silent for" in r.getMessage())
        loop_part = report.split('thread "', 2)[1]
        assert loop_part.startswith('held" (event loop)') and "in _hold_the_loop" in loop_part
        assert _lag_sum(http) - before >= HOLD_S - 0.3
