/* The MemLord type. */
#ifndef MEMLORD_LORD_H
#define MEMLORD_LORD_H

#include "core/book.h"

#include <stddef.h>

#define ML_QCACHE 4

typedef struct {
    PyObject *result; /* (int, str), strong */
    uint64_t version;
    ml_selector sel;
    int kind; /* 0 allocated, 1 freed */
} ml_qcache;

/* A lord: its book (core/book.h) first, so that a lord is an ml_book * for
 * every layer below this one, then what only the Lord's methods read. */
typedef struct MemLordObject {
    ml_book book;
    ml_qcache qcache[ML_QCACHE];
    int qnext;
    /* The last str selector, by content (no reference kept), and its parse */
    char last_sel_text[24];
    Py_ssize_t last_sel_len; /* 0: none cached */
    ml_selector last_sel;
    PyObject *weakreflist;
} MemLordObject;

/* What makes a lord an ml_book * below api/. */
_Static_assert(offsetof(MemLordObject, book) == 0, "a lord begins with its book");

extern PyType_Spec ml_lord_spec;

#endif
