"""The LMCache server's entry point for tests that inject faults: the production entry point
(:mod:`kvpersist.serving.server.entry`) after :func:`kvpersist.testing.fault_injection.install`.

    start_server(settings, env={..., "KVP_FAULT_STOP_IN_RETRIEVE_S": "8"}, entry=FAULT_ENTRY)

Invariant: a malformed ``KVP_FAULT_*`` value stops the server at start with exit code 2 (a test
that thinks it injected a fault must not pass without it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..serving.server import entry
from . import fault_injection

#: ``server_command``'s entry for a server with the faults the environment names.
FAULT_ENTRY = ("-m", "kvpersist.testing.fault_server")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        fault_injection.install()
    except ValueError as exc:
        print(f"kvpersist: {exc}", file=sys.stderr)
        return 2
    return entry.main(argv)


if __name__ == "__main__":
    sys.exit(main())
