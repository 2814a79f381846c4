/* Call-site capture, the frame walk: which frames count (torch, memlord,
 * library and user code) and reading them, through the public frame API or,
 * on CPython 3.11 to 3.13, in place.  The site table (core/sites.c) interns
 * what a walk kept. */
#include "core/frames.h"

#include <string.h>

ML_COLD static int is_internal(ml_state *st, PyObject *filename)
{
    if (!PyUnicode_Check(filename)) {
        return 0;
    }
    if (st->torch_prefix != NULL &&
        PyUnicode_Tailmatch(filename, st->torch_prefix, 0, PY_SSIZE_T_MAX, -1) == 1) {
        return 1;
    }
    if (st->memlord_prefix != NULL &&
        PyUnicode_Tailmatch(filename, st->memlord_prefix, 0, PY_SSIZE_T_MAX, -1) == 1) {
        /* memlord's own demo (memlord/_demo.py, the only such name there) is
         * user code as far as sites go; the rest, __main__.py and the CLI
         * included, is not */
        return PyUnicode_Tailmatch(filename, st->s_demo_py, 0, PY_SSIZE_T_MAX, 1) != 1;
    }
    return 0;
}

enum { KIND_INTERNAL = 0, KIND_LIBRARY = 1, KIND_USER = 2 };

/* Library code: a file under site-packages or the standard library (the
 * paths memlord/__init__.py configures), or a frozen module. */
ML_COLD static int is_library(ml_state *st, PyObject *filename)
{
    if (!PyUnicode_Check(filename)) {
        return 0;
    }
    if (st->lib_prefixes != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->lib_prefixes); i++) {
            if (PyUnicode_Tailmatch(filename, PyTuple_GET_ITEM(st->lib_prefixes, i), 0,
                                    PY_SSIZE_T_MAX, -1) == 1) {
                return 1;
            }
        }
    }
    if (st->lib_parts != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(st->lib_parts); i++) {
            if (PyUnicode_Find(filename, PyTuple_GET_ITEM(st->lib_parts, i), 0, PY_SSIZE_T_MAX,
                               1) >= 0) {
                return 1;
            }
        }
    }
    return 0;
}

ML_COLD static int classify(ml_state *st, PyObject *filename)
{
    int kind = is_internal(st, filename)  ? KIND_INTERNAL
               : is_library(st, filename) ? KIND_LIBRARY
                                          : KIND_USER;
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
    return kind;
}

/* A code object's kind, cached by its file name (a direct-mapped table of
 * strings: a file's code objects share one name object, and no code object
 * is kept).  A slot taken by another name is replaced once per capture, its
 * old name going to *drop (NULL on entry), released by the caller once it
 * holds no frame pointer. */
ML_HOT static int code_kind(ml_state *st, PyCodeObject *code, PyObject **drop)
{
    PyObject *fn = code->co_filename;
    ml_kind_entry *k = st->sites.kind;
    size_t j = ((uintptr_t)fn >> 4) & (ML_KIND_SLOTS - 1);
    if (k != NULL && k[j].filename == fn) {
        return k[j].kind;
    }
    int kind = classify(st, fn);
    if (k == NULL) {
        k = st->sites.kind = PyMem_Calloc(ML_KIND_SLOTS, sizeof(ml_kind_entry));
        if (k == NULL) {
            return kind;
        }
    }
    if (k[j].filename == NULL || *drop == NULL) {
        *drop = k[j].filename;
        k[j].filename = Py_NewRef(fn);
        k[j].kind = (uint8_t)kind;
    }
    return kind;
}

/* ---- the walk (ml_walker: core/frames.h) ------------------------------- */

/* One frame, innermost first; 1 when the walk is done.  The first frames
 * outside torch and memlord are kept up to ML_STACK_MAX - 1 of them; the
 * last slot waits for the user's frame, further library frames left out. */
ML_HOT static inline int walk_frame(ml_walker *w, PyCodeObject *code, int offset)
{
    if (w->n > 0 && ++w->looked > ML_WALK_MAX) {
        return 1;
    }
    int kind = code_kind(w->st, code, &w->drop);
    if (kind == KIND_INTERNAL) {
        return 0;
    }
    if (kind == KIND_USER || w->n < ML_STACK_MAX - 1) {
        w->code[w->n] = code;
        w->offset[w->n] = offset;
        if (kind == KIND_USER) {
            w->user = w->n;
        }
        w->n++;
        return kind == KIND_USER;
    }
    w->elided = 1;
    return 0;
}

/* Through the public frame API: PyEval_GetFrame gives the innermost frame
 * as a frame object, which CPython 3.11+ creates on first request (an
 * allocation, and a copy of the frame's locals when the function returns). */
static void capture_public(ml_walker *w)
{
    /* The innermost frame is borrowed: most captures end there (the user
     * called torch directly), with no reference taken on the frame. */
    PyFrameObject *frame = PyEval_GetFrame();
    PyFrameObject *owned = NULL; /* frames further out are new references */
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        int offset = ml_frame_lasti(frame);
        /* the frame holds its code object while it runs */
        Py_DECREF(code);
        if (walk_frame(w, code, offset)) {
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_XDECREF(owned);
        frame = owned = back;
    }
    Py_XDECREF(owned);
    if (PyErr_Occurred()) {
        PyErr_Clear();
    }
}

/* CPython 3.11 to 3.13: the interpreter's own frames, read in place, so that
 * a call site costs no frame object.  The frame's layout (ml_iframe) and the
 * version's readings of it are in base/compat.h.  The first capture checks
 * the layout against the public API on the live stack (frames_check) and, on
 * any mismatch, every capture goes through capture_public.  Where
 * ML_FRAMES_IN_PLACE is not defined (3.10, 3.14 and later, free-threaded
 * builds, the limited API) every capture reads through the public API.  No
 * public API walks the stack without frame objects: 3.12's
 * PyUnstable_InterpreterFrame_* functions read a frame's code and offset
 * given the frame, but the frame before it and whether it is complete are
 * internal, so they serve only as one more check of the layout. */
#ifdef ML_FRAMES_IN_PLACE
static int frames_direct = -1; /* -1 not checked yet, 0 no, 1 yes */

#define ML_CHECK_DEPTH 4

/* Walk the stack both ways, a few frames deep, and compare every field the
 * public API can tell (code object, frame object, offset, globals,
 * builtins) and the plausibility of the rest.  The public side is read
 * first, into strong references (asking for frame objects allocates); the
 * interpreter's frames after, with nothing that allocates.  Run once. */
ML_COLD static int frames_check(void)
{
    PyFrameObject *fo[ML_CHECK_DEPTH];
    PyObject *code[ML_CHECK_DEPTH], *globals[ML_CHECK_DEPTH], *builtins[ML_CHECK_DEPTH];
    int lasti[ML_CHECK_DEPTH];
    PyFrameObject *cur = (PyFrameObject *)Py_XNewRef(PyEval_GetFrame());
    int n = 0;
    while (cur != NULL && n < ML_CHECK_DEPTH) {
        fo[n] = cur;
        code[n] = (PyObject *)PyFrame_GetCode(cur);
        globals[n] = PyFrame_GetGlobals(cur);
        builtins[n] = PyFrame_GetBuiltins(cur);
        lasti[n] = PyFrame_GetLasti(cur);
        n++;
        cur = PyFrame_GetBack(cur);
    }
    int ended = cur == NULL; /* the public walk ended: so must this one */
    Py_XDECREF(cur);
    int ok = n > 0 && !PyErr_Occurred();
    PyErr_Clear();
    const ml_iframe *f = ml_iframe_innermost(PyThreadState_Get());
    for (int k = 0; ok && k < n; k++) {
        while (f != NULL && ml_iframe_incomplete(f)) {
            f = f->previous;
        }
        ok = f != NULL && (PyObject *)f->f_code == code[k] && f->frame_obj == fo[k] &&
             ml_iframe_offset(f) == lasti[k] && f->f_globals == globals[k] &&
             f->f_builtins == builtins[k] && ml_iframe_plausible(f);
        f = ok ? f->previous : NULL;
    }
    if (ok && ended) {
        while (f != NULL && ml_iframe_incomplete(f)) {
            f = f->previous;
        }
        ok = f == NULL;
    }
    for (int k = 0; k < n; k++) {
        Py_DECREF(fo[k]);
        Py_DECREF(code[k]);
        Py_DECREF(globals[k]);
        Py_DECREF(builtins[k]);
    }
    return n == 0 ? -1 : ok; /* no Python frame to compare with: ask again next time */
}

/* The innermost frame of the running thread, on its state ts when the caller
 * has it (else NULL: looked up here). */
static inline const ml_iframe *innermost_of(const PyThreadState *ts)
{
    return ml_iframe_innermost(ts != NULL ? ts : PyThreadState_Get());
}

ML_HOT static int capture_direct(ml_walker *w, const PyThreadState *ts)
{
    if (frames_direct < 0) {
        frames_direct = frames_check();
    }
    if (frames_direct <= 0) {
        return 0;
    }
    /* No Python runs and nothing is allocated during the walk (a verdict's
     * old file name is released by the caller, after it); the frames from
     * here out are all waiting on the call in progress. */
    for (const ml_iframe *f = innermost_of(ts); f != NULL; f = f->previous) {
        if (!ml_iframe_incomplete(f) && walk_frame(w, f->f_code, ml_iframe_offset(f))) {
            break;
        }
    }
    return 1;
}

int ml_sites_direct(void)
{
    return frames_direct > 0;
}

ML_HOT int ml_frames_user_first(const ml_state *st, const PyThreadState *ts, PyCodeObject **code,
                                int *offset)
{
    const ml_kind_entry *k = st->sites.kind;
    if (frames_direct <= 0 || k == NULL) {
        return 0;
    }
    for (const ml_iframe *f = innermost_of(ts); f != NULL; f = f->previous) {
        if (ml_iframe_incomplete(f)) {
            continue;
        }
        const PyObject *fn = f->f_code->co_filename;
        const ml_kind_entry *e = &k[((uintptr_t)fn >> 4) & (ML_KIND_SLOTS - 1)];
        if (e->filename != fn || e->kind != KIND_USER) {
            return 0; /* torch's, memlord's, a library's or not known yet: the walk's */
        }
        *code = f->f_code;
        *offset = ml_iframe_offset(f);
        return 1;
    }
    return 0;
}
#else
static int capture_direct(ml_walker *Py_UNUSED(w), const PyThreadState *Py_UNUSED(ts))
{
    return 0;
}

int ml_sites_direct(void)
{
    return 0;
}

int ml_frames_user_first(const ml_state *Py_UNUSED(st), const PyThreadState *Py_UNUSED(ts),
                         PyCodeObject **Py_UNUSED(code), int *Py_UNUSED(offset))
{
    return 0;
}
#endif

ML_HOT void ml_frames_walk(ml_state *st, ml_walker *w, int in_place, const PyThreadState *ts)
{
    w->st = st;
    w->n = 0;
    w->user = -1;
    w->looked = 0;
    w->elided = 0;
    w->drop = NULL;
    if (!in_place || !capture_direct(w, ts)) {
        capture_public(w);
    }
}

void ml_site_probe(ml_state *st, int in_place, PyObject **code, int *offset)
{
    ml_walker w;
    ml_frames_walk(st, &w, in_place, NULL);
    *code = w.n > 0 ? Py_NewRef((PyObject *)w.code[0]) : NULL;
    *offset = w.n > 0 ? w.offset[0] : 0;
    Py_XDECREF(w.drop);
}

void ml_sites_paths_changed(ml_state *st)
{
    ml_kind_entry *k = st->sites.kind;
    st->sites.kind = NULL;
    if (k != NULL) {
        for (int i = 0; i < ML_KIND_SLOTS; i++) {
            Py_XDECREF(k[i].filename);
        }
        PyMem_Free(k);
    }
}
