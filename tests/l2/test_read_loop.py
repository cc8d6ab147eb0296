"""The segmented, counted reads of :mod:`kvpersist.l2.read_loop`: the C loops and the Python loops
give the same bytes, digests and counts, count every segment as it arrives (a restore's progress
signal), never lose a count across threads, and report errors the store's O_DIRECT fallback
relies on (EINVAL) as OSError."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpersist.l2 import read_loop
from kvpersist.l2.format import payload_digest
from kvpersist.l2.read_loop import (
    PAGE,
    ReadCounter,
    python_read_counted,
    python_read_hashed,
    read_counted,
    read_hashed,
)

Reader = Callable[[int, memoryview, int, int, ReadCounter], int]
Hasher = Callable[[int, memoryview, int, int, ReadCounter, "memoryview | None"],
                  tuple[int, bytes, float]]
READERS: dict[str, Reader] = {"python": python_read_counted}
HASHERS: dict[str, Hasher] = {"python": python_read_hashed}
if read_loop.has_c_loop():
    READERS["c"] = read_counted
    HASHERS["c"] = read_hashed
needs_c = pytest.mark.skipif(not read_loop.has_c_loop(), reason="the C read loop is not built")


@pytest.fixture
def data_file(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    data = os.urandom(3 * (1 << 20) + 1234)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd, data
    finally:
        os.close(fd)


def test_the_c_loop_is_built_where_the_project_is_bootstrapped() -> None:
    # scripts/bootstrap.sh builds it; a missing build would silently cost the restore its speed
    assert read_loop.has_c_loop()


@pytest.mark.parametrize("name", sorted(READERS))
@pytest.mark.parametrize(("offset", "length", "segment"),
                         [(0, 3 * (1 << 20) + 1234, 1 << 20), (4096, 1 << 20, 65536),
                          (7, 100, 3), (3 * (1 << 20), 1 << 20, 4096), (10 << 20, 4096, 4096)])
def test_both_loops_read_the_same_bytes_and_count_them(data_file: tuple[int, bytes], name: str,
                                                       offset: int, length: int,
                                                       segment: int) -> None:
    fd, data = data_file
    out = memoryview(bytearray(length))
    counter = ReadCounter()
    got = READERS[name](fd, out, offset, segment, counter)
    want = data[offset:offset + length]
    assert got == len(want)  # short only at the end of the file
    assert bytes(out[:got]) == want
    assert counter.value == got


def page_buffer(size: int, shift: int = 0) -> memoryview:
    """``size`` bytes starting ``shift`` bytes past a page boundary."""
    return memoryview(mmap.mmap(-1, size + shift + PAGE))[shift:shift + size]


@pytest.mark.parametrize("name", sorted(HASHERS))
@pytest.mark.parametrize("bounce_pages", [None, 1, 256])
@pytest.mark.parametrize("shift", [0, 16])
@pytest.mark.parametrize(("offset", "length"),
                         [(4096, 3 * (1 << 20) + 1234 - 4096), (4096, 2 * PAGE + 77),
                          (4096, 100), (0, 5 * (1 << 20))])
def test_both_hashing_loops_read_and_hash_the_same_bytes(data_file: tuple[int, bytes], name: str,
                                                         bounce_pages: int | None, shift: int,
                                                         offset: int, length: int) -> None:
    fd, data = data_file
    out = page_buffer(length, shift)
    bounce = None if bounce_pages is None else page_buffer(bounce_pages * PAGE)
    counter = ReadCounter()
    got, digest, spent = HASHERS[name](fd, out, offset, 65536, counter, bounce)
    want = data[offset:offset + length]
    assert got == len(want)  # the last case runs past the end of the file
    assert bytes(out[:got]) == want
    assert digest == payload_digest(want)
    # every byte a pread returned counts; a bounce read's padding to a whole page is read too
    assert got <= counter.value < got + (PAGE if bounce is not None else 1)
    assert spent >= 0.0


@pytest.mark.parametrize("name", sorted(HASHERS))
@pytest.mark.parametrize("shift", [0, 16])
@pytest.mark.parametrize("length", [3 * (1 << 20), (1 << 20) + 100, 5000])
def test_the_hashing_loops_on_an_o_direct_descriptor(name: str, shift: int, length: int) -> None:
    with tempfile.TemporaryDirectory(dir=tempfile.gettempdir()) as d:
        path = Path(d) / "f"
        data = os.urandom(PAGE + length)
        path.write_bytes(data)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            pytest.skip(f"no O_DIRECT under {d}: {exc}")
        try:
            out = page_buffer(length, shift)
            got, digest, _ = HASHERS[name](fd, out, PAGE, 1 << 20, ReadCounter(),
                                           page_buffer(1 << 20))
        finally:
            os.close(fd)
    assert got == length and bytes(out) == data[PAGE:]
    assert digest == payload_digest(data[PAGE:])


@pytest.mark.parametrize("name", sorted(HASHERS))
@pytest.mark.parametrize("bounce", [lambda: page_buffer(100), lambda: page_buffer(PAGE, 8)])
def test_a_bounce_buffer_of_other_than_whole_aligned_pages_is_refused(
        data_file: tuple[int, bytes], name: str, bounce: Callable[[], memoryview]) -> None:
    with pytest.raises(ValueError):
        HASHERS[name](data_file[0], page_buffer(PAGE), 0, PAGE, ReadCounter(), bounce())


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_bad_descriptor_is_an_oserror(name: str) -> None:
    with pytest.raises(OSError) as caught:
        READERS[name](-1, memoryview(bytearray(10)), 0, 4, ReadCounter())
    assert caught.value.errno == errno.EBADF


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_bad_segment_is_refused(data_file: tuple[int, bytes], name: str) -> None:
    with pytest.raises(ValueError):
        READERS[name](data_file[0], memoryview(bytearray(10)), 0, 0, ReadCounter())


@pytest.mark.parametrize("name", sorted(READERS))
def test_an_unaligned_direct_read_is_einval(name: str) -> None:
    # the store falls back to buffered reads on EINVAL; the loop must report it as such
    with tempfile.TemporaryDirectory(dir=tempfile.gettempdir()) as d:
        path = Path(d) / "f"
        path.write_bytes(os.urandom(1 << 16))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            pytest.skip(f"no O_DIRECT under {d}: {exc}")
        try:
            unaligned = memoryview(mmap.mmap(-1, 1 << 17))[16:16 + (1 << 16)]
            with pytest.raises(OSError) as caught:
                READERS[name](fd, unaligned, 0, 4096, ReadCounter())
            assert caught.value.errno == errno.EINVAL
        finally:
            os.close(fd)


@pytest.mark.parametrize("name", sorted(READERS))
def test_concurrent_loops_never_lose_a_count(data_file: tuple[int, bytes], name: str) -> None:
    fd, data = data_file
    counter = ReadCounter()
    rounds, threads = 40, 8

    def work() -> None:
        out = memoryview(bytearray(len(data)))
        for _ in range(rounds):
            assert READERS[name](fd, out, 0, 4096, counter) == len(data)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert counter.value == rounds * threads * len(data)


def read_syscalls() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError("no syscr in /proc/self/io")


@needs_c
def test_the_c_loop_grows_its_segments_while_reads_are_fast(tmp_path: Path) -> None:
    # page-cache reads of 64 KiB take microseconds: the loop doubles to 2x 64 KiB, so the
    # 64 MiB take about half the 1024 reads of fixed segments (the Python loop's count)
    size, segment = 64 << 20, 64 << 10
    path = tmp_path / "f"
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        out = memoryview(bytearray(size))
        before = read_syscalls()
        assert read_counted(fd, out, 0, segment, ReadCounter()) == size
        c_reads = read_syscalls() - before
        before = read_syscalls()
        assert python_read_counted(fd, out, 0, segment, ReadCounter()) == size
        python_reads = read_syscalls() - before
    finally:
        os.close(fd)
    assert python_reads >= size // segment
    assert c_reads <= size // segment // 2 + 8, (c_reads, python_reads)
    assert bytes(out) == path.read_bytes()


MS = 1_000_000  # ns


@needs_c
def test_a_grown_segment_is_bounded_and_falls_back_after_one_slow_read() -> None:
    # A device fast at first and slow after (a throttle's burst): the one read across the change
    # is at most 2x the caller's segment, and the read after it is the caller's segment again.
    # With 8x, seven 5 MiB/s threads showed no progress for 5.6 s: the lookup deadline gave up.
    next_step = read_loop._readloop.next_step  # (step, segment, got, asked, took_ns)
    mib = 1 << 20
    step = mib
    for _ in range(10):  # fast, full reads
        step = next_step(step, mib, step, step, 1 * MS)
    assert step == 2 * mib
    assert next_step(step, mib, step, step, 150 * MS) == mib  # one slow read: back
    assert next_step(step, mib, step, step, 50 * MS) == step  # neither fast nor slow
    assert next_step(mib, mib, mib // 2, mib, 1 * MS) == mib  # a short read: no growth


@pytest.mark.serial  # a busy-wait must see a count mid-read
@needs_c
def test_the_c_loop_counts_each_segment_while_the_read_goes_on(tmp_path: Path) -> None:
    # The GIL is released for the whole range, so another thread sees the count between the
    # first and the last segment: the progress a restore's lookup deadline watches.
    path = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    size = 256 << 20
    with tempfile.NamedTemporaryFile(dir=path) as f:
        f.truncate(size)  # a sparse file: reads are page-cache copies of zeros, no disk
        fd = os.open(f.name, os.O_RDONLY)
        counter = ReadCounter()
        out = memoryview(mmap.mmap(-1, size))
        seen: set[int] = set()
        reader = threading.Thread(target=read_counted, args=(fd, out, 0, 16384, counter))
        try:
            reader.start()
            while reader.is_alive():
                seen.add(counter.value)
            reader.join()
        finally:
            os.close(fd)
        assert counter.value == size
        between = {v for v in seen if 0 < v < size}
        assert between, "no count was seen while the read went on"
        assert all(v % 16384 == 0 for v in between)
