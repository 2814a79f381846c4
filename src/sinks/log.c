/* The DEBUG log sink and the [auto_gc] record, through memlord/_log.py. */
#include "sinks/log.h"
#include "core/book.h"

#include <stdlib.h>

#if ML_DICT_WATCHERS
/* Every change of a dict the DEBUG log watches (os.environ's data, the
 * logger's level cache) bumps this number; CPython calls the watcher before
 * the change, under the GIL, and the watcher never fails.  One number for
 * every watched dict: a change of either only makes the next event ask
 * again. */
static uint64_t watched_epoch = 1;

static int log_dict_changed(PyDict_WatchEvent Py_UNUSED(event), PyObject *Py_UNUSED(dict),
                            PyObject *Py_UNUSED(key), PyObject *Py_UNUSED(new_value))
{
    watched_epoch++;
    return 0;
}

/* Watch both dicts; without a free watcher (CPython has eight per
 * interpreter) or a dict to watch, every event asks, as before. */
static void log_watch(ml_state *st)
{
    if (st->env_data == NULL || st->log_cache == NULL) {
        return;
    }
    if (st->log_watcher == 0) {
        int id = PyDict_AddWatcher(log_dict_changed);
        if (id < 0) {
            PyErr_Clear();
            return;
        }
        st->log_watcher = id + 1;
    }
    int id = st->log_watcher - 1;
    if (PyDict_Watch(id, st->env_data) < 0) {
        PyErr_Clear();
        return;
    }
    if (PyDict_Watch(id, st->log_cache) < 0) {
        PyErr_Clear();
        (void)PyDict_Unwatch(id, st->env_data);
        PyErr_Clear();
        return;
    }
    st->log_watched = 1;
    watched_epoch++; /* answers kept before the dicts were watched do not hold */
}

static void log_unwatch(ml_state *st)
{
    if (st->log_watched) {
        st->log_watched = 0;
        /* each on its own: a failure to unwatch one still unwatches the other */
        if (PyDict_Unwatch(st->log_watcher - 1, st->env_data) < 0) {
            PyErr_Clear();
        }
        if (PyDict_Unwatch(st->log_watcher - 1, st->log_cache) < 0) {
            PyErr_Clear();
        }
    }
}
#endif

int ml_log_configure(ml_state *st, PyObject *logger, PyObject *env_changed, PyObject *on_event,
                     PyObject *on_gc)
{
    PyObject *cache = PyObject_GetAttrString(logger, "_cache");
    if (cache == NULL) {
        PyErr_Clear(); /* another logging implementation: ask the logger every time */
    } else if (!PyDict_CheckExact(cache)) {
        Py_CLEAR(cache);
    }
    PyObject *env_data = NULL, *key = NULL;
    PyObject *environ = ml_import_attr("os", "environ");
    if (environ == NULL) {
        Py_XDECREF(cache);
        return -1;
    }
    env_data = PyObject_GetAttrString(environ, "_data");
    Py_DECREF(environ);
    if (env_data == NULL || !PyDict_CheckExact(env_data)) {
        PyErr_Clear();
        Py_CLEAR(env_data); /* not CPython's os.environ: getenv then */
    } else {
        /* os.environ keeps bytes keys on POSIX, str keys on Windows */
        PyObject *some_key = NULL, *value;
        Py_ssize_t pos = 0;
        int bytes_keys = !PyDict_Next(env_data, &pos, &some_key, &value) || PyBytes_Check(some_key);
        key = bytes_keys ? PyBytes_FromString("DEBUG") : PyUnicode_FromString("DEBUG");
        if (key == NULL || PyObject_Hash(key) == -1) {
            Py_XDECREF(cache);
            Py_XDECREF(key);
            Py_DECREF(env_data);
            return -1;
        }
    }
    ml_log_clear(st);
    st->log_logger = Py_NewRef(logger);
    st->log_cache = cache;
    st->log_env_changed = Py_NewRef(env_changed);
    st->log_on_event = Py_NewRef(on_event);
    st->log_on_gc = Py_NewRef(on_gc);
    st->env_data = env_data;
    st->debug_key = key;
    st->debug_seen = NULL;
    st->log_answer_valid[0] = st->log_answer_valid[1] = 0;
#if ML_DICT_WATCHERS
    log_watch(st);
#endif
    return 0;
}

void ml_log_clear(ml_state *st)
{
#if ML_DICT_WATCHERS
    log_unwatch(st);
#endif
    Py_CLEAR(st->log_logger);
    Py_CLEAR(st->log_cache);
    Py_CLEAR(st->log_env_changed);
    Py_CLEAR(st->log_on_event);
    Py_CLEAR(st->log_on_gc);
    Py_CLEAR(st->env_data);
    Py_CLEAR(st->debug_key);
    Py_CLEAR(st->debug_seen);
    st->log_answer_valid[0] = st->log_answer_valid[1] = 0;
}

void ml_log_free(ml_state *st)
{
    ml_log_clear(st);
#if ML_DICT_WATCHERS
    if (st->log_watcher != 0) {
        if (PyDict_ClearWatcher(st->log_watcher - 1) < 0) {
            PyErr_Clear();
        }
        st->log_watcher = 0;
    }
#endif
}

PyObject *ml_log_info(const ml_state *st)
{
    return Py_BuildValue("(KO)", (unsigned long long)st->log_worked_out,
                         ML_DICT_WATCHERS && !st->log_watched ? Py_False : Py_True);
}

int ml_log_traverse(ml_state *st, visitproc visit, void *arg)
{
    Py_VISIT(st->log_logger);
    Py_VISIT(st->log_cache);
    Py_VISIT(st->log_env_changed);
    Py_VISIT(st->log_on_event);
    Py_VISIT(st->log_on_gc);
    Py_VISIT(st->env_data);
    Py_VISIT(st->debug_seen);
    return 0;
}

/* The DEBUG value now: an object compared by identity with the last one. */
static PyObject *debug_value(ml_state *st)
{
    if (st->env_data != NULL) {
        PyObject *v = PyDict_GetItemWithError(st->env_data, st->debug_key); /* borrowed */
        if (v == NULL && PyErr_Occurred()) {
            PyErr_Clear();
        }
        return v != NULL ? v : Py_None;
    }
    return Py_None; /* no os.environ mapping to watch: DEBUG is read at import */
}

static int ask(PyObject *logger, int level)
{
    PyObject *r = PyObject_CallMethod(logger, "isEnabledFor", "i", level);
    if (r == NULL) {
        ml_write_unraisable(logger);
        return 0;
    }
    int on = PyObject_IsTrue(r) == 1;
    Py_DECREF(r);
    return on;
}

/* The logger's own cached answer for level (Py_True/Py_False, borrowed), or
 * NULL when it has none: logging empties every logger's cache whenever any
 * level changes anywhere, and refills it as it is asked. */
static PyObject *cached_answer(const ml_state *st, int level)
{
    if (st->log_cache == NULL) {
        return NULL;
    }
    PyObject *key = PyLong_FromLong(level); /* a small int: no allocation */
    if (key == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *ans = PyDict_GetItemWithError(st->log_cache, key);
    Py_DECREF(key);
    if (ans == NULL) {
        PyErr_Clear();
    }
    return ans;
}

/* Both versions the answers depend on; 0 when they cannot be read. */
static int log_versions(const ml_state *st, uint64_t *env, uint64_t *cache)
{
#if ML_DICT_WATCHERS
    *env = *cache = watched_epoch;
    return st->log_watched;
#else
    return st->env_data != NULL && st->log_cache != NULL && ml_dict_version(st->env_data, env) &&
           ml_dict_version(st->log_cache, cache);
#endif
}

static int ask_wants(ml_state *st, int level);

/* The answer for level kept from the last time it was asked, while neither
 * dict changed since: 0 or 1; -1 when it must be asked again.  *env and
 * *cache receive the versions now, *versioned whether they could be read. */
static int kept_answer(const ml_state *st, int li, uint64_t *env, uint64_t *cache, int *versioned)
{
    *versioned = log_versions(st, env, cache);
    if (*versioned && st->log_answer_valid[li] && st->log_env_version[li] == *env &&
        st->log_cache_version[li] == *cache) {
        return st->log_answer[li];
    }
    return -1;
}

int ml_log_wants(ml_state *st, int level)
{
    if (st->log_logger == NULL) {
        return 0;
    }
    /* Every event asks: the DEBUG variable and the logger's cache are read
     * again only when one of the two dicts changed since the last answer. */
    int li = level == ML_LOG_DEBUG ? 0 : 1;
    uint64_t env = 0, cache = 0;
    int versioned;
    int kept = kept_answer(st, li, &env, &cache, &versioned);
    if (kept >= 0) {
        return kept && !ml_finalizing();
    }
    if (ml_finalizing()) {
        return 0;
    }
    st->log_worked_out++;
    int on = ask_wants(st, level);
    /* Kept only when nothing changed while it was worked out (asking fills
     * the logger's cache, and may run Python that changes either dict). */
    uint64_t env2 = 0, cache2 = 0;
    st->log_answer_valid[li] = (unsigned char)(versioned && log_versions(st, &env2, &cache2) &&
                                               env2 == env && cache2 == cache);
    st->log_env_version[li] = env;
    st->log_cache_version[li] = cache;
    st->log_answer[li] = (unsigned char)on;
    return on;
}

static int ask_wants(ml_state *st, int level)
{
    PyObject *v = debug_value(st);
    const PyObject *ans = cached_answer(st, level);
    if (v != st->debug_seen || ans == NULL) {
        /* DEBUG changed, or a level changed somewhere: let _log.py apply
         * DEBUG, then ask the logger (which fills its cache).  The value is
         * kept so that its address cannot be reused by another object. */
        Py_INCREF(v);
        Py_XSETREF(st->debug_seen, v);
        PyObject *r = PyObject_CallOneArg(st->log_env_changed, v);
        if (r == NULL) {
            ml_write_unraisable(st->log_env_changed);
        }
        Py_XDECREF(r);
        return ask(st->log_logger, level);
    }
    return ans == Py_True;
}

int ml_log_cached_wants(const ml_state *st, int level)
{
    if (st->log_logger == NULL) {
        return 0;
    }
    /* The last answer, while neither dict changed since (no lookup). */
    uint64_t env = 0, cache = 0;
    int versioned;
    int kept = kept_answer(st, level == ML_LOG_DEBUG ? 0 : 1, &env, &cache, &versioned);
    if (kept >= 0) {
        return kept;
    }
    const PyObject *ans = cached_answer(st, level);
    return ans == NULL || ans == Py_True; /* unknown: defer, the safe point asks */
}

/* One DEBUG record per event, or a summary of an explicit call. */
static void log_records(ml_state *st, ml_book *lord, const ml_event *ev, int n,
                        const ml_emit_ctx *ctx);

/* Kept small: every event passes here, and almost always DEBUG is off. */
static void log_notify(void *Py_UNUSED(data), ml_book *lord, const ml_event *ev, int n,
                       const ml_emit_ctx *ctx)
{
    ml_state *st = ml_lord_state(lord);
    if (ml_log_wants(st, ML_LOG_DEBUG)) {
        log_records(st, lord, ev, n, ctx);
    }
}

#if defined(__GNUC__)
__attribute__((noinline))
#endif
static void log_records(ml_state *st, ml_book *lord, const ml_event *ev, int n,
                        const ml_emit_ctx *ctx)
{
    /* Copy what the record needs first: building it runs Python. */
    PyObject *records = PyList_New(0);
    if (records == NULL) {
        ml_write_unraisable(NULL);
        return;
    }
    for (int i = 0; i < n; i++) {
        const ml_event *e = &ev[i];
        if (e->kind == ML_EV_GC || e->kind == ML_EV_OOM) {
            continue; /* an auto-GC run and an OOM have their own INFO record */
        }
        PyObject *dev = e->kind == ML_EV_RESET ? Py_NewRef(Py_None) : ml_dev_str(st, e->dev);
        PyObject *rec =
            dev ? Py_BuildValue("(ssNLLIL)", ml_ev_kind_name(e->kind), ml_ev_source_name(e->source),
                                dev, (long long)e->bytes, (long long)e->count, (unsigned)e->site,
                                (long long)e->total_after)
                : NULL;
        if (rec == NULL || PyList_Append(records, rec) < 0) {
            Py_XDECREF(rec);
            Py_DECREF(records);
            ml_write_unraisable(NULL);
            return;
        }
        Py_DECREF(rec);
    }
    PyObject *r = PyObject_CallFunction(st->log_on_event, "OOOz", (PyObject *)lord, records,
                                        ctx->subject ? ctx->subject : Py_None, ctx->what);
    if (r == NULL) {
        ml_write_unraisable(st->log_on_event);
    }
    Py_XDECREF(r);
    Py_DECREF(records);
}

/* Quiet while the kept DEBUG answer is "off" and neither dict it depends
 * on changed since: no lookup, no Python. */
ML_HOT static int log_quiet(void *Py_UNUSED(data), ml_book *lord)
{
    const ml_state *st = ml_lord_state(lord);
    uint64_t env, cache;
    int versioned;
    return st->log_logger == NULL || kept_answer(st, 0, &env, &cache, &versioned) == 0;
}

/* A death's events wait for the safe point while DEBUG records are wanted. */
static int log_defer(void *Py_UNUSED(data), ml_book *lord, const ml_event *Py_UNUSED(ev),
                     int Py_UNUSED(n))
{
    return ml_log_cached_wants(ml_lord_state(lord), ML_LOG_DEBUG);
}

const ml_sink ml_log_sink = {"log", NULL, NULL, log_notify, NULL, NULL, 0, log_quiet, log_defer};

void ml_log_gc(ml_state *st, ml_dev dev, const ml_gc_why *why, int64_t runs, int released,
               int nlords)
{
    if (!ml_log_wants(st, ML_LOG_INFO)) {
        return;
    }
    char band[96];
    if (why->banded) {
        ml_band_name(why->lo, why->lo_is_int, why->hi, why->hi_is_int, band, sizeof(band));
    } else {
        snprintf(band, sizeof(band), "bytes");
    }
    PyObject *devs = ml_dev_str(st, dev);
    if (devs == NULL) {
        ml_write_unraisable(NULL);
        return;
    }
    PyObject *r = PyObject_CallFunction(
        st->log_on_gc, "NsdsLLLii", devs, band, why->used_pct, ml_metric_name(why->metric),
        (long long)why->value, (long long)why->threshold, (long long)runs, released, nlords);
    if (r == NULL) {
        ml_write_unraisable(st->log_on_gc);
    }
    Py_XDECREF(r);
}
