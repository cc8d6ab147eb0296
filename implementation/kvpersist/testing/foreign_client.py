"""A client of the cache server's two endpoints that needs nothing but the standard library.

The access-control tests copy this file to a world-readable place and run it with the system's
``python3`` as *another account* (``setpriv --reuid=65534``), which can reach neither this
checkout nor its virtual environment.  It must therefore import nothing from kvpersist.

It tries each operation named on the command line and prints one JSON object: for each
operation ``{"status": <HTTP status>, "body": <start of the body>}`` when the server answered,
``{"connected": true}`` when the request endpoint accepted a connection, or
``{"denied": "<error>"}`` / ``{"error": "<error>"}`` when it could not get that far.

Operations: ``healthcheck``, ``list`` (GET /cache/objects), ``delete`` (DELETE /cache/objects
of the keys in ``--keys``), ``clear`` (POST /cache/clear of L1, the only tier it clears),
``request`` (open the ZMQ request endpoint: every LOOKUP, STORE and RETRIEVE travels over that
connection).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import urllib.parse
from typing import Any

UNIX_SCHEME = "http+unix://"


def _connection(base: str, timeout: float) -> http.client.HTTPConnection:
    if base.startswith(UNIX_SCHEME):
        path = urllib.parse.unquote(base[len(UNIX_SCHEME):].split("/", 1)[0])

        class UnixConnection(http.client.HTTPConnection):
            def connect(self) -> None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                try:
                    sock.connect(path)
                except BaseException:
                    sock.close()
                    raise
                self.sock = sock

        return UnixConnection("localhost", timeout=timeout)
    parsed = urllib.parse.urlsplit(base)
    return http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=timeout)


def _refused(exc: OSError) -> dict[str, Any]:
    kind = "denied" if isinstance(exc, PermissionError) else "error"
    return {kind: f"{type(exc).__name__}: {exc}"}


def http_call(base: str, method: str, path: str, payload: Any, timeout: float) -> dict[str, Any]:
    conn = _connection(base, timeout)
    body = None if payload is None else json.dumps(payload).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return {"status": resp.status, "body": resp.read()[:300].decode(errors="replace")}
    except OSError as exc:
        return _refused(exc)
    finally:
        conn.close()


def open_request_endpoint(url: str, timeout: float) -> dict[str, Any]:
    scheme, _, target = url.partition("://")
    if scheme == "ipc":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = target
    else:
        host, _, port = target.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = (host, int(port))
    sock.settimeout(timeout)
    try:
        sock.connect(address)
        return {"connected": True}
    except OSError as exc:
        return _refused(exc)
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", required=True, help="admin API base URL")
    parser.add_argument("--request", required=True, help="request endpoint URL (ipc:// or tcp://)")
    parser.add_argument("--keys", default="[]", help="JSON list of object keys for `delete`")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("ops", nargs="+",
                        choices=("healthcheck", "list", "delete", "clear", "request"))
    args = parser.parse_args(argv)
    calls = {
        "healthcheck": ("GET", "/healthcheck", None),
        "list": ("GET", "/cache/objects", None),
        "delete": ("DELETE", "/cache/objects", {"keys": json.loads(args.keys), "tier": "all"}),
        "clear": ("POST", "/cache/clear", {"tier": "l1", "force": True}),
    }
    out: dict[str, Any] = {}
    for op in args.ops:
        if op == "request":
            out[op] = open_request_endpoint(args.request, args.timeout)
        else:
            method, path, payload = calls[op]
            out[op] = http_call(args.http, method, path, payload, args.timeout)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
