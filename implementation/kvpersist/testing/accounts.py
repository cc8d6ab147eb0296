"""Commands run as other accounts, the way a service layout runs them: the cache server as one
account, vLLM as another in the access group (``setpriv``; real uids and gids, no entries in
``/etc/passwd`` needed).

The test's own files may sit where other accounts cannot enter: the base Python under
``/root`` (pyenv), a checkout made with ``mktemp -d`` (mode 0700).  Each command therefore runs
in a mount namespace of its own where every such directory on the way to the paths the command
needs (the base Python, the virtual environment, the ``kvpersist`` package, any ``reach`` the
caller adds) is *veiled*: an empty tmpfs of mode 0755 is mounted over it and only the one entry
on the way is bound back.  The account can then run this Python and read nothing else of those
directories.  Nothing outside the namespace changes.

Invariant: every command built here drops to the given uid, gid and groups (no capabilities
kept) before it runs; :func:`unavailable` says why a host cannot run them (not root, no
``setpriv``/``unshare``, or the probe failed).
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import kvpersist

SERVICE_UID = 61001  # the cache server's account (kvpersist in the unit)
VLLM_UID = 61002  # vLLM's account
ACCESS_GID = 61003  # KVP_ACCESS_GROUP: the service's group, and one of vLLM's

ALL_ENTRIES = None  # a veil over a target itself binds every entry back


def default_reach() -> list[Path]:
    """What every command here needs: the base Python, the virtual environment and the package
    (an editable install points into the checkout)."""
    return [Path(sys.base_prefix), Path(sys.prefix), Path(kvpersist.__file__).parent]


def _closed_to_others(directory: Path) -> bool:
    return not directory.stat().st_mode & stat.S_IXOTH


def veils(reach: Iterable[Path]) -> dict[Path, set[str] | None]:
    """Each directory on the way to ``reach`` that other accounts cannot traverse, with the
    entries to bind back over its veil (``ALL_ENTRIES`` when the directory is itself a target).
    Paths are resolved first: a symlinked path is reached through its target."""
    out: dict[Path, set[str] | None] = {}
    for target in (Path(p).resolve() for p in reach):
        chain = [*reversed(target.parents), target]
        for here, below in zip(chain, [*chain[1:], None], strict=True):
            if here == Path("/") or not _closed_to_others(here):
                continue
            if below is None:
                out[here] = ALL_ENTRIES
            elif here not in out or out[here] is not ALL_ENTRIES:
                entries = out.setdefault(here, set())
                assert entries is not None
                entries.add(below.name)
    return dict(sorted(out.items(), key=lambda item: len(item[0].parts)))


def _veil_script(plan: dict[Path, set[str] | None], scratch: Path) -> str:
    """Shell lines that veil each directory of ``plan``, shallowest first, so that a deeper
    veil lands on an entry already bound back."""
    lines = ["set -e"]
    for n, (directory, entries) in enumerate(plan.items()):
        hold = scratch / f"veil-{n}"
        names = sorted(os.listdir(directory)) if entries is ALL_ENTRIES else sorted(entries)
        d, h = shlex.quote(str(directory)), shlex.quote(str(hold))
        lines += [f"mkdir -p {h}", f"mount --bind {d} {h}",
                  f"mount -t tmpfs -o mode=0755 kvp-veil {d}"]
        for name in names:
            src, dst = directory / name, shlex.quote(str(directory / name))
            held = shlex.quote(str(hold / name))
            if src.is_symlink():
                lines.append(f"ln -s {shlex.quote(os.readlink(src))} {dst}")
                continue
            lines.append(f"mkdir -p {dst}" if src.is_dir() else f"touch {dst}")
            lines.append(f"mount --bind {held} {dst}")
    lines.append('exec setpriv "$@"')
    return "\n".join(lines) + "\n"


def as_account(command: Sequence[str], *, uid: int, gid: int, groups: Sequence[int] = (),
               scratch: Path, reach: Sequence[Path] = ()) -> list[str]:
    """``command`` run as ``uid``/``gid`` with supplementary ``groups`` only, able to reach
    :func:`default_reach` and ``reach``.  ``scratch``: a directory of root's, outside every
    veiled directory, where the namespace parks its mount points."""
    group_flag = (f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups")
    plan = veils([*default_reach(), *reach])
    hidden = [d for d in plan if scratch.resolve().is_relative_to(d)]
    if hidden:
        raise ValueError(f"scratch {scratch} lies under {hidden[0]}, which the namespace veils: "
                         "its mount points would be hidden; choose one outside it")
    script = _veil_script(plan, scratch)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
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
    probe_code = "import os, kvpersist; print(os.getuid())"
    try:
        probe = subprocess.run(
            as_account([sys.executable, "-c", probe_code], uid=VLLM_UID, gid=VLLM_UID,
                       scratch=hold),
            capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(hold, ignore_errors=True)
    if probe.returncode != 0 or probe.stdout.strip() != str(VLLM_UID):
        return f"cannot run this Python as uid {VLLM_UID}: {probe.stderr.strip()[-300:]}"
    return None
