"""A real Core on its own thread and event loop, inside the test process.

Lets a test do to one Core's event loop what a bug would (hold it, as a CPU-bound call on the
loop did) while its other threads (gRPC, the election keepalive) run on, and while a second Core
in the same process keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from core_service.config import CoreSettings
from core_service.core import Core
from core_service.registry import Registry

T = TypeVar("T")


class CoreThread:
    def __init__(self, settings: CoreSettings, registry: Registry | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=settings.core_id, daemon=True)
        self._thread.start()
        self.core = self.run(self._start(settings, registry), 30)

    async def _start(self, settings: CoreSettings, registry: Registry | None) -> Core:
        core = Core(settings, registry=registry)
        await core.start()
        return core

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.core.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.core.http_port}"

    def freeze(self, seconds: float) -> None:
        """Holds the event loop for `seconds` (from now), as a blocking call on it would."""
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        try:
            self.run(self.core.stop(), 30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
