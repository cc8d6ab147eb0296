"""The weights digest: what a model folder *is*, by its bytes, cached by each file's identity.

A model folder's revision is a label: a local folder retrained in place keeps its path and its
pins, and a Hugging Face snapshot is named by a commit the engine takes on trust.  The
``weights_sha256`` identity field is computed from the bytes instead, on both sides of the pins
check (``kvp-admin identity write-pins`` and the engine's connector), so weights replaced in a
folder give another namespace without anyone re-pinning.

Invariants
----------
* The digest is sha256 over, for every regular file below the folder in path order (symlinks
  followed, as vLLM loads them; names starting with ``.`` skipped at every level, e.g. the
  download metadata ``hf download --local-dir`` keeps in ``.cache/``): its relative path, its
  size and the sha256 of its bytes.  Any other byte, an added, removed or renamed file gives
  another digest.
* A file's sha256 is computed once per *file version*: it is kept in a per-account cache
  (``$XDG_CACHE_HOME/kvpersist/file-digests``, else ``~/.cache/...``) under the file's real path,
  together with (device, inode, size, mtime, ctime), and reused only while all five are equal.
  ctime cannot be set by a user, so no rewrite in place, ``touch -d`` or rename over the path
  passes for the old version.
* Processes that digest the same file at once (an engine's scheduler and its workers) compute
  it once: the entry is written under an exclusive lock on a per-entry lock file, and rechecked
  after the lock is taken.  A cache that cannot be written only costs a recompute, never a
  wrong digest: an entry is trusted only when it names the same path and file identity.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..atomic import write_text_atomic

logger = logging.getLogger("kvpersist.identity")

#: Bytes read per step while hashing a file (hashlib releases the GIL on buffers this large).
_BLOCK = 8 << 20
#: Files hashed at once on a first digest (one thread each; NVMe needs a few reads in flight).
_THREADS = 4
_ENTRY_VERSION = 1


@dataclass(frozen=True)
class FileVersion:
    """What identifies one version of a file without reading it."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileVersion:
        real = os.path.realpath(path)
        st = os.stat(real)
        return cls(real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def default_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/kvpersist/file-digests``, else ``~/.cache/kvpersist/file-digests``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvpersist" / "file-digests"


def model_files(folder: Path) -> list[Path]:
    """Every regular file below ``folder`` that the digest covers, sorted by relative path."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _sha256_of(path: str, progress: Callable[[int], None] | None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        while block := data.read(_BLOCK):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


class FileDigestCache:
    """sha256 of files, remembered per file version (see module invariants)."""

    def __init__(self, directory: Path | None) -> None:
        """``directory`` None: nothing is remembered (every call reads the file)."""
        self.directory = directory
        self._warned = False

    def _entry_path(self, version: FileVersion) -> Path | None:
        if self.directory is None:
            return None
        name = hashlib.sha256(version.path.encode("utf-8", "surrogateescape")).hexdigest()
        return self.directory / f"{name}.json"

    def _read(self, entry: Path, version: FileVersion) -> str | None:
        try:
            data = json.loads(entry.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("version") != _ENTRY_VERSION:
            return None
        if data.get("file") != version.__dict__:
            return None
        digest = data.get("sha256")
        return digest if isinstance(digest, str) and len(digest) == 64 else None

    @contextlib.contextmanager
    def _locked(self, entry: Path) -> Iterator[bool]:
        """Hold the entry's lock; yields False (unlocked) when the cache cannot be written."""
        try:
            entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(f"{entry}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._warn(exc)
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield True
        finally:
            os.close(fd)

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("kvpersist: the file digest cache %s cannot be written (%s); "
                           "model files are digested again at every start", self.directory, exc)

    def knows(self, folder: Path) -> bool:
        """Whether every file :func:`weights_digest` reads in ``folder`` is cached as it is now
        (a digest of it then reads no file)."""
        if self.directory is None:
            return False
        for path in model_files(folder):
            version = FileVersion.of(path)
            entry = self._entry_path(version)
            if entry is None or self._read(entry, version) is None:
                return False
        return True

    def sha256(self, path: Path, progress: Callable[[int], None] | None = None) -> str:
        """The sha256 of ``path``'s bytes, read only when this file version is not cached.
        ``progress`` gets the bytes read by each step (nothing when the cache answers)."""
        version = FileVersion.of(path)
        entry = self._entry_path(version)
        if entry is None:
            return _sha256_of(version.path, progress)
        cached = self._read(entry, version)
        if cached is not None:
            return cached
        with self._locked(entry) as locked:
            cached = self._read(entry, version) if locked else None
            if cached is not None:
                return cached
            digest = _sha256_of(version.path, progress)
            if FileVersion.of(path) != version:
                raise OSError(f"{path} changed while it was being digested")
            if locked:
                body = {"version": _ENTRY_VERSION, "file": version.__dict__, "sha256": digest}
                try:
                    write_text_atomic(entry, json.dumps(body, sort_keys=True) + "\n")
                except OSError as exc:
                    self._warn(exc)
            return digest


def weights_digest(folder: Path, cache: FileDigestCache,
                   progress: Callable[[int], None] | None = None) -> str:
    """The ``weights_sha256`` of a model folder (see module invariants).  Raises OSError when
    a file cannot be read or changes while it is read."""
    files = model_files(folder)
    with ThreadPoolExecutor(max_workers=min(_THREADS, max(1, len(files)))) as pool:
        digests = list(pool.map(lambda path: cache.sha256(path, progress), files))
    outer = hashlib.sha256(b"kvpersist-weights-v1\0")
    for path, digest in zip(files, digests, strict=True):
        rel = path.relative_to(folder).as_posix().encode("utf-8", "surrogateescape")
        outer.update(len(rel).to_bytes(4, "big") + rel
                     + path.stat().st_size.to_bytes(8, "big") + bytes.fromhex(digest))
    return outer.hexdigest()


def folder_bytes(folder: Path) -> int:
    """The bytes a first :func:`weights_digest` of ``folder`` reads (for a progress bar)."""
    return sum(path.stat().st_size for path in model_files(folder))
