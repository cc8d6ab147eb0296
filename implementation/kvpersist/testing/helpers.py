"""Helpers for tests and benchmarks that run real processes: L2 files, pins, adapter status,
waits on conditions (ending processes: :mod:`kvpersist.testing.processes`)."""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import select
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..config.registry import BY_NAME, DEFAULT_CHUNK_TOKENS
from ..config.server import DEFAULTS as SERVER_DEFAULTS
from ..config.server import ServerSettings, load_settings
from ..demo.stack import free_port
from ..demo.tiny_model import TINY_PINS as TINY_PINS
from ..identity import FIELDS, load_pins
from ..identity.sources import CONNECTOR_NAME, from_model_folder
from ..l2.layout import KeyFields
from ..serving import http
from ..serving.lmcache_compat import status as server_status

#: Suffixes of L2 data files: kvpersist's (``.kvp``) and LMCache's own adapters' (``.bin``).
L2_SUFFIXES = (".bin", ".kvp")


def l2_data_files(root: Path, suffixes: tuple[str, ...] = L2_SUFFIXES) -> list[Path]:
    """Every L2 data file directly in ``root``, sorted by name."""
    return [p for p in sorted(root.iterdir()) if p.is_file() and p.suffix in suffixes]


def l2_files(root: Path, suffixes: tuple[str, ...] = L2_SUFFIXES) -> dict[str, str]:
    """name → sha256 of content, for every L2 data file directly in ``root``."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in l2_data_files(root, suffixes)}


#: ``renameat2`` flag: swap two existing paths in one step.
RENAME_EXCHANGE = 2
AT_FDCWD = -100


def exchange_paths(a: Path, b: Path) -> None:
    """Swap ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``): a watcher of
    either path never finds it missing, as when a device is unmounted from its mount point."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def wait_until(predicate: Callable[[], object], timeout: float = 60.0,
               interval: float = 0.5, *, message: str = "condition not reached") -> None:
    """Poll ``predicate`` until it is true; AssertionError (``message``) after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{message} within {timeout:.0f}s"
        time.sleep(interval)


def wait_for_l2_files(root: Path, min_count: int, timeout: float = 60.0) -> dict[str, str]:
    """Wait until at least ``min_count`` L2 files exist and the set is stable for 1 s."""
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    while time.monotonic() < deadline:
        now = l2_files(root)
        if len(now) >= min_count and now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"expected ≥{min_count} stable L2 files in {root}, have {len(last)}")


def write_pins(path: Path, **changes: str) -> Path:
    """Copy the tiny model's pins to ``path`` with ``changes`` (field name → value)."""
    pins = dict(load_pins(TINY_PINS))
    pins.update(changes)
    env_names = {f.name: f.env for f in FIELDS}
    path.write_text("".join(f"{env_names[k]}={v}\n" for k, v in pins.items()))
    return path


def adapter_status(settings: ServerSettings) -> dict[str, Any]:
    """The kvpersist adapter's ``report_status`` as the live server's ``/status`` shows it."""
    status = server_status.fetch(settings.http_url, timeout=10) or {}
    adapters = server_status.l2_adapters(status)
    assert len(adapters) == 1 and adapters == server_status.kvpersist_adapters(status), status
    return dict(adapters[0])


#: The kvpersist adapter's counters of answered stores: each put ends in exactly one of them.
STORE_OUTCOMES = ("stores", "store_exists", "store_exists_elsewhere", "rejected_capacity",
                  "rejected_scanning", "rejected_disk_full", "store_errors",
                  "store_lease_expired")


def l2_store_answers(status: Mapping[str, Any]) -> int:
    """Stores the adapter has answered since the server started (written, already there,
    refused or failed), from its ``report_status`` (:func:`adapter_status`)."""
    return sum(int(status[name]) for name in STORE_OUTCOMES)


def wait_for_l2_idle(settings: ServerSettings, stores_at_least: int = 0,
                     timeout: float = 120.0) -> dict[str, Any]:
    """Wait until the server's L2 tier is quiet and return the adapter's status then.

    Quiet: the adapter has answered at least ``stores_at_least`` stores
    (:func:`l2_store_answers`) and holds no reservation (no write in progress); LMCache has no
    key queued for L2 and no L2 store in flight; L2 usage is below LMCache's eviction watermark
    (its eviction loop has nothing left to do); and all of this read the same on two polls
    0.5 s apart, so an eviction pass or a store that was just arriving has finished."""
    deadline = time.monotonic() + timeout
    last: tuple[int, ...] | None = None
    while True:
        status = server_status.fetch(settings.http_url, timeout=10) or {}
        (adapter,) = server_status.kvpersist_adapters(status)
        quiet = (l2_store_answers(adapter) >= stores_at_least and adapter["reserved_bytes"] == 0
                 and all(c["pending_keys_count"] == 0 and c["in_flight_task_count"] == 0
                         for c in server_status.store_controllers(status))
                 and all(e["current_usage"] < e["trigger_watermark"]
                         for e in server_status.l2_eviction_adapters(status)))
        now = (l2_store_answers(adapter), int(adapter["evicted"]), int(adapter["used_bytes"]),
               int(adapter["files"]))
        if quiet and now == last:
            return dict(adapter)
        last = now if quiet else None
        assert time.monotonic() < deadline, (
            f"L2 not idle within {timeout:.0f}s (wanted ≥{stores_at_least} answered stores): "
            f"{adapter}")
        time.sleep(0.5)


def clear_l1(settings: ServerSettings) -> None:
    """Empty the server's L1 (host RAM), so the next lookup has to read L2."""
    resp = http.request("POST", settings.http_url + "/cache/clear",
                        payload={"tier": "l1", "force": True}, timeout=10)
    assert resp.status == 200, resp


def server_env(root: Path, **extra: str) -> dict[str, str]:
    """Settings for a test server on ``root`` with free loopback ports and a 1 GiB L1."""
    zmq_port = free_port()
    http_port = free_port()
    while http_port == zmq_port:  # the kernel may hand the just-closed port out again
        http_port = free_port()
    return {"KVP_CACHE_ROOT": str(root), "KVP_ZMQ_PORT": str(zmq_port),
            "KVP_HTTP_PORT": str(http_port), "KVP_L1_SIZE_GB": "1",
            "KVP_CACHE_BUDGET_GB": "2", **extra}


class SettingSpecError(ValueError, argparse.ArgumentTypeError):
    """A variant that is not ``KEY=VALUE[,KEY=VALUE]``; argparse prints its message as it is."""


def setting_overrides(spec: str) -> dict[str, str]:
    """``KEY=VALUE[,KEY=VALUE]`` (a benchmark's variant of settings) as a dict; SettingSpecError
    (a ValueError) naming the bad item otherwise, or naming a ``KVP_`` key that is no setting (a
    typo, refused before a benchmark spends minutes on it).  As an argparse ``type`` its message
    reaches the user unchanged."""
    overrides: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingSpecError(f"{item!r} is not KEY=VALUE (in {spec!r})")
        overrides[key.strip()] = value
    _refuse_unknown_settings(overrides)
    return overrides


def server_settings_in(variant: Mapping[str, str]) -> dict[str, str]:
    """The items of ``variant`` that are the cache server's settings (``load_settings`` takes
    these); the others are meant for vLLM's environment alone.  A ``KVP_`` name that is no
    setting at all is a SettingSpecError rather than silently left out."""
    _refuse_unknown_settings(variant)
    return {key: value for key, value in variant.items() if key in SERVER_DEFAULTS}


def _refuse_unknown_settings(names: Mapping[str, str]) -> None:
    unknown = sorted(k for k in names if k.startswith("KVP_") and k not in BY_NAME)
    if unknown:
        raise SettingSpecError(f"unknown setting(s): {', '.join(unknown)}")


def kvpersist_settings(root: Path, budget_gb: str = "1") -> ServerSettings:
    """Validated settings of a test server with the kvpersist adapter on ``root``."""
    return load_settings(server_env(root, KVP_CACHE_BUDGET_GB=budget_gb,
                                    KVP_L2_ADAPTER="kvpersist"))


def key_of(i: int, namespace: str = "kvp-" + "a" * 32, model: str = "org/model") -> KeyFields:
    """A distinct object key per ``i`` in ``namespace``."""
    return KeyFields(f"{model}/{namespace}", 0, 0, i.to_bytes(32, "big"), "")


def pins_for_model(snapshot: Path, path: Path, *, block_size: int = 128,
                   max_model_len: int = 2048) -> Path:
    """Write ``path``: the pins of a locally built model folder as vLLM on CPU serves it with
    ``--dtype float32`` and one process (``build`` is left to the engine)."""
    fields = {**from_model_folder(snapshot), "block_size": block_size,
              "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
              "max_model_len": max_model_len, "connector": CONNECTOR_NAME}
    env = {f.name: f.env for f in FIELDS}
    path.write_text("".join(f"{env[k]}={v}\n" for k, v in sorted(fields.items())))
    return path


def tcp_listeners(pid: int) -> list[str]:
    """``address:port`` of every listening TCP socket that process ``pid`` holds open (from
    ``/proc/<pid>/fd`` and ``/proc/net/tcp{,6}``; the addresses stay in the kernel's hex)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def chunk_hashes(model_dir: Path, messages: list[dict[str, str]], chunk: int = DEFAULT_CHUNK_TOKENS
                 ) -> list[bytes]:
    """The chunk hashes LMCache keys a chat's full chunks by, in prompt order: the model's chat
    template (as vLLM renders it) and LMCache's own rolling hasher (blake3, no salt).  A test
    that damages "chunk k" finds its files by these, not by modification time, whose
    granularity gives many files of one request the same stamp."""
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from .kv_writer import chat_token_ids

    return list(TokenHasher(chunk, "blake3").compute_chunk_hashes(
        chat_token_ids(model_dir, messages)))


def wait_for_stored_chat(root: Path, count: int, resend: Callable[[], object], *,
                         tries: int = 3) -> dict[str, str]:
    """Wait for ``count`` L2 files of a cold chat; each time they are not all there within
    30 s, ``resend()`` it: its stored chunks hit and the missing ones are computed and stored.
    A store can be dropped for reasons the test is not about (an L1 full of chunks still on
    their way to L2; a heartbeat missed on a starved 2-core host)."""
    for _ in range(tries):
        try:
            return wait_for_l2_files(root, count, timeout=30)
        except AssertionError:
            resend()
    return wait_for_l2_files(root, count, timeout=60)


def cache_diagnosis(vllm_log: Path, server_log: Path, lines: int = 40) -> str:
    """What a failed hit assertion prints: vLLM's kvpersist and LMCache lines (a bypass and its
    reason, the lookup's warnings) and the server log's tail.  CI shows only pytest's output, so
    without this a lost hit there says nothing of its cause."""
    def grep_tail(path: Path, words: tuple[str, ...]) -> str:
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError as err:
            return f"({path}: {err})"
        picked = [line for line in text if any(word in line for word in words)] if words else text
        return "\n".join(line[:400] for line in picked[-lines:])
    return (f"--- {vllm_log.name}: kvpersist lines, warnings, errors ---\n"
            f"{grep_tail(vllm_log, ('kvpersist: ', 'WARNING', 'ERROR', 'Traceback'))}\n"
            f"--- {server_log.name}: tail ---\n{grep_tail(server_log, ())}")


def wait_for_task(efd: int, query: Callable[[int], Any], tid: int,
                  timeout: float = 30.0) -> Any:
    """An L2 adapter task's result: ``query(tid)`` each time its event fd ``efd`` fires (and
    every 0.2 s), until it is not None; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        select.select([efd], [], [], 0.2)
        result = query(tid)
        if result is not None:
            return result
    raise AssertionError(f"task {tid} did not complete")
