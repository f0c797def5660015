"""gRPC plumbing shared by the Core's services: malformed-message handling, auth, status errors.

The generated `add_*Servicer_to_server` helpers deserialize with `FromString`, and a decode error
there becomes an opaque INTERNAL status. We build the handlers from the service descriptors
instead, so undecodable bytes reach the servicer as `Malformed` and get INVALID_ARGUMENT with the
reason.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError


class Malformed:
    """Stands in for a request whose bytes did not decode."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"malformed {type_name}: {error or 'bytes do not decode'}"


class RpcError(Exception):
    """Raised inside servicer code; turned into a gRPC status by `guard`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _safe_deserializer(message_cls: type) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            return Malformed(message_cls.DESCRIPTOR.full_name, exc)

    return deserialize


def _guard_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, Malformed):
                raise invalid(request.message)
            return await fn(request, context)
        except RpcError as err:
            await context.abort(err.code, err.message)

    return wrapper


def _guard_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(fn)
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if isinstance(request, Malformed):
                raise invalid(request.message)
            async for item in fn(request, context):
                yield item
        except RpcError as err:
            await context.abort(err.code, err.message)

    return wrapper


def generic_handler(service: ServiceDescriptor, servicer: object) -> grpc.GenericRpcHandler:
    """Handlers for every method of `service`, looked up on `servicer` by method name."""
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        kwargs = {
            "request_deserializer": _safe_deserializer(request_cls),
            "response_serializer": response_cls.SerializeToString,
        }
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(_guard_stream(behaviour), **kwargs)
        elif method.client_streaming:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_guard_unary(behaviour), **kwargs)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


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
        raise invalid(f"{name} must be a finite number, got {value!r}")
    if value < minimum:
        raise invalid(f"{name} must be >= {minimum}, got {value!r}")
