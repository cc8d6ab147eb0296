/*
 * kvpersist.l2._readloop: a file range read in segments with the GIL released for the whole
 * range, each segment's byte count added to a shared progress cell, and (read_hashed) each
 * segment hashed with XXH3-128 right after its read, while it is in the CPU cache (see
 * read_loop.py for the contract; its pure-Python loops implement the same one and the tests
 * compare both).
 *
 * Why: a restore reads thousands of files on many threads inside the LMCache server, whose own
 * Python threads want the GIL too.  A Python loop over 1 MiB segments takes the GIL back after
 * every segment and waits for it behind whatever holds it (up to the interpreter's switch
 * interval); one release per file removes those waits, while the per-segment progress the
 * lookup deadline watches stays as fine as before.
 *
 * Invariants:
 *   - read_counted(fd, out, offset, segment, cell) fills `out` from `offset` until it is full or
 *     the file ends, `segment` bytes per pread to begin with, up to 8x that while each read
 *     takes under 20 ms (see read_loop); it returns the bytes read (short only at end of file)
 *     and raises OSError for any other failure.
 *   - After each successful pread its byte count is added to the int64 at the start of `cell`
 *     with one atomic add, so any thread may read the cell at any time and concurrent loops
 *     never lose a count.  Bytes read before a failure are counted too (progress, not success).
 *   - EINTR is retried; nothing else is.
 *   - read_hashed(fd, out, offset, segment, cell, bounce) reads the same way and returns
 *     (bytes read, XXH3-128 digest of exactly those bytes in canonical big-endian form, seconds
 *     spent hashing).  With a bounce buffer (an O_DIRECT fd) the whole pages of a page-aligned
 *     `out` are read straight into it and everything else (a tail shorter than a page, or all of
 *     an unaligned `out`) through `bounce`, whole pages at a time, then copied; pages past the
 *     end of the file are never read (each pread's whole return is counted).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include "_vendor/xxhash/xxhash.h"

#if defined(__x86_64__)
/* xxHash's runtime dispatch (_vendor/xxhash/xxh_x86dispatch.c, built beside this file on x86-64):
 * the AVX2 or AVX-512 kernel where the CPU has it, SSE2 otherwise (the same digest on all). */
XXH_errorcode XXH3_128bits_update_dispatch(XXH3_state_t *state, const void *input, size_t len);
#define hash_update XXH3_128bits_update_dispatch
#else
#define hash_update XXH3_128bits_update
#endif

#define PAGE 4096

static void hash_piece(XXH3_state_t *state, const char *p, Py_ssize_t n, double *hash_s) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    hash_update(state, p, (size_t)n);
    clock_gettime(CLOCK_MONOTONIC, &b);
    *hash_s += (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
}

/* Segments grow while reads are fast: a fast device gets fewer, larger requests (a VM disk or
 * an NVMe drive pays per request), a slow one keeps the caller's segment.  A read's bytes are
 * counted only when it returns, so the size of a read bounds how long a restore can look
 * stalled: on a device slow from the start nothing grows (counted as often as with fixed
 * segments); on one fast at first and slow after (a throttle's burst, a cloud disk's burst
 * credits, a file's first pages cached), each reading thread's one read across the change is at
 * most MAX_GROWTH times the caller's segment, after which the segment is the caller's again.
 * MAX_GROWTH 8 let 7 threads each start a 4 MiB read at a 5 MiB/s device's burst and show no
 * progress for 5.6 s, past the lookup deadline's 5 s (test_long_restore_e2e).
 * GROW_BELOW_NS: a full read this quick doubles the next; SHRINK_ABOVE_NS: a read this slow
 * puts the segment back to the caller's. */
#define GROW_BELOW_NS 20000000LL
#define SHRINK_ABOVE_NS 100000000LL
#define MAX_GROWTH 2

/* The next read's size after a read of `got` of `asked` bytes that took `took` ns. */
static Py_ssize_t next_step(Py_ssize_t step, Py_ssize_t segment, Py_ssize_t got,
                            Py_ssize_t asked, long long took) {
    if (took > SHRINK_ABOVE_NS) return segment;
    if (got == asked && took < GROW_BELOW_NS && step < segment * MAX_GROWTH) return step * 2;
    return step;
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* One pread loop over [dst, dst+want) at `offset`, starting at `segment` bytes per call and
 * adapting as above, counting each call; hashes each piece into `state` when it is not NULL.
 * Returns bytes read or -errno. */
static Py_ssize_t read_loop(int fd, char *dst, Py_ssize_t want, long long offset,
                            Py_ssize_t segment, int64_t *counter, XXH3_state_t *state,
                            double *hash_s) {
    Py_ssize_t done = 0, step = segment;
    while (done < want) {
        Py_ssize_t n = want - done < step ? want - done : step;
        long long began = now_ns();
        ssize_t got = pread(fd, dst + done, (size_t)n, (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) break;
        long long took = now_ns() - began;
        __atomic_add_fetch(counter, (int64_t)got, __ATOMIC_RELAXED);
        if (state != NULL) hash_piece(state, dst + done, got, hash_s);
        done += got;
        step = next_step(step, segment, got, n, took);
    }
    return done;
}

static int check_cell(Py_buffer *cell) {
    return cell->len >= (Py_ssize_t)sizeof(int64_t)
           && ((uintptr_t)cell->buf % sizeof(int64_t)) == 0;
}

static PyObject *read_counted(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer out, cell;
    long long offset;
    Py_ssize_t segment;
    if (!PyArg_ParseTuple(args, "iw*Lnw*", &fd, &out, &offset, &segment, &cell)) return NULL;
    if (segment <= 0 || offset < 0 || !check_cell(&cell)) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&cell);
        PyErr_SetString(PyExc_ValueError,
                        "read_counted: segment > 0, offset >= 0 and an aligned 8-byte cell");
        return NULL;
    }
    Py_ssize_t done;
    Py_BEGIN_ALLOW_THREADS
    done = read_loop(fd, (char *)out.buf, out.len, offset, segment, (int64_t *)cell.buf, NULL,
                     NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&cell);
    if (done < 0) {
        errno = (int)-done;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(done);
}

/* The O_DIRECT part of read_hashed: aligned head straight in, the rest through the bounce. */
static Py_ssize_t read_direct(int fd, char *dst, Py_ssize_t want, long long offset,
                              Py_ssize_t segment, int64_t *counter, XXH3_state_t *state,
                              double *hash_s, char *bounce, Py_ssize_t bounce_len) {
    Py_ssize_t head = ((uintptr_t)dst % PAGE) == 0 ? want - want % PAGE : 0, done = 0;
    if (head > 0) {
        done = read_loop(fd, dst, head, offset, segment, counter, state, hash_s);
        if (done < head) return done;
    }
    while (done < want) {
        Py_ssize_t rest = want - done < bounce_len ? want - done : bounce_len;
        Py_ssize_t pages = (rest + PAGE - 1) / PAGE * PAGE;
        Py_ssize_t got = read_loop(fd, bounce, pages, offset + done, segment, counter, NULL,
                                   NULL);
        if (got < 0) return got;
        Py_ssize_t part = got < rest ? got : rest;  /* only `out`'s bytes are hashed */
        hash_piece(state, bounce, part, hash_s);
        memcpy(dst + done, bounce, (size_t)part);
        done += part;
        if (part < rest) break;
    }
    return done;
}

static PyObject *read_hashed(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer out, cell, bounce = {0};
    PyObject *bounce_obj;
    long long offset;
    Py_ssize_t segment;
    if (!PyArg_ParseTuple(args, "iw*Lnw*O", &fd, &out, &offset, &segment, &cell, &bounce_obj))
        return NULL;
    int direct = bounce_obj != Py_None;
    if (direct && PyObject_GetBuffer(bounce_obj, &bounce, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&cell);
        return NULL;
    }
    if (segment <= 0 || offset < 0 || !check_cell(&cell)
        || (direct && (bounce.len < PAGE || bounce.len % PAGE != 0
                       || ((uintptr_t)bounce.buf % PAGE) != 0))) {
        PyBuffer_Release(&out);
        PyBuffer_Release(&cell);
        if (direct) PyBuffer_Release(&bounce);
        PyErr_SetString(PyExc_ValueError,
                        "read_hashed: segment > 0, offset >= 0, an aligned 8-byte cell and a "
                        "page-aligned bounce buffer of whole pages");
        return NULL;
    }
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    double hash_s = 0.0;
    Py_ssize_t done;
    Py_BEGIN_ALLOW_THREADS
    if (direct)
        done = read_direct(fd, (char *)out.buf, out.len, offset, segment, (int64_t *)cell.buf,
                           &state, &hash_s, (char *)bounce.buf, bounce.len);
    else
        done = read_loop(fd, (char *)out.buf, out.len, offset, segment, (int64_t *)cell.buf,
                         &state, &hash_s);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&cell);
    if (direct) PyBuffer_Release(&bounce);
    if (done < 0) {
        errno = (int)-done;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(&state));
    return Py_BuildValue("ny#d", done, (const char *)canon.digest, (Py_ssize_t)sizeof(canon),
                         hash_s);
}

static PyObject *py_next_step(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t step, segment, got, asked;
    long long took;
    if (!PyArg_ParseTuple(args, "nnnnL", &step, &segment, &got, &asked, &took)) return NULL;
    return PyLong_FromSsize_t(next_step(step, segment, got, asked, took));
}

static PyMethodDef methods[] = {
    {"next_step", py_next_step, METH_VARARGS,
     "next_step(step, segment, got, asked, took_ns) -> the next read's size (the loop's rule)."},
    {"read_counted", read_counted, METH_VARARGS,
     "read_counted(fd, out, offset, segment, cell) -> bytes read; see read_loop.py."},
    {"read_hashed", read_hashed, METH_VARARGS,
     "read_hashed(fd, out, offset, segment, cell, bounce) -> (bytes read, digest, hash "
     "seconds); see read_loop.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_readloop",
    "File ranges read in segments with the GIL released, progress counted, XXH3-128 hashed.",
    -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__readloop(void) { return PyModule_Create(&module); }
