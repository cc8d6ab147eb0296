"""The server's own paths are private to its account: cache root, runtime directory, pid file, log.

Invariants
----------
* A path the server uses is accepted only when it is owned by the server's effective uid and
  grants nothing to other accounts; a directory may additionally grant its configured group
  read and search (``0750``), never write.  Anything else raises :class:`PrivatePathError` whose
  message names the path, what is wrong and the command that fixes it.  Nothing is chmod-ed or
  chown-ed behind the operator's back, except a directory this module has just created.
* The runtime directory (where the sockets are) is never a symlink: it usually sits in a shared
  place such as ``/run`` or ``/tmp`` where another account could plant one.  The cache root may
  be a symlink (to an NVMe mount); its target is checked.
* Files are never followed through a symlink: a pid file or log that is a symlink is refused,
  and the log is opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class PrivatePathError(RuntimeError):
    """A path of the server is not private to its account; the message says how to fix it."""


def _require_owned(path: Path, st: os.stat_result, what: str, *, allowed: int) -> int:
    """Raise unless ``st`` is ours and its mode grants nothing beyond ``allowed``; the mode."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise PrivatePathError(
            f"{what} {path} is owned by uid {st.st_uid}, not by this account (uid {uid}); "
            f"`chown {uid} {path}` if it is yours, or choose another path")
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~allowed & 0o777:
        raise PrivatePathError(
            f"{what} {path} has mode {mode:04o}, which lets other accounts in; "
            f"`chmod {allowed:04o} {path}` (the cache server requires {allowed:04o})")
    return mode


def check_private_dir(path: Path, what: str, *, group: int | None = None,
                      allow_symlink: bool = False) -> None:
    """Raise unless ``path`` is a directory private to us (plus read/search for ``group``)."""
    st_link = os.lstat(path)
    if stat.S_ISLNK(st_link.st_mode) and not allow_symlink:
        raise PrivatePathError(f"{what} {path} is a symlink; refusing it (another account may "
                               "have planted it). Remove it, or point the setting at a real "
                               "directory")
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PrivatePathError(f"{what} {path} exists and is not a directory")
    mode = _require_owned(path, st, what, allowed=0o750 if group is not None else 0o700)
    if group is not None and mode & 0o050 and st.st_gid != group:
        raise PrivatePathError(
            f"{what} {path} belongs to group {st.st_gid}, not KVP_ACCESS_GROUP ({group}); "
            f"`chgrp {group} {path}`")


def ensure_private_dir(path: Path, what: str, *, group: int | None = None,
                       allow_symlink: bool = False) -> bool:
    """Create ``path`` (mode 0700, or 0750 with ``group``) when missing, then check it.
    Returns True when it was created here."""
    created = False
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
            created = True
        except FileExistsError:
            pass
        if created and group is not None:
            os.chown(path, -1, group)
            os.chmod(path, 0o750)
        elif created:
            os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask; be exact
    check_private_dir(path, what, group=group, allow_symlink=allow_symlink)
    return created


def check_private_file(path: Path, what: str) -> None:
    """Raise unless ``path`` is absent or a regular file of ours that others cannot touch."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise PrivatePathError(f"{what} {path} is a symlink; refusing to follow it. Remove it")
    if not stat.S_ISREG(st.st_mode):
        raise PrivatePathError(f"{what} {path} is not a regular file; remove it")
    _require_owned(path, st, what, allowed=0o600)


def open_private_log(path: Path) -> int:
    """An ``O_APPEND`` descriptor of ``path``, created 0600, never through a symlink."""
    check_private_file(path, "the server log")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)
