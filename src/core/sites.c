/* The site table: call stacks interned by content, with stable ids; a
 * capture walks the frames (core/frames.c) and interns what it kept. */
#include "core/sites.h"

#include <string.h>

_Static_assert(ML_RAW_SLOTS >= 2 && (ML_RAW_SLOTS & (ML_RAW_SLOTS - 1)) == 0,
               "raw slots: a power of two, in sets of two");
_Static_assert(ML_RECENT_SLOTS >= 2 && (ML_RECENT_SLOTS & (ML_RECENT_SLOTS - 1)) == 0,
               "recent stacks: a power of two, in sets of two");

/* ---- the site table ------------------------------------------------------ */

/* splitmix64's finalizer: every bit of x moves every bit of the result, so
 * keys that differ only in high bits (a code offset beside a pointer) or only
 * in low bits spread over a table indexed by the low bits.  (A multiply alone
 * leaves the low bits of the product to the low bits of x: the ten call
 * sites of one function shared two raw slots and evicted each other.) */
static inline uint32_t mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    return (uint32_t)(x ^ (x >> 31));
}

/* A name's hash: str's own (cached in the object, computed without
 * allocating) for an exact str, else its address (compared by identity). */
static uint64_t name_hash(PyObject *s)
{
    if (PyUnicode_CheckExact(s)) {
        Py_hash_t h = PyObject_Hash(s);
        if (h != -1) {
            return (uint64_t)h;
        }
        PyErr_Clear();
    }
    return (uint64_t)(uintptr_t)s;
}

static int name_eq(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    return PyUnicode_CheckExact(a) && PyUnicode_CheckExact(b) && PyUnicode_Compare(a, b) == 0;
}

/* Room for one more id in a table of `size`-byte entries with its index:
 * PyMem only, which never runs the cyclic GC.  rehash re-inserts id. */
static int table_grow(void **by_id, uint32_t n, uint32_t *cap, size_t size, uint32_t **index,
                      uint32_t *nindex,
                      void (*rehash)(const void *, uint32_t *, uint32_t, uint32_t))
{
    if (n + 1 >= ML_SITES_MAX) {
        return -1;
    }
    if (n + 1 >= *cap) {
        uint32_t c = *cap ? *cap * 2 : 64;
        void *p = PyMem_Realloc(*by_id, (size_t)c * size);
        if (p == NULL) {
            return -1;
        }
        *by_id = p;
        *cap = c;
    }
    if ((n + 1) * 2 >= *nindex) {
        uint32_t ni = *nindex ? *nindex * 2 : 128;
        uint32_t *ix = PyMem_Calloc(ni, sizeof(uint32_t));
        if (ix == NULL) {
            return -1;
        }
        for (uint32_t id = 1; id <= n; id++) {
            rehash(*by_id, ix, ni, id);
        }
        PyMem_Free(*index);
        *index = ix;
        *nindex = ni;
    }
    return 0;
}

static void loc_rehash(const void *by_id, uint32_t *ix, uint32_t ni, uint32_t id)
{
    uint32_t j = ((const ml_loc *)by_id)[id].hash & (ni - 1);
    while (ix[j] != 0) {
        j = (j + 1) & (ni - 1);
    }
    ix[j] = id;
}

static void stack_rehash(const void *by_id, uint32_t *ix, uint32_t ni, uint32_t id)
{
    uint32_t j = ((const ml_sitestack *)by_id)[id].hash & (ni - 1);
    while (ix[j] != 0) {
        j = (j + 1) & (ni - 1);
    }
    ix[j] = id;
}

/* The id of a location (file, line, function), added when new; 0 when the
 * table is full.  Runs no Python: takes references to the two strings. */
static uint32_t loc_intern(ml_sitetab *t, PyObject *filename, PyObject *name, int line)
{
    uint32_t h = mix(name_hash(filename) * 31 + name_hash(name) * 7 + (uint64_t)(uint32_t)line);
    if (t->nlocindex > 0) {
        uint32_t mask = t->nlocindex - 1;
        for (uint32_t j = h & mask; t->locindex[j] != 0; j = (j + 1) & mask) {
            const ml_loc *l = &t->locs[t->locindex[j]];
            if (l->hash == h && l->line == line && name_eq(l->filename, filename) &&
                name_eq(l->name, name)) {
                return t->locindex[j];
            }
        }
    }
    void *by_id = t->locs;
    int rc = table_grow(&by_id, t->nlocs, &t->caplocs, sizeof(ml_loc), &t->locindex, &t->nlocindex,
                        loc_rehash);
    t->locs = by_id;
    if (rc < 0) {
        return 0;
    }
    uint32_t id = ++t->nlocs;
    t->locs[id] = (ml_loc){Py_NewRef(filename), Py_NewRef(name), line, h};
    loc_rehash(t->locs, t->locindex, t->nlocindex, id);
    return id;
}

static int stack_eq(const ml_sitestack *a, const ml_sitestack *b)
{
    if (a->hash != b->hash || a->n != b->n || a->user != b->user || a->elided != b->elided) {
        return 0;
    }
    for (int i = 0; i < a->n; i++) {
        if (a->loc[i] != b->loc[i]) {
            return 0;
        }
    }
    return 1;
}

static uint32_t stack_intern(ml_sitetab *t, ml_sitestack *s)
{
    uint64_t x = (uint64_t)s->n << 8 | (uint64_t)(uint8_t)s->user << 1 | s->elided;
    for (int i = 0; i < s->n; i++) {
        x = x * 0x100000001B3ULL + s->loc[i];
    }
    s->hash = mix(x);
    if (t->nindex > 0) {
        uint32_t mask = t->nindex - 1;
        for (uint32_t j = s->hash & mask; t->index[j] != 0; j = (j + 1) & mask) {
            if (stack_eq(&t->stacks[t->index[j]], s)) {
                return t->index[j];
            }
        }
    }
    void *by_id = t->stacks;
    int rc = table_grow(&by_id, t->n, &t->cap, sizeof(ml_sitestack), &t->index, &t->nindex,
                        stack_rehash);
    t->stacks = by_id;
    if (rc < 0) {
        return 0;
    }
    uint32_t id = ++t->n;
    t->stacks[id] = *s;
    stack_rehash(t->stacks, t->index, t->nindex, id);
    return id;
}

/* The first of the two raw slots (a set) where a frame's entry may be: the
 * newer of the set's two entries sits first. */
static inline uint32_t raw_set(const PyCodeObject *code, int offset)
{
    return mix((uint64_t)(uintptr_t)code->co_linetable ^ (uint64_t)(uint32_t)offset << 40) &
           (ML_RAW_SLOTS - 2);
}

/* Whether a raw entry is this frame: the fields its file, line and name
 * depend on are the same objects (the entry holds them, so an address
 * cannot be another object's), whatever the code object. */
ML_HOT static inline int raw_is(const ml_raw *e, const PyCodeObject *code, int offset)
{
    return e->offset == offset && e->linetable == code->co_linetable &&
           e->filename == code->co_filename && e->name == ML_CODE_NAME(code) &&
           e->firstlineno == code->co_firstlineno;
}

/* Whether raw set j holds this frame resolved to location loc (either entry:
 * a hit on the older one is swapped to the front by the next capture that
 * interns).  The location is compared too: a set's entries change, and a
 * recent stack must not answer for another frame that now sits where its
 * own did. */
ML_HOT static inline int raw_set_has(const ml_raw *raw, uint32_t j, const PyCodeObject *code,
                                     int offset, uint32_t loc)
{
    return (raw[j].loc == loc && raw_is(&raw[j], code, offset)) ||
           (raw[j + 1].loc == loc && raw_is(&raw[j + 1], code, offset));
}

/* Whether a walk kept one frame, the user's: its stack is the frame's raw
 * entry's `alone` when known. */
static inline int walked_alone(const ml_walker *w)
{
    return w->n == 1 && w->user == 0 && !w->elided;
}

/* The common capture (the user's line called torch directly: one frame, the
 * user's) answered by the newer entry of its raw set: the id of that stack,
 * else 0.  The entry resolves to the same location as the frame (raw_is),
 * and `alone` is the id of the one-frame stack of that location. */
ML_HOT static inline uint32_t alone_id(const ml_sitetab *t, const ml_walker *w)
{
    if (!walked_alone(w)) {
        return 0;
    }
    const ml_raw *e = &t->raw[raw_set(w->code[0], w->offset[0])];
    return e->alone != 0 && raw_is(e, w->code[0], w->offset[0]) ? e->alone : 0;
}

/* The first of the two recent stacks (a set) a stack whose innermost frame
 * is in raw set j may be in. */
static inline uint32_t recent_set(uint32_t j)
{
    return (j >> 1) & (ML_RECENT_SLOTS - 2);
}

/* A capture that is a recently interned stack: its id, else 0.  Recent
 * stacks are kept by their innermost frame, two per set: the hooked lines of
 * one loop each hit their own entry, and a line called from two places keeps
 * both stacks. */
ML_HOT static inline uint32_t recent_id(ml_sitetab *t, const ml_walker *w)
{
    uint32_t r = recent_set(raw_set(w->code[0], w->offset[0]));
    for (uint32_t k = r; k < r + 2; k++) {
        const ml_recent *c = &t->recent[k];
        if (c->id == 0 || c->n != w->n) {
            continue;
        }
        const ml_sitestack *st = &t->stacks[c->id];
        if (st->elided != w->elided || st->user != w->user) {
            continue;
        }
        int i = 0;
        while (i < w->n && raw_set_has(t->raw, c->slot[i], w->code[i], w->offset[i], st->loc[i])) {
            i++;
        }
        if (i == w->n) {
            if (walked_alone(w)) {
                /* the raw entry the frame matched knows its stack from now */
                ml_raw *e = &t->raw[c->slot[0]];
                if (!(e->loc == st->loc[0] && raw_is(e, w->code[0], w->offset[0]))) {
                    e++;
                }
                e->alone = c->id;
            }
            if (k != r) { /* newest first */
                ml_recent tmp = t->recent[r];
                t->recent[r] = t->recent[k];
                t->recent[k] = tmp;
            }
            return t->recent[r].id;
        }
    }
    return 0;
}

/* The id of the walked stack, interned when new.  Runs no Python and keeps
 * no code object: a new frame is resolved to its file, line and name now.
 * The references the raw slots let go of go to old[] (3 per frame), released
 * by the caller after. */
static uint32_t stack_id(ml_sitetab *t, const ml_walker *w, PyObject **old)
{
    if (t->raw == NULL) {
        t->raw = PyMem_Calloc(ML_RAW_SLOTS, sizeof(ml_raw));
        if (t->raw == NULL) {
            return 0;
        }
    }
    ml_sitestack s = {.n = (uint8_t)w->n, .user = (int8_t)w->user, .elided = (uint8_t)w->elided};
    uint16_t slots[ML_STACK_MAX];
    for (int i = 0; i < w->n; i++) {
        PyCodeObject *code = w->code[i];
        uint32_t j = raw_set(code, w->offset[i]);
        ml_raw *e = &t->raw[j];
        if (!raw_is(e, code, w->offset[i])) {
            if (raw_is(&t->raw[j + 1], code, w->offset[i])) {
                /* the older of the set: it becomes the newer */
                ml_raw tmp = t->raw[j];
                t->raw[j] = t->raw[j + 1];
                t->raw[j + 1] = tmp;
                s.loc[i] = e->loc;
                slots[i] = (uint16_t)j;
                continue;
            }
            int line = PyCode_Addr2Line(code, w->offset[i]);
            uint32_t loc = loc_intern(t, code->co_filename, ML_CODE_NAME(code), line);
            if (loc == 0) {
                return 0;
            }
            t->resolved++;
            /* the older entry leaves the set, the newer moves down */
            ml_raw *gone = &t->raw[j + 1];
            old[3 * i] = gone->linetable;
            old[3 * i + 1] = gone->filename;
            old[3 * i + 2] = gone->name;
            *gone = *e;
            *e = (ml_raw){.linetable = Py_NewRef(code->co_linetable),
                          .filename = Py_NewRef(code->co_filename),
                          .name = Py_NewRef(ML_CODE_NAME(code)),
                          .firstlineno = code->co_firstlineno,
                          .offset = w->offset[i],
                          .loc = loc,
                          .alone = 0,
                          .kind = 0};
        }
        s.loc[i] = e->loc;
        slots[i] = (uint16_t)j;
    }
    uint32_t id = stack_intern(t, &s);
    if (id != 0 && walked_alone(w)) {
        t->raw[slots[0]].alone = id;
    }
    if (id != 0) {
        uint32_t r = recent_set(slots[0]);
        t->recent[r + 1] = t->recent[r];
        t->recent[r].id = id;
        t->recent[r].n = (uint8_t)w->n;
        memcpy(t->recent[r].slot, slots, sizeof(slots));
    }
    return id;
}

/* A stack other than the last two: interned, and the references the raw
 * slots let go of released after (no frame pointer is held then). */
ML_COLD static uint32_t capture_new(ml_sitetab *t, const ml_walker *w)
{
    PyObject *old[3 * ML_STACK_MAX] = {NULL};
    uint32_t id = stack_id(t, w, old);
    for (int i = 0; i < 3 * ML_STACK_MAX; i++) {
        Py_XDECREF(old[i]);
    }
    return id;
}

/* Out of line: ml_site_capture_on's own answer saves no register. */
ML_NOINLINE static void capture(ml_state *st, ml_site *out, int in_place, const PyThreadState *ts)
{
    ml_walker w;
    ml_frames_walk(st, &w, in_place, ts);
    ml_sitetab *t = &st->sites;
    out->id = w.n > 0 && t->raw != NULL ? alone_id(t, &w) : 0;
    if (out->id == 0 && w.n > 0) {
        t->slow++;
        out->id = t->raw != NULL ? recent_id(t, &w) : 0;
        if (out->id == 0) {
            t->missed++;
            out->id = capture_new(t, &w);
        }
    }
    if (w.drop != NULL) {
        Py_DECREF(w.drop); /* no frame pointer is held from here */
    }
}

/* Most captures are the user's line calling torch directly, seen before:
 * the innermost frame, the user's, answered by its raw entry.  That is the
 * walk's first step and alone_id without the walker (its set-up and the
 * calls are a third of a capture's cost); anything else goes to the walk,
 * which answers the same for this case. */
ML_HOT void ml_site_capture_on(ml_state *st, const PyThreadState *ts, ml_site *out)
{
    const ml_sitetab *t = &st->sites;
    PyCodeObject *code;
    int offset;
    if (t->raw != NULL && ml_frames_user_first(st, ts, &code, &offset)) {
        const ml_raw *e = &t->raw[raw_set(code, offset)];
        if (e->alone != 0 && raw_is(e, code, offset)) {
            out->id = e->alone;
            return;
        }
    }
    capture(st, out, 1, ts);
}

void ml_site_capture(ml_state *st, ml_site *out)
{
    ml_site_capture_on(st, NULL, out);
}

void ml_site_capture_public(ml_state *st, ml_site *out)
{
    capture(st, out, 0, NULL);
}

void ml_sitetab_init(ml_sitetab *t)
{
    memset(t, 0, sizeof(*t));
}

void ml_sitetab_clear(ml_sitetab *t)
{
    /* Detach first: releasing a string may run Python (a str subclass's
     * finalizer) that captures a site again. */
    ml_sitetab old = *t;
    ml_sitetab_init(t);
    PyMem_Free(old.index);
    PyMem_Free(old.locindex);
    PyMem_Free(old.stacks);
    for (uint32_t i = 1; i <= old.nlocs; i++) {
        Py_XDECREF(old.locs[i].filename);
        Py_XDECREF(old.locs[i].name);
    }
    PyMem_Free(old.locs);
    if (old.raw != NULL) {
        for (int i = 0; i < ML_RAW_SLOTS; i++) {
            Py_XDECREF(old.raw[i].linetable);
            Py_XDECREF(old.raw[i].filename);
            Py_XDECREF(old.raw[i].name);
        }
        PyMem_Free(old.raw);
    }
    if (old.kind != NULL) {
        for (int i = 0; i < ML_KIND_SLOTS; i++) {
            Py_XDECREF(old.kind[i].filename);
        }
        PyMem_Free(old.kind);
    }
}

int ml_site_lookup(const ml_sitetab *t, uint32_t id, PyObject **filename, int *line)
{
    if (id == 0 || id > t->n) {
        return 0;
    }
    const ml_loc *l = &t->locs[t->stacks[id].loc[0]];
    *filename = l->filename;
    *line = l->line;
    return 1;
}

PyObject *ml_site_stack(const ml_sitetab *t, uint32_t id)
{
    if (id == 0 || id > t->n) {
        Py_RETURN_NONE;
    }
    /* copy first: building the tuples allocates, which can run Python that
     * interns a site and moves the table */
    ml_sitestack s = t->stacks[id];
    ml_loc l[ML_STACK_MAX];
    for (int i = 0; i < s.n; i++) {
        l[i] = t->locs[s.loc[i]];
        Py_INCREF(l[i].filename);
        Py_INCREF(l[i].name);
    }
    PyObject *frames = PyTuple_New(s.n);
    for (int i = 0; i < s.n; i++) {
        PyObject *f = frames == NULL ? NULL
                                     : Py_BuildValue("(OiOO)", l[i].filename, l[i].line, l[i].name,
                                                     i == s.user ? Py_True : Py_False);
        if (f == NULL) {
            Py_CLEAR(frames);
        } else {
            PyTuple_SET_ITEM(frames, i, f);
        }
        Py_DECREF(l[i].filename);
        Py_DECREF(l[i].name);
    }
    return frames == NULL ? NULL : Py_BuildValue("(NO)", frames, s.elided ? Py_True : Py_False);
}

PyObject *ml_sites_info(const ml_sitetab *t)
{
    Py_ssize_t raw = 0;
    for (int i = 0; t->raw != NULL && i < ML_RAW_SLOTS; i++) {
        raw += t->raw[i].linetable != NULL;
    }
    return Py_BuildValue("(IInKKK)", t->n, t->nlocs, raw, (unsigned long long)t->resolved,
                         (unsigned long long)t->missed, (unsigned long long)t->slow);
}
