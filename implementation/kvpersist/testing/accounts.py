"""Commands run as other accounts, the way a service layout runs them: the cache server as one
account, vLLM as another in the access group (``setpriv``; real uids and gids, no entries in
``/etc/passwd`` needed).

The virtual environment's Python lives under ``/root`` here (pyenv), which other accounts may
not enter.  Each command therefore runs in a mount namespace of its own where ``/root`` is an
empty, traversable tmpfs with only ``/root/.pyenv`` bound back in: the account can run that
Python and read nothing else of root's home.  Nothing outside the namespace changes.

Invariant: every command built here drops to the given uid, gid and groups (no capabilities
kept) before it runs; :func:`unavailable` says why a host cannot run them (not root, no
``setpriv``/``unshare``, or the probe failed).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

SERVICE_UID = 61001  # the cache server's account (kvpersist in the unit)
VLLM_UID = 61002  # vLLM's account
ACCESS_GID = 61003  # KVP_ACCESS_GROUP: the service's group, and one of vLLM's
PYENV = Path("/root/.pyenv")

_SCRIPT = r"""
set -e
if [ -d "$KVP_PYENV" ]; then
    mkdir -p "$KVP_HOLD"
    mount --bind "$KVP_PYENV" "$KVP_HOLD"
    mount -t tmpfs -o mode=0755 kvp-root /root
    mkdir -p "$KVP_PYENV"
    mount --bind "$KVP_HOLD" "$KVP_PYENV"
fi
exec setpriv "$@"
"""


def as_account(command: Sequence[str], *, uid: int, gid: int, groups: Sequence[int] = (),
               scratch: Path) -> list[str]:
    """``command`` run as ``uid``/``gid`` with supplementary ``groups`` only.  ``scratch``: a
    directory of root's where the namespace parks a mount point."""
    group_flag = (f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups")
    return ["env", f"KVP_PYENV={PYENV}", f"KVP_HOLD={scratch / 'pyenv'}",
            "unshare", "--mount", "--propagation", "private", "sh", "-c", _SCRIPT, "sh",
            f"--reuid={uid}", f"--regid={gid}", group_flag, "--", *command]


@functools.cache
def unavailable(scratch: Path = Path("/tmp")) -> str | None:
    """Why this host cannot run commands as other accounts, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("setpriv", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    hold = Path(tempfile.mkdtemp(prefix="kvp-acct-", dir=scratch))
    try:
        probe = subprocess.run(
            as_account([sys.executable, "-c", "import os; print(os.getuid())"],
                       uid=VLLM_UID, gid=VLLM_UID, scratch=hold),
            capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(hold, ignore_errors=True)
    if probe.returncode != 0 or probe.stdout.strip() != str(VLLM_UID):
        return f"cannot run this Python as uid {VLLM_UID}: {probe.stderr.strip()[-300:]}"
    return None
