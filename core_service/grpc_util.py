"""gRPC plumbing shared by the Core's services: malformed-message handling, auth, status errors.

The generated `add_*Servicer_to_server` helpers deserialize with `FromString`, and a decode error
there becomes an opaque INTERNAL status. We build the handlers from the service descriptors
instead, so undecodable bytes reach the servicer as `Malformed` and get INVALID_ARGUMENT with the
reason. The same wrappers time every call (elaswave_grpc_server_handling_seconds) and count every
refusal (elaswave_rejected_requests_total{api=<service>}), so no servicer can forget to.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

if TYPE_CHECKING:
    from core_service.metrics import CoreMetrics


class Malformed:
    """Stands in for a request whose bytes did not decode."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"malformed {type_name}: {error or 'bytes do not decode'}"


# A status message says what is wrong; a client's oversized value quoted in it is cut here, so
# no answer echoes a large input back.
MAX_STATUS_MESSAGE_CHARS = 1_000


class RpcError(Exception):
    """Raised inside servicer code; turned into a gRPC status by `guard`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        if len(message) > MAX_STATUS_MESSAGE_CHARS:
            message = message[: MAX_STATUS_MESSAGE_CHARS - 20] + " ... (message cut)"
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _safe_deserializer(message_cls: Any) -> Callable[[bytes], Any]:  # a generated message class
    def deserialize(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            return Malformed(message_cls.DESCRIPTOR.full_name, exc)

    return deserialize


def _status_name(context: grpc.aio.ServicerContext, failed: bool | None) -> str:
    """`failed`: None when the handler was cancelled because the client went away (it cancelled,
    or its deadline passed), which is no failure of the Core's."""
    code = context.code()
    if code is None:
        return "CANCELLED" if failed is None else ("UNKNOWN" if failed else "OK")
    return code.name if isinstance(code, grpc.StatusCode) else str(code)


class _Observer:
    """Times the calls of one method and counts the refusals of its service."""

    def __init__(self, metrics: CoreMetrics | None, service: ServiceDescriptor, method: str) -> None:
        self.metrics = metrics
        self.api = service.name.removesuffix("Service").lower()
        self.service, self.method = service.full_name, method

    def rejected(self, err: RpcError) -> None:
        if self.metrics is not None:
            self.metrics.rejected_requests.labels(api=self.api, reason=err.code.name).inc()

    def done(self, context: grpc.aio.ServicerContext, started: float, failed: bool | None) -> None:
        if self.metrics is not None:
            code = _status_name(context, failed)
            self.metrics.grpc_seconds.labels(service=self.service, method=self.method, code=code).observe(
                time.perf_counter() - started
            )
            if code in ("UNKNOWN", "INTERNAL"):
                self.metrics.server_errors.labels(api=self.api).inc()


def _guard_unary(fn: Callable[..., Awaitable[Any]], observer: _Observer) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        failed: bool | None = True  # None: cancelled because the client went away
        try:
            if isinstance(request, Malformed):
                raise invalid(request.message)
            result = await fn(request, context)
            failed = False
            return result
        except RpcError as err:
            observer.rejected(err)
            await context.abort(err.code, err.message)
        except asyncio.CancelledError:
            failed = None  # the client went away
            raise
        finally:
            observer.done(context, started, failed)

    return wrapper


def _guard_stream(
    fn: Callable[..., AsyncIterator[Any]], observer: _Observer
) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        started = time.perf_counter()
        failed: bool | None = True  # None: cancelled because the client went away
        try:
            if isinstance(request, Malformed):
                raise invalid(request.message)
            async for item in fn(request, context):
                yield item
            failed = False
        except RpcError as err:
            observer.rejected(err)
            await context.abort(err.code, err.message)
        except (asyncio.CancelledError, GeneratorExit):
            failed = None  # the client went away
            raise
        finally:
            observer.done(context, started, failed)

    return wrapper


def _timed_bidi(fn: Callable[..., Awaitable[Any]], observer: _Observer) -> Callable[..., Awaitable[Any]]:
    """Bidirectional streams validate (and count refusals) themselves; only the timing is added."""

    @functools.wraps(fn)
    async def wrapper(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        failed: bool | None = True  # None: cancelled because the client went away
        try:
            result = await fn(request_iterator, context)
            failed = False
            return result
        except asyncio.CancelledError:
            failed = None  # the client went away
            raise
        finally:
            observer.done(context, started, failed)

    return wrapper


def generic_handler(
    service: ServiceDescriptor, servicer: object, metrics: CoreMetrics | None = None
) -> grpc.GenericRpcHandler:
    """Handlers for every method of `service`, looked up on `servicer` by method name. Calls are
    timed and refusals counted in `metrics` (by default the servicer's own `metrics`)."""
    metrics = metrics if metrics is not None else getattr(servicer, "metrics", None)
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        observer = _Observer(metrics, service, method.name)
        kwargs = {
            "request_deserializer": _safe_deserializer(request_cls),
            "response_serializer": response_cls.SerializeToString,
        }
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _timed_bidi(behaviour, observer), **kwargs
            )
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _guard_stream(behaviour, observer), **kwargs
            )
        elif method.client_streaming:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                _timed_bidi(behaviour, observer), **kwargs
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _guard_unary(behaviour, observer), **kwargs
            )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    """The value of metadata `key` (lower case), or None."""
    for name, value in context.invocation_metadata() or ():
        if name.lower() == key and isinstance(value, str):
            return value
    return None


def bearer_token(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


def require(condition: bool, message: str) -> None:
    if not condition:
        raise invalid(message)


def finite(value: float, name: str, *, minimum: float = 0.0) -> None:
    if not (value == value and value not in (float("inf"), float("-inf"))):
        raise invalid(f"{name} must be a finite number")
    if value < minimum:
        raise invalid(f"{name} must be >= {minimum}")


# How a refusal raised as an RpcError answers REST clients (routes that share a gRPC handler).
HTTP_STATUS = {
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 422,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.UNAVAILABLE: 503,
}
