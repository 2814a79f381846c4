/* The torch hooks' subscribers and their public face (hooks/hooks.h): lords
 * subscribe to the torch hooks (hook_into_torch) or the factory wrappers
 * (hook_into_python); the first subscriber installs a group's patches, the
 * last one leaving restores torch.
 *
 * The hooks are in parts, one concern each (docs/architecture.md): the Hook
 * type (hook.c), the direct call of torch's C functions (direct.c), the
 * dispatcher and its thread state (dispatch.c), the CUDA pending-free queue
 * (pending.c), accounting (account.c), tracing and torch-function guards
 * (guards.c), the entry points (entries.c), patching (patch.c).
 *
 * A conversion is sized in storage bytes (the storage a tensor views, 0 for
 * meta and fake storages); the hook never touches data. */
#include "hooks/hooks.h"
#include "core/safepoint.h"
#include "hooks/dispatch.h"
#include "hooks/hook.h"
#include "hooks/ops.h"
#include "hooks/patch.h"
#include "hooks/pending.h"

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
        PyObject *ref = PyWeakref_NewRef(lord, ml_disp.on_lord_death);
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
    PyObject **slots[4] = {&ml_disp.lord_refs, &ml_disp.py_lord_refs, &ml_disp.ops_lord_refs,
                           &ml_disp.src_lord_refs};
    for (int g = 0; g < 4; g++) {
        if (*slots[g] == NULL) {
            continue;
        }
        PyObject *refs = lords_with(*slots[g], NULL, 0);
        if (refs == NULL) {
            ml_write_unraisable(NULL);
            continue;
        }
        Py_XSETREF(*slots[g], refs);
        if (PyTuple_GET_SIZE(refs) == 0) {
            Py_CLEAR(*slots[g]);
            if (g == 0) {
                ml_pending_drain(0, NULL, 0);
                ml_uninstall_torch();
            } else if (g == 1) {
                ml_unpatch_group(G_PY);
            } else if (ml_ops_install(g == 2 ? "ops" : "sources", 0) < 0) {
                ml_write_unraisable(NULL);
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
    if (ml_disp.on_lord_death == NULL) {
        ml_disp.on_lord_death = PyCFunction_New(&lord_died_def, NULL);
    }
    return ml_disp.on_lord_death != NULL ? 0 : -1;
}

/* Add lord to a group's subscribers (*refs), installing the group's patches
 * when it is the first; nothing changes on failure. */
static int subscribe(PyObject **refs, int group, int (*install)(PyObject *), ml_book *lord)
{
    PyObject *lords = ensure_death_callback() < 0 ? NULL : lords_with(*refs, (PyObject *)lord, 1);
    if (lords == NULL) {
        return -1;
    }
    if (!ml_group_installed(group) && install(lord->module) < 0) {
        Py_DECREF(lords);
        return -1;
    }
    Py_XSETREF(*refs, lords);
    return 0;
}

int ml_hooks_py_subscribe(ml_book *lord)
{
    return subscribe(&ml_disp.py_lord_refs, G_PY, ml_install_py, lord);
}

int ml_hooks_py_unsubscribe(ml_book *lord)
{
    if (!refs_contain(ml_disp.py_lord_refs, (PyObject *)lord)) {
        return 0;
    }
    PyObject *lords = lords_with(ml_disp.py_lord_refs, (PyObject *)lord, 0);
    if (lords == NULL) {
        return -1;
    }
    Py_XSETREF(ml_disp.py_lord_refs, lords);
    if (PyTuple_GET_SIZE(ml_disp.py_lord_refs) == 0) {
        Py_CLEAR(ml_disp.py_lord_refs);
        ml_unpatch_group(G_PY);
    }
    return 0;
}

/* ---- hook_into_python()'s op outputs and category sources ---------------------- */

static PyObject **ops_refs(int group)
{
    return group == ML_HOOKS_OPS ? &ml_disp.ops_lord_refs : &ml_disp.src_lord_refs;
}

static const char *ops_name(int group)
{
    return group == ML_HOOKS_OPS ? "ops" : "sources";
}

int ml_hooks_ops_subscribe(ml_book *lord, int group)
{
    PyObject **refs = ops_refs(group);
    if (refs_contain(*refs, (PyObject *)lord)) {
        return 0;
    }
    PyObject *lords = ensure_death_callback() < 0 ? NULL : lords_with(*refs, (PyObject *)lord, 1);
    if (lords == NULL) {
        return -1;
    }
    if (live_count(*refs) == 0 && ml_ops_install(ops_name(group), 1) < 0) {
        Py_DECREF(lords);
        return -1;
    }
    Py_XSETREF(*refs, lords);
    return 0;
}

int ml_hooks_ops_unsubscribe(ml_book *lord, int group)
{
    PyObject **refs = ops_refs(group);
    if (!refs_contain(*refs, (PyObject *)lord)) {
        return 0;
    }
    PyObject *lords = lords_with(*refs, (PyObject *)lord, 0);
    if (lords == NULL) {
        return -1;
    }
    if (PyTuple_GET_SIZE(lords) == 0) {
        Py_DECREF(lords);
        if (ml_ops_install(ops_name(group), 0) < 0) {
            return -1;
        }
        Py_CLEAR(*refs);
        return 0;
    }
    Py_XSETREF(*refs, lords);
    return 0;
}

/* ---- hook_into_torch()'s subscribers ------------------------------------------ */

int ml_hooks_torch_subscribe(ml_book *lord)
{
    return subscribe(&ml_disp.lord_refs, G_TORCH, ml_install_torch, lord);
}

int ml_hooks_torch_unsubscribe(ml_book *lord)
{
    PyObject *lords = lords_with(ml_disp.lord_refs, (PyObject *)lord, 0);
    if (lords == NULL) {
        return -1;
    }
    Py_XSETREF(ml_disp.lord_refs, lords);
    return 0;
}

void ml_hooks_torch_settle(ml_book *lord)
{
    /* This lord's deferred frees are credited before it leaves. */
    ml_pending_drain(0, NULL, 0);
    ml_pending_drain(1, (PyObject *)lord, 0);
    if (ml_disp.lord_refs != NULL && PyTuple_GET_SIZE(ml_disp.lord_refs) == 0) {
        Py_CLEAR(ml_disp.lord_refs);
        ml_uninstall_torch();
    }
}

void ml_hooks_poll(void)
{
    ml_pending_drain(0, NULL, 0);
    ml_safe_point();
}

int64_t ml_hooks_pending_bytes(const ml_book *lord, const ml_selector *sel)
{
    return ml_pending_bytes((const PyObject *)lord, sel);
}

Py_ssize_t ml_hooks_npending(void)
{
    return ml_disp.npending;
}

PyObject *ml_hooks_cuda_standin(PyObject *Py_UNUSED(module), PyObject *source)
{
    if (source != Py_None && !PyCallable_Check(source)) {
        PyErr_Format(PyExc_TypeError,
                     "cuda_standin(): argument 'source' must be callable or None, got %.100s",
                     Py_TYPE(source)->tp_name);
        return NULL;
    }
    if (ml_group_installed(G_TORCH)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "cuda_standin(): the torch hooks are installed; disable them first");
        return NULL;
    }
    Py_XSETREF(ml_disp.standin_stream, source == Py_None ? NULL : Py_NewRef(source));
    Py_RETURN_NONE;
}

PyObject *ml_hooks_poll_age(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "pending_poll_age() takes at most 1 argument (%zd given)",
                     nargs);
        return NULL;
    }
    int64_t set = -1;
    if (nargs == 1) {
        if (!PyLong_Check(args[0]) || PyBool_Check(args[0])) {
            PyErr_Format(PyExc_TypeError,
                         "pending_poll_age(): argument 'ns' must be int, not %.100s",
                         Py_TYPE(args[0])->tp_name);
            return NULL;
        }
        long long v = PyLong_AsLongLong(args[0]);
        if (v == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (v < 0) {
            PyErr_Format(PyExc_ValueError,
                         "pending_poll_age(): argument 'ns' must be >= 0, got %lld", v);
            return NULL;
        }
        set = (int64_t)v;
    }
    return PyLong_FromLongLong((long long)ml_pending_poll_age(set));
}

/* The names of the installed hooks that call their original's C function
 * directly (ml_direct_of), as a list. */
static PyObject *direct_names(void)
{
    PyObject *names = PyList_New(0);
    for (int i = 0; names != NULL && i < ml_disp.npatches; i++) {
        /* the list's growth may run the GC, which may unpatch: read again */
        if (i < ml_disp.npatches && ((HookObject *)ml_disp.patches[i].hook)->direct != NULL &&
            PyList_Append(names, ml_disp.patches[i].name) < 0) {
            Py_CLEAR(names);
        }
    }
    return names;
}

/* Append the live lords of refs (a tuple of weak references, or NULL) that
 * out does not hold yet. */
static int add_live(PyObject *out, PyObject *refs)
{
    ml_lords lords; /* strong references: appending may run the GC */
    if (ml_lords_acquire(refs, &lords) < 0) {
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < lords.n; i++) {
        int has = PySequence_Contains(out, lords.v[i]);
        rc = has < 0 ? -1 : has ? 0 : PyList_Append(out, lords.v[i]);
    }
    ml_lords_release(&lords);
    return rc;
}

PyObject *ml_hooks_lords(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    PyObject *out = PyList_New(0);
    if (out != NULL &&
        (add_live(out, ml_disp.lord_refs) < 0 || add_live(out, ml_disp.py_lord_refs) < 0)) {
        Py_CLEAR(out);
    }
    return out;
}

PyObject *ml_hooks_after_hook(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyUnicode_Check(args[1]) || !PyCallable_Check(args[2]) ||
        !PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "_after_hook(owner, name, original, after): name a str, original and "
                        "after callables");
        return NULL;
    }
    return ml_hook_after_new(ml_state_of_module(module), args[0], args[1], args[2], args[3]);
}

PyObject *ml_hooks_jit_alias(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyBool_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "_jit_builtin_alias(hook, original, add): add a bool");
        return NULL;
    }
    ml_jit_builtin_alias(args[0], args[1], args[2] == Py_True);
    Py_RETURN_NONE;
}

PyObject *ml_hooks_info(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return Py_BuildValue("{s:O,s:O,s:n,s:n,s:n,s:n,s:n,s:n,s:N}", "installed",
                         ml_group_installed(G_TORCH) ? Py_True : Py_False, "python_installed",
                         ml_group_installed(G_PY) ? Py_True : Py_False, "subscribers",
                         live_count(ml_disp.lord_refs), "python_subscribers",
                         live_count(ml_disp.py_lord_refs), "pending", ml_disp.npending,
                         "events_created", (Py_ssize_t)ml_cuda_events_created(), "events_pooled",
                         (Py_ssize_t)ml_cuda_events_pooled(), "events_recorded",
                         (Py_ssize_t)ml_cuda_events_recorded(), "direct", direct_names());
}
