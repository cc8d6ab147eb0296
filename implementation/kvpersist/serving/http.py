"""The one HTTP client of kvpersist (standard library only), for the LMCache server's admin API.

URLs are ``http://host:port/path`` or ``http+unix://<percent-encoded socket path>/path`` (the
convention of requests-unixsocket and Docker's clients): the server's admin API listens on a
Unix-domain socket by default (see :mod:`kvpersist.config.server`).

Invariants: every call has a timeout; a connection problem (refused, reset, timed out, DNS)
raises :class:`HttpError` with the URL in its message, so no caller hangs or sees a raw
``urllib`` exception; a socket this account may not open raises :class:`AccessDenied` (an
``HttpError``) that says so; an HTTP error status is an answer, returned like a 200.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

UNIX_SCHEME = "http+unix://"

DEFAULT_TIMEOUT_S = 3.0


class HttpError(RuntimeError):
    """No answer from the server (connection refused, reset or timed out)."""


class AccessDenied(HttpError):
    """The admin socket exists but this account may not connect to it."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def split_unix_url(url: str) -> tuple[str, str]:
    """``http+unix://%2Frun%2Fx.sock/status`` -> (``/run/x.sock``, ``/status``)."""
    rest = url[len(UNIX_SCHEME):]
    quoted, slash, path = rest.partition("/")
    return urllib.parse.unquote(quoted), slash + path or "/"


def _unix_request(method: str, url: str, data: bytes | None, headers: dict[str, str],
                  timeout: float) -> Response:
    socket_path, path = split_unix_url(url)
    conn = _UnixConnection(socket_path, timeout)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return Response(int(resp.status), resp.read())
    except PermissionError:
        raise AccessDenied(
            f"permission denied on {socket_path}: this account may not use the cache server "
            "(only its owner and KVP_ACCESS_GROUP may)") from None
    except (OSError, http.client.HTTPException) as exc:
        raise HttpError(f"no answer from {url}: {exc}") from None
    finally:
        conn.close()


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
    if url.startswith(UNIX_SCHEME):
        return _unix_request(method, url, data, headers, timeout)
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


def refuses_connections(url: str, *, timeout: float = 0.2) -> bool:
    """True only when nobody listens at ``url``'s socket: the connection is refused or the
    Unix socket file is gone (a server killed or stopped).  A connection that is accepted,
    times out or is denied is False: the server may be alive, only busy or not ours to use.
    Nothing is sent; the connection is closed at once."""
    if url.startswith(UNIX_SCHEME):
        family, address = socket.AF_UNIX, split_unix_url(url)[0]
    else:
        parts = urllib.parse.urlsplit(url)
        if parts.hostname is None:
            return False
        family, address = socket.AF_INET, (parts.hostname, parts.port or 80)  # type: ignore[assignment]
        if ":" in parts.hostname:
            family = socket.AF_INET6
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:
        return False
    finally:
        sock.close()
    return False
