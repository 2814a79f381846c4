/* Torch move hooks.
 *
 * Process-wide state (the one place memlord keeps mutable globals): the
 * dispatcher below.  Patching torch.Tensor.to is a process-wide act, so the
 * record of what was patched, the subscribed lords and the queue of
 * deferred frees belong to the process, not to a module instance.  All of
 * it is touched only with the GIL held.
 *
 * A conversion is sized in storage bytes (the storage a tensor views, 0 for
 * meta and fake storages); the hook never touches data. */
#include "hooks/hooks.h"
#include "core/autogc.h"
#include "core/emit_one.h"
#include "hooks/lifetime.h"
#include "platform/ml_cuda.h"
#include "torch/sizing.h"

#include <string.h>
#include <structmember.h>

/* HK_MOVE may change device (to, cuda, cpu); HK_CAST never does (half,
 * float, double, bfloat16), so it needs no source metadata at all. */
enum hook_kind {
    HK_MOVE = 0,
    HK_CAST = 1,
    HK_MODULE_TO = 2,
    HK_SYNC = 3,
    HK_FACTORY = 4,      /* hook_into_python: torch.empty, ...: strided unless layout= */
    HK_PARAM = 5,        /* hook_into_python: nn.Parameter.__new__ moves registrations */
    HK_FACTORY_LIKE = 6, /* *_like and Tensor.clone: the layout follows the input */
    HK_MODULE_APPLY = 7, /* Module._apply: lifetime tracking of what a conversion leaves */
};

/* Patch groups: the torch hooks and the python (lifetime) hooks come and go
 * independently. */
enum { G_TORCH = 1, G_PY = 2 };

/* What memlord installs in place of a torch attribute.  It behaves as the
 * original does in every way a program can observe, except its identity and
 * its type(): it compares and hashes equal to the original, pickles and
 * copies as the original does, takes weak references, reports the original's
 * introspection attributes (and its __class__, so that isinstance() answers
 * as for the original: torch.compile traces through it), and returns what
 * the original returned. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *original; /* what the attribute resolved to before patching */
    PyObject *owner;    /* the class or module patched */
    PyObject *name;     /* the attribute name (interned) */
    PyObject *weakreflist;
    int kind;
    /* The original's C function, when the hook calls it as the original's
     * own call would (direct_of): a method descriptor (torch.Tensor.half)
     * or a builtin (torch.empty) taking (self, args tuple, kwargs dict).
     * NULL: the hook calls the original through PyObject_Vectorcall. */
    PyCFunctionWithKeywords direct;
    PyObject *direct_self;     /* a builtin's self (borrowed: original holds it) */
    PyTypeObject *direct_type; /* a method descriptor's class (borrowed), else NULL */
} HookObject;

/* Calling the original's C function directly needs CPython's own check of a
 * call's result, _Py_CheckFunctionResult, declared for extensions up to 3.12;
 * later versions call through PyObject_Vectorcall. */
#if PY_VERSION_HEX < 0x030D0000
#define ML_DIRECT_CALL 1
#else
#define ML_DIRECT_CALL 0
#endif

/* Whether the hook may call original's C function itself: an exact method
 * descriptor or builtin of METH_VARARGS | METH_KEYWORDS (every torch.Tensor
 * method and torch function memlord patches).  Their types are CPython's
 * own and immutable, and a descriptor's or builtin's PyMethodDef never
 * changes, so what is read here holds while the hook holds original. */
static void direct_of(HookObject *hook, PyObject *original)
{
    hook->direct = NULL;
    hook->direct_self = NULL;
    hook->direct_type = NULL;
#if ML_DIRECT_CALL
    /* the flags CPython chooses a call by (METH_STATIC, on torch.empty and
     * the other torch functions, and METH_COEXIST do not change it) */
    const int how =
        METH_VARARGS | METH_FASTCALL | METH_NOARGS | METH_O | METH_KEYWORDS | METH_METHOD;
    const int want = METH_VARARGS | METH_KEYWORDS;
    if (Py_TYPE(original) == &PyMethodDescr_Type) {
        const PyMethodDef *def = ((PyMethodDescrObject *)original)->d_method;
        if ((def->ml_flags & how) == want) {
            hook->direct = (PyCFunctionWithKeywords)(void (*)(void))def->ml_meth;
            hook->direct_type = PyDescr_TYPE(original);
        }
    } else if (Py_TYPE(original) == &PyCFunction_Type &&
               (PyCFunction_GET_FLAGS(original) & how) == want) {
        hook->direct = (PyCFunctionWithKeywords)(void (*)(void))PyCFunction_GET_FUNCTION(original);
        hook->direct_self = PyCFunction_GET_SELF(original);
    }
#else
    (void)original;
#endif
}

#if ML_DIRECT_CALL
/* original(*args, **kwnames) through its C function, as CPython's own call
 * of a METH_VARARGS | METH_KEYWORDS descriptor or builtin does it: the
 * arguments as a tuple and a dict (NULL without keywords), the recursion
 * check, and the check of the result, without the call level that going
 * through the original's own call adds (a hook that only forwards a 1 KiB
 * cast: 14 ns to 17 ns that way, 6 ns to 9 ns this way; docs/benchmarks.md).
 * A method descriptor's wrong or missing self goes through the original's
 * own call, for its own error. */
static PyObject *call_direct(const HookObject *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *first = self->direct_self;
    if (self->direct_type != NULL) {
        if (nargs < 1 || !PyObject_TypeCheck(args[0], self->direct_type)) {
            return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
        }
        first = args[0];
        args++;
        nargs--;
    }
    PyObject *tuple = PyTuple_New(nargs);
    if (tuple == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    }
    PyObject *kwargs = NULL;
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nkw > 0) {
        kwargs = PyDict_New();
        for (Py_ssize_t i = 0; kwargs != NULL && i < nkw; i++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                Py_CLEAR(kwargs);
            }
        }
        if (kwargs == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
    }
    PyObject *result = NULL;
    if (Py_EnterRecursiveCall(" while calling a Python object") == 0) {
        result = self->direct(first, tuple, kwargs);
        Py_LeaveRecursiveCall();
    }
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return _Py_CheckFunctionResult(PyThreadState_Get(), self->original, result, NULL);
}
#endif

/* original(*args, **kwnames): directly when direct_of allowed it, else
 * through the original's vectorcall, looked up on every call (it belongs to
 * the original's type, which may change its slots).  The result is checked
 * by whoever called the hook. */
static inline PyObject *call_original(const HookObject *self, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames)
{
#if ML_DIRECT_CALL
    if (self->direct != NULL) {
        return call_direct(self, args, nargsf, kwnames);
    }
#endif
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

/* One patched attribute. */
typedef struct {
    PyObject *owner;    /* class or module that was patched */
    PyObject *name;     /* attribute name */
    PyObject *own;      /* owner.__dict__[name] before patching, or NULL */
    PyObject *original; /* getattr(owner, name) before patching */
    PyObject *hook;     /* the HookObject installed */
    /* The same attribute in the class torch dispatches through, when that is
     * not owner (see alias_of): alias_type.__dict__[name] held alias_own
     * and now holds alias_put (the hook, or a staticmethod of it).  NULL
     * when there is none. */
    PyObject *alias_type;
    PyObject *alias_own;
    PyObject *alias_put;
    int group;
} ml_patch;

/* A free waiting for a CUDA event. */
typedef struct {
    ml_cuda_event *event;
    ml_dev dev;
    int64_t bytes;
    uintptr_t ptr;   /* the source storage's data pointer, 0 when unknown */
    PyObject *lords; /* tuple of lords to credit */
    ml_site site;
} ml_pending;

#define ML_MAX_PATCHES 64
#define ML_PENDING_HARD_CAP 8192

static struct {
    /* What every hooked call reads comes first, in one cache line: torch's
     * own path evicts memlord's data between two calls, and each line read
     * again costs more than the instructions that read it. */
    PyObject *module; /* memlord._core, strong while installed */
    ml_state *st;     /* its state: set with module, valid while it is held */
    /* Subscribers: tuples of weak references to lords, replaced, never
     * mutated.  The dispatcher never keeps a lord alive: a lord stays
     * subscribed while it (or a handle, which holds it) lives; when it dies,
     * its reference's callback schedules a cleanup at the next safe point,
     * which drops it and restores torch once no lord is left. */
    PyObject *lord_refs;    /* hook_into_torch() */
    PyObject *py_lord_refs; /* hook_into_python(): the factory wrappers */
    Py_ssize_t npending;    /* frees waiting for a CUDA event (pending[]) */
    ml_patch patches[ML_MAX_PATCHES];
    int npatches;
    PyObject *on_lord_death;    /* the weak references' callback */
    PyObject *tracing_types[2]; /* FakeTensor, FunctionalTensor, once seen */
    PyObject *disable_tf;       /* torch._C.DisableTorchFunction, once needed */
    PyObject *current_stream;   /* torch.cuda.current_stream, or NULL */
    PyObject *raw_stream;       /* torch._C._cuda_getCurrentRawStream (an int), or NULL */
    PyObject *s_cuda_stream;
    PyObject *standin_stream; /* _cuda_standin(): a test's stream source, or NULL */
    ml_pending *pending;
    Py_ssize_t cap;
} disp;

/* Per-thread state of the hooks, one struct so that a hook finds it with a
 * single thread-local lookup. */
typedef struct {
    /* Module.to passes its non_blocking flag down through this counter, and
     * tells conversions they run inside it (module_depth). */
    int module_non_blocking;
    int module_depth;
    /* The hooked call whose original runs on this thread, if any: the
     * attribute name and the first argument.  A tensor subclass's
     * __torch_function__ or a TorchFunctionMode (with torch.device(...) is
     * one) calls func, which is the hook itself, from inside the original:
     * that same conversion re-entering counts once, at the outer call.  Any
     * other conversion made meanwhile (by a mode, a handler, a GC callback)
     * counts.  Compared by address only: the caller of the outer call holds
     * both alive until it returns. */
    const PyObject *cur_name;
    const PyObject *cur_src;
    /* The user's line of the Module.to being run on this thread: every
     * conversion inside it shares that site, found once. */
    int module_site_set;
    ml_site module_site;
    /* Depth of Module._apply calls on this thread: the outermost walks. */
    int apply_depth;
} ml_hook_tls;

static _Thread_local ml_hook_tls hook_tls;

/* ---- pending queue ----------------------------------------------------- */

static int lords_contain(PyObject *lords, const PyObject *lord)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(lords); i++) {
        if (PyTuple_GET_ITEM(lords, i) == lord) {
            return 1;
        }
    }
    return 0;
}

/* An accounting failure never reaches the caller: it is reported as
 * unraisable (sys.unraisablehook) and the original's result stands. */
ML_COLD static void report_failure(PyObject *hook)
{
    PyErr_WriteUnraisable(hook);
}

/* The lords one hooked call serves: strong references to the live lords of
 * a subscriber tuple, held for the call.  Up to ML_LORDS_INLINE sit in the
 * struct itself, so the common case (one lord) allocates nothing; more go
 * to a PyMem array (which never runs the cyclic GC).  Passed by pointer
 * only: v may point into the struct. */
#define ML_LORDS_INLINE 4
typedef struct {
    Py_ssize_t n;
    PyObject **v;
    PyObject *inl[ML_LORDS_INLINE];
} ml_lords;

static int lords_alloc(ml_lords *l, Py_ssize_t cap)
{
    l->n = 0;
    l->v = l->inl;
    if (cap > ML_LORDS_INLINE) {
        l->v = PyMem_Malloc((size_t)cap * sizeof(PyObject *));
        if (l->v == NULL) {
            l->v = l->inl;
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* The live lords of refs (NULL: none); -1 with an exception set. */
ML_HOT static int lords_acquire(PyObject *refs, ml_lords *out)
{
    Py_ssize_t n = refs != NULL ? PyTuple_GET_SIZE(refs) : 0;
    if (lords_alloc(out, n) < 0) {
        return -1;
    }
    /* Reading a weak reference runs no Python, and the array exists before
     * the first read: nothing below can run the cyclic GC. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *lord = ml_referent(PyTuple_GET_ITEM(refs, i)); /* borrowed, NULL once dying */
        if (lord != NULL) {
            out->v[out->n++] = Py_NewRef(lord);
        }
    }
    return 0;
}

/* The lords of all that keep the plain rule (do not track conversions). */
static int lords_plain(const ml_lords *all, ml_lords *out)
{
    if (lords_alloc(out, all->n) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < all->n; i++) {
        if (!ml_life_deep((ml_book *)all->v[i])) {
            out->v[out->n++] = Py_NewRef(all->v[i]);
        }
    }
    return 0;
}

ML_HOT static void lords_release(ml_lords *l)
{
    /* Detached first: releasing a lord may run Python. */
    Py_ssize_t n = l->n;
    PyObject **v = l->v;
    l->n = 0;
    l->v = l->inl;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(v[i]);
    }
    if (v != l->inl) {
        PyMem_Free(v);
    }
}

/* A new tuple of the lords (a pending free keeps one). */
static PyObject *lords_tuple(const ml_lords *l)
{
    PyObject *t = PyTuple_New(l->n);
    for (Py_ssize_t i = 0; t != NULL && i < l->n; i++) {
        PyTuple_SET_ITEM(t, i, Py_NewRef(l->v[i]));
    }
    return t;
}

static void credit(ml_pending *p, const char *label)
{
    ml_delta d = {p->dev, p->bytes, 1, p->ptr, 0};
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(p->lords); i++) {
        ml_book *lord = (ml_book *)PyTuple_GET_ITEM(p->lords, i);
        if (ml_lord_record(lord, ML_REC_FREE, &d, 1, &p->site, label, NULL) < 0) {
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
    if (disp.npending + n > disp.cap) {
        Py_ssize_t cap = disp.cap ? disp.cap : 64;
        while (cap < disp.npending + n) {
            cap *= 2;
        }
        ml_pending *p = PyMem_Realloc(disp.pending, (size_t)cap * sizeof(ml_pending));
        if (p != NULL) {
            disp.pending = p;
            disp.cap = cap;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (disp.npending < disp.cap) {
            disp.pending[disp.npending++] = items[i];
        } else {
            credit(&items[i], "(hook, deferred)"); /* no memory to wait in: credit early */
            pending_dispose(&items[i]);
        }
    }
}

/* Credit every completed entry (all of them when wait is set; only those of
 * `only` when it is not NULL; with head_only, stop at the first pending one).
 * The queue is detached first: waits release the GIL, and crediting runs
 * Python that may re-enter the hooks and queue more. */
ML_COLD static void pending_drain(int wait, PyObject *only, int head_only)
{
    if (disp.npending == 0) {
        return;
    }
    Py_ssize_t n = disp.npending, cap = disp.cap;
    char *ready = PyMem_Calloc((size_t)n, 1);
    ml_pending *done = PyMem_Malloc((size_t)n * sizeof(ml_pending));
    if (ready == NULL || done == NULL) {
        PyMem_Free(ready);
        PyMem_Free(done);
        return; /* try again at the next poll; nothing is lost */
    }
    ml_pending *items = disp.pending;
    disp.pending = NULL;
    disp.npending = disp.cap = 0;
    int stop = 0;
    for (Py_ssize_t i = 0; i < n && !stop; i++) {
        if (only != NULL && !lords_contain(items[i].lords, only)) {
            continue;
        }
        int q = ml_cuda_event_query(items[i].event);
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
    ml_pending *newer = disp.pending;
    Py_ssize_t nnewer = disp.npending;
    Py_ssize_t k = 0, ndone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ready[i]) {
            done[ndone++] = items[i];
        } else {
            items[k++] = items[i];
        }
    }
    PyMem_Free(ready);
    disp.pending = items;
    disp.npending = k;
    disp.cap = cap;
    pending_append(newer, nnewer);
    PyMem_Free(newer);
    for (Py_ssize_t i = 0; i < ndone; i++) {
        ml_pending *p = &done[i];
        if (only == NULL || PyTuple_GET_SIZE(p->lords) <= 1) {
            credit(p, "(hook, deferred)");
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
            credit(p, "(hook, deferred)"); /* no memory to split: every lord now */
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
        credit(p, "(hook, deferred)");
        Py_SETREF(p->lords, rest);
        pending_append(p, 1);
    }
    PyMem_Free(done);
}

static int pending_push(ml_cuda_event *ev, ml_dev dev, int64_t bytes, uintptr_t ptr,
                        const ml_lords *lords, const ml_site *site)
{
    PyObject *tuple = lords_tuple(lords);
    if (tuple == NULL) {
        return -1;
    }
    if (disp.npending == disp.cap) {
        Py_ssize_t cap = disp.cap ? disp.cap * 2 : 64;
        ml_pending *p = PyMem_Realloc(disp.pending, (size_t)cap * sizeof(ml_pending));
        if (p == NULL) {
            Py_DECREF(tuple);
            PyErr_NoMemory();
            return -1;
        }
        disp.pending = p;
        disp.cap = cap;
    }
    ml_pending *p = &disp.pending[disp.npending++];
    p->event = ev;
    p->dev = dev;
    p->bytes = bytes;
    p->ptr = ptr;
    p->lords = tuple;
    p->site = *site;
    return 0;
}

static int64_t pending_bytes(const PyObject *lord, const ml_selector *sel)
{
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < disp.npending; i++) {
        ml_pending *p = &disp.pending[i];
        if (lords_contain(p->lords, lord) && ml_selector_match(sel, p->dev)) {
            total += p->bytes;
        }
    }
    return total;
}

/* ---- accounting of one conversion -------------------------------------- */

static int any_tracks_callsite(const ml_lords *lords)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        if (((ml_book *)lords->v[i])->track_callsite) {
            return 1;
        }
    }
    return 0;
}

/* The call site of a conversion: the user's line of the Module.to being run
 * on this thread, else the innermost frame outside torch and memlord when a
 * lord tracks call sites, else none.  The caller clears *site. */
ML_HOT static void conversion_site(ml_state *st, const ml_hook_tls *tl, const ml_lords *lords,
                                   ml_site *site)
{
    site->id = 0;
    if (tl->module_site_set) {
        *site = tl->module_site;
    } else if (any_tracks_callsite(lords)) {
        ml_site_capture(st, site);
    }
}

/* One event for every subscribed lord; subject is the tensor it is about. */
ML_HOT static void record_all(const ml_lords *lords, int flags, ml_dev dev, int64_t bytes,
                              uintptr_t ptr, const ml_site *site, PyObject *subject)
{
    ml_delta d = {dev, bytes, 1, ptr, 0};
    ml_emit_ctx ctx = {subject, NULL};
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        ml_book *lord = (ml_book *)lords->v[i];
        if (ml_record_one(lord, (flags & ML_REC_FREE) ? ML_EV_FREE : ML_EV_ALLOC, ML_SRC_CONVERT,
                          &d, site, &ctx) < 0) {
            report_failure((PyObject *)lord);
        }
    }
}

/* Record an event on the current stream of the source device; NULL when the
 * driver cannot (then the free is credited at once). */
static ml_cuda_event *record_event(ml_dev src)
{
    PyObject *handle;
    if (disp.raw_stream != NULL) {
        /* the cudaStream_t as an int, without building a Stream object */
        handle = PyObject_CallFunction(disp.raw_stream, "i", ML_DEV_INDEX(src));
    } else if (disp.current_stream != NULL) {
        PyObject *stream = PyObject_CallFunction(disp.current_stream, "i", ML_DEV_INDEX(src));
        handle = stream ? PyObject_GetAttr(stream, disp.s_cuda_stream) : NULL;
        Py_XDECREF(stream);
    } else {
        return NULL;
    }
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

static PyObject *kwarg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *name)
{
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), name) == 0) {
            return args[nargs + i];
        }
    }
    return NULL;
}

/* The non_blocking flag of a Tensor.to/.cuda or Module.to call: the keyword,
 * or the first positional bool (every overload takes it as its first bool). */
static int call_non_blocking(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *nb = kwarg(args, nargs, kwnames, "non_blocking");
    if (nb != NULL) {
        return PyObject_IsTrue(nb) == 1;
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        if (PyBool_Check(args[i])) {
            return args[i] == Py_True;
        }
    }
    return 0;
}

static int is_non_blocking(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    const ml_hook_tls *tl = &hook_tls;
    return tl->module_non_blocking > 0 || call_non_blocking(args, nargs, kwnames);
}

/* The storages of t with their keys, for lifetime tracking.  A tensor
 * whose storage cannot be read counts as nothing: accounting never raises
 * into the caller (running out of memory aside). */
static int storages_of(ml_state *st, PyObject *t, ml_walk *w)
{
    w->collect_keys = 1;
    w->opaque_ok = 1;
    if (ml_walk_tensor(st, w, t) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return -1;
        }
        PyErr_Clear();
        ml_walk_clear(w);
        w->collect_keys = 1;
        w->opaque_ok = 1;
    }
    return 0;
}

static void track_items(const ml_lords *lords, const ml_life_item *items, Py_ssize_t n,
                        const ml_site *site, const char *label, int deep_only);
static void track_for(const ml_lords *lords, const ml_walk *w, const ml_site *site,
                      const char *label, int deep_only);

/* A new tensor seen by a tracked source (a factory, nn.Parameter): count and
 * track its storages for every lord of lords with lifetime tracking on.  A
 * plain tensor's storage is read in C, without a walk.  -1 only when memory
 * runs out. */
static int track_new_tensor(ml_state *st, const ml_lords *lords, PyObject *t, const char *label)
{
    ml_life_item item;
    uintptr_t ptr;
    if (ml_tensor_storage_in_c(st, t, &item.dev, &ptr, &item.bytes)) {
        item.tensor = t; /* the caller holds it */
        item.ptr = ptr;
        if (item.bytes <= 0) {
            return 0;
        }
        item.key = ml_tensor_untyped_storage(st, t);
        if (item.key == NULL) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                return -1;
            }
            PyErr_Clear();
            return 0;
        }
        ml_site site = {0};
        if (any_tracks_callsite(lords)) {
            ml_site_capture(st, &site);
        }
        track_items(lords, &item, 1, &site, label, 0);
        ml_site_clear(&site);
        Py_DECREF(item.key);
        return 0;
    }
    ml_walk w;
    ml_walk_init(&w);
    int rc = storages_of(st, t, &w);
    if (rc == 0 && w.n > 0) {
        ml_site site = {0};
        if (any_tracks_callsite(lords)) {
            ml_site_capture(st, &site);
        }
        track_for(lords, &w, &site, label, 0);
        ml_site_clear(&site);
    }
    ml_walk_clear(&w);
    return rc;
}

static void track_items(const ml_lords *lords, const ml_life_item *items, Py_ssize_t n,
                        const ml_site *site, const char *label, int deep_only)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        ml_book *lord = (ml_book *)lords->v[i];
        if (deep_only ? !ml_life_deep(lord) : !ml_life_active(lord)) {
            continue;
        }
        ml_site none = {0};
        if (ml_life_count(lord, items, n, 0, lord->track_callsite ? site : &none, label, NULL) <
            0) {
            PyErr_WriteUnraisable((PyObject *)lord);
        }
    }
}

/* Count and track the storages of a walk for every lord of lords that
 * tracks conversions (only): what a lord tracks already adds nothing. */
static void track_for(const ml_lords *lords, const ml_walk *w, const ml_site *site,
                      const char *label, int deep_only)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        ml_book *lord = (ml_book *)lords->v[i];
        if (deep_only ? !ml_life_deep(lord) : !ml_life_active(lord)) {
            continue;
        }
        ml_site none = {0};
        if (ml_life_count_walk(lord, w, 0, lord->track_callsite ? site : &none, label, NULL) < 0) {
            PyErr_WriteUnraisable((PyObject *)lord);
        }
    }
}

/* Lords that track conversions (hook_into_python with enable_deep_autowrap)
 * count the result's storages unless they track them already; a moved
 * source is credited when its storage dies.  The others keep the plain
 * rule: the result is counted, a moved source is credited at the move (or
 * when the copy's CUDA event completes), and stops being tracked. */
static inline void walk_clear_if(ml_walk *w, int inited)
{
    if (inited) {
        ml_walk_clear(w);
    }
}

/* Whether a storage's data pointer is worth reading for the plain lords:
 * only a sink that records addresses (the event ring) reads it, and a
 * pending CUDA free carries it to its credit. */
static int want_address(const ml_lords *lords)
{
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        if (ml_book_needs((ml_book *)lords->v[i]) & ML_NEED_ADDRESS) {
            return 1;
        }
    }
    return 0;
}

/* The common case, kept short: one lord with the plain rule, and a
 * conversion that stays on its device (every cast, most .to calls): the
 * result's storage is counted, nothing is credited.  1 when it applied, 0
 * when the general path must run, -1 when memory ran out. */
ML_HOT static int account_on_device(ml_state *st, const ml_hook_tls *tl, const ml_lords *lords,
                                    PyObject *src, PyObject *dst, int kind)
{
    if (lords->n != 1 || ml_life_deep((ml_book *)lords->v[0])) {
        return 0;
    }
    ml_dev sdev, ddev;
    int64_t bytes;
    uintptr_t ptr = 0;
    if (ml_tensor_storage(st, dst, &ddev, want_address(lords) ? &ptr : NULL, &bytes) < 0) {
        return -1;
    }
    if (kind == HK_MOVE && (ml_tensor_device(st, src, &sdev) < 0 || sdev != ddev)) {
        PyErr_Clear();
        return 0; /* moved (or unreadable): the general path decides */
    }
    if (bytes > 0) {
        ml_site site;
        conversion_site(st, tl, lords, &site);
        record_all(lords, 0, ddev, bytes, ptr, &site, dst);
        ml_site_clear(&site);
    }
    if (disp.npending > 0) {
        pending_drain(0, NULL, 1);
    }
    return 1;
}

ML_HOT static int account_conversion(ml_state *st, const ml_hook_tls *tl, const ml_lords *lords,
                                     PyObject *src, PyObject *dst, int kind, int non_blocking)
{
    int done = account_on_device(st, tl, lords, src, dst, kind);
    if (done != 0) {
        return done < 0 ? -1 : 0;
    }
    Py_ssize_t ndeep = 0, nplain = 0;
    int untrack = 0;
    for (Py_ssize_t i = 0; i < lords->n; i++) {
        const ml_book *lord = (const ml_book *)lords->v[i];
        if (ml_life_deep(lord)) {
            ndeep++;
        } else {
            nplain++;
            untrack |= lord->registry != NULL;
        }
    }
    ml_dev sdev = 0, ddev = 0;
    int64_t sbytes = 0, dbytes = 0;
    /* The destination's storages, walked only when a lord tracks them (most
     * conversions need none: the walk's set-up is a measurable part of a cast). */
    uintptr_t sptr = 0, dptr = 0;
    uintptr_t *want_ptr = NULL;
    ml_walk dw;
    if (ndeep > 0) {
        ml_walk_init(&dw);
    }
    if (ndeep > 0 && storages_of(st, dst, &dw) < 0) {
        return -1;
    }
    if (nplain > 0) {
        want_ptr = (non_blocking && kind == HK_MOVE) || want_address(lords) ? &dptr : NULL;
    }
    if (nplain > 0 ? ml_tensor_storage(st, dst, &ddev, want_ptr, &dbytes) < 0
                   : ml_tensor_device(st, dst, &ddev) < 0) {
        walk_clear_if(&dw, ndeep > 0);
        return -1;
    }
    int moved = 0;
    if (kind == HK_MOVE) {
        if (ml_tensor_device(st, src, &sdev) < 0) {
            walk_clear_if(&dw, ndeep > 0);
            return -1;
        }
        moved = sdev != ddev;
        if (moved && nplain > 0 &&
            ml_tensor_storage(st, src, &sdev, want_ptr ? &sptr : NULL, &sbytes) < 0) {
            walk_clear_if(&dw, ndeep > 0);
            return -1;
        }
    }
    ml_site site;
    conversion_site(st, tl, lords, &site);
    if (ndeep > 0) {
        track_for(lords, &dw, &site, "(hook)", 1);
    }
    walk_clear_if(&dw, ndeep > 0);
    int queued = 0;
    if (nplain > 0) {
        ml_lords subset;
        const ml_lords *plain = lords;
        if (ndeep > 0) {
            if (lords_plain(lords, &subset) < 0) {
                ml_site_clear(&site);
                return -1;
            }
            plain = &subset;
        }
        if (dbytes > 0) {
            record_all(plain, 0, ddev, dbytes, dptr, &site, dst);
        }
        if (moved && sbytes > 0) {
            ml_cuda_event *ev = NULL;
            if (non_blocking && ML_DEV_TYPE(sdev) == ML_TYPE_CUDA) {
                if (disp.npending > 0) {
                    pending_drain(0, NULL, 1); /* recycle completed events before taking one */
                }
                if (disp.npending >= ML_PENDING_HARD_CAP) {
                    pending_drain(1, NULL, 1); /* bound the queue and the event pool */
                }
                ev = record_event(sdev);
            }
            if (ev != NULL) {
                if (pending_push(ev, sdev, sbytes, sptr, plain, &site) < 0) {
                    ml_cuda_event_release(ev);
                    PyErr_Clear();
                    record_all(plain, ML_REC_FREE, sdev, sbytes, sptr, &site, src);
                } else {
                    queued = 1;
                }
            } else {
                record_all(plain, ML_REC_FREE, sdev, sbytes, sptr, &site, src);
            }
        }
        if (moved && untrack) {
            /* credited at the move: the source's death credits nothing more */
            ml_walk sw;
            ml_walk_init(&sw);
            if (storages_of(st, src, &sw) == 0) {
                for (Py_ssize_t i = 0; i < plain->n; i++) {
                    ml_book *lord = (ml_book *)plain->v[i];
                    for (Py_ssize_t j = 0; j < sw.n; j++) {
                        ml_life_untrack(lord, sw.keys[j]);
                    }
                }
            } else {
                PyErr_Clear();
            }
            ml_walk_clear(&sw);
        }
        if (plain == &subset) {
            lords_release(&subset);
        }
    }
    ml_site_clear(&site);
    if (!queued && disp.npending > 0) {
        pending_drain(0, NULL, 1);
    }
    return 0;
}

/* ---- the wrapper type -------------------------------------------------- */

/* FakeTensor and FunctionalTensor: tensors of tracing (torch.compile, AOT,
 * make_fx, FakeTensorMode) that hold no memory of their own.  Resolved from
 * sys.modules when a tensor of a subclass first shows up (never imported
 * here: a program that never loaded them has none). */
static int tracing_tensor(PyObject *t)
{
    static const char *const modules[2] = {"torch._subclasses.fake_tensor",
                                           "torch._subclasses.functional_tensor"};
    static const char *const names[2] = {"FakeTensor", "FunctionalTensor"};
    for (int i = 0; i < 2; i++) {
        if (disp.tracing_types[i] == NULL) {
            PyObject *mod_name = PyUnicode_FromString(modules[i]);
            PyObject *mod = mod_name ? PyImport_GetModule(mod_name) : NULL;
            Py_XDECREF(mod_name);
            if (mod == NULL) {
                PyErr_Clear();
                continue;
            }
            PyObject *tp = PyObject_GetAttrString(mod, names[i]);
            Py_DECREF(mod);
            if (tp == NULL || !PyType_Check(tp)) {
                Py_XDECREF(tp);
                PyErr_Clear();
                continue;
            }
            if (disp.tracing_types[i] == NULL) { /* the lookup may have run Python */
                disp.tracing_types[i] = tp;
            } else {
                Py_DECREF(tp);
            }
        }
        int r = PyObject_IsInstance(t, disp.tracing_types[i]);
        if (r != 0) {
            PyErr_Clear();
            return 1; /* an error counts as tracing: never count what cannot be read */
        }
    }
    return 0;
}

/* 1 when t (any object) is a tensor memlord must not count: a fake or
 * functional tensor.  Plain tensors and parameters answer at once. */
static inline int uncounted(const ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    if (tp == (PyTypeObject *)st->tensor_type || tp == (PyTypeObject *)st->parameter_type) {
        return 0;
    }
    return tracing_tensor(t);
}

/* Run the original as the hooked call (name, src) of this thread; *reentered
 * tells whether that same call was already running (see hook_tls). */
static inline PyObject *run_original(ml_hook_tls *tl, const HookObject *self, PyObject *const *args,
                                     size_t nargsf, PyObject *kwnames, int *reentered)
{
    const PyObject *src = PyVectorcall_NARGS(nargsf) > 0 ? args[0] : NULL;
    const PyObject *saved_name = tl->cur_name, *saved_src = tl->cur_src;
    *reentered = saved_name == self->name && saved_src == src;
    tl->cur_name = self->name;
    tl->cur_src = src;
    PyObject *result = call_original(self, args, nargsf, kwnames);
    tl->cur_name = saved_name;
    tl->cur_src = saved_src;
    return result;
}

/* Reading metadata through torch's Python getters (a tensor subclass, a
 * layout the C reader does not take) is a property get that a subclass's
 * __torch_function__ and any TorchFunctionMode would see: accounting reads
 * them with torch function disabled, so that overrides see only the calls
 * the program made.  Returns the entered guard, or NULL (no error) when
 * torch has none. */
/* Whether a TorchFunctionMode is active: then even a plain tensor's
 * untyped_storage() (which lifetime tracking reads for its key) would be seen
 * by the mode, so accounting runs with torch function disabled. */
static int tf_mode_active(void)
{
    static PyObject *fn;
    if (fn == NULL) {
        fn = ml_import_attr("torch._C", "_is_torch_function_mode_enabled");
        if (fn == NULL) {
            PyErr_Clear();
            return 1; /* cannot tell: stay quiet */
        }
    }
    /* A builtin taking no arguments (it is, in every torch memlord supports)
     * is called through its C function: the call protocol costs as much as
     * the answer, on every factory call. */
    PyObject *r = PyCFunction_Check(fn) && PyCFunction_GET_FLAGS(fn) == METH_NOARGS
                      ? PyCFunction_GET_FUNCTION(fn)(PyCFunction_GET_SELF(fn), NULL)
                      : PyObject_CallNoArgs(fn);
    if (r == NULL) {
        PyErr_Clear();
        return 1;
    }
    int on = r == Py_True;
    Py_DECREF(r);
    return on;
}

static PyObject *quiet_enter(void)
{
    if (disp.disable_tf == NULL) {
        PyObject *tp = ml_import_attr("torch._C", "DisableTorchFunction");
        if (tp == NULL) {
            PyErr_Clear();
            return NULL;
        }
        if (disp.disable_tf == NULL) {
            disp.disable_tf = tp;
        } else {
            Py_DECREF(tp);
        }
    }
    PyObject *guard = PyObject_CallNoArgs(disp.disable_tf);
    PyObject *r = guard ? PyObject_CallMethod(guard, "__enter__", NULL) : NULL;
    if (r == NULL) {
        PyErr_Clear();
        Py_XDECREF(guard);
        return NULL;
    }
    Py_DECREF(r);
    return guard;
}

static void quiet_exit(PyObject *guard)
{
    if (guard == NULL) {
        return;
    }
    PyObject *r = PyObject_CallMethod(guard, "__exit__", "OOO", Py_None, Py_None, Py_None);
    if (r == NULL) {
        PyErr_WriteUnraisable(guard);
    }
    Py_XDECREF(r);
    Py_DECREF(guard);
}

/* 1 when t's metadata is read in C (a plain tensor or parameter with the
 * stable-ABI reader on): no getter, so no __torch_function__, runs.  (Its
 * layout is not checked, to keep the hot path short: a plain sparse tensor
 * is sized through getters that only a TorchFunctionMode could see.) */
static inline int read_in_c(const ml_state *st, PyObject *t)
{
    const PyTypeObject *tp = Py_TYPE(t);
    return (tp == (PyTypeObject *)st->tensor_type || tp == (PyTypeObject *)st->parameter_type) &&
           ml_sizing_in_c();
}

ML_HOT static PyObject *hook_tensor(PyObject *callable, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (disp.lord_refs == NULL || disp.module == NULL || nargs < 1) {
        return call_original(self, args, nargsf, kwnames);
    }
    ml_state *st = disp.st;
    if (uncounted(st, args[0])) {
        return call_original(self, args, nargsf, kwnames); /* tracing: nothing to count */
    }
    ml_hook_tls *tl = &hook_tls; /* one thread-local lookup for the whole call */
    int reentered;
    PyObject *result = run_original(tl, self, args, nargsf, kwnames, &reentered);
    if (reentered || result == NULL || disp.lord_refs == NULL || disp.module == NULL) {
        return result; /* re-entered through __torch_function__: the outer call counts */
    }
    if (result == args[0]) {
        if (disp.npending > 0) {
            pending_drain(0, NULL, 1);
        }
        return result;
    }
    /* Whatever the original returned goes back unchanged; only tensors
     * converted from tensors are counted. */
    if (!PyObject_TypeCheck(result, (PyTypeObject *)st->tensor_type) ||
        !PyObject_TypeCheck(args[0], (PyTypeObject *)st->tensor_type) || uncounted(st, result)) {
        return result;
    }
    ml_lords lords; /* a snapshot: subscribers may change */
    if (lords_acquire(disp.lord_refs, &lords) < 0) {
        report_failure(callable);
        return result;
    }
    int nb = self->kind == HK_MOVE && is_non_blocking(args, nargs, kwnames);
    /* with python hooks on, tracking reads storages through torch's methods */
    PyObject *guard = read_in_c(st, result) && read_in_c(st, args[0]) &&
                              (disp.py_lord_refs == NULL || !tf_mode_active())
                          ? NULL
                          : quiet_enter();
    int rc = account_conversion(st, tl, &lords, args[0], result, self->kind, nb);
    lords_release(&lords);
    ml_safe_point();
    if (rc < 0) {
        report_failure(callable);
    }
    quiet_exit(guard);
    return result;
}

static PyObject *hook_module_to(PyObject *callable, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames)
{
    ml_hook_tls *tl = &hook_tls;
    const HookObject *self = (const HookObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int nb = call_non_blocking(args, nargs, kwnames);
    /* Nested Module.to calls keep the outermost call's site. */
    int own_site = 0;
    if (!tl->module_site_set && disp.lord_refs != NULL && disp.module != NULL) {
        ml_lords lords;
        if (lords_acquire(disp.lord_refs, &lords) < 0) {
            PyErr_WriteUnraisable(callable);
        } else {
            if (any_tracks_callsite(&lords)) {
                ml_site_capture(disp.st, &tl->module_site);
                tl->module_site_set = own_site = 1;
            }
            lords_release(&lords);
        }
    }
    tl->module_non_blocking += nb;
    tl->module_depth++;
    PyObject *result = call_original(self, args, nargsf, kwnames);
    tl->module_depth--;
    tl->module_non_blocking -= nb;
    if (own_site) {
        tl->module_site_set = 0;
        ml_site_clear(&tl->module_site);
    }
    return result;
}

/* The end of a factory or parameter hook: a tensor result (not fake or
 * functional) is counted and tracked for every lord of the python hooks;
 * result is returned unchanged whatever happens. */
static PyObject *track_result(PyObject *callable, ml_state *st, PyObject *result, const char *label)
{
    /* Only real tensors: a tensor-like result (an FX Proxy while
     * symbolic_trace runs, any __torch_function__ object) would record every
     * method memlord calls on it (untyped_storage) into the user's graph. */
    if (!PyObject_TypeCheck(result, (PyTypeObject *)st->tensor_type) || uncounted(st, result)) {
        return result;
    }
    ml_lords lords; /* a snapshot: subscribers may change */
    if (lords_acquire(disp.py_lord_refs, &lords) < 0) {
        report_failure(callable);
        return result;
    }
    PyObject *guard = read_in_c(st, result) && !tf_mode_active() ? NULL : quiet_enter();
    if (track_new_tensor(st, &lords, result, label) < 0) {
        report_failure(callable);
    }
    quiet_exit(guard);
    lords_release(&lords);
    ml_safe_point();
    return result;
}

/* torch.empty(...) and friends, Tensor.clone: the result is counted and
 * registered for every lord with hook_into_python on, unless out= was
 * given (the memory already existed). */
static PyObject *hook_factory(PyObject *callable, PyObject *const *args, size_t nargsf,
                              PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (disp.py_lord_refs == NULL || disp.module == NULL) {
        return call_original(self, args, nargsf, kwnames);
    }
    int reentered;
    PyObject *result = run_original(&hook_tls, self, args, nargsf, kwnames, &reentered);
    if (reentered || result == NULL || disp.py_lord_refs == NULL || disp.module == NULL) {
        return result; /* re-entered through __torch_function__: the outer call counts */
    }
    const PyObject *out = kwarg(args, nargs, kwnames, "out");
    if (out != NULL && out != Py_None) {
        return result;
    }
    return track_result(callable, disp.st, result, "(factory)");
}

/* nn.Parameter(data): a parameter is memory the model holds.  Its storage
 * is data's, so a storage already tracked adds nothing (a re-wrapped
 * parameter, weight_norm's weight_v); one not seen yet (weight_norm's
 * weight_g, computed by torch) is counted and tracked from here. */
static PyObject *hook_param(PyObject *callable, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    PyObject *result = call_original(self, args, nargsf, kwnames);
    if (result == NULL || disp.py_lord_refs == NULL || disp.module == NULL) {
        return result;
    }
    return track_result(callable, disp.st, result, "(param)");
}

/* Module._apply (to, half, float, double, bfloat16, cuda, cpu, type,
 * to_empty, and _apply itself): for lords that track conversions, every
 * storage the module holds afterwards that they do not track yet is counted
 * and tracked, whatever fn did (Tensor.type, empty_like with the factory
 * wrappers off, arithmetic).  Only the outermost call walks: _apply
 * recurses into children through this hook. */
static PyObject *hook_module_apply(PyObject *callable, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames)
{
    ml_hook_tls *tl = &hook_tls;
    const HookObject *self = (const HookObject *)callable;
    tl->apply_depth++;
    PyObject *result = call_original(self, args, nargsf, kwnames);
    tl->apply_depth--;
    if (result == NULL || tl->apply_depth > 0 || PyVectorcall_NARGS(nargsf) < 1 ||
        disp.lord_refs == NULL || disp.module == NULL) {
        return result;
    }
    ml_lords lords;
    if (lords_acquire(disp.lord_refs, &lords) < 0) {
        report_failure(callable);
        return result;
    }
    int any = 0;
    for (Py_ssize_t i = 0; i < lords.n; i++) {
        any |= ml_life_deep((ml_book *)lords.v[i]);
    }
    ml_state *st = disp.st;
    if (!any || !PyObject_TypeCheck(args[0], (PyTypeObject *)st->module_type)) {
        lords_release(&lords);
        return result;
    }
    ml_walk w;
    ml_walk_init(&w);
    w.collect_keys = 1;
    w.opaque_ok = 1;
    int rc = ml_walk_object(st, &w, args[0], "_apply");
    if (rc == 0 && st->module_grads != NULL) {
        /* _apply converts gradients too; a module walk does not visit them */
        PyObject *grads = PyObject_CallOneArg(st->module_grads, args[0]);
        rc = grads != NULL && PyList_Check(grads) ? 0 : -1;
        for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(grads); i++) {
            PyObject *g = Py_NewRef(PyList_GET_ITEM(grads, i)); /* held across the walk */
            rc = ml_walk_tensor(st, &w, g);
            Py_DECREF(g);
        }
        Py_XDECREF(grads);
    }
    if (rc < 0) {
        report_failure(callable);
    } else if (w.n > 0) {
        ml_site site;
        conversion_site(st, tl, &lords, &site);
        track_for(&lords, &w, &site, "(hook)", 1);
        ml_site_clear(&site);
    }
    ml_walk_clear(&w);
    lords_release(&lords);
    return result;
}

static PyObject *hook_sync(PyObject *callable, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    PyObject *result = call_original(self, args, nargsf, kwnames);
    if (result != NULL) {
        pending_drain(0, NULL, 0);
        ml_safe_point();
    }
    return result;
}

/* Each kind of hook gets its own entry point: no dispatch on the way into
 * the original. */
static vectorcallfunc hook_entry(int kind)
{
    switch (kind) {
    case HK_MOVE:
    case HK_CAST:
        return hook_tensor;
    case HK_MODULE_TO:
        return hook_module_to;
    case HK_FACTORY:
    case HK_FACTORY_LIKE:
        return hook_factory;
    case HK_PARAM:
        return hook_param;
    case HK_MODULE_APPLY:
        return hook_module_apply;
    default:
        return hook_sync;
    }
}

/* Bound like a function: obj.to(...) passes obj first.  (A bound hook is a
 * method object where torch's bound C method is a builtin; its __self__,
 * __name__, equality and calls are the same.  A builtin_function_or_method
 * holds only its PyMethodDef, its self and its __module__: nothing that
 * could keep the hook alive and find it again on a call without showing
 * (__module__ would be the hook), short of hooks that are never freed.
 * PyCMethod, which carries a class, is another type, builtin_method.  The
 * hot path never binds: `t.half()` calls the hook with t first.) */
static PyObject *hook_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    /* A C method binds only to instances of its class: for anything else
     * the original's own __get__ raises its TypeError (torch.Tensor.to.
     * __get__(3, int)).  Attribute lookups pass an instance: one type check. */
    PyObject *original = ((const HookObject *)self)->original;
    if (Py_IS_TYPE(original, &PyMethodDescr_Type) &&
        !PyObject_TypeCheck(obj, PyDescr_TYPE(original))) {
        return Py_TYPE(original)->tp_descr_get(original, obj, type);
    }
    return PyMethod_New(self, obj);
}

static PyObject *hook_repr(HookObject *self)
{
    return PyObject_Repr(self->original);
}

static void hook_dealloc(HookObject *self);

/* Either hook type: they share their deallocator. */
static inline int is_hook(const PyObject *o)
{
    return Py_TYPE(o)->tp_dealloc == (destructor)hook_dealloc;
}

/* Equal to its original (and to any hook of it), so that sets and dicts of
 * torch functions, `func in allowed_methods` checks and torch's own caches
 * treat both alike, whichever of the two they hold. */
static PyObject *hook_richcompare(PyObject *self, PyObject *other, int op)
{
    if (op != Py_EQ && op != Py_NE) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *a = ((HookObject *)self)->original;
    PyObject *b = is_hook(other) ? ((HookObject *)other)->original : other;
    if (a == b) {
        return PyBool_FromLong(op == Py_EQ);
    }
    return PyObject_RichCompare(a, b, op);
}

static Py_hash_t hook_hash(HookObject *self)
{
    return PyObject_Hash(self->original);
}

/* Attributes the hook does not have are the original's (__name__,
 * __qualname__, __self__, __objclass__, __text_signature__, __code__ ...),
 * and so is the AttributeError of a missing one. */
static PyObject *hook_getattro(PyObject *self, PyObject *name)
{
    PyObject *r = PyObject_GenericGetAttr(self, name);
    if (r != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) {
        return r;
    }
    PyErr_Clear();
    return PyObject_GetAttr(((HookObject *)self)->original, name);
}

static PyObject *hook_get_wrapped(HookObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->original);
}

/* __class__ is the original's class: isinstance(torch.zeros,
 * types.BuiltinFunctionType) holds whether hooked or not, and tools that
 * decide how to treat a callable by its class (torch.compile among them)
 * treat the hook as the original.  type() still tells them apart. */
static PyObject *hook_get_class(HookObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef((PyObject *)Py_TYPE(self->original));
}

/* __module__ and __doc__: the hook type's own would shadow the original's */
static PyObject *hook_get_forwarded(HookObject *self, void *closure)
{
    return PyObject_GetAttrString(self->original, (const char *)closure);
}

/* Pickled and copied by reference, as the original is: torch's C functions
 * and methods reduce to getattr(their class, name), which the hook returns
 * too (unpickling gives the original, equal to the hook).  A Python function
 * (Module.to) pickles by module and qualified name while the hook is what
 * that name resolves to, and as getattr(owner, name) once it is not. */
static PyObject *hook_reduce_ex(HookObject *self, PyObject *protocol)
{
    if (!PyFunction_Check(self->original)) {
        return PyObject_CallMethod(self->original, "__reduce_ex__", "O", protocol);
    }
    PyObject *current = PyObject_GetAttr(self->owner, self->name);
    if (current == NULL) {
        return NULL;
    }
    int installed = current == (PyObject *)self;
    Py_DECREF(current);
    if (installed) {
        return PyObject_GetAttrString(self->original, "__qualname__");
    }
    PyObject *getattr_fn = PyDict_GetItemString(PyEval_GetBuiltins(), "getattr"); /* borrowed */
    if (getattr_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "memlord: builtins.getattr not found");
        return NULL;
    }
    return Py_BuildValue("(O(OO))", getattr_fn, self->owner, self->name);
}

static PyObject *hook_reduce(HookObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *protocol = PyLong_FromLong(2);
    if (protocol == NULL) {
        return NULL;
    }
    PyObject *r = hook_reduce_ex(self, protocol);
    Py_DECREF(protocol);
    return r;
}

/* copy.copy and copy.deepcopy return the function itself, as for functions */
static PyObject *hook_copy(PyObject *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self);
}

static PyObject *hook_deepcopy(PyObject *self, PyObject *Py_UNUSED(memo))
{
    return Py_NewRef(self);
}

static int hook_traverse(HookObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->original);
    Py_VISIT(self->owner);
    return 0;
}

static int hook_clear(HookObject *self)
{
    self->direct = NULL; /* what direct_of read belongs to original */
    self->direct_self = NULL;
    self->direct_type = NULL;
    Py_CLEAR(self->original);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->name);
    return 0;
}

static void hook_dealloc(HookObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    hook_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef hook_methods[] = {
    {"__reduce_ex__", (PyCFunction)hook_reduce_ex, METH_O, NULL},
    {"__reduce__", (PyCFunction)hook_reduce, METH_NOARGS, NULL},
    {"__copy__", hook_copy, METH_NOARGS, NULL},
    {"__deepcopy__", hook_deepcopy, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef hook_getset[] = {
    {"__wrapped__", (getter)hook_get_wrapped, NULL, "The original torch attribute.", NULL},
    {"__class__", (getter)hook_get_class, NULL, NULL, NULL},
    {"__module__", (getter)hook_get_forwarded, NULL, NULL, "__module__"},
    {"__doc__", (getter)hook_get_forwarded, NULL, NULL, "__doc__"},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef hook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(HookObject, vectorcall), READONLY, NULL},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(HookObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *hook_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

#define HOOK_COMMON_SLOTS                                                                          \
    {Py_tp_call, hook_call}, {Py_tp_repr, hook_repr}, {Py_tp_richcompare, hook_richcompare},       \
        {Py_tp_hash, hook_hash}, {Py_tp_getattro, hook_getattro}, {Py_tp_methods, hook_methods},   \
        {Py_tp_getset, hook_getset}, {Py_tp_members, hook_members},                                \
        {Py_tp_traverse, hook_traverse}, {Py_tp_clear, hook_clear},                                \
    {                                                                                              \
        Py_tp_dealloc, hook_dealloc                                                                \
    }

static PyType_Slot hook_slots[] = {
    HOOK_COMMON_SLOTS,
    {Py_tp_descr_get, hook_descr_get},
    {0, NULL},
};

/* A hook of a class attribute binds like a function (a descriptor). */
PyType_Spec ml_hook_spec = {
    .name = "memlord._core.Hook",
    .basicsize = sizeof(HookObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_DISALLOW_INSTANTIATION |
             /* immutable: CPython then specializes `t.half()` on a hook
              * like on a method descriptor (LOAD_METHOD skips the lookup) */
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = hook_slots,
};

static PyType_Slot fn_hook_slots[] = {
    HOOK_COMMON_SLOTS,
    {0, NULL},
};

/* A hook of a module attribute (torch.zeros) is no descriptor, as torch's
 * builtin functions are not: inspect.ismethoddescriptor() answers alike. */
PyType_Spec ml_fn_hook_spec = {
    .name = "memlord._core.FunctionHook",
    .basicsize = sizeof(HookObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = fn_hook_slots,
};

/* ---- install / uninstall ----------------------------------------------- */

static int installing_group;

/* torch.jit.script resolves torch's functions through a table keyed by
 * id(function) (torch.jit._builtins): a hook gets its original's entry while
 * installed, so scripted code calling torch.zeros compiles to aten::zeros as
 * without memlord.  Best effort: without that module nothing is needed. */
static void jit_builtin_alias(PyObject *hook, PyObject *original, int add)
{
    PyObject *mod_name = PyUnicode_FromString("torch.jit._builtins");
    PyObject *mod = mod_name ? PyImport_GetModule(mod_name) : NULL;
    Py_XDECREF(mod_name);
    if (mod == NULL) {
        PyErr_Clear();
        return;
    }
    if (add) {
        PyObject *op = PyObject_CallMethod(mod, "_find_builtin", "O", original);
        if (op != NULL && op != Py_None) {
            PyObject *r = PyObject_CallMethod(mod, "_register_builtin", "OO", hook, op);
            Py_XDECREF(r);
        }
        Py_XDECREF(op);
    } else {
        PyObject *table = PyObject_GetAttrString(mod, "_builtin_table");
        PyObject *key = table != NULL && PyDict_Check(table) ? PyLong_FromVoidPtr(hook) : NULL;
        if (key != NULL && PyDict_DelItem(table, key) < 0) {
            PyErr_Clear(); /* not there */
        }
        Py_XDECREF(key);
        Py_XDECREF(table);
    }
    Py_DECREF(mod);
    PyErr_Clear();
}

/* torch finds a function it hands to a TorchFunctionMode or a subclass's
 * __torch_function__ in its own class, not where memlord patches it:
 * torch.zeros is torch._C._VariableFunctionsClass.zeros (a staticmethod of
 * the builtin, whose m_self is that class), torch.Tensor.to is
 * torch._C.TensorBase.to (torch.Tensor inherits it); pickle names them there
 * too.  The hook goes into that class as well, so that `func is
 * torch.zeros` in a mode and pickle.loads(pickle.dumps(torch.zeros)) is
 * torch.zeros hold as they do bare.  Finds that class: *cls, the entry it
 * holds now (*own) and the entry to put (*put: the hook, or a staticmethod
 * of it), new references; all NULL when there is none (a Python function,
 * a method torch.Tensor defines itself).  Best effort: errors are cleared. */
static void alias_of(PyObject *owner, PyObject *name, PyObject *original, PyObject *hook,
                     PyObject **cls, PyObject **own, PyObject **put)
{
    *cls = *own = *put = NULL;
    PyObject *c = NULL;
    int wrap = 0;
    if (PyCFunction_Check(original) && (PyCFunction_GET_FLAGS(original) & METH_STATIC) &&
        PyType_Check(((PyCFunctionObject *)original)->m_self)) {
        c = ((PyCFunctionObject *)original)->m_self; /* METH_STATIC: the defining class */
        wrap = 1;
    } else if (PyType_Check(owner) && Py_TYPE(original) == &PyMethodDescr_Type) {
        c = (PyObject *)PyDescr_TYPE(original);
    }
    if (c == NULL || c == owner || ((PyTypeObject *)c)->tp_dict == NULL) {
        return;
    }
    Py_INCREF(c);
    PyObject *v = PyDict_GetItemWithError(((PyTypeObject *)c)->tp_dict, name);
    Py_XINCREF(v);
    int match = 0;
    if (v != NULL && wrap && PyObject_TypeCheck(v, &PyStaticMethod_Type)) {
        PyObject *f = PyObject_GetAttrString(v, "__func__");
        match = f == original;
        Py_XDECREF(f);
    } else if (v != NULL && !wrap) {
        match = v == original;
    }
    PyObject *p = !match ? NULL : wrap ? PyStaticMethod_New(hook) : Py_NewRef(hook);
    if (p == NULL) {
        PyErr_Clear();
        Py_DECREF(c);
        Py_XDECREF(v);
        return;
    }
    *cls = c;
    *own = v;
    *put = p;
}

/* Write cls.__dict__[name] = value.  These classes are immutable static
 * types (setattr refuses), so their dict is written as CPython's own
 * setattr of a mutable type does, and the type's attribute caches are
 * invalidated.  name is never a special method (no slot to update). */
static int alias_set(PyObject *cls, PyObject *name, PyObject *value)
{
    if (PyDict_SetItem(((PyTypeObject *)cls)->tp_dict, name, value) < 0) {
        return -1;
    }
    PyType_Modified((PyTypeObject *)cls);
    return 0;
}

/* Put the alias's own entry back where the hook is still there. */
static void alias_restore(PyObject *cls, PyObject *name, PyObject *own, const PyObject *put)
{
    if (cls == NULL) {
        return;
    }
    const PyObject *v = PyDict_GetItemWithError(((PyTypeObject *)cls)->tp_dict, name);
    if (v == put && alias_set(cls, name, own) < 0) {
        PyErr_WriteUnraisable(cls);
    }
    PyErr_Clear();
}

static int patch_one(ml_state *st, PyObject *owner, const char *name, int kind)
{
    if (disp.npatches == ML_MAX_PATCHES) {
        PyErr_SetString(PyExc_RuntimeError, "memlord: too many patches");
        return -1;
    }
    PyObject *pname = PyUnicode_InternFromString(name);
    if (pname == NULL) {
        return -1;
    }
    PyObject *original = PyObject_GetAttr(owner, pname);
    if (original == NULL) {
        Py_DECREF(pname);
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear(); /* not in this torch build: skipped */
            return 0;
        }
        return -1;
    }
    PyObject *own = NULL;
    if (PyType_Check(owner)) {
        PyObject *dict = ((PyTypeObject *)owner)->tp_dict;
        own = PyDict_GetItemWithError(dict, pname);
        if (own == NULL && PyErr_Occurred()) {
            Py_DECREF(pname);
            Py_DECREF(original);
            return -1;
        }
        Py_XINCREF(own);
    } else {
        own = Py_NewRef(original);
    }
    HookObject *hook =
        PyObject_GC_New(HookObject, PyType_Check(owner) ? st->hook_type : st->fn_hook_type);
    if (hook == NULL) {
        Py_DECREF(pname);
        Py_DECREF(original);
        Py_XDECREF(own);
        return -1;
    }
    hook->vectorcall = hook_entry(kind);
    hook->original = Py_NewRef(original);
    hook->owner = Py_NewRef(owner);
    hook->name = Py_NewRef(pname);
    hook->weakreflist = NULL;
    hook->kind = kind;
    direct_of(hook, original);
    PyObject_GC_Track(hook);
    if (PyObject_SetAttr(owner, pname, (PyObject *)hook) < 0) {
        Py_DECREF(hook);
        Py_DECREF(pname);
        Py_DECREF(original);
        Py_XDECREF(own);
        return -1;
    }
    jit_builtin_alias((PyObject *)hook, original, 1);
    PyObject *acls, *aown, *aput;
    alias_of(owner, pname, original, (PyObject *)hook, &acls, &aown, &aput);
    if (acls != NULL && alias_set(acls, pname, aput) < 0) {
        PyErr_Clear(); /* best effort: only identity differs without it */
        Py_CLEAR(acls);
        Py_CLEAR(aown);
        Py_CLEAR(aput);
    }
    if (disp.npatches == ML_MAX_PATCHES) { /* filled while Python ran */
        alias_restore(acls, pname, aown, aput);
        Py_XDECREF(acls);
        Py_XDECREF(aown);
        Py_XDECREF(aput);
        jit_builtin_alias((PyObject *)hook, original, 0);
        if (PyObject_SetAttr(owner, pname, own != NULL ? own : original) < 0) {
            PyErr_Clear();
        }
        Py_DECREF(hook);
        Py_DECREF(pname);
        Py_DECREF(original);
        Py_XDECREF(own);
        PyErr_SetString(PyExc_RuntimeError, "memlord: too many patches");
        return -1;
    }
    ml_patch *p = &disp.patches[disp.npatches++];
    p->owner = Py_NewRef(owner);
    p->name = pname;
    p->own = own;
    p->original = original;
    p->hook = (PyObject *)hook;
    p->alias_type = acls;
    p->alias_own = aown;
    p->alias_put = aput;
    p->group = installing_group;
    return 0;
}

/* 1 when owner.name still holds hook (memlord's patch is on top), 0 when
 * someone else's patch is there or the attribute is gone, -1 on error. */
static int holds_hook(PyObject *owner, PyObject *name, const PyObject *hook)
{
    if (PyType_Check(owner)) {
        PyObject *dict = ((PyTypeObject *)owner)->tp_dict;
        const PyObject *v = dict ? PyDict_GetItemWithError(dict, name) : NULL; /* compared only */
        if (v == NULL && PyErr_Occurred()) {
            return -1;
        }
        return v == hook;
    }
    PyObject *v = PyObject_GetAttr(owner, name);
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int same = v == hook;
    Py_DECREF(v);
    return same;
}

/* Put every original of a group back, the very same objects, newest first,
 * but only where the attribute still holds memlord's hook: a patch a third
 * party made on top of memlord's stays, and an attribute someone else has
 * already restored is left as it is (their removed patch is never put
 * back).  Each entry leaves the registry before any Python runs. */
static int unpatch_group(int group)
{
    int rc = 0;
    for (;;) {
        int i = disp.npatches - 1;
        while (i >= 0 && disp.patches[i].group != group) {
            i--;
        }
        if (i < 0) {
            break;
        }
        ml_patch p = disp.patches[i];
        memmove(&disp.patches[i], &disp.patches[i + 1],
                (size_t)(disp.npatches - i - 1) * sizeof(ml_patch));
        disp.npatches--;
        jit_builtin_alias(p.hook, p.original, 0);
        alias_restore(p.alias_type, p.name, p.alias_own, p.alias_put);
        int ours = holds_hook(p.owner, p.name, p.hook);
        int r = 0;
        if (ours > 0) {
            r = p.own != NULL ? PyObject_SetAttr(p.owner, p.name, p.own)
                              : PyObject_DelAttr(p.owner, p.name);
        }
        if (ours < 0 || r < 0) {
            rc = -1;
            PyErr_WriteUnraisable(p.owner);
        }
        Py_XDECREF(p.owner);
        Py_XDECREF(p.name);
        Py_XDECREF(p.own);
        Py_XDECREF(p.original);
        Py_XDECREF(p.hook);
        Py_XDECREF(p.alias_type);
        Py_XDECREF(p.alias_own);
        Py_XDECREF(p.alias_put);
    }
    if (disp.npatches == 0) {
        disp.st = NULL;
        Py_CLEAR(disp.module);
    }
    return rc;
}

static int group_installed(int group)
{
    for (int i = 0; i < disp.npatches; i++) {
        if (disp.patches[i].group == group) {
            return 1;
        }
    }
    return 0;
}

/* 1 when this torch was built with CUDA (or ROCm), so torch.cuda is real. */
static int torch_has_cuda(void)
{
    PyObject *version = ml_import_attr("torch", "version");
    if (version == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *cuda = PyObject_GetAttrString(version, "cuda");
    PyObject *hip = cuda ? PyObject_GetAttrString(version, "hip") : NULL;
    Py_DECREF(version);
    int has = (cuda != NULL && cuda != Py_None) || (hip != NULL && hip != Py_None);
    Py_XDECREF(cuda);
    Py_XDECREF(hip);
    PyErr_Clear();
    return has;
}

static int install_torch(PyObject *module)
{
    ml_state *st = ml_state_of_module(module);
    static const char *const moves[] = {"to", "cuda", "cpu"};
    static const char *const casts[] = {"half", "float", "double", "bfloat16"};
    installing_group = G_TORCH;
    Py_XSETREF(disp.module, Py_NewRef(module));
    disp.st = st;
    if (disp.s_cuda_stream == NULL &&
        (disp.s_cuda_stream = PyUnicode_InternFromString("cuda_stream")) == NULL) {
        goto fail;
    }
    for (size_t i = 0; i < sizeof(moves) / sizeof(moves[0]); i++) {
        if (patch_one(st, st->tensor_type, moves[i], HK_MOVE) < 0) {
            goto fail;
        }
    }
    for (size_t i = 0; i < sizeof(casts) / sizeof(casts[0]); i++) {
        if (patch_one(st, st->tensor_type, casts[i], HK_CAST) < 0) {
            goto fail;
        }
    }
    if (patch_one(st, st->module_type, "to", HK_MODULE_TO) < 0 ||
        patch_one(st, st->module_type, "_apply", HK_MODULE_APPLY) < 0) {
        goto fail;
    }
    if (disp.standin_stream != NULL || torch_has_cuda()) {
        PyObject *cuda = PyImport_ImportModule("torch.cuda");
        if (cuda == NULL) {
            goto fail;
        }
        PyObject *stream_cls = PyObject_GetAttrString(cuda, "Stream");
        PyObject *event_cls = stream_cls ? PyObject_GetAttrString(cuda, "Event") : NULL;
        if (disp.standin_stream != NULL) {
            /* A test's stand-in (tests/fakecuda/): its stream source, and
             * whatever torch.cuda's synchronize, Stream, Event are now. */
            disp.current_stream = event_cls ? Py_NewRef(disp.standin_stream) : NULL;
            disp.raw_stream = Py_NewRef(disp.standin_stream);
        } else {
            disp.current_stream = event_cls ? PyObject_GetAttrString(cuda, "current_stream") : NULL;
            disp.raw_stream = ml_import_attr("torch._C", "_cuda_getCurrentRawStream");
            if (disp.raw_stream == NULL) {
                PyErr_Clear(); /* older torch: current_stream(i).cuda_stream */
            }
        }
        int rc = disp.current_stream == NULL                             ? -1
                 : patch_one(st, cuda, "synchronize", HK_SYNC) < 0       ? -1
                 : patch_one(st, stream_cls, "synchronize", HK_SYNC) < 0 ? -1
                 : patch_one(st, event_cls, "synchronize", HK_SYNC) < 0  ? -1
                                                                         : 0;
        Py_DECREF(cuda);
        Py_XDECREF(stream_cls);
        Py_XDECREF(event_cls);
        if (rc < 0) {
            goto fail;
        }
    }
    return 0;
fail:
    unpatch_group(G_TORCH);
    Py_CLEAR(disp.current_stream);
    Py_CLEAR(disp.raw_stream);
    return -1;
}

static void uninstall_torch(void)
{
    unpatch_group(G_TORCH);
    Py_CLEAR(disp.current_stream);
    Py_CLEAR(disp.raw_stream);
}

/* The factories of hook_into_python (torch.<name>), Tensor.clone and
 * nn.Parameter.__new__. */
static int install_py(PyObject *module)
{
    static const char *const factories[] = {
        "empty",  "zeros",  "ones",     "full",     "rand", "randn",         "randint", "randperm",
        "tensor", "arange", "linspace", "logspace", "eye",  "empty_strided", "normal",
    };
    static const char *const likes[] = {
        "empty_like", "zeros_like", "ones_like",    "full_like",
        "rand_like",  "randn_like", "randint_like", "clone",
    };
    ml_state *st = ml_state_of_module(module);
    installing_group = G_PY;
    Py_XSETREF(disp.module, Py_NewRef(module));
    disp.st = st;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) {
        goto fail;
    }
    for (size_t i = 0; i < sizeof(factories) / sizeof(factories[0]); i++) {
        if (patch_one(st, torch, factories[i], HK_FACTORY) < 0) {
            Py_DECREF(torch);
            goto fail;
        }
    }
    for (size_t i = 0; i < sizeof(likes) / sizeof(likes[0]); i++) {
        if (patch_one(st, torch, likes[i], HK_FACTORY_LIKE) < 0) {
            Py_DECREF(torch);
            goto fail;
        }
    }
    Py_DECREF(torch);
    if (patch_one(st, st->tensor_type, "clone", HK_FACTORY_LIKE) < 0 ||
        patch_one(st, st->parameter_type, "__new__", HK_PARAM) < 0) {
        goto fail;
    }
    return 0;
fail:
    unpatch_group(G_PY);
    return -1;
}

/* New subscriber tuple: refs without the dead ones, with lord added or
 * removed.  NULL with an exception set. */
static PyObject *lords_with(PyObject *refs, PyObject *lord, int add)
{
    Py_ssize_t n = refs ? PyTuple_GET_SIZE(refs) : 0;
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ref = PyTuple_GET_ITEM(refs, i);
        const PyObject *l = ml_referent(ref);
        if (l == NULL || l == lord || PyList_Append(out, ref) == 0) {
            continue;
        }
        Py_DECREF(out);
        return NULL;
    }
    if (add) {
        PyObject *ref = PyWeakref_NewRef(lord, disp.on_lord_death);
        if (ref == NULL || PyList_Append(out, ref) < 0) {
            Py_XDECREF(ref);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(ref);
    }
    PyObject *t = PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
}

static int refs_contain(PyObject *refs, const PyObject *lord)
{
    for (Py_ssize_t i = 0; refs != NULL && i < PyTuple_GET_SIZE(refs); i++) {
        if (ml_referent(PyTuple_GET_ITEM(refs, i)) == lord) {
            return 1;
        }
    }
    return 0;
}

static Py_ssize_t live_count(PyObject *refs)
{
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; refs != NULL && i < PyTuple_GET_SIZE(refs); i++) {
        k += ml_referent(PyTuple_GET_ITEM(refs, i)) != NULL;
    }
    return k;
}

/* At a safe point after a lord died: drop dead subscribers, and restore
 * torch's originals for a group nobody subscribes to any more. */
static void cleanup_dead_lords(void)
{
    PyObject **slots[2] = {&disp.lord_refs, &disp.py_lord_refs};
    for (int g = 0; g < 2; g++) {
        if (*slots[g] == NULL) {
            continue;
        }
        PyObject *refs = lords_with(*slots[g], NULL, 0);
        if (refs == NULL) {
            PyErr_WriteUnraisable(NULL);
            continue;
        }
        Py_XSETREF(*slots[g], refs);
        if (PyTuple_GET_SIZE(refs) == 0) {
            Py_CLEAR(*slots[g]);
            if (g == 0) {
                pending_drain(0, NULL, 0);
                uninstall_torch();
            } else {
                unpatch_group(G_PY);
            }
        }
    }
}

/* The weak references' callback: runs inside the lord's deallocator, so it
 * only schedules. */
static PyObject *lord_died(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ref))
{
    ml_safe_point_add_task(cleanup_dead_lords);
    Py_RETURN_NONE;
}

static PyMethodDef lord_died_def = {"_lord_died", lord_died, METH_O, NULL};

static int ensure_death_callback(void)
{
    if (disp.on_lord_death == NULL) {
        disp.on_lord_death = PyCFunction_New(&lord_died_def, NULL);
    }
    return disp.on_lord_death != NULL ? 0 : -1;
}

/* Add lord to a group's subscribers (*refs), installing the group's patches
 * when it is the first; nothing changes on failure. */
static int subscribe(PyObject **refs, int group, int (*install)(PyObject *), ml_book *lord)
{
    PyObject *lords = ensure_death_callback() < 0 ? NULL : lords_with(*refs, (PyObject *)lord, 1);
    if (lords == NULL) {
        return -1;
    }
    if (!group_installed(group) && install(lord->module) < 0) {
        Py_DECREF(lords);
        return -1;
    }
    Py_XSETREF(*refs, lords);
    return 0;
}

int ml_hooks_py_subscribe(ml_book *lord)
{
    return subscribe(&disp.py_lord_refs, G_PY, install_py, lord);
}

int ml_hooks_py_unsubscribe(ml_book *lord)
{
    if (!refs_contain(disp.py_lord_refs, (PyObject *)lord)) {
        return 0;
    }
    PyObject *lords = lords_with(disp.py_lord_refs, (PyObject *)lord, 0);
    if (lords == NULL) {
        return -1;
    }
    Py_XSETREF(disp.py_lord_refs, lords);
    if (PyTuple_GET_SIZE(disp.py_lord_refs) == 0) {
        Py_CLEAR(disp.py_lord_refs);
        unpatch_group(G_PY);
    }
    return 0;
}

/* ---- hook_into_torch()'s subscribers ------------------------------------------ */

int ml_hooks_torch_subscribe(ml_book *lord)
{
    return subscribe(&disp.lord_refs, G_TORCH, install_torch, lord);
}

int ml_hooks_torch_unsubscribe(ml_book *lord)
{
    PyObject *lords = lords_with(disp.lord_refs, (PyObject *)lord, 0);
    if (lords == NULL) {
        return -1;
    }
    Py_XSETREF(disp.lord_refs, lords);
    return 0;
}

void ml_hooks_torch_settle(ml_book *lord)
{
    /* This lord's deferred frees are credited before it leaves. */
    pending_drain(0, NULL, 0);
    pending_drain(1, (PyObject *)lord, 0);
    if (disp.lord_refs != NULL && PyTuple_GET_SIZE(disp.lord_refs) == 0) {
        Py_CLEAR(disp.lord_refs);
        uninstall_torch();
    }
}

void ml_hooks_poll(void)
{
    pending_drain(0, NULL, 0);
    ml_safe_point();
}

int64_t ml_hooks_pending_bytes(const ml_book *lord, const ml_selector *sel)
{
    return pending_bytes((const PyObject *)lord, sel);
}

Py_ssize_t ml_hooks_npending(void)
{
    return disp.npending;
}

PyObject *ml_hooks_cuda_standin(PyObject *Py_UNUSED(module), PyObject *source)
{
    if (source != Py_None && !PyCallable_Check(source)) {
        PyErr_Format(PyExc_TypeError,
                     "_cuda_standin(): argument 'source' must be callable or None, got %.100s",
                     Py_TYPE(source)->tp_name);
        return NULL;
    }
    if (group_installed(G_TORCH)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "_cuda_standin(): the torch hooks are installed; disable them first");
        return NULL;
    }
    Py_XSETREF(disp.standin_stream, source == Py_None ? NULL : Py_NewRef(source));
    Py_RETURN_NONE;
}

/* The names of the installed hooks that call their original's C function
 * directly (direct_of), as a list. */
static PyObject *direct_names(void)
{
    PyObject *names = PyList_New(0);
    for (int i = 0; names != NULL && i < disp.npatches; i++) {
        /* the list's growth may run the GC, which may unpatch: read again */
        if (i < disp.npatches && ((HookObject *)disp.patches[i].hook)->direct != NULL &&
            PyList_Append(names, disp.patches[i].name) < 0) {
            Py_CLEAR(names);
        }
    }
    return names;
}

PyObject *ml_hooks_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return Py_BuildValue("{s:O,s:O,s:n,s:n,s:n,s:n,s:n,s:N}", "installed",
                         group_installed(G_TORCH) ? Py_True : Py_False, "python_installed",
                         group_installed(G_PY) ? Py_True : Py_False, "subscribers",
                         live_count(disp.lord_refs), "python_subscribers",
                         live_count(disp.py_lord_refs), "pending", disp.npending, "events_created",
                         (Py_ssize_t)ml_cuda_events_created(), "events_pooled",
                         (Py_ssize_t)ml_cuda_events_pooled(), "direct", direct_names());
}
