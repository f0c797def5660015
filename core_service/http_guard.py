"""Cheap refusals of bad REST input, before any route, parser or authentication runs.

- A body larger than `MAX_BODY_BYTES` is refused with 413 from its Content-Length, or as soon as
  a streamed body passes the bound: it is never held in memory whole.
- A JSON body with `NaN`/`Infinity` (which Python's json module accepts but JSON does not) or
  nested deeper than `MAX_JSON_DEPTH` is refused with 422 before FastAPI parses it.
- Validation errors (422) say where and what, never echo the input back (`input`/`ctx` are
  dropped), so a large or hostile body costs one short answer.
- Every error body has the same shape as FastAPI's own: 422 `{"detail": [{"loc", "msg", "type"}]}`,
  other 4xx/5xx `{"detail": "<what is wrong>"}` (documented per route in the OpenAPI schema).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import FastAPI, Path, Request, Response
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core_service.config import JOB_NAME_PATTERN
from core_service.limits import MAX_BODY_BYTES

# A job name in a REST path: a name that cannot exist (config.JOB_NAME_PATTERN: too long, or other
# characters) is refused with 422 before any lookup; a well-formed name nobody created is 404.
JobName = Annotated[str, Path(max_length=63, pattern=JOB_NAME_PATTERN.pattern, description="job name")]

MAX_JSON_DEPTH = 64
MAX_ERRORS_SHOWN = 20
MAX_MESSAGE_CHARS = 300


class ErrorBody(BaseModel):
    """Body of every 4xx/5xx answer except 422."""

    detail: str


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorBody(BaseModel):
    """Body of a 422: what is wrong, field by field (never the input itself)."""

    detail: list[FieldError]


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the given statuses, with their bodies."""
    meaning = {
        400: "the body is not JSON",
        401: "no credentials",
        403: "wrong credentials, or not allowed",
        404: "no such job or worker",
        408: "the wait for the other nodes expired",
        409: "conflicts with the current state",
        413: f"body larger than {MAX_BODY_BYTES} bytes",
        422: "a value is invalid (which, and why)",
        500: "the Core failed while acting on a valid request (counted in elaswave_server_errors_total)",
        503: "this Core is not the leader (the leader's address is in detail), or the change is not stored",
    }
    return {
        s: {"model": ValidationErrorBody if s == 422 else ErrorBody, "description": meaning[s]}
        for s in statuses
    }


def field_error(where: str, message: str) -> list[dict[str, Any]]:
    """A 422 detail for one field, in the same shape as FastAPI's own validation errors."""
    return [{"loc": ["body", where], "msg": message[:MAX_MESSAGE_CHARS], "type": "value_error"}]


class BodyGuard:
    """ASGI middleware: bounded bodies, JSON without non-finite numbers or deep nesting."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _answer(send, 413, {"detail": f"request body larger than {self.max_bytes} bytes"})
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await _answer(send, 413, {"detail": f"request body larger than {self.max_bytes} bytes"})
                return
            more = message.get("more_body", False)
        problem = _json_problem(bytes(body)) if b"json" in headers.get(b"content-type", b"") else None
        if problem is not None:
            await _answer(send, 422, {"detail": field_error("", problem)})
            return
        await self.app(scope, _replay(bytes(body)), send)


def _json_problem(body: bytes) -> str | None:
    """Why a JSON body is refused here (non-finite numbers, too deep); None to let FastAPI parse it
    (it answers malformed JSON with its own 422)."""
    if _depth(body) > MAX_JSON_DEPTH:
        return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"

    def reject(constant: str) -> Any:
        raise ValueError(f"{constant} is not a JSON number: send finite numbers only")

    try:
        json.loads(body, parse_constant=reject)
    except ValueError as exc:
        if "JSON number" in str(exc):
            return str(exc)
    except RecursionError:
        return f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    return None


def _depth(body: bytes) -> int:
    """Deepest bracket nesting, ignoring brackets inside strings (linear, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive


async def _answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer, except that a 405 lists every method the path has (Starlette lists only
    those of the first route that matched the path)."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code != 405:
        return await http_exception_handler(request, exc)
    allowed: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE and isinstance(route, APIRoute | Route) and route.methods:
            allowed |= route.methods
    headers = {"Allow": ", ".join(sorted(allowed))}
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers=headers)


async def _validation_failed(request: Request, exc: Exception) -> JSONResponse:
    """422 with where and what, never the input (which may be large or hostile)."""
    assert isinstance(exc, RequestValidationError)
    errors = [
        {
            "loc": [p if isinstance(p, int) else str(p)[:100] for p in err.get("loc", ())],
            "msg": str(err.get("msg", "invalid"))[:MAX_MESSAGE_CHARS],
            "type": str(err.get("type", "value_error"))[:100],
        }
        for err in list(exc.errors())[:MAX_ERRORS_SHOWN]
    ]
    return JSONResponse(status_code=422, content={"detail": errors})


def install(app: FastAPI) -> None:
    """Adds the body guard (outermost, before routing and authentication) and the 422 handler."""
    app.add_exception_handler(RequestValidationError, _validation_failed)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(BodyGuard)
