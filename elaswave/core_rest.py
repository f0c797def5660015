"""The launcher's REST client for a set of Cores: every request goes to the one that leads.

`elaswave run --core A,B` knows every Core's REST address. Only the leader serves; a standby
answers 503 "not leader; leader is <url>" (`core_service.rest`), and a Core that died does not
answer at all. Either way the request goes again, to the hinted Core or the next address of the
list, with exponential backoff, at most `ROUNDS` times around the list: a Core failover (the
standby leads once the dead leader's lease lapses, a few seconds) costs the launcher a late
answer, never the job. With one address it is a plain `httpx.Client`.
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.1, 2.0
ROUNDS = 3  # times around the address list before the last failure is the answer
_LEADER_HINT = re.compile(r"leader is (https?://[^\s;,]+)")


class CoreClient(httpx.Client):
    """An `httpx.Client` whose base URL follows the leading Core among `urls`."""

    def __init__(self, urls: list[str], **kwargs: Any) -> None:
        if not urls:
            raise ValueError("at least one Core REST URL is needed")
        super().__init__(base_url=urls[0], **kwargs)
        self.urls = list(urls)
        self._index = 0

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        if len(self.urls) == 1:
            return super().send(request, **kwargs)
        delay = BACKOFF_FIRST_S
        attempts = ROUNDS * len(self.urls)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                response = super().send(request, **kwargs)
            except httpx.TransportError:  # a Core that died, or one not started yet
                if last:
                    raise
                hint = None
            else:
                hint = not_leader(response)
                if hint is None or last:
                    return response
                response.close()
            request = self._to_next(request, hint or None)
            time.sleep(delay)
            delay = min(BACKOFF_MAX_S, delay * 2)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _to_next(self, request: httpx.Request, hint: str | None) -> httpx.Request:
        """The same request for the hinted Core, else the next of the list."""
        if hint is not None and hint in self.urls:
            self._index = self.urls.index(hint)
        elif hint is not None:
            self.urls.append(hint)  # a leader this launcher was not told of (a new replica)
            self._index = len(self.urls) - 1
        else:
            self._index = (self._index + 1) % len(self.urls)
        self.base_url = httpx.URL(self.urls[self._index])
        target = self.base_url.join(request.url.raw_path.decode())
        return self.build_request(
            request.method, target, headers=_without_host(request.headers), content=request.content
        )


def not_leader(response: httpx.Response) -> str | None:
    """The leader's URL when `response` is a standby's refusal ("" when it names none), else None."""
    if response.status_code != 503:
        return None
    try:
        response.read()
        detail = str(response.json().get("detail", ""))
    except (ValueError, AttributeError, httpx.HTTPError):
        return None
    if not detail.startswith("not leader"):
        return None  # a leader that could not store a change: its answer stands
    match = _LEADER_HINT.search(detail)
    return match.group(1) if match else ""


def _without_host(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length")}
