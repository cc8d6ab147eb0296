"""kvpersist's LMCache L2 adapter: a verified, restart-safe file tier (LMCache plugin adapter).

Load it through LMCache's plugin adapter type::

    {"type": "plugin", "module_path": "kvpersist.l2.adapter",
     "class_name": "KvPersistL2Adapter", "config_class_name": "KvPersistL2AdapterConfig",
     "adapter_params": {"path": "/nvme/kvcache", "max_capacity_gb": 1500},
     "persist_enabled": true,
     "eviction": {"eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 0.1}}

Invariants (the store's, see :mod:`kvpersist.l2.store`, plus):

* A load task sets a key's bit only when :meth:`KvFileStore.read_into` verified its bytes; a
  task's files are read in parallel, each checked as it arrives, so a failure of one file is a
  miss of that key only.
* Each root has its own ``file_threads`` (:mod:`kvpersist.l2.file_pools`), and no thread waits
  for a file: a device that stops answering holds its own root's file threads and the tasks
  with a file on it, and nothing else.
* A lookup sets a key's bit only if the file is indexed (or present on disk during the scan).
* LMCache's byte accounting (``_notify_keys_stored``/``_notify_keys_deleted``) receives exactly
  the index changes of the store, and its LRU bookkeeping every verified read
  (``_notify_keys_accessed``), all in the order they happened, on one thread
  (:mod:`kvpersist.l2.announcer`): once that thread is idle, ``get_usage()`` equals the
  on-disk bytes of the index, after a restart too (the scan re-announces every file, oldest
  access first, for LRU order).  Stores never wait for it: they resume as soon as the index
  is complete, and the index alone enforces the cap while LMCache's view catches up.  Only
  LMCache's own eviction waits: :meth:`KvPersistL2Adapter.delete` returns once its deletions
  are delivered, so the next usage check never evicts the same bytes twice.
* Every submitted task completes and signals its event fd, even if an I/O call raises; only a
  file that never returns (a hung device) keeps its task, and the buffers it writes into, with
  it.
* A task touches the L1 buffers LMCache gave it only within its lease (``store_lease_s``,
  ``load_lease_s``, :mod:`kvpersist.l2.lease`): LMCache's locks on them are TTL locks, and a
  store that read its object after the lock lapsed could publish another chunk's bytes under
  its key.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from .. import __version__
from ..config import values
from ..config.admin import WALKERS
from ..config.values import SettingsError
from . import bound_aesgcm, metrics
from .announcer import Announcer
from .file_pools import FilePools
from .index import KeysCallback
from .layout import KeyFields
from .lease import LOAD_LEASE_S, STORE_LEASE_S, Lease
from .restore_timeline import RestoreTimeline
from .roots import RootSet, shares
from .store import KvFileStore

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger("kvpersist.l2")
bound_aesgcm.register()  # before LMCache wraps this adapter in a serde (kvp-aesgcm)
_GB = 1024**3
#: How long LMCache's eviction waits, at most, for its deletions to reach its own accounting
#: (seconds: a million-key restart announcement takes about 5).
DELETE_ANNOUNCED_WAIT_S = 60.0


_KNOWN_PARAMS = {"path", "max_capacity_gb", "sharded", "fsync", "io_threads", "file_threads",
                 "quarantine_max_files", "shared_tree", "shared_negative_ttl_s", "walker",
                 "store_lease_s", "load_lease_s",
                 "walk_threads", "direct_io", "scan_snapshot", "extra_paths"}


class KvPersistL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """Config of the kvpersist L2 adapter (``adapter_params`` of the plugin entry)."""

    def __init__(self, path: str, max_capacity_gb: float, *, sharded: bool = False,
                 fsync: bool = False, io_threads: int = 4, file_threads: int = 16,
                 quarantine_max_files: int = 1024, shared_tree: str | None = None,
                 shared_negative_ttl_s: float = 2.0, walker: str = "auto",
                 walk_threads: int = 0, direct_io: bool = True,
                 scan_snapshot: bool = True, extra_paths: tuple[str, ...] = (),
                 store_lease_s: float = STORE_LEASE_S, load_lease_s: float = LOAD_LEASE_S) -> None:
        self.path = path
        self.store_lease_s = store_lease_s
        self.load_lease_s = load_lease_s
        self.extra_paths = tuple(extra_paths)
        self.max_capacity_gb = max_capacity_gb
        self.sharded = sharded
        self.fsync = fsync
        self.io_threads = io_threads
        self.file_threads = file_threads
        self.quarantine_max_files = quarantine_max_files
        self.shared_tree = shared_tree
        self.shared_negative_ttl_s = shared_negative_ttl_s
        self.walker = walker
        self.walk_threads = walk_threads
        self.direct_io = direct_io
        self.scan_snapshot = scan_snapshot

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvPersistL2AdapterConfig:
        """Strict: unknown keys and bad values raise ValueError naming the field (and ``help``)."""
        unknown = sorted(set(d) - _KNOWN_PARAMS)
        if unknown:
            raise ValueError(f"kvpersist L2 adapter: unknown keys {unknown}; {cls.help()}")
        path = d.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError("kvpersist L2 adapter: path must be a non-empty string")
        extra = d.get("extra_paths", [])
        if (not isinstance(extra, list | tuple)
                or not all(isinstance(p, str) and p for p in extra)):
            raise ValueError("kvpersist L2 adapter: extra_paths must be a list of non-empty "
                             "strings")
        if len({path, *extra}) != len(extra) + 1:
            raise ValueError(f"kvpersist L2 adapter: a root is given twice in path and "
                             f"extra_paths ({[path, *extra]})")
        shared_tree = d.get("shared_tree")
        if shared_tree is not None and extra:
            raise ValueError("kvpersist L2 adapter: extra_paths and shared_tree do not go "
                             "together (a shared tree is one directory per node)")
        if shared_tree is not None and (not isinstance(shared_tree, str) or not shared_tree):
            raise ValueError("kvpersist L2 adapter: shared_tree must be a non-empty string")
        try:
            return cls(
                path,
                values.positive_float("max_capacity_gb", d.get("max_capacity_gb", 0)),
                sharded=values.boolean("sharded", d.get("sharded", False)),
                fsync=values.boolean("fsync", d.get("fsync", False)),
                io_threads=values.positive_int("io_threads", d.get("io_threads", 4)),
                file_threads=values.positive_int("file_threads", d.get("file_threads", 16)),
                quarantine_max_files=values.positive_int(
                    "quarantine_max_files", d.get("quarantine_max_files", 1024)),
                shared_tree=shared_tree,
                shared_negative_ttl_s=values.positive_float(
                    "shared_negative_ttl_s", d.get("shared_negative_ttl_s", 2.0)),
                walker=values.choice("walker", d.get("walker", "auto"), WALKERS),
                walk_threads=values.integer("walk_threads", d.get("walk_threads", 0),
                                            minimum=0),
                direct_io=values.boolean("direct_io", d.get("direct_io", True)),
                scan_snapshot=values.boolean("scan_snapshot", d.get("scan_snapshot", True)),
                extra_paths=tuple(extra),
                store_lease_s=values.positive_float(
                    "store_lease_s", d.get("store_lease_s", STORE_LEASE_S)),
                load_lease_s=values.positive_float(
                    "load_lease_s", d.get("load_lease_s", LOAD_LEASE_S)),
            )
        except SettingsError as exc:
            raise ValueError(f"kvpersist L2 adapter: {exc}") from None

    @classmethod
    def help(cls) -> str:
        return (
            "kvpersist L2 adapter config fields:\n"
            "- path (str): KVP_CACHE_ROOT, the directory of the .kvp files (required)\n"
            "- max_capacity_gb (float): hard cap in GiB, header overhead included (required)\n"
            "- sharded (bool): two-level ab/cd/ directories by chunk hash (default false)\n"
            "- fsync (bool): fsync each file before publishing (default false; the checksum\n"
            "  already turns a torn write after power loss into a miss)\n"
            "- io_threads (int): LMCache tasks (store, lookup, load) run at once (default 4)\n"
            "- file_threads (int): files read or written at once on each root, across all\n"
            "  tasks, each read verified as it arrives (default 16: many reads in flight for\n"
            "  NVMe; a drive that hangs holds only its own root's)\n"
            "- quarantine_max_files (int): beyond this, corrupt files are removed, not kept\n"
            "- shared_tree (str): the tree several nodes share; path is then this node's part\n"
            "  (<tree>/nodes/<id>), and keys it lacks are read from the other parts (default none)\n"
            "- shared_negative_ttl_s (float): how long a key missing from every other part is\n"
            "  not looked for again (default 2.0)\n"
            "- walker (str): the start-up scan's walker, auto (C when built), c or python\n"
            "  (default auto; KVP_WALKER)\n"
            "- walk_threads (int): threads the C walker stats files on, 0 = one per CPU up to 8\n"
            "  (default 0; KVP_WALK_THREADS)\n"
            "- direct_io (bool): read payloads with O_DIRECT, past the page cache, straight into\n"
            "  L1's buffers where they are page-aligned; verified as ever; a file system that\n"
            "  refuses it falls back to buffered reads with a log line (default true;\n"
            "  KVP_L2_DIRECT_IO)\n"
            "- scan_snapshot (bool): a clean stop leaves an index snapshot, and the next start\n"
            "  adopts it instead of walking the tree when no data directory changed since\n"
            "  (stores resume sooner); never on a shared tree (default true; KVP_SCAN_SNAPSHOT)\n"
            "- extra_paths (list of str): more roots, one per device; each key's file lives on\n"
            "  one root chosen by its key, each root holds an equal share of max_capacity_gb,\n"
            "  and a root whose device fails is given up alone (default none;\n"
            "  KVP_CACHE_EXTRA_ROOTS)\n"
            "- store_lease_s (float): a store task's file is published only if its payload was\n"
            "  read in full within this many seconds of the task's submission: LMCache's read\n"
            "  lock on the L1 object lapses after --l1-read-ttl-seconds (300), and its memory\n"
            "  may then hold another chunk; keep it below that (default 270)\n"
            "- load_lease_s (float): a load task reads no file later than this after its\n"
            "  submission (a miss instead): LMCache's write lock on the L1 buffer lapses after\n"
            "  --l1-write-ttl-seconds (600); keep it below that (default 540)"
        )


def to_fields(key: ObjectKey) -> KeyFields:
    return KeyFields(key.model_name, key.kv_rank, key.object_group_id, bytes(key.chunk_hash),
                     key.cache_salt)


def to_object_key(fields: KeyFields) -> ObjectKey:
    return ObjectKey(chunk_hash=fields.chunk_hash, model_name=fields.model_name,
                     kv_rank=fields.kv_rank, object_group_id=fields.object_group_id,
                     cache_salt=fields.cache_salt)


def _layout_of(obj: Any) -> dict[str, Any]:
    try:
        meta = obj.metadata
        return {"shape": [int(x) for x in meta.shape], "dtype": str(meta.dtype)}
    except Exception:  # layout is informational only; never fail a store over it
        return {}


class KvPersistL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache L2 adapter over :class:`KvFileStore` (see module invariants)."""

    def __init__(self, config: KvPersistL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=int(config.max_capacity_gb * _GB))
        self._config = config
        self._announcer = Announcer({
            "stored": lambda keys, sizes: self._notify_keys_stored(
                [to_object_key(k) for k in keys], sizes),
            "deleted": lambda keys, sizes: self._notify_keys_deleted(
                [to_object_key(k) for k in keys], sizes),
            "accessed": lambda keys, _: self._notify_keys_accessed(keys),
        })
        paths = [Path(config.path), *(Path(p) for p in config.extra_paths)]
        self._store = RootSet(paths, shares(int(config.max_capacity_gb * _GB), len(paths)),
                              self._new_store, on_added=self._announce_added,
                              on_removed=self._announce_removed)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._done_store: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookup: dict[L2TaskId, Bitmap] = {}
        self._done_load: dict[L2TaskId, Bitmap] = {}
        self._timeline = RestoreTimeline()
        self._pool = ThreadPoolExecutor(max_workers=config.io_threads,
                                        thread_name_prefix="kvpersist-l2-task")
        self._files = FilePools(len(paths), config.file_threads)
        self._store.open(background_scan=True)
        metrics.bind(self._store.status)
        # an encrypted chunk whose tag fails under its own key (renamed, re-headered, foreign)
        self._unsubscribe = bound_aesgcm.on_rejected(self._reject_payload)
        logger.info("kvpersist L2 adapter on %s: capacity %.3f GiB, sharded=%s",
                    ", ".join(map(str, paths)), config.max_capacity_gb, config.sharded)

    def _new_store(self, root: Path, capacity: int, on_added: KeysCallback,
                   on_removed: KeysCallback) -> KvFileStore:
        config = self._config
        return KvFileStore(
            root, capacity, sharded=config.sharded, fsync=config.fsync,
            quarantine_max_files=config.quarantine_max_files, on_added=on_added,
            on_removed=on_removed, shared_tree=config.shared_tree,
            shared_negative_ttl_s=config.shared_negative_ttl_s, walker=config.walker,
            walk_threads=config.walk_threads, direct_io=config.direct_io,
            scan_snapshot=config.scan_snapshot)

    # -- accounting bridge (see module invariants)
    def _announce_added(self, keys: list[KeyFields], sizes: list[int]) -> None:
        self._announcer.announce("stored", keys, sizes)

    def _announce_removed(self, keys: list[KeyFields], sizes: list[int]) -> None:
        self._announcer.announce("deleted", keys, sizes)

    def wait_announced(self, timeout: float | None = None) -> bool:
        """Wait until LMCache has been told of every index change and read so far; False on
        timeout."""
        return self._announcer.wait_idle(timeout)

    # -- event fds
    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    def _new_id(self) -> L2TaskId:
        with self._lock:
            tid = self._next_id
            self._next_id += 1
            return tid

    # -- store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._new_id()
        lease = Lease.starting_now(self._config.store_lease_s)  # LMCache locked them just now
        self._pool.submit(self._run_store, tid, list(keys), list(objects), lease)
        return tid

    def _run_store(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj],
                   lease: Lease) -> None:
        """Every key's file is written on its root's file pool, published only within the
        task's ``lease`` (:mod:`kvpersist.l2.lease`); the task finishes with the last
        (:meth:`_store_done`)."""
        try:
            calls = []
            for key, obj in zip(keys, objects, strict=True):
                fields = to_fields(key)
                calls.append((self._store.root_index(fields), functools.partial(
                    self._store.put, fields, obj.byte_array, _layout_of(obj), lease)))
            self._files.run_all(f"store task {tid}", calls,
                                functools.partial(self._store_done, tid, objects))
        except Exception:
            logger.exception("kvpersist L2 store task %d failed", tid)
            self._store_done(tid, objects, None)

    def _store_done(self, tid: L2TaskId, objects: list[MemoryObj],
                    outcomes: list[str | None] | None) -> None:
        ok, written = outcomes is not None, 0
        for outcome, obj in zip(outcomes or [], objects, strict=True):
            if outcome == "stored":
                written += len(memoryview(obj.byte_array).cast("B"))
            elif outcome != "exists":
                ok = False
        with self._lock:
            self._done_store[tid] = L2StoreResult(ok, written)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done_store = self._done_store, {}
        return done

    # -- lookup
    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:
        tid = self._new_id()
        self._timeline.mark("lookup_submitted")
        self._pool.submit(self._run_lookup, tid, list(keys))
        return tid

    def _run_lookup(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            for i, hit in enumerate(self._store.contains_many([to_fields(k) for k in keys])):
                if hit:
                    bitmap.set(i)
        except Exception:
            logger.exception("kvpersist L2 lookup task %d failed", tid)
        self._timeline.mark("lookup_done")  # before the result can be taken
        with self._lock:
            self._done_lookup[tid] = bitmap
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_lookup.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        # No per-key locks: a delete racing lookup→load turns that load into a verified miss.
        return None

    # -- load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._new_id()
        lease = Lease.starting_now(self._config.load_lease_s)  # LMCache locked them just now
        self._timeline.mark("load_submitted")
        self._pool.submit(self._run_load, tid, list(keys), list(objects), lease)
        return tid

    def _run_load(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj],
                  lease: Lease) -> None:
        """Every key's file is read on its root's file pool within the task's ``lease``
        (:mod:`kvpersist.l2.lease`), each verified as it arrives; the task finishes with the
        last (:meth:`_load_done`)."""
        try:
            calls = []
            for key, obj in zip(keys, objects, strict=True):
                fields = to_fields(key)
                calls.append((self._store.root_index(fields), functools.partial(
                    self._store.read_into, fields, obj.byte_array, lease)))
            self._timeline.mark("load_dispatched")
            self._files.run_all(f"load task {tid}", calls,
                                functools.partial(self._load_done, tid, keys))
        except Exception:
            logger.exception("kvpersist L2 load task %d failed", tid)
            self._load_done(tid, keys, [])

    def _load_done(self, tid: L2TaskId, keys: list[ObjectKey], hits: list[bool | None]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[ObjectKey] = []
        for i, hit in enumerate(hits):
            if hit:
                bitmap.set(i)
                loaded.append(keys[i])
        if loaded:
            self._announcer.announce("accessed", loaded)
        self._timeline.mark("load_done")  # before the result can be taken
        with self._lock:
            self._done_load[tid] = bitmap
        self._load_efd.notify()

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_load.pop(task_id, None)

    # -- eviction, listing, status
    def delete(self, keys: list[ObjectKey]) -> None:
        """LMCache's eviction: returns once LMCache has heard of these deletions (and of
        everything before them), so that its next usage check does not count the evicted bytes
        again and evict more than it meant to while a restart's announcement catches up."""
        for key in keys:
            self._store.delete(to_fields(key))
        if not self._announcer.wait_idle(timeout=DELETE_ANNOUNCED_WAIT_S):
            logger.warning("kvpersist L2: LMCache not yet told of %d deletions after %.0f s",
                           len(keys), DELETE_ANNOUNCED_WAIT_S)

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        page, next_cursor = self._store.list_keys(model_name, cursor, page_size)
        entries = tuple(KeyEntry(key=to_object_key(k).to_encoded_object_key(), size_bytes=size)
                        for k, size in page)
        return KeyListPage(entries=entries, next_page_token=next_cursor)

    def get_usage(self) -> AdapterUsage:
        """LMCache's accounting, with the capacity scaled so that the fraction is the fullest
        root's (see :meth:`RootSet.usage_fraction`): LMCache's watermark eviction runs as soon
        as one device reaches it.  With one root, LMCache's own figures unchanged."""
        usage = super().get_usage()
        if not self._store.several:
            return usage
        fullest = self._store.usage_fraction()
        used = self._store.used_bytes
        capacity = (int(used / fullest) if fullest > 0 and used > 0
                    else self._store.healthy_capacity_bytes)
        return AdapterUsage(total_bytes_used=usage.total_bytes_used,
                            total_capacity_bytes=capacity,
                            bytes_by_cache_salt=usage.bytes_by_cache_salt)

    def report_status(self) -> dict[str, Any]:
        status = self._store.status()
        scan_error = self._store.scan_error
        if scan_error is not None:  # stores are refused until a scan succeeds
            status["unhealthy_reason"] = (f"the start-up scan failed ({scan_error}); stores are "
                                          "refused and the scan is tried again")
        degraded = self._store.degraded
        if degraded and len(degraded) == len(self._store.paths):
            scan_error = scan_error or "every root is degraded"
            status["unhealthy_reason"] = "every root is degraded: " + "; ".join(
                why for _, why in degraded)
        # index changes and reads LMCache has not been told of yet (a restart's scan: seconds)
        status["announcements_pending"] = self._announcer.pending
        status["last_restore_timeline"] = self._timeline.snapshot()
        status.update({"is_healthy": scan_error is None, "type": "KvPersistL2Adapter",
                       "kvpersist_version": __version__, "kvpersist_module": __file__})
        return status

    @property
    def store(self) -> RootSet:
        return self._store

    def _reject_payload(self, key: ObjectKey) -> None:
        fields = to_fields(key)
        if self._store.contains(fields):
            self._store.quarantine_key(fields, "key-binding", "its encrypted payload fails "
                                       "authentication under its object key")

    def close(self) -> None:
        self._unsubscribe()
        metrics.bind(None)
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._files.shutdown()
        self._store.close()
        self._announcer.close(timeout=60)
        self._store_efd.close()
        self._lookup_efd.close()
        self._load_efd.close()
        logger.info("kvpersist L2 adapter closed")
