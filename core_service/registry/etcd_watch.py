"""A prefix watch on etcd v3 that survives dropped streams without losing or repeating events.

python3-etcd3's own ``Watcher`` multiplexes every watch on one stream and, when that stream
breaks, crashes in its cleanup path (``six`` is used but never imported in 0.13.0), so the
callbacks are never told and the watch silently stops. This watch owns its stream (etcd3's
generated ``WatchStub``), remembers the next revision it expects, and on a broken stream
reconnects from exactly that revision, so the callback sees every change once, in order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from etcd3 import etcdrpc, utils

from core_service.registry.base import (
    BackendUnavailable,
    KVEvent,
    RegistryError,
    WatchCallback,
    WatchHandle,
)

log = logging.getLogger(__name__)

_PUT = 0  # mvccpb.Event.EventType.PUT; DELETE is 1
_MAX_BACKOFF_S = 2.0


class EtcdPrefixWatch(WatchHandle):
    """Delivers every change under ``prefix`` to ``callback`` on its own thread until cancelled."""

    def __init__(
        self,
        channel: Callable[[], grpc.Channel],
        endpoint: Callable[[], str],
        prefix: str,
        callback: WatchCallback,
        start_timeout_s: float,
        on_broken: Callable[[], None],
        metadata: Callable[[], tuple[tuple[str, str], ...] | None] = lambda: None,
    ) -> None:
        self._channel = channel
        self._metadata = metadata  # etcd's auth token when the registry logs in with a user
        self._on_broken = on_broken
        self._endpoint = endpoint
        self._key = utils.to_bytes(prefix)
        self._range_end = utils.prefix_range_end(self._key)
        self._callback = callback
        self._next_revision = 0  # 0 asks etcd for "changes after now"; set once the watch exists
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._cancelled = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcdwatch:{prefix}", daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s) or self._start_error is not None:
            self.cancel()
            reason = self._start_error or f"no answer within {start_timeout_s:.1f} s"
            raise BackendUnavailable(f"could not start a watch on {prefix!r} at etcd {endpoint()}: {reason}")

    @property
    def active(self) -> bool:
        return not self._cancelled.is_set()

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._cancelled.is_set():
            stream_over = threading.Event()
            try:
                call = etcdrpc.WatchStub(self._channel()).Watch(
                    self._requests(stream_over), metadata=self._metadata()
                )
                with self._lock:
                    self._call = call
                if self._cancelled.is_set():
                    call.cancel()
                for response in call:
                    self._handle(response, call)
                    backoff_s = 0.1
            except (grpc.RpcError, RegistryError) as exc:
                # RegistryError: the registry could not hand out a channel (closing, or no
                # endpoint answers); like a broken stream, it is retried until cancel().
                if self._cancelled.is_set():
                    return
                if not self._started.is_set():
                    self._start_error = exc
                    self._started.set()
                    return
                reason = exc.code() if isinstance(exc, grpc.RpcError) else exc
                self._on_broken()
                log.warning(
                    "etcd watch on %r at %s broke (%s); resuming from revision %d",
                    self._key,
                    self._endpoint(),
                    reason,
                    self._next_revision,
                )
            finally:
                stream_over.set()
            if self._cancelled.wait(backoff_s):
                return
            backoff_s = min(2 * backoff_s, _MAX_BACKOFF_S)

    def _requests(self, stream_over: threading.Event) -> Iterator[etcdrpc.WatchRequest]:
        create = etcdrpc.WatchCreateRequest(
            key=self._key, range_end=self._range_end, start_revision=self._next_revision
        )
        yield etcdrpc.WatchRequest(create_request=create)
        # Ending the request stream would half-close the call, and etcd then ends the watch.
        stream_over.wait()

    def _handle(self, response: etcdrpc.WatchResponse, call: grpc.Future) -> None:
        if response.created and self._next_revision == 0:
            self._next_revision = response.header.revision + 1
            self._started.set()
        if response.canceled:
            if response.compact_revision:
                # The history we need is gone: say so loudly and continue from what is left.
                log.error(
                    "etcd watch on %r lost events: revisions before %d were compacted",
                    self._key,
                    response.compact_revision,
                )
                self._next_revision = response.compact_revision
            call.cancel()  # the loop reconnects from self._next_revision
            return
        for event in response.events:
            self._deliver(event)
            self._next_revision = event.kv.mod_revision + 1

    def _deliver(self, event: Any) -> None:  # an etcd mvccpb.Event (generated, untyped)
        kv = event.kv
        is_put = event.type == _PUT
        change = KVEvent(
            kind="put" if is_put else "delete",
            key=kv.key.decode("utf-8"),
            value=bytes(kv.value) if is_put else None,
            revision=kv.mod_revision,
        )
        try:
            self._callback(change)
        except Exception:
            log.exception("watch callback on %r failed on %s", self._key, change)
