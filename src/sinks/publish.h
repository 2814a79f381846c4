/* Publishing (lord.publish()): a sink that keeps this lord's per-device
 * counters in a record other processes read (memlord/_publish.py, `python
 * -m memlord top`).  The record is a memory-mapped file the Python side
 * creates; the sink writes into it in phase 1 (no Python, no failure) under
 * a sequence counter: odd while a write is inside, so that a reader in
 * another process retries instead of seeing a torn record.  Every writer of a
 * record holds the GIL (the sink, and _publish_write for the fields Python
 * keeps), so writes never interleave. */
#ifndef MEMLORD_PUBLISH_H
#define MEMLORD_PUBLISH_H

#include "core/event.h"

#define ML_PUB_MAGIC 0x3142555044524c4dULL /* "MLRDPUB1" little-endian */
#define ML_PUB_VERSION 1
#define ML_PUB_DEVS 8
#define ML_PUB_CATS 16 /* >= ML_NCAT (a static assertion keeps it so) */
#define ML_PUB_PY 1024 /* the bytes memlord/_publish.py lays out itself */

/* One device's counters: code, live, peak, ooms and the categories are the
 * sink's; reserved and name are Python's (written by the heartbeat). */
typedef struct {
    uint32_t code; /* the device's key (ml_dev: 0 is cpu) */
    uint32_t used; /* 1: the slot is a device's */
    int64_t live;
    int64_t peak;
    int64_t ooms;
    int64_t cat[ML_PUB_CATS];
    int64_t reserved; /* CUDA's reserved bytes, -1: unknown */
    char name[16];    /* "cuda:0", NUL-terminated */
} ml_pub_dev;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t size; /* sizeof(ml_pub) */
    uint64_t seq;  /* odd while a writer is inside */
    ml_pub_dev devs[ML_PUB_DEVS];
    uint8_t py[ML_PUB_PY];
} ml_pub;

struct ml_publish;

extern const ml_sink ml_publish_sink_proto; /* data: the lord's ml_publish */

struct ml_publish *ml_publish_new(void); /* NULL with an exception set */
const int *ml_publish_busy(const struct ml_publish *p);
void ml_publish_free(struct ml_publish *p); /* releases the record's buffer */

/* Methods of the Lord type (lord.c lists them). */
/* _publish_attach(buffer or None): publish into buffer (a writable buffer of
 * at least sizeof(ml_pub) bytes, kept exported while attached: an mmap
 * cannot be closed under the sink), copying the ledger's counters now; None
 * detaches. */
PyObject *ml_lord_publish_attach(PyObject *self, PyObject *buffer);
/* _publish_write(offset, data): write bytes into the record under the
 * sequence counter. */
PyObject *ml_lord_publish_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* _core._publish_layout(): {"size", "seq", "devs", "dev_size", "ndev",
 * "ncat", "py", "py_size", "magic", "version"} and each device field's
 * offset ("dev.code", ...). */
PyObject *ml_publish_layout(PyObject *module, PyObject *unused);

#endif
