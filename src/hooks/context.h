/* The category a storage is born into (core/ledger.h): from the source
 * that saw it and what the thread is doing (an optimizer step, backward).
 * Private to hooks/. */
#ifndef MEMLORD_HOOKS_CONTEXT_H
#define MEMLORD_HOOKS_CONTEXT_H

#include "core/event.h"
#include "core/ledger.h"

/* The category of a new storage seen by source through tensor (NULL: none):
 * explicit calls: other; torch.load: loaded; gradients: gradient;
 * nn.Parameter, or a factory, op or conversion whose result is a parameter:
 * parameter; a factory, op or conversion inside optimizer.step() on this
 * thread: optimizer_state; in backward (the autograd engine runs a graph
 * task on this thread), outside a tracked module's forward and outside
 * torch.utils.checkpoint's recomputation: temporary; else activation.  May call torch
 * (torch._C._current_graph_task_id); never fails. */
int ml_context_cat(ml_state *st, enum ml_ev_source source, PyObject *tensor);
/* optimizer.step() of this thread begins (1) or ends (0): its hooks. */
void ml_context_optimizer(int begin);
/* 1 while this thread runs optimizer.step() (the hooks saw it begin). */
int ml_context_in_optimizer(void);
/* A tracked module's forward begins (1) or ends (0) on this thread.  While
 * one that began in backward runs (activation checkpointing recomputes the
 * forward there), what backward makes is activation, as torch's MemTracker
 * counts it.  Returns 1 when a begin was noted (its end must be given), else
 * 0.  May call torch; never fails. */
int ml_context_recompute(int begin);

#endif
