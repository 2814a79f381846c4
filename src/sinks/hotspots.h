/* The hotspot sink: cumulative bytes per (device, site) of a lord's
 * allocations and frees. */
#ifndef MEMLORD_SINKS_HOTSPOTS_H
#define MEMLORD_SINKS_HOTSPOTS_H

#include "core/book.h"

extern const ml_sink ml_hotspot_sink;

#endif
