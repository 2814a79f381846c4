/* Patch install and uninstall. */
#include "hooks/patch.h"
#include "hooks/direct.h"
#include "hooks/dispatch.h"
#include "hooks/entries.h"

#include <string.h>

static int installing_group;

/* torch.jit.script resolves torch's functions through a table keyed by
 * id(function) (torch.jit._builtins): a hook gets its original's entry while
 * installed, so scripted code calling torch.zeros compiles to aten::zeros as
 * without memlord.  Best effort: without that module nothing is needed. */
void ml_jit_builtin_alias(PyObject *hook, PyObject *original, int add)
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

/* Write cls.__dict__[name] = value, or delete it where value is NULL.  These
 * classes are immutable static types (setattr refuses), so their dict is
 * written as CPython's own setattr of a mutable type does, and the type's
 * attribute caches are invalidated.  name is never a special method (no slot
 * to update). */
static int alias_set(PyObject *cls, PyObject *name, PyObject *value)
{
    PyObject *dict = ((PyTypeObject *)cls)->tp_dict;
    if ((value != NULL ? PyDict_SetItem(dict, name, value) : PyDict_DelItem(dict, name)) < 0) {
        return -1;
    }
    PyType_Modified((PyTypeObject *)cls);
    return 0;
}

/* owner.name = value, or del owner.name where value is NULL.  An immutable
 * static type (torch._C.Generator: setattr refuses) has its dict written by
 * alias_set. */
static int owner_set(PyObject *owner, PyObject *name, PyObject *value)
{
    if (PyType_Check(owner) && (((PyTypeObject *)owner)->tp_flags & Py_TPFLAGS_IMMUTABLETYPE)) {
        return alias_set(owner, name, value);
    }
    return value != NULL ? PyObject_SetAttr(owner, name, value) : PyObject_DelAttr(owner, name);
}

/* A new hook of kind over original (owner.pname), tracked by the GC; after
 * for HK_AFTER, else NULL.  NULL with an exception set on failure. */
static HookObject *hook_new(const ml_state *st, PyTypeObject *type, PyObject *owner,
                            PyObject *pname, PyObject *original, int kind, PyObject *after)
{
    HookObject *hook = PyObject_GC_New(HookObject, type);
    if (hook == NULL) {
        return NULL;
    }
    hook->vectorcall = ml_hook_entry(kind);
    hook->original = Py_NewRef(original);
    hook->owner = Py_NewRef(owner);
    hook->name = Py_NewRef(pname);
    hook->weakreflist = NULL;
    hook->kind = kind;
    hook->after = Py_XNewRef(after);
    ml_direct_of(hook, original, (PyTypeObject *)st->tensor_type);
    PyObject_GC_Track(hook);
    return hook;
}

/* Put the alias's own entry back where the hook is still there. */
static void alias_restore(PyObject *cls, PyObject *name, PyObject *own, const PyObject *put)
{
    if (cls == NULL) {
        return;
    }
    const PyObject *v = PyDict_GetItemWithError(((PyTypeObject *)cls)->tp_dict, name);
    if (v == put && alias_set(cls, name, own) < 0) {
        ml_write_unraisable(cls);
    }
    PyErr_Clear();
}

/* The next registry entry (the caller checked there is room; no Python runs
 * here): it takes over the references to every object but owner. */
static void patch_record(PyObject *owner, PyObject *pname, PyObject *own, PyObject *original,
                         PyObject *hook, PyObject *put, PyObject *acls, PyObject *aown,
                         PyObject *aput)
{
    ml_patch *p = &ml_disp.patches[ml_disp.npatches++];
    p->owner = Py_NewRef(owner);
    p->name = pname;
    p->own = own;
    p->original = original;
    p->hook = hook;
    p->put = put;
    p->alias_type = acls;
    p->alias_own = aown;
    p->alias_put = aput;
    p->group = installing_group;
}

static int patch_one(ml_state *st, PyObject *owner, const char *name, int kind)
{
    if (ml_disp.npatches == ML_MAX_PATCHES) {
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
    HookObject *hook = hook_new(st, PyType_Check(owner) ? st->hook_type : st->fn_hook_type, owner,
                                pname, original, kind, NULL);
    if (hook == NULL) {
        Py_DECREF(pname);
        Py_DECREF(original);
        Py_XDECREF(own);
        return -1;
    }
    /* A staticmethod in the class (nn.Parameter.__new__) goes in as a
     * staticmethod of the hook: read through an instance it binds to
     * nothing, as the original does (p.__new__(cls, data)). */
    PyObject *put = own != NULL && PyObject_TypeCheck(own, &PyStaticMethod_Type)
                        ? PyStaticMethod_New((PyObject *)hook)
                        : Py_NewRef((PyObject *)hook);
    if (put == NULL || owner_set(owner, pname, put) < 0) {
        Py_XDECREF(put);
        Py_DECREF(hook);
        Py_DECREF(pname);
        Py_DECREF(original);
        Py_XDECREF(own);
        return -1;
    }
    ml_jit_builtin_alias((PyObject *)hook, original, 1);
    PyObject *acls, *aown, *aput;
    alias_of(owner, pname, original, (PyObject *)hook, &acls, &aown, &aput);
    if (acls != NULL && alias_set(acls, pname, aput) < 0) {
        PyErr_Clear(); /* best effort: only identity differs without it */
        Py_CLEAR(acls);
        Py_CLEAR(aown);
        Py_CLEAR(aput);
    }
    if (ml_disp.npatches == ML_MAX_PATCHES) { /* filled while Python ran */
        alias_restore(acls, pname, aown, aput);
        Py_XDECREF(acls);
        Py_XDECREF(aown);
        Py_XDECREF(aput);
        ml_jit_builtin_alias((PyObject *)hook, original, 0);
        if (owner_set(owner, pname, own != NULL ? own : original) < 0) {
            PyErr_Clear();
        }
        Py_DECREF(put);
        Py_DECREF(hook);
        Py_DECREF(pname);
        Py_DECREF(original);
        Py_XDECREF(own);
        PyErr_SetString(PyExc_RuntimeError, "memlord: too many patches");
        return -1;
    }
    patch_record(owner, pname, own, original, (PyObject *)hook, put, acls, aown, aput);
    return 0;
}

/* owner.name = the hook of the patch made last, where owner.name is that
 * patch's original too (torch.random.get_rng_state is torch.get_rng_state):
 * both names keep naming one object, as bare.  Nothing done where the
 * attribute is something else or missing. */
static int patch_alias(PyObject *owner, const char *name)
{
    if (ml_disp.npatches == 0 || ml_disp.npatches == ML_MAX_PATCHES || PyType_Check(owner)) {
        return 0;
    }
    /* strong references to the last patch's objects before anything that may
     * allocate or run Python (the registry may change meanwhile) */
    const ml_patch *last = &ml_disp.patches[ml_disp.npatches - 1];
    PyObject *want = Py_NewRef(last->original);
    PyObject *hook = Py_NewRef(last->hook);
    PyObject *put = Py_NewRef(last->put);
    PyObject *pname = PyUnicode_InternFromString(name);
    PyObject *original = pname != NULL ? PyObject_GetAttr(owner, pname) : NULL;
    int rc = 0;
    if (original == NULL) {
        if (pname != NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear(); /* not in this torch */
        } else {
            rc = -1;
        }
        goto done;
    }
    if (original != want) {
        goto done; /* another function there: nothing to alias */
    }
    if (PyObject_SetAttr(owner, pname, put) < 0) {
        rc = -1;
        goto done;
    }
    if (ml_disp.npatches == ML_MAX_PATCHES) { /* filled while Python ran */
        if (PyObject_SetAttr(owner, pname, original) < 0) {
            PyErr_Clear();
        }
        PyErr_SetString(PyExc_RuntimeError, "memlord: too many patches");
        rc = -1;
        goto done;
    }
    patch_record(owner, pname, Py_NewRef(original), original, hook, put, NULL, NULL, NULL);
    Py_DECREF(want);
    return 0;
done:
    Py_XDECREF(original);
    Py_XDECREF(pname);
    Py_DECREF(want);
    Py_DECREF(hook);
    Py_DECREF(put);
    return rc;
}

PyObject *ml_hook_after_new(ml_state *st, PyObject *owner, PyObject *name, PyObject *original,
                            PyObject *after)
{
    PyObject *pname = PyUnicode_FromObject(name);
    if (pname == NULL) {
        return NULL;
    }
    PyUnicode_InternInPlace(&pname);
    /* a Python function (torch.load) binds when a class holds it: a hook of one is a
     * descriptor, binding as the function does */
    HookObject *hook = hook_new(
        st, PyType_Check(owner) || PyFunction_Check(original) ? st->hook_type : st->fn_hook_type,
        owner, pname, original, HK_AFTER, after);
    Py_DECREF(pname);
    return (PyObject *)hook;
}

/* 1 when owner.name still holds put (memlord's patch is on top), 0 when
 * someone else's patch is there or the attribute is gone, -1 on error. */
static int holds_hook(PyObject *owner, PyObject *name, const PyObject *put)
{
    if (PyType_Check(owner)) {
        PyObject *dict = ((PyTypeObject *)owner)->tp_dict;
        const PyObject *v = dict ? PyDict_GetItemWithError(dict, name) : NULL; /* compared only */
        if (v == NULL && PyErr_Occurred()) {
            return -1;
        }
        return v == put;
    }
    PyObject *v = PyObject_GetAttr(owner, name);
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    int same = v == put;
    Py_DECREF(v);
    return same;
}

/* Put every original of a group back, the very same objects, newest first,
 * but only where the attribute still holds memlord's hook: a patch a third
 * party made on top of memlord's stays, and an attribute someone else has
 * already restored is left as it is (their removed patch is never put
 * back).  Each entry leaves the registry before any Python runs. */
int ml_unpatch_group(int group)
{
    int rc = 0;
    for (;;) {
        int i = ml_disp.npatches - 1;
        while (i >= 0 && ml_disp.patches[i].group != group) {
            i--;
        }
        if (i < 0) {
            break;
        }
        ml_patch p = ml_disp.patches[i];
        memmove(&ml_disp.patches[i], &ml_disp.patches[i + 1],
                (size_t)(ml_disp.npatches - i - 1) * sizeof(ml_patch));
        ml_disp.npatches--;
        ml_jit_builtin_alias(p.hook, p.original, 0);
        alias_restore(p.alias_type, p.name, p.alias_own, p.alias_put);
        int ours = holds_hook(p.owner, p.name, p.put);
        int r = 0;
        if (ours > 0) {
            r = owner_set(p.owner, p.name, p.own);
        }
        if (ours < 0 || r < 0) {
            rc = -1;
            ml_write_unraisable(p.owner);
        }
        Py_XDECREF(p.owner);
        Py_XDECREF(p.name);
        Py_XDECREF(p.own);
        Py_XDECREF(p.original);
        Py_XDECREF(p.hook);
        Py_XDECREF(p.put);
        Py_XDECREF(p.alias_type);
        Py_XDECREF(p.alias_own);
        Py_XDECREF(p.alias_put);
    }
    if (ml_disp.npatches == 0) {
        ml_disp.st = NULL;
        Py_CLEAR(ml_disp.module);
    }
    return rc;
}

int ml_group_installed(int group)
{
    for (int i = 0; i < ml_disp.npatches; i++) {
        if (ml_disp.patches[i].group == group) {
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

int ml_install_torch(PyObject *module)
{
    ml_state *st = ml_state_of_module(module);
    static const char *const moves[] = {"to", "cuda", "cpu"};
    static const char *const casts[] = {"half", "float", "double", "bfloat16"};
    installing_group = G_TORCH;
    Py_XSETREF(ml_disp.module, Py_NewRef(module));
    ml_disp.st = st;
    if (ml_disp.s_cuda_stream == NULL &&
        (ml_disp.s_cuda_stream = PyUnicode_InternFromString("cuda_stream")) == NULL) {
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
    if (ml_disp.standin_stream != NULL || torch_has_cuda()) {
        PyObject *cuda = PyImport_ImportModule("torch.cuda");
        if (cuda == NULL) {
            goto fail;
        }
        PyObject *stream_cls = PyObject_GetAttrString(cuda, "Stream");
        PyObject *event_cls = stream_cls ? PyObject_GetAttrString(cuda, "Event") : NULL;
        if (ml_disp.standin_stream != NULL) {
            /* A test's stand-in (tests/fakecuda/): its stream source, and
             * whatever torch.cuda's synchronize, Stream, Event are now. */
            ml_disp.current_stream = event_cls ? Py_NewRef(ml_disp.standin_stream) : NULL;
            ml_disp.raw_stream = Py_NewRef(ml_disp.standin_stream);
        } else {
            ml_disp.current_stream =
                event_cls ? PyObject_GetAttrString(cuda, "current_stream") : NULL;
            ml_disp.raw_stream = ml_import_attr("torch._C", "_cuda_getCurrentRawStream");
            if (ml_disp.raw_stream == NULL) {
                PyErr_Clear(); /* older torch: current_stream(i).cuda_stream */
            }
        }
        int rc = ml_disp.current_stream == NULL                          ? -1
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
    ml_unpatch_group(G_TORCH);
    Py_CLEAR(ml_disp.current_stream);
    Py_CLEAR(ml_disp.raw_stream);
    return -1;
}

void ml_uninstall_torch(void)
{
    ml_unpatch_group(G_TORCH);
    Py_CLEAR(ml_disp.current_stream);
    Py_CLEAR(ml_disp.raw_stream);
}

/* The factories of hook_into_python (torch.<name>, torch.as_tensor of
 * Python data, torch.get_rng_state), Tensor.clone, Tensor.new_tensor (always
 * a copy), Tensor.new_empty and its kin, and nn.Parameter.__new__. */
int ml_install_py(PyObject *module)
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
    Py_XSETREF(ml_disp.module, Py_NewRef(module));
    ml_disp.st = st;
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
    if (patch_one(st, torch, "as_tensor", HK_FACTORY_DATA) < 0) {
        Py_DECREF(torch);
        goto fail;
    }
    /* the generators' states: a tensor made in C++ that no dispatch mode sees
     * (torch.utils.checkpoint and fork_rng call torch.get_rng_state, and
     * torch.cuda's for each device; a generator of one's own, a sampler's or
     * a data loader's, is asked with get_state, a method of the immutable
     * torch._C.Generator, whose dict owner_set writes). */
    static const char *const rng_owners[] = {"torch.random", "torch.cuda", "torch.cuda.random"};
    if (patch_one(st, torch, "get_rng_state", HK_FACTORY) < 0) {
        Py_DECREF(torch);
        goto fail;
    }
    for (size_t i = 0; i < sizeof(rng_owners) / sizeof(rng_owners[0]); i++) {
        /* only a module torch has imported (it imports all three) */
        PyObject *mname = PyUnicode_FromString(rng_owners[i]);
        PyObject *owner = mname != NULL ? PyImport_GetModule(mname) : NULL;
        Py_XDECREF(mname);
        if (owner == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(torch);
                goto fail;
            }
            continue;
        }
        /* torch.random's is torch's; torch.cuda.random's is torch.cuda's */
        int rc = i == 1 ? patch_one(st, owner, "get_rng_state", HK_FACTORY)
                        : patch_alias(owner, "get_rng_state");
        Py_DECREF(owner);
        if (rc < 0) {
            Py_DECREF(torch);
            goto fail;
        }
    }
    /* after the aliases above, which name the patch made last */
    PyObject *generator = PyObject_GetAttrString(torch, "Generator");
    if (generator == NULL || !PyType_Check(generator)) {
        Py_XDECREF(generator);
        PyErr_Clear(); /* not a type in this torch: left as it is */
    } else {
        int rc = patch_one(st, generator, "get_state", HK_FACTORY);
        Py_DECREF(generator);
        if (rc < 0) {
            Py_DECREF(torch);
            goto fail;
        }
    }
    Py_DECREF(torch);
    /* the allocations of the code inductor generates (torch.compile): its buffers
     * come from these, not from an operator, so no dispatch mode sees them; the
     * generated module binds them when it is loaded */
    PyObject *guards = PyImport_ImportModule("torch._C._dynamo.guards");
    if (guards == NULL) {
        PyErr_Clear(); /* a torch without dynamo: nothing to patch */
    } else {
        static const char *const inductor[] = {"_empty_strided_cpu", "_empty_strided_cuda",
                                               "_empty_strided_cpu_pinned", "_empty_strided_xpu",
                                               "_empty_strided_mtia"};
        for (size_t i = 0; i < sizeof(inductor) / sizeof(inductor[0]); i++) {
            if (patch_one(st, guards, inductor[i], HK_FACTORY) < 0) {
                Py_DECREF(guards);
                goto fail;
            }
        }
        Py_DECREF(guards);
    }
    /* Tensor.new_*: factories taking the tensor's dtype and device */
    static const char *const news[] = {"clone",    "new_tensor", "new_empty",        "new_zeros",
                                       "new_ones", "new_full",   "new_empty_strided"};
    for (size_t i = 0; i < sizeof(news) / sizeof(news[0]); i++) {
        if (patch_one(st, st->tensor_type, news[i], HK_FACTORY_LIKE) < 0) {
            goto fail;
        }
    }
    if (patch_one(st, st->parameter_type, "__new__", HK_PARAM) < 0) {
        goto fail;
    }
    return 0;
fail:
    ml_unpatch_group(G_PY);
    return -1;
}
