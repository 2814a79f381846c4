/* The CUDA pending-free queue (its storage is the dispatcher's). */
#include "hooks/pending.h"

static int64_t poll_age_ns = ML_PENDING_POLL_AGE_NS;

int64_t ml_pending_poll_age(int64_t set_ns)
{
    int64_t old = poll_age_ns;
    if (set_ns >= 0) {
        poll_age_ns = set_ns;
    }
    return old;
}

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
            ml_write_unraisable((PyObject *)lord);
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

/* Whether entry p's copy has run: 1 yes, 0 not yet, -1 error (counted as
 * done: a free is never held forever).  An entry with no event asks its
 * stream, which lives as long as the process (see ml_pending_push). */
static int entry_query(const ml_pending *p)
{
    return p->event != NULL ? ml_cuda_event_query(p->event)
                            : ml_cuda_stream_query(ML_DEV_INDEX(p->dev), p->stream);
}

/* Record one event on the stream of items[from] (which has none) and give
 * it to every entry of items[from..n) that waits on the same stream without
 * one: each copy was queued before it, so its completion covers them all.
 * 0, or -1 when no event could be recorded (nothing changed). */
static int seal(ml_pending *items, Py_ssize_t from, Py_ssize_t n)
{
    ml_pending *head = &items[from];
    ml_cuda_event *ev = ml_cuda_event_record(ML_DEV_INDEX(head->dev), head->stream);
    if (ev == NULL) {
        return -1;
    }
    head->event = ev;
    for (Py_ssize_t i = from + 1; i < n; i++) {
        ml_pending *p = &items[i];
        if (p->event == NULL && p->dev == head->dev && p->stream == head->stream) {
            ml_cuda_event_share(ev);
            p->event = ev;
        }
    }
    return 0;
}

/* The answers of one drain: an event or a stream asked once, whatever
 * number of entries wait on it. */
typedef struct {
    const ml_cuda_event *event;
    int event_q;
    ml_dev dev;
    uintptr_t stream;
    int stream_q; /* -2: not asked yet */
} ml_answers;

static int answer(ml_answers *a, const ml_pending *p)
{
    if (p->event != NULL) {
        if (p->event != a->event) {
            a->event = p->event;
            a->event_q = ml_cuda_event_query(p->event);
        }
        return a->event_q;
    }
    if (a->stream_q == -2 || a->dev != p->dev || a->stream != p->stream) {
        a->dev = p->dev;
        a->stream = p->stream;
        a->stream_q = entry_query(p);
    }
    return a->stream_q;
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
     * means nothing to credit, found without allocating (-2: not asked).
     * An oldest entry waiting on a busy stream gets its event now, shared
     * with the others on that stream: the polls after it ask the event. */
    int head = -2;
    if (head_only && !wait && only == NULL) {
        const ml_pending *first = &ml_disp.pending[0];
        if (poll_age_ns > 0 && ml_now_ns() - first->queued_ns < poll_age_ns) {
            return; /* queued a moment ago: not worth a driver call yet */
        }
        head = entry_query(first);
        if (head == 0 &&
            (first->event != NULL || seal(ml_disp.pending, 0, ml_disp.npending) == 0)) {
            return;
        }
        if (head == 0) {
            head = -1; /* busy, and no event to wait on: credit it now */
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
    ml_answers a = {NULL, 0, 0, 0, -2};
    if (head != -2 && items[0].event != NULL) {
        a.event = items[0].event; /* the head was asked above */
        a.event_q = head;
    } else if (head != -2) {
        a.dev = items[0].dev;
        a.stream = items[0].stream;
        a.stream_q = head;
    }
    int stop = 0;
    for (Py_ssize_t i = 0; i < n && !stop; i++) {
        if (only != NULL && !ml_lords_contain(items[i].lords, only)) {
            continue;
        }
        int q = answer(&a, &items[i]);
        if (q == 0 && items[i].event == NULL) {
            /* its stream is busy: an event to wait on (or, without one,
             * credit now) */
            q = seal(items, i, n) == 0 ? answer(&a, &items[i]) : -1;
        }
        if (q == 0 && wait) {
            int w;
            Py_BEGIN_ALLOW_THREADS w = ml_cuda_event_wait(items[i].event);
            Py_END_ALLOW_THREADS q = w == 0 ? 1 : -1;
            a.event = items[i].event;
            a.event_q = q;
            a.stream_q = -2; /* the stream may have run on meanwhile */
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

int ml_pending_push(ml_cuda_event *ev, uintptr_t stream, ml_dev dev, int64_t bytes, uintptr_t ptr,
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
    p->stream = stream;
    p->dev = dev;
    p->bytes = bytes;
    p->ptr = ptr;
    p->lords = tuple;
    p->site = *site;
    p->queued_ns = ml_now_ns();
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

/* The current stream of the source device, as the driver's handle: 0, or
 * -1 when torch cannot say (then the free is credited at once). */
int ml_pending_stream(ml_dev src, uintptr_t *out)
{
    PyObject *handle;
    /* a small int: CPython's cached object, no allocation; one vectorcall,
     * no argument tuple */
    PyObject *index = PyLong_FromLong(ML_DEV_INDEX(src));
    if (index == NULL) {
        PyErr_Clear();
        return -1;
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
        return -1;
    }
    Py_DECREF(index);
    if (handle == NULL) {
        PyErr_Clear();
        return -1;
    }
    uintptr_t h = (uintptr_t)PyLong_AsUnsignedLongLongMask(handle);
    Py_DECREF(handle);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = h;
    return 0;
}
