/* The dispatcher: the process-wide record of what is patched, the
 * subscribed lords, the pending CUDA queue's storage, the per-thread state of
 * the hooks and the snapshot of lords one hooked call serves.  Private to
 * hooks/.
 *
 * Process-wide state (the one place memlord keeps mutable globals): patching
 * torch.Tensor.to is a process-wide act, so the record of what was patched,
 * the subscribed lords and the queue of deferred frees belong to the
 * process, not to a module instance.  All of it is touched only with the GIL
 * held. */
#ifndef MEMLORD_HOOKS_DISPATCH_H
#define MEMLORD_HOOKS_DISPATCH_H

#include "core/book.h"
#include "platform/ml_cuda.h"

/* Patch groups: the torch hooks and the python (lifetime) hooks come and go
 * independently. */
enum { G_TORCH = 1, G_PY = 2 };

/* One patched attribute. */
typedef struct {
    PyObject *owner;    /* class or module that was patched */
    PyObject *name;     /* attribute name */
    PyObject *own;      /* owner.__dict__[name] before patching, or NULL */
    PyObject *original; /* getattr(owner, name) before patching */
    PyObject *hook;     /* the HookObject installed */
    PyObject *put;      /* what owner.name was set to: the hook, or a staticmethod
                         * of it where own is a staticmethod (Parameter.__new__) */
    /* The same attribute in the class torch dispatches through, when that is
     * not owner (see alias_of): alias_type.__dict__[name] held alias_own
     * and now holds alias_put (the hook, or a staticmethod of it).  NULL
     * when there is none. */
    PyObject *alias_type;
    PyObject *alias_own;
    PyObject *alias_put;
    int group;
} ml_patch;

/* A free waiting for a CUDA copy: on its event, or, with none (yet), on
 * its stream (see ml_pending_push). */
typedef struct {
    ml_cuda_event *event; /* shared by the entries sealed together */
    uintptr_t stream;
    ml_dev dev;
    int64_t bytes;
    uintptr_t ptr;   /* the source storage's data pointer, 0 when unknown */
    PyObject *lords; /* tuple of lords to credit */
    ml_site site;
    int64_t queued_ns; /* monotonic clock when it was queued */
} ml_pending;

#define ML_MAX_PATCHES 64
#define ML_PENDING_HARD_CAP 8192

typedef struct {
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
    PyObject *lord_refs;     /* hook_into_torch() */
    PyObject *py_lord_refs;  /* hook_into_python(): the factory wrappers */
    PyObject *ops_lord_refs; /* hook_into_python(ops=True): the dispatch mode (ops.c) */
    PyObject *src_lord_refs; /* hook_into_python(): the category sources (ops.c) */
    Py_ssize_t npending;     /* frees waiting for a CUDA event (pending[]) */
    ml_patch patches[ML_MAX_PATCHES];
    int npatches;
    PyObject *on_lord_death;    /* the weak references' callback */
    PyObject *tracing_types[2]; /* FakeTensor, FunctionalTensor, once seen */
    PyObject *disable_tf;       /* torch._C.DisableTorchFunction, once needed */
    PyObject *current_stream;   /* torch.cuda.current_stream, or NULL */
    PyObject *raw_stream;       /* torch._C._cuda_getCurrentRawStream (an int), or NULL */
    PyObject *s_cuda_stream;
    PyObject *standin_stream; /* _testing.cuda_standin(): a test's stream source, or NULL */
    ml_pending *pending;
    Py_ssize_t cap;
} ml_dispatcher;

/* The one dispatcher of the process (hooks/dispatch.c). */
extern ml_dispatcher ml_disp;

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
    /* Hooked calls running on this thread (conversions, factories, the
     * dispatch mode's operators): an error leaving the outermost one is
     * offered to the OOM handler (oom.h).  oom_claimed: torch's CUDA OOM
     * observer reported the OOM now unwinding through them (_oom_claim()),
     * so the outermost one offers nothing; cleared when it returns. */
    int depth;
    int oom_claimed;
} ml_hook_tls;

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

/* 1 when the tuple lords holds lord. */
int ml_lords_contain(PyObject *lords, const PyObject *lord);
/* An empty set of lords with room for cap: 0, or -1 with MemoryError. */
int ml_lords_alloc(ml_lords *l, Py_ssize_t cap);
/* The live lords of refs (NULL: none); -1 with an exception set. */
int ml_lords_acquire_n(PyObject *refs, ml_lords *out);
void ml_lords_release_n(ml_lords *l);

/* ml_lords_acquire_n, with the common case (one subscriber) inline: every
 * hooked call takes this snapshot, and the call, the array's set-up and the
 * loop cost more than the one read of a weak reference (reading it runs no
 * Python). */
static inline int ml_lords_acquire(PyObject *refs, ml_lords *out)
{
    if (refs != NULL && PyTuple_GET_SIZE(refs) == 1) {
        PyObject *lord = ml_referent(PyTuple_GET_ITEM(refs, 0)); /* borrowed, NULL once dying */
        out->v = out->inl;
        out->n = lord != NULL;
        out->inl[0] = Py_XNewRef(lord);
        return 0;
    }
    return ml_lords_acquire_n(refs, out);
}

/* ml_lords_release_n, one lord inline (detached first: releasing it may run
 * Python). */
static inline void ml_lords_release(ml_lords *l)
{
    if (l->n == 1 && l->v == l->inl) {
        PyObject *lord = l->inl[0];
        l->n = 0;
        Py_DECREF(lord);
        return;
    }
    ml_lords_release_n(l);
}
/* A new tuple of the lords (a pending free keeps one). */
PyObject *ml_lords_tuple(const ml_lords *l);
/* An accounting failure never reaches the caller: reported as unraisable. */
ML_COLD void ml_report_failure(PyObject *hook);

#endif
