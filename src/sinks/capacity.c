/* Device capacity on demand: system RAM, the CUDA driver, or a user source. */
#include "sinks/capacity.h"
#include "platform/ml_cuda.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/sysinfo.h>
#endif

/* The coarse monotonic clock (a few ms resolution) is plenty for a 50 ms
 * window and costs a third of CLOCK_MONOTONIC: it keeps a cached read within
 * 2x a no-op method call. */
#ifdef CLOCK_MONOTONIC_COARSE
#define ML_CAP_CLOCK CLOCK_MONOTONIC_COARSE
#else
#define ML_CAP_CLOCK CLOCK_MONOTONIC
#endif

static int64_t now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(ML_CAP_CLOCK, &ts) != 0) {
        return 0;
    }
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void ml_capacity_init(ml_capacity *c)
{
    memset(c, 0, sizeof(*c));
}

void ml_capacity_clear(ml_capacity *c)
{
    for (int i = 0; i < ML_CAP_CACHE; i++) {
        c->cache[i].valid = 0;
        Py_CLEAR(c->cache[i].result);
    }
    Py_CLEAR(c->last_str);
    Py_CLEAR(c->source);
}

int ml_capacity_traverse(ml_capacity *c, visitproc visit, void *arg)
{
    Py_VISIT(c->source);
    return 0;
}

int ml_capacity_set_source(ml_capacity *c, PyObject *fn)
{
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError,
                     "argument 'source': expected a callable(device: str) -> (total_bytes, "
                     "used_bytes) | None, or None, got %.100s",
                     Py_TYPE(fn)->tp_name);
        return -1;
    }
    /* Built-in answers read before the swap are dropped either way. */
    for (int i = 0; i < ML_CAP_CACHE; i++) {
        c->cache[i].valid = 0;
    }
    Py_XSETREF(c->source, fn == Py_None ? NULL : Py_NewRef(fn));
    return 0;
}

/* ---- built-in readers --------------------------------------------------- */

#ifdef __linux__
/* "MemTotal:  16318480 kB" -> bytes; -1 when the field is absent. */
static int64_t meminfo_field(const char *buf, const char *name)
{
    const char *p = strstr(buf, name);
    if (p == NULL) {
        return -1;
    }
    p += strlen(name);
    char *end;
    long long kb = strtoll(p, &end, 10);
    if (end == p || kb < 0) {
        return -1;
    }
    return (int64_t)kb * 1024;
}

static int read_meminfo(int64_t *total, int64_t *avail)
{
    char buf[8192];
    int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, buf + len, sizeof(buf) - 1 - len);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            break;
        }
        len += (size_t)r;
        if (len == sizeof(buf) - 1) {
            break;
        }
    }
    close(fd);
    buf[len] = '\0';
    *total = meminfo_field(buf, "MemTotal:");
    *avail = meminfo_field(buf, "MemAvailable:");
    return *total > 0 && *avail >= 0 ? 0 : -1;
}
#endif

static void read_cpu(ml_capinfo *out)
{
#ifdef __linux__
    int64_t total, avail;
    if (read_meminfo(&total, &avail) == 0) {
        out->known = 1;
        out->total = total;
        out->used = avail < total ? total - avail : 0;
        return;
    }
    /* Kernels without MemAvailable: free + buffers is what sysinfo knows. */
    struct sysinfo si;
    if (sysinfo(&si) == 0 && si.totalram > 0) {
        int64_t unit = si.mem_unit ? (int64_t)si.mem_unit : 1;
        int64_t t = (int64_t)si.totalram * unit;
        int64_t f = ((int64_t)si.freeram + (int64_t)si.bufferram) * unit;
        out->known = 1;
        out->total = t;
        out->used = f < t ? t - f : 0;
    }
#else
    (void)out;
#endif
}

static void read_builtin(ml_dev dev, int may_init, ml_capinfo *out)
{
    out->known = 0;
    out->total = out->used = 0;
    if (ML_DEV_TYPE(dev) == ML_TYPE_CPU) {
        read_cpu(out);
    } else if (ML_DEV_TYPE(dev) == ML_TYPE_CUDA) {
        int index = ML_DEV_INDEX(dev);
        int64_t free_b, total_b;
        if (index >= 0 && (may_init || ml_cuda_primary_active(index) == 1) &&
            ml_cuda_mem_info(index, &free_b, &total_b) == 0 && total_b > 0) {
            out->known = 1;
            out->total = total_b;
            out->used = free_b < total_b ? total_b - free_b : 0;
        }
    }
}

static ml_cap_entry *cache_find(ml_capacity *c, ml_dev dev)
{
    for (int i = 0; i < ML_CAP_CACHE; i++) {
        if (c->cache[i].valid && c->cache[i].dev == dev) {
            return &c->cache[i];
        }
    }
    return NULL;
}

/* A fresh cached entry for dev, reading the built-in source when the entry
 * is missing or stale.  Pure C: no Python code runs here, except dropping
 * an old result tuple of ints and floats. */
static ml_cap_entry *cache_get(ml_capacity *c, ml_dev dev, int64_t now)
{
    ml_cap_entry *e = cache_find(c, dev);
    if (e != NULL && now - e->stamp_ns < ML_CAP_TTL_NS) {
        return e;
    }
    if (e == NULL) {
        e = &c->cache[c->next];
        c->next = (c->next + 1) % ML_CAP_CACHE;
    }
    e->valid = 1;
    e->dev = dev;
    e->stamp_ns = now;
    read_builtin(dev, 1, &e->info);
    Py_CLEAR(e->result);
    return e;
}

/* ---- user source -------------------------------------------------------- */

static int read_count(PyObject *fn, PyObject *r, Py_ssize_t i, const char *what, int64_t *out)
{
    PyObject *v = PyTuple_GET_ITEM(r, i);
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "capacity source %R: %s must be an int, got %.100s", fn, what,
                     Py_TYPE(v)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || n < 0) {
        PyErr_Format(PyExc_ValueError, "capacity source %R: %s must be in [0, 2**63), got %R", fn,
                     what, v);
        return -1;
    }
    *out = n;
    return 0;
}

static int read_user(ml_state *st, PyObject *fn, ml_dev dev, ml_capinfo *out)
{
    PyObject *name = ml_dev_str(st, dev);
    if (name == NULL) {
        return -1;
    }
    PyObject *r = PyObject_CallOneArg(fn, name);
    Py_DECREF(name);
    if (r == NULL) {
        return -1;
    }
    out->known = 0;
    out->total = out->used = 0;
    int rc = 0;
    if (r == Py_None) {
        /* unknown */
    } else if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        PyErr_Format(PyExc_TypeError,
                     "capacity source %R must return (total_bytes, used_bytes) or None, got %R", fn,
                     r);
        rc = -1;
    } else if (read_count(fn, r, 0, "total_bytes", &out->total) < 0 ||
               read_count(fn, r, 1, "used_bytes", &out->used) < 0) {
        rc = -1;
    } else if (out->total == 0 || out->used > out->total) {
        PyErr_Format(PyExc_ValueError,
                     "capacity source %R: expected 0 <= used_bytes <= total_bytes and "
                     "total_bytes > 0, got %R",
                     fn, r);
        rc = -1;
    } else {
        out->known = 1;
    }
    Py_DECREF(r);
    return rc;
}

/* ---- reads -------------------------------------------------------------- */

int ml_capacity_read(ml_state *st, ml_capacity *c, ml_dev dev, int may_init, ml_capinfo *out)
{
    if (c->source != NULL) {
        PyObject *fn = Py_NewRef(c->source); /* the source may replace itself */
        int rc = read_user(st, fn, dev, out);
        Py_DECREF(fn);
        return rc;
    }
    int64_t now = now_ns();
    const ml_cap_entry *e = cache_find(c, dev);
    if (e != NULL && now - e->stamp_ns < ML_CAP_TTL_NS) {
        *out = e->info;
        return 0;
    }
    if (!may_init && ML_DEV_TYPE(dev) == ML_TYPE_CUDA &&
        ml_cuda_primary_active(ML_DEV_INDEX(dev)) != 1) {
        /* Not cached: an explicit device_memory() may still initialise it. */
        out->known = 0;
        out->total = out->used = 0;
        return 0;
    }
    *out = cache_get(c, dev, now)->info;
    return 0;
}

static PyObject *info_tuple(const ml_capinfo *info)
{
    if (!info->known) {
        return Py_BuildValue("(OOO)", Py_None, Py_None, Py_None);
    }
    double pct = (double)info->used * 100.0 / (double)info->total;
    return Py_BuildValue("(LLd)", (long long)info->total, (long long)info->used, pct);
}

PyObject *ml_capacity_query(ml_state *st, ml_capacity *c, ml_dev dev)
{
    if (c->source != NULL) {
        ml_capinfo info;
        if (ml_capacity_read(st, c, dev, 1, &info) < 0) {
            return NULL;
        }
        return info_tuple(&info);
    }
    ml_cap_entry *e = cache_get(c, dev, now_ns());
    if (e->result != NULL) {
        return Py_NewRef(e->result);
    }
    ml_capinfo info = e->info;
    PyObject *t = info_tuple(&info);
    if (t == NULL) {
        return NULL;
    }
    /* Building the tuple may have run GC callbacks that reused the entry. */
    e = cache_find(c, dev);
    if (e != NULL && e->result == NULL && e->info.known == info.known &&
        e->info.total == info.total && e->info.used == info.used) {
        e->result = Py_NewRef(t);
    }
    return t;
}

int ml_capacity_parse_device(ml_state *st, ml_capacity *c, PyObject *arg, ml_dev *out)
{
    if (arg == c->last_str && arg != NULL) {
        *out = c->last_dev;
        return 0;
    }
    ml_selector sel;
    if (arg == NULL || arg == Py_None) {
        PyErr_SetString(PyExc_TypeError,
                        "argument 'device': expected one device such as 'cpu' or 'cuda:0'");
        return -1;
    }
    if (ml_selector_parse(st, arg, &sel) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            /* the queries' message offers None, which names no single device */
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "argument 'device': expected one device, a str or a torch.device "
                         "such as 'cpu' or 'cuda:0', got %.100s",
                         Py_TYPE(arg)->tp_name);
        }
        return -1;
    }
    if (sel.type != ML_TYPE_CPU && sel.index < 0) {
        PyErr_Format(PyExc_ValueError,
                     "argument 'device': %R names no single device; give an index, e.g. '%s:0'",
                     arg, ml_type_name(st, sel.type));
        return -1;
    }
    *out = sel.type == ML_TYPE_CPU ? ML_DEV(ML_TYPE_CPU, -1) : ML_DEV(sel.type, sel.index);
    if (PyUnicode_CheckExact(arg)) {
        Py_XSETREF(c->last_str, Py_NewRef(arg));
        c->last_dev = *out;
    }
    return 0;
}
