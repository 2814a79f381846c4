/* Op outputs (hook_into_python(ops=True)) and the category sources. */
#include "hooks/ops.h"
#include <structmember.h>
#include "base/compat.h"
#include "core/safepoint.h"
#include "hooks/context.h"
#include "hooks/dispatch.h"
#include "hooks/entries.h"
#include "hooks/guards.h"
#include "hooks/lifetime.h"

/* What the mode remembers of an operator, per OpOverload (a dict from the
 * overload to a tuple (callable, fresh, flags)): the callable torch's
 * OpOverload.__call__ calls (its _op), the bit mask of the returns that are
 * new (no alias annotation in the schema), and flags. */
#define OP_RESIZE 1 /* resize_, resize_as_, set_: the storage may change size */
#define OP_SET 32   /* set_: the storage it puts in the tensor existed (not made here) */
#define OP_OUT 2    /* an out= overload: torch resizes an out tensor that is too small */
/* Written arguments (in-place, out=: a sparse one may get new component
 * tensors): bit OP_WRITES_SHIFT + i for positional argument i (as torch's
 * dispatch passes them: every argument that is not keyword-only), OP_WRITES_KW
 * for a keyword-only one (out=), OP_WRITES_ALL for one beyond the mask. */
#define OP_WRITES_KW 4
#define OP_WRITES_ALL 8
/* a higher-order operator (torch.cond, map, while_loop, flex_attention...):
 * run_hop runs it */
#define OP_HOP 16
#define OP_WRITES_SHIFT 8
#define OP_WRITES_MAX 20
#define OP_MUTATES (OP_WRITES_KW | OP_WRITES_ALL | (((1 << OP_WRITES_MAX) - 1) << OP_WRITES_SHIFT))
#define OP_CACHE_MAX 8192

static PyObject *op_cache;   /* dict, strong */
static PyObject *overload_t; /* torch._ops.OpOverload, strong, or NULL */
static PyObject *hop_t;      /* torch._ops.HigherOrderOperator, strong, or NULL */

/* memlord._ops._install, once imported (strong): at exit, when a lord's
 * death uninstalls a group, nothing can be imported any more. */
static PyObject *install_fn;

int ml_ops_install(const char *group, int on)
{
    if (ml_finalizing()) {
        return 0; /* the interpreter is going: nothing to put back */
    }
    if (install_fn == NULL) {
        PyObject *mod = PyImport_ImportModule("memlord._ops");
        if (mod == NULL) {
            return -1;
        }
        PyObject *fn = PyObject_GetAttrString(mod, "_install");
        Py_DECREF(mod);
        if (fn == NULL) {
            return -1;
        }
        if (install_fn == NULL) {
            install_fn = fn;
        } else {
            Py_DECREF(fn); /* the import ran code that set it */
        }
    }
    PyObject *fn = Py_NewRef(install_fn);
    PyObject *r = PyObject_CallFunction(fn, "sO", group, on ? Py_True : Py_False);
    Py_DECREF(fn);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* The mask of the new returns of func's schema; -1 with an exception set. */
static long fresh_returns(PyObject *func, int *flags)
{
    *flags = 0;
    PyObject *schema = PyObject_GetAttrString(func, "_schema");
    if (schema == NULL) {
        return -1;
    }
    long mask = 0;
    PyObject *name = PyObject_GetAttrString(schema, "name");
    PyObject *returns = name != NULL ? PyObject_GetAttrString(schema, "returns") : NULL;
    PyObject *seq = returns != NULL ? PySequence_Fast(returns, "returns") : NULL;
    if (seq == NULL) {
        mask = -1;
        goto done;
    }
    const char *n = PyUnicode_AsUTF8(name);
    if (n == NULL) {
        mask = -1;
        goto done;
    }
    if (strcmp(n, "aten::resize_") == 0 || strcmp(n, "aten::resize_as_") == 0) {
        *flags |= OP_RESIZE;
    } else if (strcmp(n, "aten::set_") == 0) {
        *flags |= OP_RESIZE | OP_SET;
    }
    PyObject *arguments = PyObject_GetAttrString(schema, "arguments");
    PyObject *aseq = arguments != NULL ? PySequence_Fast(arguments, "arguments") : NULL;
    Py_XDECREF(arguments);
    if (aseq == NULL) {
        mask = -1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(aseq); i++) {
        PyObject *arg = PySequence_Fast_GET_ITEM(aseq, i); /* aseq holds it */
        PyObject *is_out = PyObject_GetAttrString(arg, "is_out");
        int out = is_out != NULL ? PyObject_IsTrue(is_out) : -1;
        Py_XDECREF(is_out);
        PyObject *kw = out >= 0 ? PyObject_GetAttrString(arg, "kwarg_only") : NULL;
        int kwarg_only = kw != NULL ? PyObject_IsTrue(kw) : -1;
        Py_XDECREF(kw);
        PyObject *alias = kwarg_only >= 0 ? PyObject_GetAttrString(arg, "alias_info") : NULL;
        PyObject *write = alias != NULL && alias != Py_None
                              ? PyObject_GetAttrString(alias, "is_write")
                              : Py_XNewRef(alias);
        int written = write == NULL ? -1 : 0;
        if (write != NULL && write != Py_None) {
            written = PyObject_IsTrue(write);
        }
        Py_XDECREF(write);
        Py_XDECREF(alias);
        if (out < 0 || kwarg_only < 0 || written < 0) {
            Py_DECREF(aseq);
            mask = -1;
            goto done;
        }
        if (out) {
            *flags |= OP_OUT;
        }
        if (written) {
            *flags |= kwarg_only          ? OP_WRITES_KW
                      : i < OP_WRITES_MAX ? 1 << (OP_WRITES_SHIFT + i)
                                          : OP_WRITES_ALL;
        }
    }
    Py_DECREF(aseq);
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < k && i < 31; i++) {
        PyObject *alias = PyObject_GetAttrString(PySequence_Fast_GET_ITEM(seq, i), "alias_info");
        if (alias == NULL) {
            mask = -1;
            goto done;
        }
        if (alias == Py_None) {
            mask |= 1L << i;
        }
        Py_DECREF(alias);
    }
done:
    Py_XDECREF(seq);
    Py_XDECREF(returns);
    Py_XDECREF(name);
    Py_DECREF(schema);
    return mask;
}

/* func's entry (a new reference): (callable, fresh, flags).  A
 * higher-order operator is flagged OP_HOP (run_hop runs it);
 * another object without a schema is called as it is and creates nothing
 * memlord counts here. */
static PyObject *op_entry(PyObject *func)
{
    if (op_cache == NULL) {
        op_cache = PyDict_New();
        if (op_cache == NULL) {
            return NULL;
        }
    }
    PyObject *e = PyDict_GetItemWithError(op_cache, func);
    if (e != NULL) {
        return Py_NewRef(e);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (overload_t == NULL || hop_t == NULL) {
        PyObject *ops = PyImport_ImportModule("torch._ops");
        PyObject *o = ops != NULL ? PyObject_GetAttrString(ops, "OpOverload") : NULL;
        PyObject *h = o != NULL ? PyObject_GetAttrString(ops, "HigherOrderOperator") : NULL;
        Py_XDECREF(ops);
        if (h == NULL) {
            Py_XDECREF(o);
            return NULL;
        }
        /* the import may have run code that set them */
        Py_XSETREF(overload_t, o);
        Py_XSETREF(hop_t, h);
    }
    PyObject *call = NULL;
    long fresh = 0;
    int flags = 0;
    if ((PyObject *)Py_TYPE(func) == overload_t) {
        /* what OpOverload.__call__ does, without its frame */
        call = PyObject_GetAttrString(func, "_op");
        if (call == NULL) {
            return NULL;
        }
        fresh = fresh_returns(func, &flags);
        if (fresh < 0) {
            PyErr_Clear(); /* counted as creating nothing */
            fresh = 0;
        }
    } else {
        call = Py_NewRef(func);
        int is_hop = PyObject_IsInstance(func, hop_t);
        if (is_hop < 0) {
            Py_DECREF(call);
            return NULL;
        }
        if (is_hop) {
            flags |= OP_HOP;
        } else if (PyObject_HasAttrString(func, "_schema")) {
            fresh = fresh_returns(func, &flags);
            if (fresh < 0) {
                PyErr_Clear();
                fresh = 0;
            }
        }
    }
    e = Py_BuildValue("(Nli)", call, fresh, flags);
    if (e == NULL) {
        return NULL;
    }
    if (PyDict_GET_SIZE(op_cache) >= OP_CACHE_MAX) {
        PyDict_Clear(op_cache);
    }
    if (PyDict_SetItem(op_cache, func, e) < 0) {
        Py_DECREF(e);
        return NULL;
    }
    return e;
}

/* A plain tensor's storage as an item to count (1), or 0 when it is not
 * one memlord counts here (a subclass: fake, functional, a wrapper; meta;
 * empty); -1 only when memory ran out.  A wrapper subclass's inner
 * operators run in its __torch_dispatch__ while torch has this mode off
 * the stack: they are not seen (test_ops_mode.py, a strict xfail). */
static int item_of(ml_state *st, PyObject *t, ml_life_item *it)
{
    const PyTypeObject *tp = Py_TYPE(t);
    if (tp != (PyTypeObject *)st->tensor_type && tp != (PyTypeObject *)st->parameter_type) {
        return 0;
    }
    uintptr_t ptr = 0;
    int in_c = ml_tensor_storage_in_c(st, t, &it->dev, &ptr, &it->bytes);
    if (!in_c && ml_tensor_composite(st, t)) {
        return 0; /* components of their own: count_composite counts them */
    }
    if (!in_c && ml_tensor_storage(st, t, &it->dev, &ptr, &it->bytes) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    if (it->bytes <= 0) {
        return 0;
    }
    it->key = ml_tensor_untyped_storage(st, t);
    if (it->key == NULL) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    it->tensor = t;
    it->ptr = ptr;
    it->cat = ML_LIFE_CAT_CONTEXT;
    return 1;
}

#define OPS_ITEMS 8

/* What count_for_ops_lords does with items for each lord. */
enum {
    OPS_COUNT = 0,       /* count and track those it does not track yet */
    OPS_RESIZE = 1,      /* an item's storage tracked already counts its change of size
                          * (resize_, set_, a grown out=, a sparse tensor's component
                          * grown in place); the others as OPS_COUNT */
    OPS_RESIZE_ONLY = 2, /* items[0]'s storage counts its change of size when
                          * tracked; nothing else (UntypedStorage.resize_) */
    OPS_SET = 3,         /* as OPS_RESIZE, but a storage not tracked yet existed
                          * before (set_ allocates nothing): found, with no site */
};

/* Count items (n of them; their keys and tensors held by the caller) for
 * every lord of the ops group with lifetime tracking on, at one call site
 * read once (how: OPS_*).  Failures are reported as unraisable: accounting
 * never raises. */
static void count_for_ops_lords(ml_state *st, const ml_life_item *items, Py_ssize_t n, int how)
{
    ml_lords lords;
    if (ml_lords_acquire(ml_disp.ops_lord_refs, &lords) < 0) {
        ml_write_unraisable(NULL);
        return;
    }
    ml_site site = {0};
    int captured = 0;
    for (Py_ssize_t j = 0; j < lords.n; j++) {
        ml_book *lord = (ml_book *)lords.v[j];
        if (!ml_life_active(lord) ||
            (how == OPS_RESIZE_ONLY && !ml_life_tracks(lord, items[0].key))) {
            continue;
        }
        if (lord->track_callsite && !captured) {
            ml_site_capture(st, &site);
            captured = 1;
        }
        ml_site none = {0};
        const ml_site *s = lord->track_callsite ? &site : &none;
        int r = 0;
        Py_ssize_t nresize = how == OPS_COUNT ? 0 : how == OPS_RESIZE_ONLY ? 1 : n;
        for (Py_ssize_t i = 0; r >= 0 && i < nresize; i++) {
            r = ml_life_resize(lord, items[i].key, items[i].bytes, s);
        }
        if (r >= 0 && how != OPS_RESIZE_ONLY) {
            /* storages tracked already (resized above) add nothing */
            r = how == OPS_SET ? ml_life_count(lord, items, n, 0, &none, ML_SRC_FOUND, NULL)
                               : ml_life_count(lord, items, n, 0, s, ML_SRC_OP, NULL);
        }
        if (r < 0) {
            ml_write_unraisable((PyObject *)lord);
        }
    }
    ml_site_clear(&site);
    ml_lords_release(&lords);
}

/* Count result's new outputs for every lord of the ops group. */
static void count_outputs(ml_state *st, PyObject *result, long fresh, int flags)
{
    ml_life_item items[OPS_ITEMS];
    Py_ssize_t n = 0;
    PyObject *holder = NULL; /* result's items, held while counted */
    if (PyObject_TypeCheck(result, (PyTypeObject *)st->tensor_type)) {
        if ((fresh & 1) || (flags & OP_RESIZE)) {
            int r = item_of(st, result, &items[0]);
            if (r < 0) {
                goto fail;
            }
            n = r;
        }
    } else if (PyTuple_Check(result) || PyList_Check(result)) {
        holder = PySequence_Tuple(result); /* a list may change while counted */
        if (holder == NULL) {
            goto fail;
        }
        Py_ssize_t k = PyTuple_GET_SIZE(holder);
        /* a Tensor[] return (foreach ops) is one return of many tensors */
        int list_return = PyList_Check(result);
        for (Py_ssize_t i = 0; i < k && n < OPS_ITEMS; i++) {
            int is_fresh = list_return ? (int)(fresh & 1) : i < 31 && ((fresh >> i) & 1);
            PyObject *t = PyTuple_GET_ITEM(holder, i);
            if (!is_fresh || !PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type)) {
                continue;
            }
            int r = item_of(st, t, &items[n]);
            if (r < 0) {
                goto fail;
            }
            n += r;
        }
        if (list_return && PyTuple_GET_SIZE(holder) > OPS_ITEMS) {
            /* a long Tensor[] (foreach over many parameters): the rest one by one */
            for (Py_ssize_t i = OPS_ITEMS; i < PyTuple_GET_SIZE(holder); i++) {
                PyObject *t = PyTuple_GET_ITEM(holder, i);
                if (!(fresh & 1) || !PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type)) {
                    continue;
                }
                ml_life_item extra;
                int r = item_of(st, t, &extra);
                if (r < 0) {
                    goto fail;
                }
                if (r == 0) {
                    continue;
                }
                count_for_ops_lords(st, &extra, 1, OPS_COUNT);
                Py_DECREF(extra.key);
            }
        }
    }
    if (n == 0) {
        Py_XDECREF(holder);
        return;
    }
    /* resize_, set_: a tracked storage that changed size counts the change; one
     * not tracked yet is counted whole */
    count_for_ops_lords(st, items, n,
                        (flags & OP_SET)      ? OPS_SET
                        : (flags & OP_RESIZE) ? OPS_RESIZE
                                              : OPS_COUNT);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(items[i].key);
    }
    Py_XDECREF(holder);
    return;
fail:
    Py_XDECREF(holder);
    ml_write_unraisable(NULL);
}

/* out= operators: the plain tensors passed by keyword (the out tensors are
 * keyword-only in every aten schema) and their storages' bytes before the
 * call.  Strong references, released by out_grown. */
#define OPS_OUTS 8
typedef struct {
    Py_ssize_t n;
    PyObject *t[OPS_OUTS];
    int64_t bytes[OPS_OUTS];
} ops_outs;

static void out_before(ml_state *st, PyObject *kwargs, ops_outs *o)
{
    o->n = 0;
    Py_ssize_t pos = 0;
    PyObject *k;
    PyObject *v;
    while (kwargs != NULL && o->n < OPS_OUTS && PyDict_Next(kwargs, &pos, &k, &v)) {
        if (PyObject_TypeCheck(v, (PyTypeObject *)st->tensor_type)) {
            o->t[o->n] = Py_NewRef(v);
            o->bytes[o->n] = 0;
            o->n++;
        }
    }
    for (Py_ssize_t i = 0; i < o->n; i++) {
        ml_life_item it;
        int r = item_of(st, o->t[i], &it);
        if (r > 0) {
            o->bytes[i] = it.bytes;
            Py_DECREF(it.key);
        } else if (r < 0) {
            PyErr_Clear();
        }
    }
}

/* The out tensors whose storage torch grew (resized to fit the result):
 * counted like resize_ (a tracked storage counts the change, one not
 * tracked yet is counted whole: its memory is new). */
static void out_grown(ml_state *st, ops_outs *o)
{
    for (Py_ssize_t i = 0; i < o->n; i++) {
        ml_life_item it;
        int r = item_of(st, o->t[i], &it);
        if (r < 0) {
            ml_write_unraisable(NULL);
            continue;
        }
        if (r == 0 || it.bytes <= o->bytes[i]) {
            if (r > 0) {
                Py_DECREF(it.key);
            }
            continue;
        }
        count_for_ops_lords(st, &it, 1, OPS_RESIZE);
        Py_DECREF(it.key);
    }
    for (Py_ssize_t i = 0; i < o->n; i++) {
        Py_CLEAR(o->t[i]);
    }
    o->n = 0;
}

/* ---- composite results: sparse layouts, traceable wrapper subclasses ------
 *
 * A sparse tensor holds its memory in component tensors (indices and values;
 * compressed indices), a jagged NestedTensor in the inner tensors its
 * __tensor_flatten__ names (values, offsets).  An operator's composite result
 * counts every storage it holds that none of the operator's arguments held
 * before the call: torch.sparse_coo_tensor(i, v) and a NestedTensor's view
 * share their inputs' tensors; s.t() of a sparse tensor is annotated as a
 * view, yet holds new ones; j * 2 of a jagged one makes new values and keeps
 * j's offsets.  So every result is looked at, whatever its schema says. */

/* 1 when obj (a tensor, or a tuple, list or dict of them, levels deep) may
 * hold a composite tensor.  Runs no Python and allocates nothing. */
static int any_may_be_composite(const ml_state *st, PyObject *obj, int levels)
{
    if (PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type)) {
        return ml_tensor_may_be_composite(st, obj);
    }
    if (levels <= 0) {
        return 0;
    }
    if (PyTuple_Check(obj) || PyList_Check(obj)) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(obj); i++) {
            if (any_may_be_composite(st, PySequence_Fast_GET_ITEM(obj, i), levels - 1)) {
                return 1;
            }
        }
    } else if (PyDict_Check(obj)) {
        Py_ssize_t pos = 0;
        PyObject *k;
        PyObject *v;
        while (PyDict_Next(obj, &pos, &k, &v)) {
            if (any_may_be_composite(st, v, levels - 1)) {
                return 1;
            }
        }
    }
    return 0;
}

/* Call visit(st, t, ctx) for each tensor t in obj (levels deep in tuples,
 * lists and dicts); the first nonzero answer ends the visit and is returned.
 * The containers are copied first: visit may run Python. */
static int each_tensor(ml_state *st, PyObject *obj, int levels,
                       int (*visit)(ml_state *, PyObject *, void *), void *ctx)
{
    if (PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type)) {
        return visit(st, obj, ctx);
    }
    if (levels <= 0) {
        return 0;
    }
    PyObject *items = NULL;
    if (PyTuple_Check(obj)) {
        items = Py_NewRef(obj);
    } else if (PyList_Check(obj)) {
        items = PySequence_Tuple(obj);
    } else if (PyDict_Check(obj)) {
        PyObject *values = PyDict_Values(obj);
        items = values != NULL ? PySequence_Tuple(values) : NULL;
        Py_XDECREF(values);
    } else {
        return 0;
    }
    if (items == NULL) {
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyTuple_GET_SIZE(items); i++) {
        rc = each_tensor(st, PyTuple_GET_ITEM(items, i), levels - 1, visit, ctx);
    }
    Py_DECREF(items);
    return rc;
}

/* each_tensor's visits: is t composite (1 ends the visit); add t's
 * storages to the walk ctx (all of them, or a composite t's only).  What
 * cannot be read adds nothing: -1 only when memory ran out. */
static int visit_is_composite(ml_state *st, PyObject *t, void *Py_UNUSED(ctx))
{
    return ml_tensor_composite(st, t);
}

static int visit_walk(ml_state *st, PyObject *t, void *ctx)
{
    if (ml_walk_tensor(st, (ml_walk *)ctx, t) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
            return -1;
        }
        PyErr_Clear(); /* unreadable: what was read of it stands */
    }
    return 0;
}

static int visit_walk_composite(ml_state *st, PyObject *t, void *ctx)
{
    return ml_tensor_composite(st, t) ? visit_walk(st, t, ctx) : 0;
}

/* The storages of an operator's arguments (args, a tuple, and kwargs, a dict
 * or NULL: tensors and lists of them) into w, initialised here; the walk holds
 * them, so none can die and give its address to a result's storage while the
 * results are walked.  -1 only when memory ran out (w cleared). */
static int walk_args(ml_state *st, ml_walk *w, PyObject *fargs, PyObject *fkwargs)
{
    ml_walk_init(w);
    w->collect_keys = 1;
    w->opaque_ok = 1;
    if (each_tensor(st, fargs, 2, visit_walk, w) < 0 ||
        (fkwargs != NULL && each_tensor(st, fkwargs, 2, visit_walk, w) < 0)) {
        ml_walk_clear(w);
        return -1;
    }
    return 0;
}

/* Whether a written argument of the operator (flags: OP_WRITES_*) is
 * composite: exact 0, without Python (ml_tensor_may_be_composite); exact 1,
 * ml_tensor_composite (may read a getter).  Never raises but for memory. */
static int written_composite(ml_state *st, PyObject *fargs, PyObject *fkwargs, int flags, int exact)
{
    if (flags & OP_WRITES_ALL) {
        if (!exact) {
            return any_may_be_composite(st, fargs, 2) ||
                   (fkwargs != NULL && any_may_be_composite(st, fkwargs, 2));
        }
        int rc = each_tensor(st, fargs, 2, visit_is_composite, NULL);
        if (rc == 0 && fkwargs != NULL) {
            rc = each_tensor(st, fkwargs, 2, visit_is_composite, NULL);
        }
        return rc;
    }
    if ((flags & OP_WRITES_KW) && fkwargs != NULL) {
        int rc = exact ? each_tensor(st, fkwargs, 2, visit_is_composite, NULL)
                       : any_may_be_composite(st, fkwargs, 2);
        if (rc != 0) {
            return rc;
        }
    }
    for (Py_ssize_t i = 0; i < OP_WRITES_MAX && i < PyTuple_GET_SIZE(fargs); i++) {
        if (!(flags & (1 << (OP_WRITES_SHIFT + i)))) {
            continue;
        }
        PyObject *a = PyTuple_GET_ITEM(fargs, i); /* fargs is held: a tuple */
        int rc = exact ? each_tensor(st, a, 1, visit_is_composite, NULL)
                       : any_may_be_composite(st, a, 1);
        if (rc != 0) {
            return rc;
        }
    }
    return 0;
}

/* The argument storages of an operator that writes one of its arguments (an
 * in-place or out= operator) when a written argument is composite, taken
 * before the call: the operator may give a sparse argument new component
 * tensors, which are then new memory.  1 when *in was walked (the caller
 * clears it), 0 when not.  Failures are reported, never raised. */
static int args_before(ml_state *st, ml_walk *in, PyObject *fargs, PyObject *fkwargs, int flags)
{
    if (!written_composite(st, fargs, fkwargs, flags, 0)) {
        return 0;
    }
    /* the components are read through torch's methods: a TorchFunctionMode
     * sees only the program's calls */
    PyObject *guard = ml_tf_mode_active() ? ml_quiet_enter() : NULL;
    int rc = written_composite(st, fargs, fkwargs, flags, 1);
    if (rc > 0) {
        rc = walk_args(st, in, fargs, fkwargs) < 0 ? -1 : 1;
    }
    ml_quiet_exit(guard);
    if (rc < 0) {
        ml_write_unraisable(NULL);
        return 0;
    }
    return rc;
}

/* Count the storages the composite results hold that the arguments did not
 * (*in: the arguments' storages when args_before walked them, *have_in says;
 * else walked here, after the call: the operator wrote none of them). */
static void count_composite(ml_state *st, PyObject *result, PyObject *fargs, PyObject *fkwargs,
                            ml_walk *in, int *have_in)
{
    if (!any_may_be_composite(st, result, 2)) {
        return;
    }
    PyObject *guard = ml_tf_mode_active() ? ml_quiet_enter() : NULL;
    ml_walk out;
    ml_walk_init(&out);
    ml_life_item inline_items[OPS_ITEMS];
    ml_life_item *items = inline_items;
    Py_ssize_t n = 0;
    int rc = each_tensor(st, result, 2, visit_is_composite, NULL);
    if (rc < 0) {
        goto fail;
    }
    if (rc == 0) {
        goto done; /* none is (a plain tensor the C reader could not read) */
    }
    if (!*have_in) {
        if (walk_args(st, in, fargs, fkwargs) < 0) {
            goto fail;
        }
        *have_in = 1;
    }
    /* beside the arguments: what they hold adds nothing */
    out.collect_keys = 1;
    out.opaque_ok = 1;
    out.skip = in;
    if (each_tensor(st, result, 2, visit_walk_composite, &out) < 0) {
        goto fail;
    }
    if (out.n > OPS_ITEMS) {
        items = PyMem_Malloc((size_t)out.n * sizeof(ml_life_item));
        if (items == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < out.n; i++) {
        if (out.keys[i] == NULL) {
            continue; /* no storage to follow (an opaque component): never credited */
        }
        items[n++] = (ml_life_item){out.keys[i],          out.tensors[i],    out.blocks[i].dev,
                                    out.blocks[i].nbytes, out.blocks[i].ptr, ML_LIFE_CAT_CONTEXT};
    }
    if (n > 0) {
        /* the walk holds every key and tensor; a component grown in place
         * (tracked already) counts its growth */
        count_for_ops_lords(st, items, n, OPS_RESIZE);
    }
    goto done;
fail:
    ml_write_unraisable(NULL);
done:
    if (items != inline_items) {
        PyMem_Free(items);
    }
    out.skip = NULL;
    ml_walk_clear(&out);
    ml_quiet_exit(guard);
}

/* In front of op_cache, a direct-mapped table by the overload's address:
 * the dict's lookup calls OpOverload.__hash__, a Python method, at every
 * operator.  A slot holds its func, so no other object can have that
 * address while the slot names it. */
#define OP_FAST_SLOTS 512

typedef struct {
    PyObject *func; /* strong, or NULL */
    PyObject *call; /* strong */
    long fresh;
    int flags;
} op_fast;

static op_fast op_fast_tab[OP_FAST_SLOTS];

static inline op_fast *op_fast_slot(const PyObject *func)
{
    uintptr_t a = (uintptr_t)func;
    return &op_fast_tab[((a >> 4) ^ (a >> 13)) & (OP_FAST_SLOTS - 1)];
}

/* func's callable (a new reference) and masks; NULL with an exception set. */
static PyObject *op_lookup(PyObject *func, long *fresh, int *flags)
{
    op_fast *f = op_fast_slot(func);
    if (f->func == func) {
        *fresh = f->fresh;
        *flags = f->flags;
        return Py_NewRef(f->call);
    }
    PyObject *entry = op_entry(func);
    if (entry == NULL) {
        return NULL;
    }
    PyObject *call = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
    *fresh = PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
    *flags = (int)PyLong_AsLong(PyTuple_GET_ITEM(entry, 2));
    Py_DECREF(entry);
    /* op_entry may have run Python: the slot is read afresh */
    f = op_fast_slot(func);
    op_fast old = *f;
    *f = (op_fast){Py_NewRef(func), Py_NewRef(call), *fresh, *flags};
    /* released once the slot is consistent: a release may run anything */
    Py_XDECREF(old.func);
    Py_XDECREF(old.call);
    return call;
}

/* ---- higher-order operators ----------------------------------------------
 *
 * torch.cond, map, while_loop, flex_attention... reach the mode as one call,
 * with the mode off the stack while torch runs the operator's dense kernel.
 * run_hop asks memlord._ops._hop_prepare what to call (the operator with its
 * subgraphs wrapped in InMode objects, which put the mode back on the stack
 * while they run, or its dense kernel in one) and the storages of the inputs,
 * makes the call, and passes the result to memlord._ops._hop_count (its
 * outputs' new storages are counted).  The operator, its kernel and its
 * subgraphs are called from C: an error they raise reaches the caller with no
 * frame of memlord's in its traceback. */

static PyObject *hop_prepare_fn; /* memlord._ops._hop_prepare, strong, or NULL */
static PyObject *hop_count_fn;   /* memlord._ops._hop_count, strong, or NULL */
static PyObject *take_off_fn;    /* memlord._ops._take_off, strong, or NULL */
static PyObject *push_mode_fn;   /* torch._C._push_on_torch_dispatch_stack, or NULL */
/* torch._C._dynamo.eval_frame.get_eval_frame_callback, strong; None where this
 * torch has none; NULL until looked up */
static PyObject *eval_frame_callback_fn;

/* The helpers above (strong references), imported once; -1 with an exception set. */
static int hop_helpers(void)
{
    if (hop_prepare_fn != NULL && hop_count_fn != NULL && take_off_fn != NULL &&
        push_mode_fn != NULL) {
        return 0;
    }
    PyObject *mod = PyImport_ImportModule("memlord._ops");
    PyObject *prepare = mod != NULL ? PyObject_GetAttrString(mod, "_hop_prepare") : NULL;
    PyObject *count = prepare != NULL ? PyObject_GetAttrString(mod, "_hop_count") : NULL;
    PyObject *take_off = count != NULL ? PyObject_GetAttrString(mod, "_take_off") : NULL;
    Py_XDECREF(mod);
    PyObject *tc = take_off != NULL ? PyImport_ImportModule("torch._C") : NULL;
    PyObject *push =
        tc != NULL ? PyObject_GetAttrString(tc, "_push_on_torch_dispatch_stack") : NULL;
    Py_XDECREF(tc);
    if (push == NULL) {
        Py_XDECREF(prepare);
        Py_XDECREF(count);
        Py_XDECREF(take_off);
        return -1;
    }
    /* the imports may have run code that set them */
    Py_XSETREF(hop_prepare_fn, prepare);
    Py_XSETREF(hop_count_fn, count);
    Py_XSETREF(take_off_fn, take_off);
    Py_XSETREF(push_mode_fn, push);
    return 0;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fn;   /* the subgraph, strong */
    PyObject *mode; /* memlord's mode, strong */
} InModeObject;

/* Call fn with the mode on top of this thread's dispatch stack, taken off
 * after (memlord._ops._take_off).  Failing to put it on or take it off is
 * reported, never raised: fn's result or error is the caller's. */
static PyObject *in_mode_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames)
{
    const InModeObject *o = (const InModeObject *)self;
    if (o->fn == NULL || o->mode == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "memlord: a cleared subgraph wrapper was called");
        return NULL;
    }
    PyObject *fn = Py_NewRef(o->fn);
    PyObject *mode = Py_NewRef(o->mode);
    int pushed = 0;
    if (hop_helpers() < 0) {
        ml_write_unraisable(fn);
    } else {
        PyObject *push = Py_NewRef(push_mode_fn);
        PyObject *r = PyObject_CallOneArg(push, mode);
        Py_DECREF(push);
        if (r == NULL) {
            ml_write_unraisable(fn);
        } else {
            Py_DECREF(r);
            pushed = 1;
        }
    }
    PyObject *result = PyObject_Vectorcall(fn, args, nargsf, kwnames);
    if (pushed) {
        PyObject *exc = result == NULL ? ml_err_get_raised() : NULL;
        PyObject *take_off = Py_NewRef(take_off_fn);
        PyObject *r = PyObject_CallOneArg(take_off, mode);
        Py_DECREF(take_off);
        if (r == NULL) {
            ml_write_unraisable(fn);
        }
        Py_XDECREF(r);
        if (exc != NULL) {
            ml_err_set_raised(exc);
        }
    }
    Py_DECREF(mode);
    Py_DECREF(fn);
    return result;
}

static PyObject *in_mode_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

/* Any attribute but its own is the subgraph's (invoke_subgraph reads
 * _boxed_call). */
static PyObject *in_mode_getattro(PyObject *self, PyObject *name)
{
    PyObject *r = PyObject_GenericGetAttr(self, name);
    PyObject *fn = ((const InModeObject *)self)->fn;
    if (r != NULL || fn == NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) {
        return r;
    }
    PyErr_Clear();
    Py_INCREF(fn);
    r = PyObject_GetAttr(fn, name);
    Py_DECREF(fn);
    return r;
}

static PyObject *in_mode_repr(PyObject *self)
{
    PyObject *fn = ((const InModeObject *)self)->fn;
    if (fn == NULL) {
        return PyUnicode_FromString("<memlord in-mode subgraph (cleared)>");
    }
    Py_INCREF(fn); /* its repr may run anything */
    PyObject *r = PyUnicode_FromFormat("<memlord in-mode subgraph %R>", fn);
    Py_DECREF(fn);
    return r;
}

static int in_mode_traverse(InModeObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->fn);
    Py_VISIT(self->mode);
    return 0;
}

static int in_mode_clear(InModeObject *self)
{
    Py_CLEAR(self->fn);
    Py_CLEAR(self->mode);
    return 0;
}

static void in_mode_dealloc(InModeObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    in_mode_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef in_mode_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(InModeObject, vectorcall), READONLY, NULL},
    {"__wrapped__", T_OBJECT, offsetof(InModeObject, fn), READONLY, "The subgraph."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot in_mode_slots[] = {
    {Py_tp_doc, "A higher-order operator's subgraph, called with memlord's mode on the stack."},
    {Py_tp_call, in_mode_call},
    {Py_tp_getattro, in_mode_getattro},
    {Py_tp_repr, in_mode_repr},
    {Py_tp_members, in_mode_members},
    {Py_tp_traverse, in_mode_traverse},
    {Py_tp_clear, in_mode_clear},
    {Py_tp_dealloc, in_mode_dealloc},
    {0, NULL},
};

static PyType_Spec in_mode_spec = {
    .name = "memlord._core.InMode",
    .basicsize = sizeof(InModeObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = in_mode_slots,
};

static PyObject *in_mode_type; /* strong, made by the first _in_mode() */

PyObject *ml_ops_in_mode(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "_in_mode() takes 2 arguments (fn, mode), got %zd", nargs);
        return NULL;
    }
    if (!PyCallable_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "_in_mode(): fn must be callable, not %.100s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (in_mode_type == NULL) {
        PyObject *t = PyType_FromModuleAndSpec(module, &in_mode_spec, NULL);
        if (t == NULL) {
            return NULL;
        }
        Py_XSETREF(in_mode_type, t);
    }
    InModeObject *o = PyObject_GC_New(InModeObject, (PyTypeObject *)in_mode_type);
    if (o == NULL) {
        return NULL;
    }
    /* PyObject_GC_New took the reference each instance of a heap type holds
     * (in_mode_dealloc gives it back) */
    o->fn = Py_NewRef(args[0]);
    o->mode = Py_NewRef(args[1]);
    o->vectorcall = in_mode_vectorcall;
    PyObject_GC_Track(o);
    return (PyObject *)o;
}

/* 1 when dynamo's frame evaluation is on in this thread (a callback that
 * compiles the frames it meets), 0 when not or unknown.  Bare torch turns it
 * on around an eager torch.cond or map once dynamo has skipped the
 * operator's frame (after the operator ran under a user's dispatch mode): it
 * then compiles the operator's dense kernel, whose subgraph arguments must be
 * what torch passed (an InMode wrapper is a call dynamo cannot trace). */
static int dynamo_evaluating(void)
{
    if (eval_frame_callback_fn == NULL) {
        PyObject *m = PyImport_ImportModule("torch._C._dynamo.eval_frame");
        PyObject *fn = m != NULL ? PyObject_GetAttrString(m, "get_eval_frame_callback") : NULL;
        Py_XDECREF(m);
        if (fn == NULL) {
            PyErr_Clear(); /* a torch without it: never evaluating */
            fn = Py_NewRef(Py_None);
        }
        Py_XSETREF(eval_frame_callback_fn, fn);
    }
    if (eval_frame_callback_fn == Py_None) {
        return 0;
    }
    PyObject *fn = Py_NewRef(eval_frame_callback_fn);
    PyObject *cb = PyObject_CallNoArgs(fn);
    Py_DECREF(fn);
    if (cb == NULL) {
        PyErr_Clear();
        return 0;
    }
    /* None: off; False: run compiled code only, compile nothing */
    int on = cb != Py_None && cb != Py_False;
    Py_DECREF(cb);
    return on;
}

/* A higher-order operator, with lords to count for (see above); mode: the
 * dispatch mode, or None when called as _core._torch_dispatch (nothing to
 * put back: the subgraphs run as they are).  While dynamo's frame evaluation
 * is on, the operator runs as torch called it, and only its outputs are
 * counted: that evaluation compiles the operator's kernel, and it must see
 * what it sees bare. */
static PyObject *run_hop(PyObject *mode, PyObject *func, PyObject *fargs, PyObject *fkwargs)
{
    PyObject *prep = NULL;
    if (hop_helpers() < 0) {
        ml_write_unraisable(func); /* accounting never raises into the caller */
    } else {
        if (mode != Py_None && dynamo_evaluating()) {
            mode = Py_None;
        }
        PyObject *prepare = Py_NewRef(hop_prepare_fn);
        PyObject *pargs[4] = {mode, func, fargs, fkwargs != NULL ? fkwargs : Py_None};
        prep = PyObject_Vectorcall(prepare, pargs, 4, NULL);
        Py_DECREF(prepare);
        if (prep == NULL) {
            ml_write_unraisable(func);
        }
    }
    /* prep: (callable, args, kwargs, inputs), or None when _hop_prepare failed
     * (it said so): then the operator runs as it was called */
    PyObject *call = func;
    PyObject *cargs = fargs;
    PyObject *ckwargs = fkwargs;
    PyObject *inputs = NULL;
    if (prep != NULL && PyTuple_Check(prep) && PyTuple_GET_SIZE(prep) == 4 &&
        PyTuple_Check(PyTuple_GET_ITEM(prep, 1)) &&
        (PyTuple_GET_ITEM(prep, 2) == Py_None || PyDict_Check(PyTuple_GET_ITEM(prep, 2)))) {
        call = PyTuple_GET_ITEM(prep, 0); /* prep holds them until the end */
        cargs = PyTuple_GET_ITEM(prep, 1);
        ckwargs = PyTuple_GET_ITEM(prep, 2) == Py_None ? NULL : PyTuple_GET_ITEM(prep, 2);
        inputs = PyTuple_GET_ITEM(prep, 3);
    }
    ml_hook_call_enter();
    PyObject *result = PyObject_Call(call, cargs, ckwargs);
    ml_hook_call_exit(result == NULL, func, ML_SRC_OP);
    if (result != NULL && inputs != NULL && ml_disp.ops_lord_refs != NULL) {
        PyObject *count = Py_NewRef(hop_count_fn);
        PyObject *cargs2[2] = {result, inputs};
        PyObject *r = PyObject_Vectorcall(count, cargs2, 2, NULL);
        Py_DECREF(count);
        if (r == NULL) {
            ml_write_unraisable(func);
        }
        Py_XDECREF(r);
    }
    Py_XDECREF(prep);
    return result;
}

static PyObject *ops_dispatch(PyObject *module, PyObject *mode, PyObject *const *args,
                              Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 4) {
        PyErr_Format(PyExc_TypeError,
                     "_torch_dispatch() takes from 1 to 4 positional arguments (func, types, "
                     "args, kwargs), got %zd",
                     nargs);
        return NULL;
    }
    PyObject *func = args[0];
    PyObject *fargs = nargs > 2 ? args[2] : NULL;
    PyObject *fkwargs = nargs > 3 && args[3] != Py_None ? args[3] : NULL;
    if (fargs != NULL && !PyTuple_Check(fargs)) {
        fargs = NULL; /* a list: PyObject_Call wants a tuple */
        PyObject *t = PySequence_Tuple(args[2]);
        if (t == NULL) {
            return NULL;
        }
        fargs = t;
    } else if (fargs != NULL) {
        Py_INCREF(fargs);
    } else {
        fargs = PyTuple_New(0);
        if (fargs == NULL) {
            return NULL;
        }
    }
    if (fkwargs != NULL && !PyDict_Check(fkwargs)) {
        Py_DECREF(fargs);
        PyErr_Format(PyExc_TypeError, "_torch_dispatch(): kwargs must be a dict, not %.100s",
                     Py_TYPE(fkwargs)->tp_name);
        return NULL;
    }
    long fresh = 0;
    int flags = 0;
    PyObject *call = op_lookup(func, &fresh, &flags);
    if (call == NULL) {
        /* accounting never raises into the caller: run the operator as it is */
        ml_write_unraisable(func);
        PyObject *r = PyObject_Call(func, fargs, fkwargs);
        Py_DECREF(fargs);
        return r;
    }
    if ((flags & OP_HOP) && ml_disp.ops_lord_refs != NULL) {
        Py_DECREF(call);
        PyObject *r = run_hop(mode, func, fargs, fkwargs);
        Py_DECREF(fargs);
        return r;
    }
    ops_outs outs = {0};
    ml_state *out_st = NULL;
    if ((flags & OP_OUT) && fkwargs != NULL && ml_disp.ops_lord_refs != NULL &&
        (out_st = PyModule_GetState(module)) != NULL) {
        out_before(out_st, fkwargs, &outs);
    }
    ml_walk in; /* the arguments' storages, for composite results */
    int have_in = 0;
    ml_state *in_st = ml_disp.ops_lord_refs != NULL ? PyModule_GetState(module) : NULL;
    if ((flags & OP_MUTATES) && in_st != NULL) {
        have_in = args_before(in_st, &in, fargs, fkwargs, flags);
    }
    ml_hook_call_enter();
    PyObject *result = PyObject_Call(call, fargs, fkwargs);
    ml_hook_call_exit(result == NULL, func, ML_SRC_OP);
    Py_DECREF(call);
    if (result != NULL && in_st != NULL && ml_disp.ops_lord_refs != NULL) {
        count_composite(in_st, result, fargs, fkwargs, &in, &have_in);
    }
    if (have_in) {
        ml_walk_clear(&in); /* storages the operator replaced may die here */
    }
    Py_DECREF(fargs);
    if (outs.n > 0) {
        if (result != NULL && ml_disp.ops_lord_refs != NULL) {
            out_grown(out_st, &outs);
            ml_safe_point();
        }
        for (Py_ssize_t i = 0; i < outs.n; i++) {
            Py_CLEAR(outs.t[i]);
        }
    }
    if (result != NULL && (fresh != 0 || (flags & OP_RESIZE)) && ml_disp.ops_lord_refs != NULL) {
        ml_state *st = PyModule_GetState(module);
        if (st != NULL) {
            count_outputs(st, result, fresh, flags);
        }
        ml_safe_point();
    }
    return result;
}

PyObject *ml_ops_dispatch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return ops_dispatch(module, Py_None, args, nargs);
}

/* _core._count_new(tensors): count the storages of the tensors (a list or
 * tuple: a higher-order operator's outputs that no input holds) for every
 * lord of the ops group; storages tracked already add nothing. */
PyObject *ml_ops_count_new(PyObject *module, PyObject *arg)
{
    if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "_count_new(): tensors must be a list or tuple, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    ml_state *st = PyModule_GetState(module);
    if (st == NULL || ml_disp.ops_lord_refs == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *holder = PySequence_Tuple(arg); /* a list may change while counted */
    if (holder == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(holder); i++) {
        PyObject *t = PyTuple_GET_ITEM(holder, i); /* holder holds it */
        if (!PyObject_TypeCheck(t, (PyTypeObject *)st->tensor_type)) {
            continue;
        }
        ml_life_item it;
        int r = item_of(st, t, &it);
        if (r < 0) {
            Py_DECREF(holder);
            return NULL;
        }
        if (r > 0) {
            count_for_ops_lords(st, &it, 1, OPS_COUNT);
            Py_DECREF(it.key);
        }
    }
    Py_DECREF(holder);
    ml_safe_point();
    Py_RETURN_NONE;
}

/* ---- the category sources -------------------------------------------------- */

PyObject *ml_ops_categorize(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "_categorize() takes 4 arguments (objs, category, source, from_mask), got %zd",
                     nargs);
        return NULL;
    }
    int cat = PyLong_AsLong(args[1]);
    int source = PyLong_AsLong(args[2]);
    unsigned long from_mask = PyLong_AsUnsignedLongMask(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (cat < 0 || cat >= ML_NCAT || source < -1 || source >= ML_SRC_NSOURCES) {
        PyErr_Format(PyExc_ValueError, "_categorize(): category %d or source %d out of range", cat,
                     source);
        return NULL;
    }
    ml_state *st = PyModule_GetState(module);
    if (st == NULL || ml_disp.src_lord_refs == NULL) {
        Py_RETURN_NONE;
    }
    ml_walk w;
    ml_walk_init(&w);
    w.collect_keys = 1;
    w.opaque_ok = 1;
    if (ml_walk_object(st, &w, args[0], "_categorize") < 0) {
        ml_walk_clear(&w);
        return NULL;
    }
    ml_lords lords;
    if (ml_lords_acquire(ml_disp.src_lord_refs, &lords) < 0) {
        ml_walk_clear(&w);
        return NULL;
    }
    ml_site site = {0};
    int captured = 0;
    for (Py_ssize_t j = 0; j < lords.n; j++) {
        ml_book *lord = (ml_book *)lords.v[j];
        if (!ml_life_active(lord)) {
            continue;
        }
        /* retag what the lord tracks; count what it does not */
        int any_new = 0;
        for (Py_ssize_t i = 0; i < w.n; i++) {
            if (w.keys[i] == NULL ||
                !ml_life_recategorize(lord, w.keys[i], cat, (unsigned)from_mask)) {
                any_new = 1;
            }
        }
        if (any_new && source >= 0) {
            /* what a step found alive is no allocation of the line that stepped */
            int sited = lord->track_callsite && source != ML_SRC_FOUND;
            if (sited && !captured) {
                ml_site_capture(st, &site);
                captured = 1;
            }
            ml_site none = {0};
            /* storages tracked already add nothing */
            if (ml_life_count_walk(lord, &w, 0, sited ? &site : &none, (enum ml_ev_source)source,
                                   NULL, cat) < 0) {
                ml_write_unraisable((PyObject *)lord);
            }
        }
    }
    ml_site_clear(&site);
    ml_lords_release(&lords);
    ml_walk_clear(&w);
    ml_safe_point();
    Py_RETURN_NONE;
}

PyObject *ml_ops_optimizer_step(PyObject *Py_UNUSED(module), PyObject *arg)
{
    int begin = PyObject_IsTrue(arg);
    if (begin < 0) {
        return NULL;
    }
    ml_context_optimizer(begin);
    Py_RETURN_NONE;
}

PyObject *ml_ops_recompute(PyObject *Py_UNUSED(module), PyObject *arg)
{
    int begin = PyObject_IsTrue(arg);
    if (begin < 0) {
        return NULL;
    }
    return PyBool_FromLong(ml_context_recompute(begin));
}

/* ---- the mode's base type ------------------------------------------------------ */

/* OpsModeBase.__torch_dispatch__(self, func, types, args=(), kwargs=None):
 * torch wants the mode's __torch_dispatch__ as a method bound to the mode
 * (not a classmethod, not a bare function), so the C function is a method
 * of a base type the Python mode class derives from (memlord/_ops.py). */
static PyObject *base_torch_dispatch(PyObject *self, PyTypeObject *defining_class,
                                     PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        /* keywords (args=, kwargs=): put them in order */
        PyObject *full[4] = {NULL, NULL, NULL, NULL};
        if (nargs > 4) {
            PyErr_SetString(PyExc_TypeError, "__torch_dispatch__() takes at most 4 arguments");
            return NULL;
        }
        for (Py_ssize_t i = 0; i < nargs; i++) {
            full[i] = args[i];
        }
        static const char *const names[4] = {"func", "types", "args", "kwargs"};
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            const char *kn = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
            int found = -1;
            for (int j = 0; kn != NULL && j < 4; j++) {
                if (strcmp(kn, names[j]) == 0) {
                    found = j;
                }
            }
            if (found < 0 || full[found] != NULL) {
                PyErr_Format(PyExc_TypeError, "__torch_dispatch__() got an unexpected keyword %R",
                             PyTuple_GET_ITEM(kwnames, k));
                return NULL;
            }
            full[found] = args[nargs + k];
        }
        if (full[0] == NULL) {
            PyErr_SetString(PyExc_TypeError, "__torch_dispatch__() missing argument 'func'");
            return NULL;
        }
        Py_ssize_t n = 4;
        while (n > 1 && full[n - 1] == NULL) {
            n--;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (full[i] == NULL) {
                full[i] = i == 2 ? NULL : Py_None;
            }
        }
        if (n > 2 && full[2] == NULL) {
            PyObject *empty = PyTuple_New(0);
            if (empty == NULL) {
                return NULL;
            }
            full[2] = empty;
            PyObject *r = ops_dispatch(PyType_GetModule(defining_class), self, full, n);
            Py_DECREF(empty);
            return r;
        }
        return ops_dispatch(PyType_GetModule(defining_class), self, full, n);
    }
    return ops_dispatch(PyType_GetModule(defining_class), self, args, nargs);
}

static PyMethodDef base_methods[] = {
    {"__torch_dispatch__", (PyCFunction)(void (*)(void))base_torch_dispatch,
     METH_METHOD | METH_FASTCALL | METH_KEYWORDS,
     "__torch_dispatch__($self, func, types, args=(), kwargs=None, /)\n--\n\n"
     "Run the operator unchanged; count the storages of the outputs it creates."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot base_slots[] = {
    {Py_tp_doc, "The C base of memlord's dispatch mode (memlord._ops.OpsMode)."},
    {Py_tp_methods, base_methods},
    {0, NULL},
};

PyType_Spec ml_ops_mode_base_spec = {
    .name = "memlord._core.OpsModeBase",
    .basicsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .slots = base_slots,
};

/* _core._storage_made(storage): torch.UntypedStorage(...) (a typed
 * storage's too, copy.deepcopy's and pickle's of a tensor) made a storage
 * with no tensor, which no factory, operator or dispatch mode sees: counted
 * and tracked like a factory's result for every lord of the python hooks
 * with lifetime tracking on.  Accounting errors are reported as unraisable. */
PyObject *ml_ops_storage_made(PyObject *module, PyObject *storage)
{
    ml_state *st = PyModule_GetState(module);
    if (st == NULL || ml_disp.py_lord_refs == NULL) {
        Py_RETURN_NONE;
    }
    ml_life_item item = {0};
    item.key = Py_NewRef(storage); /* held across everything below */
    item.cat = ML_LIFE_CAT_CONTEXT;
    PyObject *dev = PyObject_GetAttrString(storage, "device");
    PyObject *type = dev != NULL ? PyObject_GetAttrString(dev, "type") : NULL;
    PyObject *nbytes = type != NULL ? PyObject_CallMethod(storage, "nbytes", NULL) : NULL;
    PyObject *ptr = nbytes != NULL ? PyObject_CallMethod(storage, "data_ptr", NULL) : NULL;
    int ok = ptr != NULL && PyUnicode_Check(type) &&
             PyUnicode_CompareWithASCIIString(type, "meta") != 0 &&
             ml_dev_from_torch_device(st, dev, &item.dev) == 0;
    if (ok) {
        item.bytes = PyLong_AsLongLong(nbytes);
        item.ptr = (uintptr_t)PyLong_AsVoidPtr(ptr);
        ok = !PyErr_Occurred() && item.bytes > 0;
    }
    Py_XDECREF(ptr);
    Py_XDECREF(nbytes);
    Py_XDECREF(type);
    Py_XDECREF(dev);
    if (!ok) {
        /* an unreadable or empty storage: nothing to count */
        PyErr_Clear();
        Py_DECREF(item.key);
        Py_RETURN_NONE;
    }
    ml_lords lords;
    if (ml_lords_acquire(ml_disp.py_lord_refs, &lords) < 0) {
        ml_write_unraisable(NULL);
        Py_DECREF(item.key);
        Py_RETURN_NONE;
    }
    ml_site site = {0};
    int captured = 0;
    for (Py_ssize_t j = 0; j < lords.n; j++) {
        ml_book *lord = (ml_book *)lords.v[j];
        if (!ml_life_active(lord)) {
            continue;
        }
        if (lord->track_callsite && !captured) {
            ml_site_capture(st, &site);
            captured = 1;
        }
        ml_site none = {0};
        if (ml_life_count(lord, &item, 1, 0, lord->track_callsite ? &site : &none, ML_SRC_FACTORY,
                          NULL) < 0) {
            ml_write_unraisable((PyObject *)lord);
        }
    }
    ml_site_clear(&site);
    ml_lords_release(&lords);
    Py_DECREF(item.key);
    ml_safe_point();
    Py_RETURN_NONE;
}

/* torch.UntypedStorage's own tp_new (torch's C constructor, inherited), saved
 * before memlord's __new__ hook made it CPython's generic slot */
static newfunc storage_tp_new;
static const PyTypeObject *storage_tp_new_of; /* compared only */

/* _core._storage_new_slot(cls, restore): before the hook goes on (restore
 * False), remember cls's tp_new; after it came off (True), and cls has no
 * __new__ of its own again, put that tp_new back.  Deleting the hook leaves
 * CPython's generic slot in place (it keeps whatever tp_new the type has
 * when the inherited __new__ is torch's builtin), which looks __new__ up on
 * every construction: 50 ns more per storage than bare, for good. */
PyObject *ml_ops_storage_new_slot(PyObject *Py_UNUSED(module), PyObject *const *args,
                                  Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0]) || !PyBool_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "_storage_new_slot(cls, restore): cls a type, restore a bool");
        return NULL;
    }
    PyTypeObject *cls = (PyTypeObject *)args[0];
    if (args[1] == Py_False) {
        if (storage_tp_new == NULL) {
            storage_tp_new = cls->tp_new;
            storage_tp_new_of = cls;
        }
        Py_RETURN_NONE;
    }
    /* a borrowed entry, only tested for presence */
    const PyObject *own = PyDict_GetItemString(cls->tp_dict, "__new__");
    if (own == NULL && storage_tp_new != NULL && storage_tp_new_of == cls) {
        cls->tp_new = storage_tp_new;
        PyType_Modified(cls);
    }
    Py_RETURN_NONE;
}

/* _core._storage_resized(storage, nbytes): torch.UntypedStorage.resize_ ran
 * (it is no aten operator: the mode never sees it; FSDP2 frees and
 * re-allocates parameters with it).  A storage the lords of the ops group
 * track counts its change of size. */
PyObject *ml_ops_storage_resized(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "_storage_resized() takes 2 arguments (storage, nbytes), got %zd", nargs);
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[1]);
    if (nbytes == -1 && PyErr_Occurred()) {
        return NULL;
    }
    ml_state *st = PyModule_GetState(module);
    if (st == NULL || ml_disp.ops_lord_refs == NULL || nbytes < 0) {
        Py_RETURN_NONE;
    }
    ml_life_item item = {0};
    item.key = Py_NewRef(args[0]); /* held across the records */
    item.bytes = nbytes;
    count_for_ops_lords(st, &item, 1, OPS_RESIZE_ONLY);
    Py_DECREF(item.key);
    ml_safe_point();
    Py_RETURN_NONE;
}
