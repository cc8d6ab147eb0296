"""The one HTTP client of kvpersist (standard library only), for the LMCache server's admin API.

Invariants: every call has a timeout; a connection problem (refused, reset, timed out, DNS)
raises :class:`HttpError` with the URL in its message, so no caller hangs or sees a raw
``urllib`` exception; an HTTP error status is an answer, returned like a 200.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 3.0


class HttpError(RuntimeError):
    """No answer from the server (connection refused, reset or timed out)."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        return json.loads(self.body)


def request(method: str, url: str, *, payload: Any = None,
            timeout: float = DEFAULT_TIMEOUT_S) -> Response:
    """Send ``payload`` (JSON, if given) and return the answer, whatever its status."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {} if payload is None else {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Response(int(resp.status), resp.read())
    except urllib.error.HTTPError as exc:
        return Response(int(exc.code), exc.read())
    except (urllib.error.URLError, OSError) as exc:
        raise HttpError(f"no answer from {url}: {exc}") from None


def get(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> Response:
    return request("GET", url, timeout=timeout)


def get_object(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any] | None:
    """The JSON object ``url`` answers with 200, or None (no answer, an error status, not JSON,
    not an object): for callers where "no usable answer" is one case."""
    try:
        resp = get(url, timeout=timeout)
        body = resp.json() if resp.ok else None
    except (HttpError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def answers(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True if ``url`` answers 200 within ``timeout``."""
    try:
        return get(url, timeout=timeout).status == 200
    except HttpError:
        return False
