/* Accounting of what one hooked call saw: a conversion (the hot path), a
 * new tensor of a factory or nn.Parameter, the storages a walk found.
 * Private to hooks/. */
#ifndef MEMLORD_HOOKS_ACCOUNT_H
#define MEMLORD_HOOKS_ACCOUNT_H

#include "hooks/dispatch.h"
#include "torch/sizing.h"

/* Whether any of lords records call sites. */
int ml_any_tracks_callsite(const ml_lords *lords);
/* The call site of a conversion (the caller clears *site); ts: the calling
 * thread's state when the caller has it, else NULL. */
void ml_conversion_site(ml_state *st, const ml_hook_tls *tl, const PyThreadState *ts,
                        const ml_lords *lords, ml_site *site);
/* Count the conversion of src into dst (kind: HK_MOVE or HK_CAST) for lords,
 * on ts, the calling thread's state (or NULL): 0, or -1 with an exception
 * set (reported by the caller). */
int ml_account_conversion(ml_state *st, const ml_hook_tls *tl, const PyThreadState *ts,
                          const ml_lords *lords, PyObject *src, PyObject *dst, int kind,
                          int non_blocking);
/* Count and track a new tensor's storages for the lords with lifetime
 * tracking on; of a composite t (a sparse tensor, a jagged NestedTensor),
 * those that src (the call's source tensor, or NULL) does not hold.  -1 only
 * when memory runs out. */
int ml_track_new_tensor(ml_state *st, const ml_lords *lords, PyObject *t, PyObject *src,
                        enum ml_ev_source source);
/* The storage of t, tracked by a lord of lords, is of category cat from now
 * on (whatever it was).  No storage readable: nothing. */
void ml_recategorize_tensor(ml_state *st, const ml_lords *lords, PyObject *t, int cat);
/* Count and track a walk's storages for the lords that track them (only
 * those that track conversions with deep_only). */
void ml_track_for(const ml_lords *lords, const ml_walk *w, const ml_site *site,
                  enum ml_ev_source source, int deep_only);

#endif
