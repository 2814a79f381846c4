/* The safe point: deferred notifications and tasks.
 *
 * Process-wide state (every access holds the GIL): the queue of deferred
 * notifications and the tasks.  Entries hold a strong reference to their
 * lord, taken without running Python. */
#include "core/safepoint.h"
#include "core/book.h"

#include <string.h>

typedef struct {
    ml_book *lord; /* strong */
    ml_event ev;
} ml_deferred;

#define ML_DEFERRED_MAX 65536 /* beyond, deferred DEBUG records are counted, not kept */
#define ML_TASKS_MAX 8

typedef struct {
    void (*fn[ML_TASKS_MAX])(void);
    int n;
} ml_tasks;

static struct {
    ml_deferred *deferred;
    Py_ssize_t ndeferred, cap;
    int64_t dropped; /* deferred notifications that found the queue full */
    /* what the deferred events go to: the seam's notify (emit.c) */
    void (*notify)(ml_book *lord, const ml_event *ev, int n);
    ml_tasks tasks, late;
    int scheduled; /* a pending call is queued */
    int running;   /* a safe point is running (no nesting) */
} q;

/* ---- thread names ------------------------------------------------------------- */

/* the calling thread: 0 not seen, 1 seen (to be named at its next safe point),
 * 2 named (or nobody to name it) */
static _Thread_local int tls_thread_state;
static PyObject *thread_namer; /* strong, or NULL */

void ml_thread_seen(void)
{
    if (tls_thread_state == 0) {
        tls_thread_state = 1;
    }
}

void ml_thread_set_namer(PyObject *namer)
{
    Py_XSETREF(thread_namer, namer == Py_None ? NULL : Py_NewRef(namer));
}

void ml_thread_name_now(void)
{
    if (tls_thread_state != 1) {
        return;
    }
    tls_thread_state = 2;
    if (thread_namer == NULL) {
        return;
    }
    PyObject *namer = Py_NewRef(thread_namer); /* the call may set another */
    PyObject *res = PyObject_CallNoArgs(namer);
    Py_DECREF(namer);
    if (res == NULL) {
        ml_write_unraisable(NULL);
    }
    Py_XDECREF(res);
}

int ml_safe_point_pending(void)
{
    return q.ndeferred > 0 || q.late.n > 0 || q.tasks.n > 0 || tls_thread_state == 1;
}

static int pending_call(void *Py_UNUSED(arg))
{
    q.scheduled = 0;
    ml_safe_point();
    return 0; /* never raise into whatever the main thread runs */
}

static void schedule(void)
{
    if (!q.scheduled && Py_AddPendingCall(pending_call, NULL) == 0) {
        q.scheduled = 1;
    }
}

static void tasks_add(ml_tasks *t, void (*fn)(void))
{
    for (int i = 0; i < t->n; i++) {
        if (t->fn[i] == fn) {
            return;
        }
    }
    if (t->n < ML_TASKS_MAX) {
        t->fn[t->n++] = fn;
    }
    schedule();
}

void ml_safe_point_add_task(void (*fn)(void))
{
    tasks_add(&q.tasks, fn);
}

void ml_safe_point_add_late(void (*fn)(void))
{
    tasks_add(&q.late, fn);
}

/* Run each task, first added first; what they add meanwhile runs too. */
static void tasks_run(ml_tasks *t)
{
    while (t->n > 0) {
        void (*fn)(void) = t->fn[0];
        t->n--;
        memmove(t->fn, t->fn + 1, (size_t)t->n * sizeof(t->fn[0]));
        fn();
        if (PyErr_Occurred()) {
            ml_write_unraisable(NULL);
        }
    }
}

/* ---- deferral out of deallocators ------------------------------------------- */

void ml_defer_notify(ml_book *lord, const ml_event *ev, int n,
                     void (*notify)(ml_book *lord, const ml_event *ev, int n))
{
    int want = 0;
    for (int i = 0; i < lord->nsinks && !want; i++) {
        const ml_sink *s = &lord->sinks[i];
        want = s->defer != NULL && s->defer(s->data, lord, ev, n);
    }
    if (!want) {
        return;
    }
    q.notify = notify;
    for (int i = 0; i < n; i++) {
        if (q.ndeferred == q.cap) {
            Py_ssize_t cap = q.cap ? q.cap * 2 : 64;
            ml_deferred *d = cap <= ML_DEFERRED_MAX
                                 ? PyMem_Realloc(q.deferred, (size_t)cap * sizeof(ml_deferred))
                                 : NULL;
            if (d == NULL) {
                q.dropped += n - i;
                break;
            }
            q.deferred = d;
            q.cap = cap;
        }
        q.deferred[q.ndeferred].lord = (ml_book *)Py_NewRef((PyObject *)lord);
        q.deferred[q.ndeferred].ev = ev[i];
        q.ndeferred++;
    }
    schedule();
}

/* ---- the safe point ----------------------------------------------------------- */

void ml_safe_point(void)
{
    if (q.running || !ml_safe_point_pending()) {
        return;
    }
    q.running = 1;
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    ml_thread_name_now();
    tasks_run(&q.tasks);
    while (q.ndeferred > 0) {
        /* Detach the queue: the sinks may defer more. */
        ml_deferred *items = q.deferred;
        Py_ssize_t n = q.ndeferred;
        q.deferred = NULL;
        q.ndeferred = q.cap = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            /* consecutive events of one lord go out as one batch */
            Py_ssize_t j = i;
            while (j + 1 < n && items[j + 1].lord == items[i].lord && j - i < 7) {
                j++;
            }
            ml_event batch[8];
            for (Py_ssize_t k = i; k <= j; k++) {
                batch[k - i] = items[k].ev;
            }
            q.notify(items[i].lord, batch, (int)(j - i + 1));
            for (Py_ssize_t k = i; k <= j; k++) {
                Py_DECREF(items[k].lord);
            }
            i = j;
        }
        PyMem_Free(items);
    }
    tasks_run(&q.late);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    q.running = 0;
}

void ml_safe_point_clear(void)
{
    ml_deferred *items = q.deferred;
    Py_ssize_t n = q.ndeferred;
    q.deferred = NULL;
    q.ndeferred = q.cap = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(items[i].lord);
    }
    PyMem_Free(items);
    q.tasks.n = 0;
    q.late.n = 0;
    Py_CLEAR(thread_namer);
}
