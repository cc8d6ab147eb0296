/*
 * kvpersist.l2._walk: the inventory walk of a cache root in C (see inventory.py for the contract).
 *
 * One lstat-class syscall (fstatat with AT_SYMLINK_NOFOLLOW) per entry and no Python object per
 * file: the result is a set of columns (raw native arrays in bytes objects) that inventory.py
 * wraps with numpy.  The pure-Python walker in inventory.py implements the same contract and the
 * tests check that both give identical inventories.
 *
 * Invariants (shared with inventory.py):
 *   - Nothing is opened for reading except directories, opened with O_NOFOLLOW; symlinks are never
 *     followed, a symlink or any non-regular file is class FOREIGN with size 0.
 *   - Each regular file falls in exactly one class, decided by classify_name() below, which must
 *     agree with inventory.classify() byte for byte.
 *   - A directory or file that cannot be read adds one error line and the walk goes on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Index into inventory.CLASSES. */
enum { CLS_LIVE = 0, CLS_TEMP = 1, CLS_QUARANTINE = 2, CLS_UNPARSABLE = 3, CLS_FOREIGN = 4 };

typedef struct {
    char *data;
    size_t len;
    size_t cap;
} Buf;

static int buf_add(Buf *b, const void *src, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        char *p = realloc(b->data, cap);
        if (p == NULL) return -1;
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

static int is_hex(char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static int all_hex(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!is_hex(s[i])) return 0;
    return 1;
}

static int ends_with(const char *s, size_t n, const char *suffix) {
    size_t k = strlen(suffix);
    return n >= k && memcmp(s + n - k, suffix, k) == 0;
}

/*
 * Length of the safe model name of a live cache file name, or 0 if the name does not have the
 * shape <model>_<8 hex>_<hex>_<even hex>[@<salt>] followed by ".kvp" or ".bin" (l2_format.split_stem).
 */
static size_t live_model_len(const char *name, size_t n) {
    size_t stem = n - 4; /* both suffixes have four characters */
    const char *at = memchr(name, '@', stem);
    if (at != NULL) {
        size_t salt_len = stem - (size_t)(at - name) - 1;
        if (salt_len == 0 || memchr(at + 1, '@', salt_len) != NULL) return 0;
        stem = (size_t)(at - name);
    }
    size_t pos[3];
    int found = 0;
    for (size_t i = stem; i > 0 && found < 3; i--)
        if (name[i - 1] == '_') pos[found++] = i - 1;
    if (found < 3) return 0;
    size_t u3 = pos[0], u2 = pos[1], u1 = pos[2];
    size_t hash_len = stem - u3 - 1, group_len = u3 - u2 - 1, rank_len = u2 - u1 - 1;
    if (u1 == 0 || rank_len != 8 || group_len == 0 || hash_len % 2 != 0) return 0;
    if (!all_hex(name + u1 + 1, rank_len) || !all_hex(name + u2 + 1, group_len) ||
        !all_hex(name + u3 + 1, hash_len))
        return 0;
    return u1;
}

/*
 * Whether a name is the atomic writer's temp name of a cache file: <name>.kvp.tmp.<hex>, the mark
 * anchored at the end (layout.is_temp_name).  A live name that merely contains ".tmp." (a salt
 * such as "team.tmp.a") ends in ".kvp" and is not one.
 */
static int is_temp_name(const char *name, size_t n) {
    static const char mark[] = ".kvp.tmp.";
    size_t k = sizeof(mark) - 1;
    size_t tail = 0;
    while (tail < n && strchr("0123456789abcdef", name[n - 1 - tail]) != NULL &&
           name[n - 1 - tail] != '\0')
        tail++;
    if (tail == 0 || n < tail + k + 1) return 0;
    return memcmp(name + n - tail - k, mark, k) == 0;
}

static int classify_name(const char *name, size_t n, int in_quarantine, size_t *model_len) {
    *model_len = 0;
    if (in_quarantine) return CLS_QUARANTINE;
    if (is_temp_name(name, n)) return CLS_TEMP;
    if (ends_with(name, n, ".kvp") || ends_with(name, n, ".bin")) {
        *model_len = live_model_len(name, n);
        return *model_len ? CLS_LIVE : CLS_UNPARSABLE;
    }
    return CLS_FOREIGN;
}

/* ------------------------------------------------------------------ distinct model names */

typedef struct {
    char **keys;
    size_t *lens;
    int32_t *ids;
    size_t cap;   /* power of two */
    size_t count;
    /* The name found last time: consecutive files mostly share a model. */
    const char *last_key;
    size_t last_len;
    int32_t last_id;
} ModelTable;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    return h;
}

static int table_grow(ModelTable *t) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    char **keys = calloc(cap, sizeof(char *));
    size_t *lens = calloc(cap, sizeof(size_t));
    int32_t *ids = calloc(cap, sizeof(int32_t));
    if (!keys || !lens || !ids) {
        free(keys), free(lens), free(ids);
        return -1;
    }
    for (size_t i = 0; i < t->cap; i++) {
        if (t->keys[i] == NULL) continue;
        size_t j = hash_bytes(t->keys[i], t->lens[i]) & (cap - 1);
        while (keys[j] != NULL) j = (j + 1) & (cap - 1);
        keys[j] = t->keys[i], lens[j] = t->lens[i], ids[j] = t->ids[i];
    }
    free(t->keys), free(t->lens), free(t->ids);
    t->keys = keys, t->lens = lens, t->ids = ids, t->cap = cap;
    return 0;
}

/* The id of model name s[0:n], adding it to `order` (a list of str) when new; -1 on error. */
static int32_t model_id(ModelTable *t, const char *s, size_t n, PyObject *order) {
    if (t->last_key != NULL && t->last_len == n && memcmp(t->last_key, s, n) == 0)
        return t->last_id;
    if (2 * (t->count + 1) > t->cap && table_grow(t) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    size_t j = hash_bytes(s, n) & (t->cap - 1);
    while (t->keys[j] != NULL) {
        if (t->lens[j] == n && memcmp(t->keys[j], s, n) == 0) {
            t->last_key = t->keys[j], t->last_len = n, t->last_id = t->ids[j];
            return t->ids[j];
        }
        j = (j + 1) & (t->cap - 1);
    }
    char *copy = malloc(n ? n : 1);
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, s, n);
    PyObject *text = PyUnicode_DecodeFSDefaultAndSize(s, (Py_ssize_t)n);
    if (text == NULL || PyList_Append(order, text) < 0) {
        Py_XDECREF(text);
        free(copy);
        return -1;
    }
    Py_DECREF(text);
    t->keys[j] = copy, t->lens[j] = n, t->ids[j] = (int32_t)t->count;
    t->last_key = copy, t->last_len = n, t->last_id = (int32_t)t->count;
    return (int32_t)t->count++;
}

static void table_free(ModelTable *t) {
    for (size_t i = 0; i < t->cap; i++) free(t->keys[i]);
    free(t->keys), free(t->lens), free(t->ids);
}

/* ------------------------------------------------------------------ the walk */

/*
 * Directories are read in the calling thread; the entries they hold are collected in a batch and
 * their fstatat calls, the bulk of the work, run on `threads` threads without the GIL.  The rows
 * are then added in readdir order, in the calling thread.  A batch is flushed when it holds
 * BATCH_ENTRIES entries (also in the middle of a large directory) or BATCH_DIRS open directories.
 */
#define BATCH_ENTRIES 16384
#define BATCH_DIRS 256
#define PARALLEL_MIN 1024 /* fewer entries than this are stat'ed in the calling thread */

typedef struct {
    char *path;
    int in_quarantine;
} Pending;

typedef struct {
    DIR *d;
    char *path;
    int32_t dir;
    int in_quarantine;
} BatchDir;

typedef struct {
    uint32_t bdir;      /* index into Batch.dirs */
    unsigned char type; /* d_type */
    size_t name_off;    /* into Batch.names, NUL-terminated */
    size_t name_len;
    int err;            /* errno of fstatat, 0 if it succeeded */
    mode_t mode;
    int64_t size;
    int64_t mtime_ns;
} Entry;

typedef struct {
    Buf dirs;    /* of BatchDir */
    Buf entries; /* of Entry */
    Buf names;
} Batch;

typedef struct {
    Buf names, name_end, cls, size, mtime_ns, dir_idx, model_idx;
    Buf stack; /* of Pending */
    Batch batch;
    ModelTable models;
    PyObject *dirs, *model_names, *errors, *progress;
    long long regular;
    int threads;
} Walk;

static int add_error(Walk *w, const char *what, const char *path, int err) {
    PyObject *p = PyUnicode_DecodeFSDefault(path);
    if (p == NULL) return -1;
    PyObject *line = PyUnicode_FromFormat("%s %U: %s", what, p, strerror(err));
    Py_DECREF(p);
    if (line == NULL) return -1;
    int rc = PyList_Append(w->errors, line);
    Py_DECREF(line);
    return rc;
}

static char *join_path(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    int slash = !(a > 0 && dir[a - 1] == '/');
    char *out = malloc(a + slash + b + 1);
    if (out == NULL) return NULL;
    memcpy(out, dir, a);
    if (slash) out[a] = '/';
    memcpy(out + a + slash, name, b + 1);
    return out;
}

static int push_dir(Walk *w, char *path, int in_quarantine) {
    Pending p = {path, in_quarantine};
    if (path == NULL || buf_add(&w->stack, &p, sizeof p) < 0) {
        free(path);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int add_file(Walk *w, const char *name, size_t n, int cls, int64_t size, int64_t mtime_ns,
                    int32_t dir, int32_t model) {
    uint8_t c = (uint8_t)cls;
    int64_t end = (int64_t)(w->names.len + n);
    if (buf_add(&w->names, name, n) < 0 || buf_add(&w->name_end, &end, sizeof end) < 0 ||
        buf_add(&w->cls, &c, 1) < 0 || buf_add(&w->size, &size, sizeof size) < 0 ||
        buf_add(&w->mtime_ns, &mtime_ns, sizeof mtime_ns) < 0 ||
        buf_add(&w->dir_idx, &dir, sizeof dir) < 0 || buf_add(&w->model_idx, &model, sizeof model) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

typedef struct {
    Batch *b;
    size_t begin, end;
} Slice;

static void *stat_slice(void *arg) {
    Slice *s = arg;
    Entry *entries = (Entry *)s->b->entries.data;
    BatchDir *dirs = (BatchDir *)s->b->dirs.data;
    for (size_t i = s->begin; i < s->end; i++) {
        Entry *e = &entries[i];
        struct stat st;
        if (fstatat(dirfd(dirs[e->bdir].d), s->b->names.data + e->name_off, &st,
                    AT_SYMLINK_NOFOLLOW) < 0) {
            e->err = errno;
            continue;
        }
        e->err = 0;
        e->mode = st.st_mode;
        e->size = (int64_t)st.st_size;
        e->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    }
    return NULL;
}

/* fstatat every entry of the batch, on up to w->threads threads, without the GIL. */
static void stat_batch(Walk *w) {
    Batch *b = &w->batch;
    size_t n = b->entries.len / sizeof(Entry);
    int threads = n < PARALLEL_MIN ? 1 : w->threads;
    pthread_t ids[64];
    Slice slices[64];
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++) {
        slices[t] = (Slice){b, n * (size_t)t / (size_t)threads, n * (size_t)(t + 1) / (size_t)threads};
        if (pthread_create(&ids[t], NULL, stat_slice, &slices[t]) != 0) break;
        started = t;
    }
    /* The calling thread takes the first slice and every slice no thread could be started for. */
    slices[0] = (Slice){b, 0, n * 1 / (size_t)threads};
    stat_slice(&slices[0]);
    if (started + 1 < threads) {
        Slice rest = {b, n * (size_t)(started + 1) / (size_t)threads, n};
        stat_slice(&rest);
    }
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
    Py_END_ALLOW_THREADS
}

/*
 * Stat and record every entry of the batch, then release its directories except the last one
 * when `keep_last` (a directory still being read).  -1 with a Python error set.
 */
static int flush_batch(Walk *w, int keep_last) {
    Batch *b = &w->batch;
    size_t n = b->entries.len / sizeof(Entry);
    BatchDir *dirs = (BatchDir *)b->dirs.data;
    size_t ndirs = b->dirs.len / sizeof(BatchDir);
    int rc = 0;
    if (n > 0) stat_batch(w);
    for (size_t i = 0; i < n && rc == 0; i++) {
        Entry *e = &((Entry *)b->entries.data)[i];
        BatchDir *bd = &dirs[e->bdir];
        const char *name = b->names.data + e->name_off;
        if (e->err != 0) {
            char *full = join_path(bd->path, name);
            rc = full ? add_error(w, "cannot stat", full, e->err) : (PyErr_NoMemory(), -1);
            free(full);
            continue;
        }
        if (S_ISDIR(e->mode)) { /* d_type was DT_UNKNOWN */
            rc = push_dir(w, join_path(bd->path, name), bd->in_quarantine);
            continue;
        }
        if (!S_ISREG(e->mode)) {
            rc = add_file(w, name, e->name_len, CLS_FOREIGN, 0, e->mtime_ns, bd->dir, -1);
            continue;
        }
        size_t model_len;
        int cls = classify_name(name, e->name_len, bd->in_quarantine, &model_len);
        int32_t model = -1;
        if (cls == CLS_LIVE && (model = model_id(&w->models, name, model_len, w->model_names)) < 0) {
            rc = -1;
            break;
        }
        if ((rc = add_file(w, name, e->name_len, cls, e->size, e->mtime_ns, bd->dir, model)) < 0) break;
        if (++w->regular % 10000 == 0) {
            if (PyErr_CheckSignals() < 0) {
                rc = -1;
                break;
            }
            if (w->progress != Py_None) {
                PyObject *r = PyObject_CallFunction(w->progress, "L", w->regular);
                if (r == NULL) rc = -1;
                Py_XDECREF(r);
            }
        }
    }
    b->entries.len = 0;
    b->names.len = 0;
    size_t keep = keep_last && ndirs > 0 ? 1 : 0;
    for (size_t i = 0; i + keep < ndirs; i++) {
        closedir(dirs[i].d);
        free(dirs[i].path);
    }
    if (keep) {
        dirs[0] = dirs[ndirs - 1];
        b->dirs.len = sizeof(BatchDir);
    } else {
        b->dirs.len = 0;
    }
    return rc;
}

/* Read one directory into the batch; subdirectories go on the stack. -1 with a Python error. */
static int read_dir(Walk *w, char *path, int in_quarantine, int is_root) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    DIR *d = fd < 0 ? NULL : fdopendir(fd);
    if (d == NULL) {
        int err = errno;
        if (fd >= 0) close(fd);
        int rc = add_error(w, "cannot read directory", path, err);
        free(path);
        return rc;
    }
    PyObject *dir_text = PyUnicode_DecodeFSDefault(path);
    if (dir_text == NULL || PyList_Append(w->dirs, dir_text) < 0) {
        Py_XDECREF(dir_text);
        closedir(d);
        free(path);
        return -1;
    }
    Py_DECREF(dir_text);
    BatchDir bd = {d, path, (int32_t)(PyList_GET_SIZE(w->dirs) - 1), in_quarantine};
    if (buf_add(&w->batch.dirs, &bd, sizeof bd) < 0) {
        closedir(d);
        free(path);
        PyErr_NoMemory();
        return -1;
    }
    for (;;) {
        errno = 0;
        struct dirent *e = readdir(d);
        if (e == NULL) {
            if (errno != 0 && add_error(w, "cannot read directory", path, errno) < 0) return -1;
            break;
        }
        const char *name = e->d_name;
        if (name[0] == '.' && (name[1] == 0 || (name[1] == '.' && name[2] == 0))) continue;
        if (e->d_type == DT_DIR) {
            int q = in_quarantine || (is_root && strcmp(name, "quarantine") == 0);
            if (push_dir(w, join_path(path, name), q) < 0) return -1;
            continue;
        }
        size_t n = strlen(name);
        Entry entry = {(uint32_t)(w->batch.dirs.len / sizeof(BatchDir) - 1), e->d_type,
                       w->batch.names.len, n, 0, 0, 0, 0};
        if (buf_add(&w->batch.names, name, n + 1) < 0 ||
            buf_add(&w->batch.entries, &entry, sizeof entry) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        if (w->batch.entries.len / sizeof(Entry) >= BATCH_ENTRIES && flush_batch(w, 1) < 0) return -1;
    }
    if (w->batch.dirs.len / sizeof(BatchDir) >= BATCH_DIRS) return flush_batch(w, 0);
    return 0;
}

static PyObject *bytes_of(Buf *b) {
    return PyBytes_FromStringAndSize(b->data ? b->data : "", (Py_ssize_t)b->len);
}

PyDoc_STRVAR(scan_doc,
"scan(root: str, progress: Callable[[int], None] | None = None, threads: int = 0) -> tuple\n\n"
"Walk ``root`` (never following symlinks) and return the columns of its inventory:\n"
"(dirs, model_names, names, name_end, cls, size, mtime_ns, dir_idx, model_idx, errors).\n"
"``names`` is the concatenation of all file names (file system bytes) and ``name_end`` the\n"
"int64 end offset of each; ``cls`` is uint8, ``size``/``mtime_ns`` int64, ``dir_idx``/\n"
"``model_idx`` int32 (model -1 unless live), all in native byte order.  ``model_names`` are\n"
"the distinct safe model names of live files, as str.  ``threads`` (0: one per CPU, at most\n"
"8) run the stat calls; the result does not depend on it.");

static PyObject *scan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *root_obj, *progress = Py_None;
    int threads = 0;
    if (!PyArg_ParseTuple(args, "O&|Oi:scan", PyUnicode_FSConverter, &root_obj, &progress, &threads))
        return NULL;
    if (threads <= 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        threads = cpus < 1 ? 1 : cpus > 8 ? 8 : (int)cpus;
    }
    Walk w;
    memset(&w, 0, sizeof w);
    w.threads = threads > 64 ? 64 : threads;
    w.progress = progress;
    w.dirs = PyList_New(0);
    w.model_names = PyList_New(0);
    w.errors = PyList_New(0);
    PyObject *result = NULL;
    if (w.dirs == NULL || w.model_names == NULL || w.errors == NULL) goto done;
    char *root = strdup(PyBytes_AS_STRING(root_obj));
    if (root == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_dir(&w, root, 0, 1) < 0) goto done;
    for (;;) {
        if (w.stack.len == 0) {
            if (flush_batch(&w, 0) < 0) goto done;
            if (w.stack.len == 0) break; /* the flush found no directory behind a DT_UNKNOWN */
        }
        w.stack.len -= sizeof(Pending);
        Pending p;
        memcpy(&p, w.stack.data + w.stack.len, sizeof p);
        if (read_dir(&w, p.path, p.in_quarantine, 0) < 0) goto done;
    }
    result = Py_BuildValue("(OONNNNNNNO)", w.dirs, w.model_names, bytes_of(&w.names),
                           bytes_of(&w.name_end), bytes_of(&w.cls), bytes_of(&w.size),
                           bytes_of(&w.mtime_ns), bytes_of(&w.dir_idx), bytes_of(&w.model_idx),
                           w.errors);
done:
    while (w.stack.len > 0) {
        w.stack.len -= sizeof(Pending);
        Pending p;
        memcpy(&p, w.stack.data + w.stack.len, sizeof p);
        free(p.path);
    }
    for (size_t i = 0; i < w.batch.dirs.len / sizeof(BatchDir); i++) {
        BatchDir *bd = &((BatchDir *)w.batch.dirs.data)[i];
        closedir(bd->d);
        free(bd->path);
    }
    Buf *bufs[] = {&w.names,   &w.name_end,     &w.cls,          &w.size,         &w.mtime_ns,
                   &w.dir_idx, &w.model_idx,    &w.stack,        &w.batch.dirs,   &w.batch.entries,
                   &w.batch.names};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]->data);
    table_free(&w.models);
    Py_XDECREF(w.dirs);
    Py_XDECREF(w.model_names);
    Py_XDECREF(w.errors);
    Py_DECREF(root_obj);
    return result;
}

/* ------------------------------------------------------------------ keys of live rows */

static int hex_value(char c) {
    return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
}

PyDoc_STRVAR(live_keys_doc,
"live_keys(names, name_end, model_idx, rows, model_names, key_type) -> list\n\n"
"The object keys of live ``rows`` (int64 row numbers, in bytes) of an inventory's columns\n"
"(``names``, ``name_end`` int64, ``model_idx`` int32): a list of\n"
"``key_type(model_names[model_idx[row]], rank, group, chunk_hash, salt)``, made the way\n"
"``tuple.__new__`` makes a NamedTuple.  A row whose name is not a live cache-file name raises\n"
"ValueError.  Call it on slices of a large row set: it holds the GIL while it runs.");

PyDoc_STRVAR(live_index_doc,
"live_index(into, names, name_end, model_idx, rows, sizes, model_names, key_type) -> None\n\n"
"As ``live_keys``, but sets ``into[key] = size`` (``sizes`` int64, one per row, in bytes)\n"
"in row order instead of returning a list: the index of a walk without an intermediate list\n"
"(a key given twice keeps its last size).");

/* Fill tuple slot `i` of `t` with `v`, which is a new reference or NULL (then -1). */
static int set_slot(PyObject *t, Py_ssize_t i, PyObject *v) {
    if (v == NULL) return -1;
    PyTuple_SET_ITEM(t, i, v);
    return 0;
}

static PyObject *hex_long(const char *s, size_t n) {
    if (n <= 15) {
        unsigned long long v = 0;
        for (size_t k = 0; k < n; k++) v = v * 16 + (unsigned long long)hex_value(s[k]);
        return PyLong_FromUnsignedLongLong(v);
    }
    char *copy = malloc(n + 1);
    if (copy == NULL) return PyErr_NoMemory();
    memcpy(copy, s, n);
    copy[n] = 0;
    PyObject *v = PyLong_FromString(copy, NULL, 16);
    free(copy);
    return v;
}

/* What one call shares between its keys: the columns, and the last rank made (a tree holds
   few ranks, so most keys share one int object instead of allocating their own). */
typedef struct {
    Py_buffer names, ends, models, rows;
    PyObject *model_names, *empty, *rank, *key_type;
    char rank_hex[8];
    unsigned char *hash;
} KeyMaker;

static void maker_release(KeyMaker *mk) {
    free(mk->hash);
    Py_XDECREF(mk->empty);
    Py_XDECREF(mk->rank);
    PyBuffer_Release(&mk->names);
    PyBuffer_Release(&mk->ends);
    PyBuffer_Release(&mk->models);
    PyBuffer_Release(&mk->rows);
}

static int maker_check(KeyMaker *mk) {
    if (!PyType_IsSubtype((PyTypeObject *)mk->key_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "key_type must be a tuple subclass (a NamedTuple)");
        return -1;
    }
    mk->empty = PyUnicode_FromStringAndSize("", 0);
    return mk->empty == NULL ? -1 : 0;
}

/* The key of row number `i` of `rows` (a new reference), or NULL with an exception set. */
static PyObject *make_key(KeyMaker *mk, Py_ssize_t i) {
    const int64_t *row = mk->rows.buf, *end = mk->ends.buf;
    const int32_t *model = mk->models.buf;
    const char *blob = mk->names.buf;
    Py_ssize_t nnames = mk->ends.len / (Py_ssize_t)sizeof(int64_t);
    int64_t r = row[i];
    if (r < 0 || r >= nnames || (Py_ssize_t)(mk->models.len / sizeof(int32_t)) <= r) {
        PyErr_SetString(PyExc_IndexError, "row out of range");
        return NULL;
    }
    size_t start = r ? (size_t)end[r - 1] : 0;
    const char *name = blob + start;
    size_t len = (size_t)end[r] - start;
    size_t model_len = len >= 4 ? live_model_len(name, len) : 0;
    int32_t m = model[r];
    if (model_len == 0 || m < 0 || m >= PyList_GET_SIZE(mk->model_names)) {
        PyErr_Format(PyExc_ValueError, "row %lld is not a live cache file", (long long)r);
        return NULL;
    }
    size_t stem = len - 4;
    const char *at = memchr(name, '@', stem);
    size_t head = at ? (size_t)(at - name) : stem;
    size_t rank_at = model_len + 1, group_at = rank_at + 9;
    const char *u3 = memchr(name + group_at, '_', head - group_at);
    size_t group_len = (size_t)(u3 - (name + group_at));
    size_t hash_at = (size_t)(u3 - name) + 1, hash_len = head - hash_at;
    unsigned char *grown = realloc(mk->hash, hash_len / 2 + 1);
    if (grown == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    mk->hash = grown;
    for (size_t k = 0; k < hash_len; k += 2)
        mk->hash[k / 2] = (unsigned char)(hex_value(name[hash_at + k]) * 16 + hex_value(name[hash_at + k + 1]));
    if (mk->rank == NULL || memcmp(mk->rank_hex, name + rank_at, 8) != 0) {
        PyObject *rank = hex_long(name + rank_at, 8);
        if (rank == NULL) return NULL;
        Py_XSETREF(mk->rank, rank);
        memcpy(mk->rank_hex, name + rank_at, 8);
    }
    PyTypeObject *key_type = (PyTypeObject *)mk->key_type;
    PyObject *key = key_type->tp_alloc(key_type, 5);
    if (key == NULL) return NULL;
    PyObject *model_name = PyList_GET_ITEM(mk->model_names, m);
    Py_INCREF(model_name);
    PyTuple_SET_ITEM(key, 0, model_name);
    Py_INCREF(mk->rank);
    PyTuple_SET_ITEM(key, 1, mk->rank);
    if (set_slot(key, 2, hex_long(name + group_at, group_len)) < 0 ||
        set_slot(key, 3, PyBytes_FromStringAndSize((const char *)mk->hash, (Py_ssize_t)(hash_len / 2))) < 0) {
        Py_DECREF(key);  /* a tuple's unset slots are NULL, which its dealloc skips */
        return NULL;
    }
    PyObject *salt = mk->empty;
    if (at != NULL) {
        salt = PyUnicode_DecodeFSDefaultAndSize(at + 1, (Py_ssize_t)(stem - head - 1));
    } else {
        Py_INCREF(salt);
    }
    if (set_slot(key, 4, salt) < 0) {
        Py_DECREF(key);
        return NULL;
    }
    /* Every slot is a str, an int or bytes, and the type never refers to its instances, so a
       key is never part of a reference cycle.  The collector untracks such tuples itself, but
       only exact tuples, never a NamedTuple: untracked here, a million keys are not traversed
       by every full collection for as long as the server runs. */
    PyObject_GC_UnTrack(key);
    return key;
}

static PyObject *live_keys(PyObject *self, PyObject *args) {
    (void)self;
    KeyMaker mk = {0};
    if (!PyArg_ParseTuple(args, "y*y*y*y*O!O!:live_keys", &mk.names, &mk.ends, &mk.models,
                          &mk.rows, &PyList_Type, &mk.model_names, &PyType_Type, &mk.key_type))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = mk.rows.len / (Py_ssize_t)sizeof(int64_t);
    if (maker_check(&mk) < 0 || (out = PyList_New(n)) == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = make_key(&mk, i);
        if (key == NULL) goto fail;
        PyList_SET_ITEM(out, i, key);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    maker_release(&mk);
    return out;
}

static PyObject *live_index(PyObject *self, PyObject *args) {
    (void)self;
    KeyMaker mk = {0};
    Py_buffer sizes = {0};
    PyObject *into;
    if (!PyArg_ParseTuple(args, "O!y*y*y*y*y*O!O!:live_index", &PyDict_Type, &into, &mk.names,
                          &mk.ends, &mk.models, &mk.rows, &sizes, &PyList_Type, &mk.model_names,
                          &PyType_Type, &mk.key_type))
        return NULL;
    PyObject *result = NULL, *value = NULL;
    Py_ssize_t n = mk.rows.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *size = sizes.buf;
    if (sizes.len != mk.rows.len) {
        PyErr_SetString(PyExc_ValueError, "sizes and rows differ in length");
        goto done;
    }
    if (maker_check(&mk) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = make_key(&mk, i);
        if (key == NULL) goto done;
        if (value == NULL || i == 0 || size[i] != size[i - 1]) {  /* sizes repeat: share */
            Py_XSETREF(value, PyLong_FromLongLong(size[i]));
        }
        int failed = value == NULL || PyDict_SetItem(into, key, value) < 0;
        Py_DECREF(key);
        if (failed) goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(value);
    PyBuffer_Release(&sizes);
    maker_release(&mk);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {"live_keys", live_keys, METH_VARARGS, live_keys_doc},
    {"live_index", live_index, METH_VARARGS, live_index_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpersist.l2._walk",
    "The inventory walk of a cache root in C (see kvpersist.l2.inventory).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__walk(void) { return PyModule_Create(&module); }
