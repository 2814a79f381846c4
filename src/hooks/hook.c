/* The Hook type: a hook behaves as its original in every way a program can
 * observe (equality, hash, pickling, copying, introspection, binding), except
 * its identity and its type().  What it does when called is hooks/entries.c's;
 * where it is installed, hooks/patch.c's. */
#include "hooks/hook.h"

#include <structmember.h>

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
    Py_VISIT(self->direct_sub);
    Py_VISIT(self->after);
    return 0;
}

static int hook_clear(HookObject *self)
{
    self->direct = NULL; /* what ml_direct_of read belongs to original */
    self->direct_self = NULL;
    self->direct_type = NULL;
    Py_CLEAR(self->direct_sub);
    Py_CLEAR(self->after);
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
