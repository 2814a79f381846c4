/* Lifetime tracking through C weak-reference callbacks.
 *
 * A tracker is a subclass of weakref.ref that carries the size snapshot of
 * the object it watches.  Its callback is the lord's registry, one small
 * callable shared by all of the lord's trackers, which holds only a
 * borrowed pointer to the lord (cleared when the lord goes): no tracker
 * holds a strong reference to the lord or to the object, so nothing forms a
 * cycle.  A tracker owns one reference to itself until its object dies (the
 * callback credits the free and drops it) or it is cancelled (free(obj), a
 * counted move, a transfer), so no Python container per tracked object is
 * needed: about 100 bytes per live tracked object in all. */
#include "lifetime.h"
#include "hooks.h"

#include <structmember.h>
#include <string.h>

#define ML_TR_OWNED 1u

typedef struct {
    PyWeakReference base;
    ml_dev dev;
    uint32_t flags;
    int64_t bytes;
    ml_delta *more; /* further devices of a module spanning several, or NULL */
    int nmore;
} TrackerObject;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    MemLordObject *lord;        /* borrowed; NULL once the lord is gone or detached */
    PyTypeObject *tracker_type; /* strong: what its callbacks accept */
    Py_ssize_t live;            /* trackers still owned */
} RegistryObject;

typedef struct {
    PyObject_HEAD
    MemLordObject *lord; /* strong */
    int enabled;
    int factories;
    int deep;
} PyHandleObject;

static int finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* ---- the tracker type --------------------------------------------------- */

/* Trackers come and go with every tracked tensor, so the memory of dead
 * ones is kept in a small per-module free list (as CPython does for tuples):
 * a new tracker then costs no allocation and no GC bookkeeping.  Sanitizer
 * builds keep no list, so that a use after free is still caught. */
static void tracker_free(void *op)
{
#ifndef ML_NO_FREELIST
    ml_state *st = PyType_GetModuleState(Py_TYPE((PyObject *)op));
    if (st != NULL && !st->tracker_free_closed && st->ntracker_free < ML_TRACKER_FREELIST) {
        st->tracker_free[st->ntracker_free++] = op; /* untracked by weakref's dealloc */
        return;
    }
#endif
    PyObject_GC_Del(op);
}

static TrackerObject *tracker_alloc(ml_state *st, PyTypeObject *tp)
{
    if (st->ntracker_free == 0) {
        return (TrackerObject *)tp->tp_alloc(tp, 0);
    }
    PyObject *op = st->tracker_free[--st->ntracker_free];
    memset((char *)op + sizeof(PyObject), 0, sizeof(TrackerObject) - sizeof(PyObject));
    PyObject_Init(op, tp); /* a new reference to tp, as tp_alloc takes */
    PyObject_GC_Track(op);
    return (TrackerObject *)op;
}

void ml_life_free_trackers(ml_state *st)
{
    st->tracker_free_closed = 1; /* trackers that die later are freed at once */
    while (st->ntracker_free > 0) {
        PyObject_GC_Del(st->tracker_free[--st->ntracker_free]);
    }
}

static void tracker_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyMem_Free(((TrackerObject *)self)->more);
    ((TrackerObject *)self)->more = NULL;
    _PyWeakref_RefType.tp_dealloc(self);
    Py_DECREF(tp);
}

static int tracker_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return _PyWeakref_RefType.tp_traverse(self, visit, arg);
}

static PyType_Slot tracker_slots[] = {
    {Py_tp_dealloc, tracker_dealloc},
    {Py_tp_free, tracker_free},
    {Py_tp_traverse, tracker_traverse},
    {Py_tp_doc, "A weak reference that credits its object's bytes to a MemLord when the "
                "object dies."},
    {0, NULL},
};

PyType_Spec ml_tracker_spec = {
    .name = "memlord._core.Tracker",
    .basicsize = sizeof(TrackerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = tracker_slots,
};

/* ---- the registry: the callback of every tracker of one lord ------------ */

static int tracker_deltas(TrackerObject *tr, ml_delta *buf, int cap, ml_delta **out)
{
    int n = 1 + tr->nmore;
    ml_delta *d = n <= cap ? buf : PyMem_Malloc((size_t)n * sizeof(ml_delta));
    if (d == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    d[0] = (ml_delta){tr->dev, tr->bytes, 1};
    for (int i = 0; i < tr->nmore; i++) {
        d[i + 1] = tr->more[i];
    }
    *out = d;
    return n;
}

static void release(RegistryObject *reg, TrackerObject *tr)
{
    tr->flags &= ~ML_TR_OWNED;
    reg->live--;
    Py_DECREF(tr);
}

static PyObject *registry_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                     PyObject *Py_UNUSED(kwnames))
{
    RegistryObject *reg = (RegistryObject *)callable;
    if (PyVectorcall_NARGS(nargsf) != 1) {
        Py_RETURN_NONE;
    }
    /* Called by hand (the callback is reachable from Python through
     * weakref.getweakrefs(obj)[i].__callback__), it must do nothing: only a
     * tracker of this registry whose object is already dead counts. */
    TrackerObject *tr = (TrackerObject *)args[0];
    if (!Py_IS_TYPE(args[0], reg->tracker_type) || tr->base.wr_object != Py_None ||
        !(tr->flags & ML_TR_OWNED)) {
        Py_RETURN_NONE; /* not ours, still alive, or cancelled */
    }
    MemLordObject *lord = reg->lord;
    if (lord != NULL && !finalizing()) {
        ml_delta buf[4], *d = NULL;
        int n = tracker_deltas(tr, buf, 4, &d);
        if (n > 0) {
            ml_site site = {NULL, 0};
            if (lord->track_callsite) {
                ml_site_capture(ml_lord_state(lord), &site);
            }
            Py_INCREF(lord);
            if (ml_lord_record(lord, ML_REC_FREE, d, n, &site, "(del)", NULL) < 0) {
                PyErr_WriteUnraisable((PyObject *)lord);
            }
            Py_DECREF(lord);
            ml_site_clear(&site);
            if (d != buf) {
                PyMem_Free(d);
            }
        } else {
            PyErr_WriteUnraisable(callable);
        }
    }
    release(reg, tr);
    Py_RETURN_NONE;
}

static PyObject *registry_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static void registry_dealloc(PyObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_CLEAR(((RegistryObject *)self)->tracker_type);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef registry_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(RegistryObject, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot registry_slots[] = {
    {Py_tp_call, registry_call},
    {Py_tp_dealloc, registry_dealloc},
    {Py_tp_members, registry_members},
    {0, NULL},
};

PyType_Spec ml_registry_spec = {
    .name = "memlord._core.Registry",
    .basicsize = sizeof(RegistryObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = registry_slots,
};

static RegistryObject *get_registry(MemLordObject *lord)
{
    if (lord->registry == NULL) {
        ml_state *st = ml_lord_state(lord);
        RegistryObject *reg = PyObject_New(RegistryObject, st->registry_type);
        if (reg == NULL) {
            return NULL;
        }
        reg->vectorcall = registry_vectorcall;
        reg->lord = lord;
        reg->tracker_type = (PyTypeObject *)Py_NewRef(st->tracker_type);
        reg->live = 0;
        lord->registry = (PyObject *)reg;
    }
    return (RegistryObject *)lord->registry;
}

/* ---- registration ------------------------------------------------------- */

static PyObject **weaklist(PyObject *obj)
{
    const PyTypeObject *tp = Py_TYPE(obj);
    if (tp->tp_weaklistoffset == 0) {
        return NULL;
    }
    return (PyObject **)((char *)obj + tp->tp_weaklistoffset);
}

/* Building a tracker through weakref.ref's constructor costs an argument
 * tuple and its parsing per object, which is most of the cost of tracking a
 * small tensor.  On the CPython versions whose weakref layout memlord knows
 * (3.11 to 3.13 with the GIL), trackers are linked directly, following
 * weakrefobject.c: after the object's basic ref and proxy (callback-less,
 * exact types), at the head otherwise.  The direct path is self-tested once
 * at import (process-wide facts about the interpreter, hence globals) and
 * the constructor is used when the test fails. */
static int direct_ok = -1;

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
#define ML_DIRECT_TRACKERS 1
static vectorcallfunc weakref_vectorcall;
#endif

static TrackerObject *tracker_new(PyTypeObject *tp, PyObject *obj, PyObject *callback)
{
#ifdef ML_DIRECT_TRACKERS
    if (direct_ok == 1) {
        PyWeakReference **list = (PyWeakReference **)weaklist(obj);
        TrackerObject *tr = tracker_alloc(PyType_GetModuleState(tp), tp);
        if (tr == NULL) {
            return NULL;
        }
        PyWeakReference *self = &tr->base;
        self->hash = -1;
        self->wr_object = obj;
        self->wr_callback = Py_NewRef(callback);
        self->vectorcall = weakref_vectorcall;
        PyWeakReference *prev = NULL, *head = *list;
        if (head != NULL && head->wr_callback == NULL) {
            if (PyWeakref_CheckRefExact(head)) {
                prev = head;
                head = head->wr_next;
            }
            if (head != NULL && head->wr_callback == NULL && PyWeakref_CheckProxy(head)) {
                prev = head;
            }
        }
        if (prev == NULL) {
            self->wr_prev = NULL;
            self->wr_next = *list;
            if (*list != NULL) {
                (*list)->wr_prev = self;
            }
            *list = self;
        } else {
            self->wr_prev = prev;
            self->wr_next = prev->wr_next;
            if (prev->wr_next != NULL) {
                prev->wr_next->wr_prev = self;
            }
            prev->wr_next = self;
        }
        return tr;
    }
#endif
    PyObject *args = PyTuple_Pack(2, obj, callback);
    if (args == NULL) {
        return NULL;
    }
    TrackerObject *tr = (TrackerObject *)_PyWeakref_RefType.tp_new(tp, args, NULL);
    Py_DECREF(args);
    return tr;
}

#ifdef ML_DIRECT_TRACKERS
static int selftest_fired;

static PyObject *selftest_callback(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ref))
{
    selftest_fired++;
    Py_RETURN_NONE;
}

static PyMethodDef selftest_def = {"_memlord_selftest", selftest_callback, METH_O, NULL};
#endif

/* Link trackers directly next to a basic ref, check that weakref's own
 * functions see them, and that deaths call back. */
int ml_life_selftest(PyTypeObject *tracker_type)
{
#ifdef ML_DIRECT_TRACKERS
    direct_ok = 0;
    PyObject *cb = PyCFunction_New(&selftest_def, NULL);
    PyObject *obj = PySet_New(NULL);
    PyObject *basic = obj ? PyWeakref_NewRef(obj, NULL) : NULL;
    if (basic == NULL || cb == NULL) {
        Py_XDECREF(cb);
        Py_XDECREF(obj);
        return -1;
    }
    weakref_vectorcall = ((PyWeakReference *)basic)->vectorcall;
    direct_ok = 1;
    TrackerObject *a = tracker_new(tracker_type, obj, cb);
    TrackerObject *b = a ? tracker_new(tracker_type, obj, cb) : NULL;
    direct_ok = 0;
    Py_ssize_t count = 0;
    for (const PyWeakReference *r = *(PyWeakReference **)weaklist(obj); r != NULL; r = r->wr_next) {
        count++;
    }
    int ok = a != NULL && b != NULL && count == 3 && a->base.wr_object == obj &&
             *(PyWeakReference **)weaklist(obj) == (PyWeakReference *)basic;
    PyObject *basic2 = ok ? PyWeakref_NewRef(obj, NULL) : NULL;
    ok = ok && basic2 == basic; /* the basic ref is still found first */
    Py_XDECREF(basic2);
    selftest_fired = 0;
    Py_DECREF(obj);
    ok = ok && selftest_fired == 2 && ((PyWeakReference *)basic)->wr_object == Py_None;
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_DECREF(basic);
    Py_DECREF(cb);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        ok = 0;
    }
    direct_ok = ok;
#else
    (void)tracker_type;
    direct_ok = 0;
#endif
    return 0;
}

int ml_life_direct(void)
{
    return direct_ok == 1;
}

int ml_life_register(MemLordObject *lord, PyObject *obj, const ml_delta *d, int n)
{
    if (n <= 0 || weaklist(obj) == NULL) {
        return 0;
    }
    RegistryObject *reg = get_registry(lord);
    if (reg == NULL) {
        return -1;
    }
    ml_delta *more = NULL;
    if (n > 1) {
        more = PyMem_Malloc((size_t)(n - 1) * sizeof(ml_delta));
        if (more == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (int i = 1; i < n; i++) {
            more[i - 1] = d[i];
        }
    }
    TrackerObject *tr = tracker_new(ml_lord_state(lord)->tracker_type, obj, (PyObject *)reg);
    if (tr == NULL) {
        PyMem_Free(more);
        return -1;
    }
    tr->dev = d[0].dev;
    tr->bytes = d[0].bytes;
    tr->more = more;
    tr->nmore = n - 1;
    tr->flags = ML_TR_OWNED; /* the reference we hold from here on */
    reg->live++;
    return 0;
}

/* Call fn on each owned tracker of lord on obj.  The list may lose the
 * current entry inside fn, so the next one is read first. */
typedef int (*tracker_fn)(MemLordObject *lord, RegistryObject *reg, TrackerObject *tr, void *arg);

static int for_each_tracker(MemLordObject *lord, PyObject *obj, tracker_fn fn, void *arg)
{
    PyObject **list = weaklist(obj);
    if (list == NULL || lord->registry == NULL) {
        return 0;
    }
    RegistryObject *reg = (RegistryObject *)lord->registry;
    PyTypeObject *tracker_type = ml_lord_state(lord)->tracker_type;
    int count = 0;
    PyWeakReference *ref = (PyWeakReference *)*list;
    while (ref != NULL) {
        PyWeakReference *next = ref->wr_next;
        if (Py_IS_TYPE(ref, tracker_type) && ref->wr_callback == (PyObject *)reg &&
            (((TrackerObject *)ref)->flags & ML_TR_OWNED)) {
            int rc = fn(lord, reg, (TrackerObject *)ref, arg);
            if (rc < 0) {
                return -1;
            }
            count++;
            if (rc > 0) {
                break;
            }
        }
        ref = next;
    }
    return count;
}

static int cancel_one(MemLordObject *Py_UNUSED(lord), RegistryObject *reg, TrackerObject *tr,
                      void *Py_UNUSED(arg))
{
    release(reg, tr);
    return 0;
}

int ml_life_cancel(MemLordObject *lord, PyObject *obj)
{
    return for_each_tracker(lord, obj, cancel_one, NULL);
}

static int transfer_one(MemLordObject *lord, RegistryObject *reg, TrackerObject *tr, void *arg)
{
    ml_delta buf[4], *d = NULL;
    int n = tracker_deltas(tr, buf, 4, &d);
    if (n < 0) {
        return -1;
    }
    int rc = ml_life_register(lord, (PyObject *)arg, d, n);
    if (d != buf) {
        PyMem_Free(d);
    }
    if (rc < 0) {
        return -1;
    }
    release(reg, tr);
    return 0;
}

int ml_life_transfer(MemLordObject *lord, PyObject *src, PyObject *dst)
{
    return for_each_tracker(lord, src, transfer_one, dst);
}

typedef struct {
    ml_dev dev;
    int64_t bytes;
} resize_arg;

static int resize_one(MemLordObject *Py_UNUSED(lord), RegistryObject *Py_UNUSED(reg),
                      TrackerObject *tr, void *arg)
{
    const resize_arg *r = arg;
    tr->dev = r->dev;
    tr->bytes = r->bytes;
    PyMem_Free(tr->more);
    tr->more = NULL;
    tr->nmore = 0;
    return 1; /* one is enough */
}

int ml_life_resize(MemLordObject *lord, PyObject *obj, ml_dev dev, int64_t bytes)
{
    resize_arg r = {dev, bytes};
    return for_each_tracker(lord, obj, resize_one, &r);
}

void ml_life_detach(MemLordObject *lord)
{
    RegistryObject *reg = (RegistryObject *)lord->registry;
    if (reg == NULL) {
        return;
    }
    reg->lord = NULL; /* outstanding trackers become inert */
    lord->registry = NULL;
    Py_DECREF(reg);
}

Py_ssize_t ml_life_count(MemLordObject *lord)
{
    return lord->registry ? ((RegistryObject *)lord->registry)->live : 0;
}

/* ---- the handle --------------------------------------------------------- */

PyObject *ml_life_enable(MemLordObject *lord, int factories, int deep)
{
    if (lord->py_handle != NULL) {
        PyHandleObject *h = (PyHandleObject *)lord->py_handle;
        if (h->factories != factories || h->deep != deep) {
            PyErr_SetString(PyExc_ValueError,
                            "hook_into_python(): already enabled with other options; "
                            "disable() it first");
            return NULL;
        }
        return Py_NewRef(h); /* enabling again is a no-op */
    }
    ml_state *st = ml_lord_state(lord);
    PyHandleObject *h = PyObject_GC_New(PyHandleObject, st->pyhandle_type);
    if (h == NULL) {
        return NULL;
    }
    h->lord = (MemLordObject *)Py_NewRef(lord);
    h->enabled = 0;
    h->factories = factories;
    h->deep = deep;
    PyObject_GC_Track(h);
    if (factories && ml_hooks_py_subscribe(lord) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    h->enabled = 1;
    lord->deep_autowrap = deep;
    lord->py_handle = Py_NewRef(h);
    return (PyObject *)h;
}

static PyObject *pyhandle_disable(PyHandleObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->enabled) {
        Py_RETURN_NONE;
    }
    self->enabled = 0;
    MemLordObject *lord = self->lord;
    lord->deep_autowrap = 0;
    if (self->factories && ml_hooks_py_unsubscribe(lord) < 0) {
        return NULL;
    }
    if (lord->py_handle == (PyObject *)self) {
        Py_CLEAR(lord->py_handle);
    }
    Py_RETURN_NONE;
}

static PyObject *pyhandle_enter(PyHandleObject *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self);
}

static PyObject *pyhandle_exit(PyHandleObject *self, PyObject *Py_UNUSED(args))
{
    PyObject *r = pyhandle_disable(self, NULL);
    if (r == NULL) {
        return NULL;
    }
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *pyhandle_get_enabled(PyHandleObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->enabled);
}

static PyObject *pyhandle_get_lord(PyHandleObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->lord);
}

static PyObject *pyhandle_get_tracked(PyHandleObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(ml_life_count(self->lord));
}

static PyObject *pyhandle_repr(PyHandleObject *self)
{
    return PyUnicode_FromFormat("<memlord python hooks %s, factories=%s, deep_autowrap=%s>",
                                self->enabled ? "enabled" : "disabled",
                                self->factories ? "on" : "off", self->deep ? "on" : "off");
}

static int pyhandle_traverse(PyHandleObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->lord);
    return 0;
}

static int pyhandle_clear(PyHandleObject *self)
{
    Py_CLEAR(self->lord);
    return 0;
}

static void pyhandle_dealloc(PyHandleObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    pyhandle_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef pyhandle_methods[] = {
    {"disable", (PyCFunction)pyhandle_disable, METH_NOARGS,
     "disable($self, /)\n--\n\nStop registering new objects and restore the wrapped factories. "
     "Objects already registered still credit their bytes when they die."},
    {"__enter__", (PyCFunction)pyhandle_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)pyhandle_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pyhandle_getset[] = {
    {"enabled", (getter)pyhandle_get_enabled, NULL, "Whether new objects are registered.", NULL},
    {"lord", (getter)pyhandle_get_lord, NULL, "The MemLord this handle belongs to.", NULL},
    {"tracked", (getter)pyhandle_get_tracked, NULL,
     "Objects registered and still alive (their free not yet credited).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot pyhandle_slots[] = {
    {Py_tp_doc, "What MemLord.hook_into_python() returns: disable(), enabled, tracked; a "
                "context manager."},
    {Py_tp_methods, pyhandle_methods},
    {Py_tp_getset, pyhandle_getset},
    {Py_tp_repr, pyhandle_repr},
    {Py_tp_traverse, pyhandle_traverse},
    {Py_tp_clear, pyhandle_clear},
    {Py_tp_dealloc, pyhandle_dealloc},
    {0, NULL},
};

PyType_Spec ml_pyhandle_spec = {
    .name = "memlord.PythonHooks",
    .basicsize = sizeof(PyHandleObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = pyhandle_slots,
};
