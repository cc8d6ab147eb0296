"""The sweep of LMCache's CPU shared-memory segments: a dead worker's segment goes, a live
worker's, another account's and anything not LMCache's stay."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.serving.shm_sweep import SHM_DIR, sweep_stale_segments


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dead_workers_segments_of_this_account_go(tmp_path: Path) -> None:
    gone = dead_pid()
    dead = tmp_path / f"lmcache_kv_{gone}_0"
    dead.write_bytes(b"k" * 4096)
    live = tmp_path / f"lmcache_kv_{os.getpid()}_0"
    live.write_bytes(b"k")
    others = [tmp_path / "psm_0123abcd", tmp_path / f"lmcache_l1_pool_{gone}",
              tmp_path / f"lmcache_kv_{gone}_0.bak"]
    for path in others:
        path.write_bytes(b"x")
    foreign = tmp_path / f"lmcache_kv_{gone}_1"
    foreign.write_bytes(b"f")
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
    swept = sweep_stale_segments(tmp_path)
    assert not dead.exists() and live.exists() and all(p.exists() for p in others)
    assert foreign.exists() == (os.geteuid() == 0)  # as root: owned by nobody, kept
    assert (swept.segments, swept.bytes) == (1 if os.geteuid() == 0 else 2,
                                             4096 if os.geteuid() == 0 else 4097)
    assert sweep_stale_segments(tmp_path / "missing").segments == 0


@pytest.mark.serial  # /dev/shm is machine-wide: another test's sweep could remove the segment first
@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_a_real_posix_segment_of_a_dead_worker_is_removed() -> None:
    """A segment made through shm_open (as LMCache's CPU transport makes it), named for a worker
    that has exited."""
    from multiprocessing import resource_tracker, shared_memory

    name = f"lmcache_kv_{dead_pid()}_7"
    segment = shared_memory.SharedMemory(name=name, create=True, size=1 << 20)
    resource_tracker.unregister(f"/{name}", "shared_memory")  # as a killed worker leaves it
    segment.close()
    assert (SHM_DIR / name).exists()
    assert sweep_stale_segments().segments >= 1
    assert not (SHM_DIR / name).exists()


def test_a_segment_a_live_process_maps_stays_whatever_pid_its_name_holds(tmp_path: Path) -> None:
    """The name's pid is a dead process, but a process in view maps the segment (a worker of
    another pid namespace that reused the name, or a pid recycled): its owner is not proven
    dead, so it stays."""
    import mmap

    mapped = tmp_path / f"lmcache_kv_{dead_pid()}_3"
    mapped.write_bytes(b"m" * 4096)
    with open(mapped, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        assert sweep_stale_segments(tmp_path).segments == 0
        assert mapped.exists()
    assert sweep_stale_segments(tmp_path).segments == 1  # unmapped, its pid dead: gone


def test_outside_the_initial_pid_namespace_nothing_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from kvpersist.serving import shm_sweep

    dead = tmp_path / f"lmcache_kv_{dead_pid()}_0"
    dead.write_bytes(b"k")
    monkeypatch.setattr(shm_sweep, "sees_every_process", lambda: False)
    caplog.set_level("INFO", logger=shm_sweep.__name__)
    assert sweep_stale_segments(tmp_path).segments == 0 and dead.exists()
    assert "cannot prove their owners dead" in caplog.text


def test_orphaned_python_segments_go_only_when_unused_and_old_or_of_an_ended_run(
        tmp_path: Path) -> None:
    """vLLM's message queues (``psm_*``) carry no pid: a segment goes when nobody maps or holds
    it open and it is older than the grace period, or it is among the names a run the caller
    ended made.  Named semaphores (``sem.mp-*``) and vLLM's CPU communicator buffers go by
    the same rules."""
    from kvpersist.serving.shm_sweep import python_segments, sweep_python_segments

    old, young, held = tmp_path / "psm_0123abcd", tmp_path / "psm_abcd1234", \
        tmp_path / "psm_deadbeef"
    semaphore = tmp_path / "sem.mp-abcd_234"
    semaphore.write_bytes(b"s" * 32)
    comm = tmp_path / ("vllm_dist_" + "0" * 32 + "-tp:0-[0-1]-cpushm_1")
    comm.write_bytes(b"c" * 64)
    for path in (old, held):
        path.write_bytes(b"q" * 1024)
    later = os.stat(old).st_ctime + 3600  # an hour after they were made ...
    young.write_bytes(b"q" * 1024)
    os.utime(young, (later, later))  # ... when `young` was last written
    unrelated = tmp_path / "psm_not_hex!"
    unrelated.write_bytes(b"x")
    assert python_segments(tmp_path) == {old.name, young.name, held.name, semaphore.name,
                                         comm.name}
    with open(held, "rb"):  # a live process holds it open: in use
        swept = sweep_python_segments(tmp_path, grace_s=600, now=later + 1)
        assert (swept.segments, swept.bytes) == (3, 1024 + 32 + 64)
        assert not old.exists() and young.exists() and held.exists()
        assert not semaphore.exists() and not comm.exists()
        # a run the caller ended made `young`: no grace for it, but `held` stays in use
        sweep_python_segments(tmp_path, only={young.name, held.name})
        assert not young.exists() and held.exists() and unrelated.exists()


#: The tail of a script that made a shared-memory name and printed it: with ``die`` it is
#: SIGKILLed (its resource tracker never ran), else it lives until its stdin closes.
_DIE_OR_LIVE = ("if sys.argv[1] == 'die':\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\n"
                "sys.stdin.read()\n")


@contextlib.contextmanager
def _orphan_and_held(make: str) -> Iterator[tuple[str, str, int]]:
    """Run ``make`` (which prints the name it made) twice: the name a SIGKILLed run left,
    the name a live run holds, and the live run's pid (alive inside the block)."""
    import signal

    script = make + _DIE_OR_LIVE
    dying = subprocess.run([sys.executable, "-c", script, "die"], capture_output=True,
                           text=True, timeout=60)
    assert dying.returncode == -signal.SIGKILL
    orphan = dying.stdout.strip()
    live = subprocess.Popen([sys.executable, "-c", script, "live"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    held = ""
    try:
        assert live.stdout is not None
        held = live.stdout.readline().strip()
        assert (SHM_DIR / orphan).exists() and (SHM_DIR / held).exists()
        yield orphan, held, live.pid
    finally:
        live.communicate("", timeout=30)
        for name in (orphan, held):
            if name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(SHM_DIR / name)


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_a_real_semaphore_in_use_under_its_temporary_name_stays_and_an_orphan_goes() -> None:
    """``multiprocessing``'s spawn-context locks are named semaphores.  Their creator maps
    one under glibc's temporary name (``sem.XXXXXX (deleted)``), never ``sem.mp-*``: the
    inode tells it is in use.  A creator SIGKILLed with its resource tracker leaves it."""
    from kvpersist.serving.shm_sweep import sweep_python_segments

    make = ("import multiprocessing as mp, os, signal, sys\n"
            "from multiprocessing import resource_tracker\n"
            "lock = mp.get_context('spawn').Lock()\n"
            "name = lock._semlock.name\n"
            "resource_tracker.unregister(name, 'semaphore')\n"
            "print('sem.' + name.lstrip('/'), flush=True)\n")
    with _orphan_and_held(make) as (orphan, held, pid):
        assert held not in Path(f"/proc/{pid}/maps").read_text()  # only the inode shows it
        assert sweep_python_segments(only={orphan, held}).segments == 1
        assert not (SHM_DIR / orphan).exists() and (SHM_DIR / held).exists()


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_a_real_python_segment_of_a_killed_process_goes_and_a_live_one_stays() -> None:
    """Real ``multiprocessing.shared_memory`` segments: one whose process was SIGKILLed (its
    resource tracker with it: nothing unlinked it), one a live process maps."""
    from kvpersist.serving.shm_sweep import sweep_python_segments

    make = ("import os, signal, sys\n"
            "from multiprocessing import resource_tracker, shared_memory\n"
            "m = shared_memory.SharedMemory(create=True, size=1 << 16)\n"
            "resource_tracker.unregister(m._name, 'shared_memory')\n"
            "print(m.name, flush=True)\n")
    with _orphan_and_held(make) as (orphan, held, _):
        assert sweep_python_segments(only={orphan, held}).segments == 1
        assert not (SHM_DIR / orphan).exists() and (SHM_DIR / held).exists()
