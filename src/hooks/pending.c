/* The CUDA pending-free queue (its storage is the dispatcher's). */
#include "hooks/pending.h"

/* Free p unless it is the caller's stack buffer buf. */
static void free_unless(void *p, const void *buf)
{
    if (p != buf) {
        PyMem_Free(p);
    }
}

static void credit(ml_pending *p, enum ml_ev_source source)
{
    ml_delta d = {p->dev, p->bytes, 1, p->ptr, 0};
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p->lords); i++) {
        ml_book *lord = (ml_book *)PyTuple_GET_ITEM(p->lords, i);
        if (ml_lord_record(lord, ML_REC_FREE, &d, 1, &p->site, source, NULL) < 0) {
            PyErr_WriteUnraisable((PyObject *)lord);
        }
    }
}

static void pending_dispose(ml_pending *p)
{
    if (p->event != NULL) {
        ml_cuda_event_release(p->event);
    }
    Py_CLEAR(p->lords);
    ml_site_clear(&p->site);
}

/* Append entries to the queue; an entry that finds no room is credited
 * now, never dropped. */
static void pending_append(ml_pending *items, Py_ssize_t n)
{
    if (n == 0) {
        return;
    }
    if (ml_disp.npending + n > ml_disp.cap) {
        Py_ssize_t cap = ml_disp.cap ? ml_disp.cap : 64;
        while (cap < ml_disp.npending + n) {
            cap *= 2;
        }
        ml_pending *p = PyMem_Realloc(ml_disp.pending, (size_t)cap * sizeof(ml_pending));
        if (p != NULL) {
            ml_disp.pending = p;
            ml_disp.cap = cap;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ml_disp.npending < ml_disp.cap) {
            ml_disp.pending[ml_disp.npending++] = items[i];
        } else {
            credit(&items[i], ML_SRC_DEFERRED); /* no memory to wait in: credit early */
            pending_dispose(&items[i]);
        }
    }
}

/* Credit every completed entry (all of them when wait is set; only those of
 * `only` when it is not NULL; with head_only, stop at the first pending one).
 * The queue is detached first: waits release the GIL, and crediting runs
 * Python that may re-enter the hooks and queue more. */
ML_COLD void ml_pending_drain(int wait, PyObject *only, int head_only)
{
    if (ml_disp.npending == 0) {
        return;
    }
    /* The poll of every quiet conversion: the oldest entry still running
     * means nothing to credit, found without allocating (-2: not asked). */
    int head = -2;
    if (head_only && !wait && only == NULL) {
        head = ml_cuda_event_query(ml_disp.pending[0].event);
        if (head == 0) {
            return;
        }
    }
    Py_ssize_t n = ml_disp.npending, cap = ml_disp.cap;
    /* a short queue (a poll after a move or two) on the stack */
    char ready_buf[16] = {0};
    ml_pending done_buf[16];
    int small = n <= 16;
    char *ready = small ? ready_buf : PyMem_Calloc((size_t)n, 1);
    ml_pending *done = small ? done_buf : PyMem_Malloc((size_t)n * sizeof(ml_pending));
    if (ready == NULL || done == NULL) {
        free_unless(ready, ready_buf);
        free_unless(done, done_buf);
        return; /* try again at the next poll; nothing is lost */
    }
    ml_pending *items = ml_disp.pending;
    ml_disp.pending = NULL;
    ml_disp.npending = ml_disp.cap = 0;
    int stop = 0;
    for (Py_ssize_t i = 0; i < n && !stop; i++) {
        if (only != NULL && !ml_lords_contain(items[i].lords, only)) {
            continue;
        }
        int q = i == 0 && head != -2 ? head : ml_cuda_event_query(items[i].event);
        if (q == 0 && wait) {
            int w;
            Py_BEGIN_ALLOW_THREADS w = ml_cuda_event_wait(items[i].event);
            Py_END_ALLOW_THREADS q = w == 0 ? 1 : -1;
        }
        ready[i] = q != 0; /* an error counts as done: never hold a free forever */
        stop = !ready[i] && head_only;
    }
    /* What other threads queued while the GIL was released goes after the
     * entries still waiting, which keep their order. */
    ml_pending *newer = ml_disp.pending;
    Py_ssize_t nnewer = ml_disp.npending;
    Py_ssize_t k = 0, ndone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ready[i]) {
            done[ndone++] = items[i];
        } else {
            items[k++] = items[i];
        }
    }
    free_unless(ready, ready_buf);
    ml_disp.pending = items;
    ml_disp.npending = k;
    ml_disp.cap = cap;
    pending_append(newer, nnewer);
    PyMem_Free(newer);
    for (Py_ssize_t i = 0; i < ndone; i++) {
        ml_pending *p = &done[i];
        if (only == NULL || PyTuple_GET_SIZE(p->lords) <= 1) {
            credit(p, ML_SRC_DEFERRED);
            pending_dispose(p);
            continue;
        }
        /* Credit only `only`; the others keep waiting on their own. */
        Py_ssize_t nl = PyTuple_GET_SIZE(p->lords);
        PyObject *one = PyTuple_Pack(1, only);
        PyObject *rest = one ? PyTuple_New(nl - 1) : NULL;
        if (rest == NULL) {
            PyErr_Clear();
            Py_XDECREF(one);
            credit(p, ML_SRC_DEFERRED); /* no memory to split: every lord now */
            pending_dispose(p);
            continue;
        }
        for (Py_ssize_t j = 0, r = 0; j < nl; j++) {
            PyObject *l = PyTuple_GET_ITEM(p->lords, j);
            if (l != only) {
                PyTuple_SET_ITEM(rest, r++, Py_NewRef(l));
            }
        }
        Py_SETREF(p->lords, one);
        credit(p, ML_SRC_DEFERRED);
        Py_SETREF(p->lords, rest);
        pending_append(p, 1);
    }
    free_unless(done, done_buf);
}

int ml_pending_push(ml_cuda_event *ev, ml_dev dev, int64_t bytes, uintptr_t ptr,
                    const ml_lords *lords, const ml_site *site)
{
    PyObject *tuple = ml_lords_tuple(lords);
    if (tuple == NULL) {
        return -1;
    }
    if (ml_disp.npending == ml_disp.cap) {
        Py_ssize_t cap = ml_disp.cap ? ml_disp.cap * 2 : 64;
        ml_pending *p = PyMem_Realloc(ml_disp.pending, (size_t)cap * sizeof(ml_pending));
        if (p == NULL) {
            Py_DECREF(tuple);
            PyErr_NoMemory();
            return -1;
        }
        ml_disp.pending = p;
        ml_disp.cap = cap;
    }
    ml_pending *p = &ml_disp.pending[ml_disp.npending++];
    p->event = ev;
    p->dev = dev;
    p->bytes = bytes;
    p->ptr = ptr;
    p->lords = tuple;
    p->site = *site;
    return 0;
}

int64_t ml_pending_bytes(const PyObject *lord, const ml_selector *sel)
{
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < ml_disp.npending; i++) {
        ml_pending *p = &ml_disp.pending[i];
        if (ml_lords_contain(p->lords, lord) && ml_selector_match(sel, p->dev)) {
            total += p->bytes;
        }
    }
    return total;
}

/* Record an event on the current stream of the source device; NULL when the
 * driver cannot (then the free is credited at once). */
ml_cuda_event *ml_pending_record_event(ml_dev src)
{
    PyObject *handle;
    /* a small int: CPython's cached object, no allocation; one vectorcall,
     * no argument tuple */
    PyObject *index = PyLong_FromLong(ML_DEV_INDEX(src));
    if (index == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (ml_disp.raw_stream != NULL) {
        /* the cudaStream_t as an int, without building a Stream object */
        handle = PyObject_Vectorcall(ml_disp.raw_stream, &index, 1, NULL);
    } else if (ml_disp.current_stream != NULL) {
        PyObject *stream = PyObject_Vectorcall(ml_disp.current_stream, &index, 1, NULL);
        handle = stream ? PyObject_GetAttr(stream, ml_disp.s_cuda_stream) : NULL;
        Py_XDECREF(stream);
    } else {
        Py_DECREF(index);
        return NULL;
    }
    Py_DECREF(index);
    if (handle == NULL) {
        PyErr_Clear();
        return NULL;
    }
    uintptr_t h = (uintptr_t)PyLong_AsUnsignedLongLongMask(handle);
    Py_DECREF(handle);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    return ml_cuda_event_record(ML_DEV_INDEX(src), h);
}
