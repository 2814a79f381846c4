/* The hook entry points: each kind of hook has its own, so nothing dispatches
 * on the way into the original. */
#include "hooks/entries.h"
#include "core/safepoint.h"
#include "hooks/account.h"
#include "hooks/direct.h"
#include "hooks/guards.h"
#include "hooks/lifetime.h"
#include "hooks/oom.h"
#include "hooks/pending.h"

static _Thread_local ml_hook_tls hook_tls;

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
 * or the first positional bool (every overload takes it as its first bool).
 * torch's parser takes only a bool there, so nothing else is asked for its
 * truth: Module.to's hook reads the flag before torch's parser has refused
 * it, and a tensor's __bool__ would show in a TorchFunctionMode. */
static int call_non_blocking(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    const PyObject *nb = kwarg(args, nargs, kwnames, "non_blocking");
    if (nb != NULL) {
        return nb == Py_True;
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

/* The end of the outermost hooked call of this thread (depth back at 0):
 * an error leaving it is offered to the OOM handler, unless torch's OOM
 * observer reported it already. */
ML_COLD static void outermost_done(ml_hook_tls *tl, int failed, PyObject *what, int source)
{
    int claimed = tl->oom_claimed;
    tl->oom_claimed = 0;
    if (failed && !claimed && ml_disp.st != NULL) {
        tl->depth++; /* what the handler runs is not offered again */
        ml_oom_offer(ml_disp.st, what, source);
        tl->depth--;
    }
}

/* Run the original as the hooked call (name, src) of this thread (ts: its
 * state, or NULL); *reentered tells whether that same call was already
 * running (see hook_tls). */
static inline PyObject *run_original(ml_hook_tls *tl, PyThreadState *ts, const HookObject *self,
                                     PyObject *const *args, size_t nargsf, PyObject *kwnames,
                                     int *reentered, int source)
{
    const PyObject *src = PyVectorcall_NARGS(nargsf) > 0 ? args[0] : NULL;
    const PyObject *saved_name = tl->cur_name, *saved_src = tl->cur_src;
    *reentered = saved_name == self->name && saved_src == src;
    tl->cur_name = self->name;
    tl->cur_src = src;
    tl->depth++;
    PyObject *result = ml_call_original_on(ts, self, args, nargsf, kwnames);
    tl->depth--;
    tl->cur_name = saved_name;
    tl->cur_src = saved_src;
    if (ML_UNLIKELY(result == NULL || tl->oom_claimed) && tl->depth == 0) {
        outermost_done(tl, result == NULL, (PyObject *)self, source);
    }
    return result;
}

void ml_hook_call_enter(void)
{
    hook_tls.depth++;
}

void ml_hook_call_exit(int failed, PyObject *what, int source)
{
    ml_hook_tls *tl = &hook_tls;
    tl->depth--;
    if ((failed || tl->oom_claimed) && tl->depth == 0) {
        outermost_done(tl, failed, what, source);
    }
}

PyObject *ml_hooks_oom_claim(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    ml_hook_tls *tl = &hook_tls;
    if (tl->depth > 0) {
        tl->oom_claimed = 1;
        Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

ML_HOT static PyObject *hook_tensor(PyObject *callable, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (ml_disp.lord_refs == NULL || ml_disp.module == NULL || nargs < 1) {
        return ml_call_original(self, args, nargsf, kwnames);
    }
    ml_state *st = ml_disp.st;
    if (ml_uncounted(st, args[0])) {
        return ml_call_original(self, args, nargsf, kwnames); /* tracing: nothing to count */
    }
    ml_hook_tls *tl = &hook_tls; /* one thread-local lookup for the whole call */
    if (ml_disp.npending > 0 && tl->depth == 0) {
        /* The queue's poll, before this conversion's own work is queued: a
         * free waiting on the default stream is done when that stream is
         * idle now, which it could not be once a copy or a cast kernel of
         * this call is on it (pending.h). */
        ml_pending_drain(0, NULL, 1);
    }
    /* one look-up of the thread state, for the call of the original and the
     * call site after */
    PyThreadState *ts = PyThreadState_Get();
    int reentered;
    PyObject *result =
        run_original(tl, ts, self, args, nargsf, kwnames, &reentered, ML_SRC_CONVERT);
    if (reentered || result == NULL || ml_disp.lord_refs == NULL || ml_disp.module == NULL) {
        return result; /* re-entered through __torch_function__: the outer call counts */
    }
    if (result == args[0]) {
        return result;
    }
    /* Whatever the original returned goes back unchanged; only tensors
     * converted from tensors are counted. */
    if (!PyObject_TypeCheck(result, (PyTypeObject *)st->tensor_type) ||
        !PyObject_TypeCheck(args[0], (PyTypeObject *)st->tensor_type) || ml_uncounted(st, result)) {
        return result;
    }
    ml_lords lords; /* a snapshot: subscribers may change */
    if (ml_lords_acquire(ml_disp.lord_refs, &lords) < 0) {
        ml_report_failure(callable);
        return result;
    }
    int nb = self->kind == HK_MOVE && is_non_blocking(args, nargs, kwnames);
    /* with python hooks on, tracking reads storages through torch's methods */
    PyObject *guard = ml_read_in_c(st, result) && ml_read_in_c(st, args[0]) &&
                              (ml_disp.py_lord_refs == NULL || !ml_tf_mode_active())
                          ? NULL
                          : ml_quiet_enter();
    int rc = ml_account_conversion(st, tl, ts, &lords, args[0], result, self->kind, nb);
    ml_lords_release(&lords);
    ml_safe_point();
    if (rc < 0) {
        ml_report_failure(callable);
    }
    ml_quiet_exit(guard);
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
    if (!tl->module_site_set && ml_disp.lord_refs != NULL && ml_disp.module != NULL) {
        ml_lords lords;
        if (ml_lords_acquire(ml_disp.lord_refs, &lords) < 0) {
            ml_write_unraisable(callable);
        } else {
            if (ml_any_tracks_callsite(&lords)) {
                ml_site_capture(ml_disp.st, &tl->module_site);
                tl->module_site_set = own_site = 1;
            }
            ml_lords_release(&lords);
        }
    }
    tl->module_non_blocking += nb;
    tl->module_depth++;
    PyObject *result = ml_call_original(self, args, nargsf, kwnames);
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
static PyObject *track_result(PyObject *callable, ml_state *st, PyObject *result, PyObject *src,
                              enum ml_ev_source source)
{
    /* Only real tensors: a tensor-like result (an FX Proxy while
     * symbolic_trace runs, any __torch_function__ object) would record every
     * method memlord calls on it (untyped_storage) into the user's graph. */
    if (!PyObject_TypeCheck(result, (PyTypeObject *)st->tensor_type) || ml_uncounted(st, result)) {
        return result;
    }
    ml_lords lords; /* a snapshot: subscribers may change */
    if (ml_lords_acquire(ml_disp.py_lord_refs, &lords) < 0) {
        ml_report_failure(callable);
        return result;
    }
    PyObject *guard = ml_read_in_c(st, result) && !ml_tf_mode_active() ? NULL : ml_quiet_enter();
    if (ml_track_new_tensor(st, &lords, result, src, source) < 0) {
        ml_report_failure(callable);
    }
    if (source == ML_SRC_FOUND) {
        /* a storage counted before (an op's output, a conversion's: Module._apply
         * wraps its results in new parameters) is a parameter's now */
        ml_recategorize_tensor(st, &lords, result, ML_CAT_PARAMETER);
    }
    ml_quiet_exit(guard);
    ml_lords_release(&lords);
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
    if (ml_disp.py_lord_refs == NULL || ml_disp.module == NULL) {
        return ml_call_original(self, args, nargsf, kwnames);
    }
    int reentered;
    PyObject *result =
        run_original(&hook_tls, NULL, self, args, nargsf, kwnames, &reentered, ML_SRC_FACTORY);
    if (reentered || result == NULL || ml_disp.py_lord_refs == NULL || ml_disp.module == NULL) {
        return result; /* re-entered through __torch_function__: the outer call counts */
    }
    const PyObject *out = kwarg(args, nargs, kwnames, "out");
    if (out != NULL && out != Py_None) {
        return result;
    }
    if (self->kind == HK_FACTORY_DATA) {
        /* torch.as_tensor copies Python data (a list, a tuple, a number); a
         * tensor or an array it shares (their memory is not its own) */
        const PyObject *data = nargs > 0 ? args[0] : kwarg(args, nargs, kwnames, "data");
        if (data == NULL || !(PyList_Check(data) || PyTuple_Check(data) || PyLong_Check(data) ||
                              PyFloat_Check(data) || PyComplex_Check(data))) {
            return result;
        }
    }
    /* a *_like's or clone's source: a composite result (a jagged NestedTensor)
     * may keep some of its component tensors (the offsets) */
    PyObject *src = NULL;
    if (nargs > 0 && PyObject_TypeCheck(args[0], (PyTypeObject *)ml_disp.st->tensor_type)) {
        src = args[0];
    }
    return track_result(callable, ml_disp.st, result, src, ML_SRC_FACTORY);
}

/* nn.Parameter(data): a parameter is memory the model holds.  Its storage
 * is data's, so a storage already tracked adds nothing (a re-wrapped
 * parameter, weight_norm's weight_v, a factory's result: its allocation
 * stays where the factory made it).  One no source saw made (data made
 * before the hooks, or by code memlord does not see: weight_norm's weight_g
 * without ops=True) is found, not made here: counted and tracked from here
 * as a parameter, with no call site, and no allocation of an open region's
 * (it raises the region's entry level). */
static PyObject *hook_param(PyObject *callable, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    PyObject *result = ml_call_original(self, args, nargsf, kwnames);
    if (result == NULL || ml_disp.py_lord_refs == NULL || ml_disp.module == NULL) {
        return result;
    }
    return track_result(callable, ml_disp.st, result, NULL, ML_SRC_FOUND);
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
    PyObject *result = ml_call_original(self, args, nargsf, kwnames);
    tl->apply_depth--;
    if (result == NULL || tl->apply_depth > 0 || PyVectorcall_NARGS(nargsf) < 1 ||
        ml_disp.lord_refs == NULL || ml_disp.module == NULL) {
        return result;
    }
    ml_lords lords;
    if (ml_lords_acquire(ml_disp.lord_refs, &lords) < 0) {
        ml_report_failure(callable);
        return result;
    }
    int any = 0;
    for (Py_ssize_t i = 0; i < lords.n; i++) {
        any |= ml_life_deep((ml_book *)lords.v[i]);
    }
    ml_state *st = ml_disp.st;
    if (!any || !PyObject_TypeCheck(args[0], (PyTypeObject *)st->module_type)) {
        ml_lords_release(&lords);
        return result;
    }
    /* the walk reads the module's tensors and gradients through torch's
     * methods (untyped_storage, .grad): a TorchFunctionMode would see them */
    PyObject *guard = ml_quiet_enter();
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
        ml_report_failure(callable);
    } else if (w.n > 0) {
        ml_site site;
        ml_conversion_site(st, tl, NULL, &lords, &site);
        ml_track_for(&lords, &w, &site, ML_SRC_CONVERT, 1);
        ml_site_clear(&site);
    }
    ml_walk_clear(&w);
    ml_quiet_exit(guard);
    ml_lords_release(&lords);
    return result;
}

/* A Python function of torch whose result memlord looks at (torch.load: the
 * category source of what it loads), called with no frame of memlord's
 * between it and its caller: what it reads of its caller's frame (a
 * warning's stacklevel=2 names the program's line) is as without memlord.
 * after's failure is reported, never raised; the result goes back
 * unchanged. */
static PyObject *hook_after(PyObject *callable, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    PyObject *result = ml_call_original(self, args, nargsf, kwnames);
    if (result == NULL || self->after == NULL) {
        return result;
    }
    PyObject *after = Py_NewRef(self->after); /* held across its call */
    PyObject *r = PyObject_CallOneArg(after, result);
    Py_DECREF(after);
    if (r == NULL) {
        ml_write_unraisable(callable);
    }
    Py_XDECREF(r);
    return result;
}

static PyObject *hook_sync(PyObject *callable, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames)
{
    const HookObject *self = (const HookObject *)callable;
    PyObject *result = ml_call_original(self, args, nargsf, kwnames);
    if (result != NULL) {
        ml_pending_drain(0, NULL, 0);
        ml_safe_point();
    }
    return result;
}

/* Each kind of hook gets its own entry point: no dispatch on the way into
 * the original. */
vectorcallfunc ml_hook_entry(int kind)
{
    switch (kind) {
    case HK_MOVE:
    case HK_CAST:
        return hook_tensor;
    case HK_MODULE_TO:
        return hook_module_to;
    case HK_FACTORY:
    case HK_FACTORY_LIKE:
    case HK_FACTORY_DATA:
        return hook_factory;
    case HK_PARAM:
        return hook_param;
    case HK_MODULE_APPLY:
        return hook_module_apply;
    case HK_AFTER:
        return hook_after;
    default:
        return hook_sync;
    }
}
