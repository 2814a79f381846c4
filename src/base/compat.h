/* memlord's compatibility layer: every CPython version gate and every private
 * CPython internal the core uses, named here once, so that no other file of
 * src/ tests PY_VERSION_HEX or reaches a private CPython name itself.
 *
 * Each entry says which CPython versions take which branch and which test
 * proves it; the tox environments py310, py312 and py313 (tox.ini
 * [testenv:py3{10,12,13}]) run the tests named in their list, and `tox -e py`
 * runs them all on 3.11.  tools/lint_c.py compiles every unit against the
 * headers of 3.10, 3.11, 3.12 and 3.13, so a branch no interpreter here runs
 * still builds.
 *
 * Two other places read internals, each isolated in its own unit:
 *  - src/base/gcfrozen.c is built with Py_BUILD_CORE to reach the cyclic
 *    GC's permanent generation (gc.freeze()), which no API walks
 *    (tests/unit/api/test_scan_frozen_objects.py);
 *  - src/torch/tensorabi.c reads torch's at::Tensor layout, checked against
 *    torch's own Python API at import (tests/unit/torch/test_tensorabi.py).
 *
 * Included by base/memlord.h: every unit sees it. */
#ifndef MEMLORD_BASE_COMPAT_H
#define MEMLORD_BASE_COMPAT_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>

#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h> /* PyFrameObject's fields (f_lasti) on 3.10 */
#endif

/* ---- module definition ---------------------------------------------------
 * The module's slots beyond Py_mod_exec: one interpreter only (3.12 on) and
 * the GIL required (3.13 on; free-threaded builds would otherwise assume the
 * module safe without it).  Earlier versions have neither slot.  Proven by
 * every test importing memlord._core on 3.10, 3.12 and 3.13 (the py3x tox
 * environments). */
#if PY_VERSION_HEX >= 0x030C0000
#define ML_SLOT_MULTI_INTERP                                                                       \
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#else
#define ML_SLOT_MULTI_INTERP
#endif
#if PY_VERSION_HEX >= 0x030D0000
#define ML_SLOT_GIL {Py_mod_gil, Py_MOD_GIL_USED},
#else
#define ML_SLOT_GIL
#endif
#define ML_COMPAT_MODULE_SLOTS ML_SLOT_MULTI_INTERP ML_SLOT_GIL

/* ---- interpreter state ---------------------------------------------------
 * 1 while the interpreter is shutting down (no Python may be called then):
 * Py_IsFinalizing is public from 3.13, _Py_IsFinalizing before (3.10-3.12).
 * tests/unit/hooks/test_lifetime.py and tests/unit/core/test_threads.py
 * (objects freed at exit). */
static inline int ml_finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* ---- exceptions ----------------------------------------------------------
 * The pending exception, normalised, and cleared: PyErr_GetRaisedException
 * from 3.12, PyErr_Fetch + normalisation before (3.10, 3.11).
 * tests/unit/hooks/test_transparency.py (errors raised through the walker
 * keep their type, value and traceback). */
static inline PyObject *ml_err_get_raised(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyException_SetTraceback(value, tb);
    }
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Set exc (a new reference, stolen) as the pending exception: the inverse of
 * ml_err_get_raised.  tests/unit/hooks/test_oom_seen.py (an OOM error leaves the
 * hooks with its type, message, traceback and reference count; run on 3.10 to 3.13). */
static inline void ml_err_set_raised(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyObject *type = Py_NewRef((PyObject *)Py_TYPE(exc));
    PyErr_Restore(type, exc, PyException_GetTraceback(exc));
#endif
}

/* ---- types ---------------------------------------------------------------
 * What attribute lookup on type tp finds for name in its MRO, borrowed, no
 * descriptor called, no exception set: the private _PyType_Lookup, exported
 * with the same signature in 3.10-3.13 (no public equivalent before 3.14's
 * PyType_Lookup).  Call it with no exception pending: on a miss of the
 * method cache it takes one for its own lookup's error and clears it
 * (tests/unit/core/test_allocate_free.py, the cold type cache).
 * tests/unit/hooks/test_torch_hooks.py (the getters called directly) and
 * tests/unit/torch/test_tensorabi.py. */
static inline PyObject *ml_type_lookup(PyTypeObject *tp, PyObject *name)
{
    return _PyType_Lookup(tp, name);
}

/* ---- calls ---------------------------------------------------------------
 * A hook calls its original's C function itself (hooks/direct.c) on 3.10 to
 * 3.13, checking the result as CPython's _Py_CheckFunctionResult does: the
 * function itself where it is declared for extensions (3.10-3.12), its steps
 * written with public calls on 3.13, where it is internal
 * (ml_check_vectorcall_result).  Other originals, and every original from
 * 3.14, go through their vectorcall; on 3.13 and later the hook checks that
 * call's result itself too (ML_VECTORCALL_CHECK).  Both paths:
 * tests/unit/hooks/test_torch_hooks.py, test_transparency.py and
 * test_transparency_repros.py (py310, py312 and py313 take the direct call
 * for torch's methods; _testcapi's misbehaving functions take the
 * vectorcall). */
#if PY_VERSION_HEX >= 0x030D0000
#define ML_VECTORCALL_CHECK 1
/* 3.13 on: a result checked as _Py_CheckFunctionResult(tstate, callable,
 * result, NULL) does (internal from 3.13), with the same SystemError
 * messages, the cause and context of the second set as
 * _PyErr_FormatFromCauseTstate sets them.  tests/unit/hooks/test_torch_hooks.py
 * (a misbehaving original's errors, hooked and bare). */
static inline PyObject *ml_check_vectorcall_result(PyObject *callable, PyObject *result)
{
    if (result == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_SystemError, "%R returned NULL without setting an exception",
                         callable);
#ifdef Py_DEBUG
            Py_FatalError("a function returned NULL without setting an exception");
#endif
        }
        return NULL;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(result);
        PyObject *cause = PyErr_GetRaisedException();
        PyErr_Format(PyExc_SystemError, "%R returned a result with an exception set", callable);
        PyObject *exc = PyErr_GetRaisedException();
        PyException_SetCause(exc, Py_NewRef(cause));
        PyException_SetContext(exc, Py_NewRef(cause));
        Py_DECREF(cause);
        PyErr_SetRaisedException(exc);
#ifdef Py_DEBUG
        Py_FatalError("a function returned a result with an exception set");
#endif
        return NULL;
    }
    return result;
}
#else
#define ML_VECTORCALL_CHECK 0
#endif

#if PY_VERSION_HEX < 0x030E0000
#define ML_DIRECT_CALL 1
/* result checked as CPython checks a C function's (NULL without an
 * exception, or a result with one, become SystemError). */
static inline PyObject *ml_check_function_result(PyThreadState *ts, PyObject *callable,
                                                 PyObject *result)
{
#if PY_VERSION_HEX >= 0x030D0000
    (void)ts;
    return ml_check_vectorcall_result(callable, result);
#else
    return _Py_CheckFunctionResult(ts, callable, result, NULL);
#endif
}
/* The thread's C recursion counter and its pending exception, read on the
 * thread state the caller holds: CPython's own Py_EnterRecursiveCall,
 * Py_LeaveRecursiveCall and _Py_CheckFunctionResult each look the thread
 * state up again (a thread-local read through __tls_get_addr in a shared
 * libpython, 11 instructions).  On 3.11 to 3.13 Py_EnterRecursiveCall is
 * `remaining-- <= 0 && _Py_CheckRecursiveCall(...)` (3.13: `< 0`) on a
 * field of the public PyThreadState (pycore_ceval.h), and
 * Py_LeaveRecursiveCall `remaining++`: while the counter is above 0 the hook
 * does exactly that itself, and calls CPython's functions otherwise (the
 * limit reached: its RecursionError).  Not where CPython also checks the C
 * stack every 64 calls (USE_STACKCHECK, Windows) nor on 3.10 (its limit is
 * the interpreter's, internal).  tests/unit/hooks/test_torch_hooks.py (the
 * recursion limit and a result with an exception set, through a hooked
 * call). */
#if PY_VERSION_HEX >= 0x030B0000 && !defined(USE_STACKCHECK)
#define ML_INLINE_RECURSION 1
static inline int *ml_recursion_remaining(PyThreadState *ts)
{
#if PY_VERSION_HEX >= 0x030C0000
    return &ts->c_recursion_remaining;
#else
    return &ts->recursion_remaining;
#endif
}
#else
#define ML_INLINE_RECURSION 0
#endif
#else
#define ML_DIRECT_CALL 0
#endif

/* ---- profile functions ---------------------------------------------------
 * What CPython tells a thread's profile function (sys.setprofile,
 * PyEval_SetProfile: torch.profiler's Python tracer, cProfile before 3.12)
 * about a builtin or method descriptor the bytecode calls: c_call before,
 * c_return or c_exception after, with the builtin (a method descriptor
 * bound to its self), and the caller's frame.  A hook is neither, so
 * hooks/direct.c reports its original's call itself, as CPython would have:
 * the same fields (PyThreadState's c_profilefunc, c_profileobj and tracing
 * are public in 3.10 to 3.13), nothing while a trace or profile function
 * already runs (tracing), and tracing entered during the call
 * (PyThreadState_EnterTracing from 3.11; on 3.10 its steps, as 3.10's
 * call_trace takes them).  tests/unit/hooks/test_transparency.py
 * (profilers_see_hooked_calls and its rows), run on 3.10 to 3.13. */
static inline int ml_profiling(const PyThreadState *ts)
{
    return ts->c_profilefunc != NULL && ts->tracing == 0;
}

/* 1 for a callable CPython reports as a builtin: exactly a builtin
 * (PyCFunction or PyCMethod) on 3.10 and 3.11 (trace_call_function), any
 * PyCFunction from 3.12 (sys_profile_call_or_return). */
static inline int ml_profiled_builtin(PyObject *callable)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyCFunction_Check(callable);
#else
    return PyCFunction_CheckExact(callable) || PyCMethod_CheckExact(callable);
#endif
}

/* Event what (PyTrace_C_CALL, PyTrace_C_RETURN, PyTrace_C_EXCEPTION) with
 * arg, to ts's profile function, with the running Python frame, under
 * tracing.  0, or -1 with the profile function's exception set; 0 without a
 * call when no profile function is set, one runs already, or no Python
 * frame runs (a call made from C with no Python caller: CPython reports
 * none). */
static inline int ml_profile_event(PyThreadState *ts, int what, PyObject *arg)
{
    Py_tracefunc func = ts->c_profilefunc;
    if (func == NULL || ts->tracing != 0) {
        return 0;
    }
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed */
    if (frame == NULL) {
        return 0;
    }
    PyObject *obj = Py_XNewRef(ts->c_profileobj);
    Py_INCREF(frame);
#if PY_VERSION_HEX >= 0x030B0000
    PyThreadState_EnterTracing(ts);
#else
    ts->tracing++;
    ts->cframe->use_tracing = 0;
#endif
    int r = func(obj, frame, what, arg);
#if PY_VERSION_HEX >= 0x030B0000
    PyThreadState_LeaveTracing(ts);
#else
    ts->tracing--;
    ts->cframe->use_tracing = ts->c_tracefunc != NULL || ts->c_profilefunc != NULL;
#endif
    Py_DECREF(frame);
    Py_XDECREF(obj);
    return r != 0 ? -1 : 0;
}

/* CPython 3.10 compiles a method call with keywords (s.resize_(size=8)) as
 * an attribute load, which binds a method descriptor, and a call of the
 * bound builtin: its errors name the instance's class
 * ("UntypedStorage.resize_() takes no keyword arguments"); from 3.11 the
 * descriptor itself is called ("StorageBase.resize_() ...").  A hook called
 * with keywords calls its method-descriptor original bound, on 3.10 only.
 * tests/unit/hooks/test_transparency.py (storage_resize_arguments, in py310). */
#if PY_VERSION_HEX < 0x030B0000
#define ML_KWARGS_CALL_BOUND 1
#else
#define ML_KWARGS_CALL_BOUND 0
#endif

/* Whether an exception is set on ts (PyErr_Occurred without looking the
 * thread state up). */
static inline int ml_exc_pending(const PyThreadState *ts)
{
#if PY_VERSION_HEX >= 0x030C0000
    return ts->current_exception != NULL;
#else
    return ts->curexc_type != NULL;
#endif
}

/* ---- weak references -----------------------------------------------------
 * weakref.ref's type object (the base of memlord's tracker type), public
 * only as the private _PyWeakref_RefType in 3.10-3.13 (PyWeakref_RefType in
 * no version).  tests/unit/hooks/test_lifetime.py. */
#define ML_WEAKREF_REF_TYPE (&_PyWeakref_RefType)

/* The object a weak reference points to (borrowed, for comparison or a
 * Py_NewRef at once: no reference is kept), or NULL once it is dead.
 * 3.10-3.12 read it borrowed (PyWeakref_GET_OBJECT).  3.13 deprecates that
 * read; its PyWeakref_GetRef is an exported call (a type check, a reference
 * taken, given back here: 28 instructions on every hooked call, which reads
 * its lord's reference).  Where the GIL guards the reference (3.13 not
 * free-threaded: ML_WEAKREF_FIELD) the field is read as both of 3.13's
 * functions read it: wr_object, Py_None once cleared, and a referent whose
 * count already reached 0 (a trashcan-delayed clear, gh-60806) is dead.
 * Free-threaded builds and later versions call PyWeakref_GetRef.
 * tests/unit/hooks/test_lifetime.py and test_storage_ledger.py. */
#if PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
#define ML_WEAKREF_FIELD 1
#else
#define ML_WEAKREF_FIELD 0
#endif
static inline PyObject *ml_referent(PyObject *ref)
{
#if PY_VERSION_HEX < 0x030D0000
    PyObject *obj = PyWeakref_GET_OBJECT(ref);
    return obj == Py_None ? NULL : obj;
#elif ML_WEAKREF_FIELD
    PyObject *obj = ((PyWeakReference *)ref)->wr_object;
    return obj != Py_None && Py_REFCNT(obj) > 0 ? obj : NULL;
#else
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(ref, &obj) != 1) {
        PyErr_Clear();
        return NULL;
    }
    Py_DECREF(obj);
    return obj;
#endif
}

/* 1 while ref's referent lives, reading only the reference itself where the
 * field is there to read (3.10-3.12: wr_object, Py_None once dead; the walk
 * of every tracker then touches no referent); 3.13 asks ml_referent.
 * tests/unit/hooks/test_lifetime.py. */
static inline int ml_weakref_alive(const PyWeakReference *ref)
{
#if PY_VERSION_HEX >= 0x030D0000
    return ml_referent((PyObject *)ref) != NULL;
#else
    return ref->wr_object != Py_None;
#endif
}

/* ---- dicts ---------------------------------------------------------------
 * A number that changes whenever dict d changes, or 0 when none can be read
 * cheaply.  3.10 and 3.11 keep one in every dict (PEP 509's ma_version_tag,
 * bumped by every insert, delete and clear).  It is deprecated from 3.12,
 * which has dict watchers instead (PEP 509's successor, PyDict_Watch): there
 * the answer is 0, and the DEBUG log watches its two dicts (sinks/log.c).
 * tests/unit/sinks/test_debug_log.py (the log's configuration read again
 * after the environment changes, and not read on every event). */
#if PY_VERSION_HEX >= 0x030C0000 && !defined(Py_LIMITED_API)
#define ML_DICT_WATCHERS 1
#else
#define ML_DICT_WATCHERS 0
#endif

static inline int ml_dict_version(PyObject *d, uint64_t *out)
{
#if PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API)
    if (d != NULL && PyDict_CheckExact(d)) {
        *out = ((PyDictObject *)d)->ma_version_tag;
        return 1;
    }
#else
    (void)d;
#endif
    *out = 0;
    return 0;
}

/* ---- code objects and frames ---------------------------------------------
 * A code object's name for a call site: co_qualname from 3.11, co_name on
 * 3.10 (which has no qualified name).  tests/unit/core/test_site_stacks.py. */
#if PY_VERSION_HEX >= 0x030B0000
#define ML_CODE_NAME(c) ((c)->co_qualname)
#else
#define ML_CODE_NAME(c) ((c)->co_name)
#endif

/* The byte offset of frame's last instruction: PyFrame_GetLasti from 3.11,
 * the field f_lasti (in code units) on 3.10.  tests/unit/core/
 * test_site_stacks.py and test_hotspots.py (lines of the sites). */
static inline int ml_frame_lasti(PyFrameObject *frame)
{
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(frame);
#else
    return frame->f_lasti * 2;
#endif
}

/* CPython 3.11 to 3.13: the interpreter's own frames, read in place by
 * core/frames.c, so that a call site costs no frame object.  ml_iframe
 * mirrors the head of the version's _PyInterpreterFrame
 * (Include/internal/pycore_frame.h, which needs Py_BUILD_CORE and is not
 * included); the fields read have the same names in every version's mirror
 * (f_code, previous, instr, owner), so that one walk serves them all.
 * core/frames.c checks the layout against the public API on the live stack
 * at the first capture and, on any mismatch, reads through the public API.
 * CPython 3.10 (whose frame objects are the frames), 3.14 and later,
 * free-threaded builds and the limited API read through the public API only
 * (ML_FRAMES_IN_PLACE undefined).  tests/unit/core/test_site_stacks.py,
 * test_hotspots.py and test_site_table_lifetime.py (and
 * tests/unit/hooks/test_torch_hooks.py, whose sites both ways agree). */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_LIMITED_API) &&     \
    !defined(Py_GIL_DISABLED)
#define ML_FRAMES_IN_PLACE 1
#endif

#ifdef ML_FRAMES_IN_PLACE
#define ML_OWNED_BY_GENERATOR 1 /* FRAME_OWNED_BY_GENERATOR, 3.11 to 3.13 */
#define ML_OWNED_BY_CSTACK 3    /* FRAME_OWNED_BY_CSTACK, 3.12 and 3.13 */

#if PY_VERSION_HEX < 0x030C0000
typedef struct ml_iframe { /* 3.11 */
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_func;
    PyObject *f_globals;
    PyObject *f_builtins;
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_locals;
    PyCodeObject *f_code;
    PyFrameObject *frame_obj;
    struct ml_iframe *previous;
    const uint16_t *instr; /* prev_instr */
    int stacktop;          /* -1 while the frame runs */
    char is_entry;         /* a bool */
    char owner;
} ml_iframe;
#else
typedef struct ml_iframe { /* 3.12 and 3.13 */
    /* 3.13's f_executable: the code object of every frame but the entry
     * frames the C stack owns, which are incomplete (below) */
    PyCodeObject *f_code;
    struct ml_iframe *previous;
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_funcobj;
    PyObject *f_globals;
    PyObject *f_builtins;
    // cppcheck-suppress unusedStructMember ; layout only
    PyObject *f_locals;
    PyFrameObject *frame_obj;
    const uint16_t *instr; /* 3.12's prev_instr, 3.13's instr_ptr */
    int stacktop;          /* -1 while the frame runs */
    // cppcheck-suppress unusedStructMember ; layout only
    uint16_t return_offset;
    char owner;
} ml_iframe;
#endif

/* The innermost frame of the thread whose state ts is (the running one's):
 * the thread state's current_frame from 3.13, its cframe's before (3.11,
 * 3.12). */
static inline const ml_iframe *ml_iframe_innermost(const PyThreadState *ts)
{
#if PY_VERSION_HEX >= 0x030D0000
    return (const ml_iframe *)ts->current_frame;
#else
    return (const ml_iframe *)ts->cframe->current_frame;
#endif
}

/* The code units (_Py_CODEUNIT, two bytes) of a code object. */
static inline const uint16_t *ml_code_units(const PyCodeObject *code)
{
    return (const uint16_t *)(const void *)code->co_code_adaptive;
}

/* 1 when f is still being set up, or an entry frame of the C stack
 * (_PyFrame_IsIncomplete of the version; the C stack's entry frames exist
 * from 3.13): the public API skips such frames. */
static inline int ml_iframe_incomplete(const ml_iframe *f)
{
#if PY_VERSION_HEX >= 0x030D0000
    if (f->owner == ML_OWNED_BY_CSTACK) {
        return 1;
    }
#endif
    return f->owner != ML_OWNED_BY_GENERATOR &&
           f->instr < ml_code_units(f->f_code) + f->f_code->_co_firsttraceable;
}

/* The byte offset of f's instruction, as PyFrame_GetLasti gives it. */
static inline int ml_iframe_offset(const ml_iframe *f)
{
    return (int)(f->instr - ml_code_units(f->f_code)) * 2;
}

/* What the public API cannot tell about a complete frame f looks sane; from
 * 3.12 on, CPython's own reading of f (PyUnstable_InterpreterFrame_*, which
 * takes the frame itself) gives the same code object and offset.  Nothing
 * here allocates: the code object's reference is the frame's too. */
static inline int ml_iframe_plausible(const ml_iframe *f)
{
#if PY_VERSION_HEX < 0x030C0000
    return f->stacktop >= -1 && (f->is_entry == 0 || f->is_entry == 1) &&
           (f->owner >= 0 && f->owner <= 2);
#else
    struct _PyInterpreterFrame *real = (struct _PyInterpreterFrame *)(uintptr_t)f;
    PyObject *code = PyUnstable_InterpreterFrame_GetCode(real);
    int same = code == (PyObject *)f->f_code;
    Py_XDECREF(code);
    return same && PyUnstable_InterpreterFrame_GetLasti(real) == ml_iframe_offset(f) &&
           f->stacktop >= -1 && f->owner >= 0 && f->owner <= ML_OWNED_BY_CSTACK;
#endif
}
#endif /* ML_FRAMES_IN_PLACE */

#endif
