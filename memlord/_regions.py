"""Regions and module breakdowns: ``lord.region(name)``, ``lord.regions()``,
``lord.track_modules(model)``.

The counting is a C sink (``src/sinks/regions.c``): every allocation or free event of a
region's thread updates that region's per-device net bytes, running peak and counts, in
the event's apply phase.  The Region object (``lord.region(name)``) is a C type too, so
entering and leaving cost a few hundred nanoseconds; Python aggregates closed regions by
name, decorates functions and hooks modules.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import struct
import sys
import threading
import types
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from . import _core, _ops
from ._core import CATEGORIES, Region

if TYPE_CHECKING:
    from ._core import Lord, _RegionRaw
    from ._core import Lord as _LordBase

    # what a closing region appends to its lord's (or a tracker's) list
    _Closed = tuple[str, _RegionRaw]
else:
    _LordBase = object  # the mixin's methods run on memlord.MemLord, a _core.Lord

log = logging.getLogger("memlord")

_ENGINE = torch.autograd.Variable._execution_engine

_FOLD_AT = 4096

#: How many closed regions a lord keeps one by one (the newest), with their start time,
#: thread and nesting depth, for ``lord.export()``'s region slices; older ones are
#: still counted in ``lord.regions()``.  The default of ``MemLord(region_history=...)``;
#: ``regions(clear=True)`` empties the history with the aggregate.
REGION_HISTORY = 100_000


_CATS = struct.Struct("=4q")
iter_cats = _CATS.iter_unpack  # (index in CATEGORIES, delta, peak_delta, at_peak) per category


def row_categories(raw: bytes) -> list[tuple[str, int, int, int]]:
    """A closed region's device row's categories (the C core packs them as bytes, which
    the cyclic GC does not walk): ``(category, delta, peak_delta, at_peak)`` for each
    category an event of the region had on the device, in ``CATEGORIES`` order."""
    return [(CATEGORIES[ix], net, peak, at) for ix, net, peak, at in _CATS.iter_unpack(raw)]


def _drain(done: list[_Closed]) -> list[_Closed]:
    """Take the items at the head of a list that closing regions append to: safe
    against appends from other threads meanwhile."""
    n = len(done)
    items = done[:n]
    del done[:n]
    return items


class _Aggregate:
    """Per region name: count, total ns and per device total, max delta, max peak delta.

    Closing a region (C) only appends ``(name, (duration_ns, rows, start_ns, thread,
    depth))`` to a list; the list is folded in here under a lock when read, or when many
    are waiting.  With ``history`` > 0 the newest that many items are also kept one by
    one (what ``lord.export()`` draws as slices)."""

    def __init__(self, history: int = 0) -> None:
        # Re-entrant: a finalizer run by the cyclic GC (or a signal handler) in the
        # middle of a fold may close a region, and a region's exit may ask for a fold;
        # that nested fold returns at once (the items wait for the next one), so a drain
        # is never interleaved. A fold builds the new aggregate aside and publishes it
        # with one assignment: a nested read sees the last complete fold, and an
        # exception in the middle (KeyboardInterrupt) puts the items back, unfolded.
        self._lock = threading.RLock()
        self._folding = False
        self._gen = 0  # bumped by every clear: a fold that saw one folds again
        self._inflight: list[_Closed] = []  # the items a fold is taking in
        # name -> [count, total ns, {device: [total, max, max peak, {category: [...]}]}]
        self._by_name: dict[str, list[Any]] = {}
        self._history: deque[_Closed] | None = deque(maxlen=history) if history > 0 else None
        self._seen = 0  # items folded since creation (history keeps the newest)

    def fold(self, done: list[_Closed]) -> None:
        with self._lock:
            if self._folding:
                return
            self._folding = True
            try:
                self._fold_locked(done)
            finally:
                self._folding = False

    def _fold_locked(self, done: list[_Closed]) -> None:
        items = _drain(done)
        if not items:
            return
        self._inflight = items
        try:
            while True:
                gen = self._gen
                by_name = self._folded(self._by_name, items)
                if gen == self._gen:  # no clear meanwhile: publish
                    break
        except BaseException:
            done[:0] = items  # unfolded: the next fold takes them in
            raise
        finally:
            self._inflight = []
        self._by_name = by_name
        if self._history is not None:
            self._history.extend(items)
        self._seen += len(items)

    @staticmethod
    def _folded(base: dict[str, list[Any]], items: list[_Closed]) -> dict[str, list[Any]]:
        """base with items folded in, as a new dict: base and the lists it holds are
        left as they are (those of the names items touch are copied first)."""
        by_name = dict(base)
        copied: set[str] = set()
        for name, raw in items:
            duration_ns, rows = raw[0], raw[1]
            agg = by_name.get(name)
            if agg is None:
                agg = by_name[name] = [0, 0, {}]  # count, total ns, devices
                copied.add(name)
            elif name not in copied:
                agg = by_name[name] = [
                    agg[0],
                    agg[1],
                    {
                        dev: [d[0], d[1], d[2], {ix: list(c) for ix, c in d[3].items()}]
                        for dev, d in agg[2].items()
                    },
                ]
                copied.add(name)
            agg[0] += 1
            agg[1] += duration_ns
            devices = agg[2]
            for row in rows:
                dev, net, peak_net = row[0], row[2], row[3]
                d = devices.get(dev)
                if d is None:
                    d = devices[dev] = [net, net, peak_net, {}]  # total, max, max peak, cats
                else:
                    d[0] += net
                    d[1] = max(d[1], net)
                    d[2] = max(d[2], peak_net)
                # by category index (named in result()); this runs once per closed
                # region and device: plain comparisons, no calls
                cats = d[3]
                for ix, cnet, cpeak, _at_peak in iter_cats(row[6]):
                    c = cats.get(ix)
                    if c is None:
                        cats[ix] = [cnet, cnet, cpeak]
                    else:
                        c[0] += cnet
                        if cnet > c[1]:
                            c[1] = cnet
                        if cpeak > c[2]:
                            c[2] = cpeak
        return by_name

    def history(self, done: list[_Closed]) -> tuple[list[_Closed], int]:
        """The kept closed regions, oldest first, as ``(name, raw)``, and how many
        closed regions were folded in all (more than kept when the history overflowed)."""
        with self._lock:
            if self._folding:
                # asked from a finalizer or a signal handler in the middle of a fold: the
                # kept items, those being folded and those still waiting, without draining
                waiting = list(self._inflight) + list(done)
                kept = list(self._history or ())
                return kept + waiting, self._seen + len(waiting)
            self._folding = True
            try:
                self._fold_locked(done)
                return list(self._history or ()), self._seen
            finally:
                self._folding = False

    def result(self, done: list[_Closed], clear: bool) -> dict[str, dict[str, Any]]:
        with self._lock:
            # asked from a finalizer or a signal handler in the middle of a fold: the
            # last complete fold (the items being folded count from the next call)
            nested = self._folding
            self._folding = True
            try:
                if not nested:
                    self._fold_locked(done)
                out = {}
                for name, (count, total_ns, devs) in self._by_name.items():
                    devices = {
                        dev: {
                            "total_delta": total,
                            # over every run of the region (a run that did not touch
                            # the device counts 0)
                            "avg_delta": total / count,
                            "max_delta": mx,
                            "max_peak_delta": mpeak,
                            # by category, those some run of the region touched
                            "categories": {
                                CATEGORIES[ix]: {
                                    "total_delta": t,
                                    "max_delta": m,
                                    "max_peak_delta": p,
                                }
                                for ix, (t, m, p) in sorted(cats.items())
                            },
                        }
                        for dev, (total, mx, mpeak, cats) in devs.items()
                    }
                    out[name] = {"count": count, "total_s": total_ns / 1e9, "devices": devices}
                if clear:
                    self._gen += 1
                    self._by_name = {}
                    if self._history is not None:
                        self._history = deque(maxlen=self._history.maxlen)
                    self._seen = 0
                return out
            finally:
                self._folding = nested


def _decorate(region: Region, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``@lord.region(name)``: a fresh region of that name around every call.

    On a generator function the region is open from the first ``next()`` to the end of
    the iteration, on an ``async def`` while the coroutine is awaited, and on an async
    generator from the first ``anext()`` to its end: as a ``with lord.region(name):``
    around the body would be.  The wrapper is of the same kind as ``fn``, so
    ``inspect.isgeneratorfunction``, ``iscoroutinefunction`` and
    ``isasyncgenfunction`` answer as they do for ``fn``."""
    if not callable(fn):
        raise TypeError(f"region(): a decorator takes a function, not {type(fn).__name__}")
    lord, name, sink = region._lord, region.name, region._sink

    if sink is None:

        def make() -> Region:
            return lord.region(name)

    else:

        def make() -> Region:
            return lord._region_with_sink(name, sink)

    if inspect.isasyncgenfunction(fn):
        return functools.wraps(fn)(_async_gen_wrapper(fn, make))

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Any:
            gen = fn(*args, **kwargs)
            with make():
                return (yield from gen)

        return gen_wrapper

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def coro_wrapper(*args: Any, **kwargs: Any) -> Any:
            coro = fn(*args, **kwargs)
            with make():
                return await coro

        return coro_wrapper

    if sink is None:

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lord.region(name):
                return fn(*args, **kwargs)

    else:

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with lord._region_with_sink(name, sink):
                return fn(*args, **kwargs)

    return wrapper


def _async_gen_wrapper(fn: Callable[..., Any], make: Callable[[], Region]) -> Callable[..., Any]:
    """An async generator function delegating to ``fn``'s (``yield from`` has no async
    form): values sent, exceptions thrown and ``aclose()`` reach the inner generator."""

    async def agen_wrapper(*args: Any, **kwargs: Any) -> Any:
        agen = fn(*args, **kwargs)
        with make():
            try:
                value = await agen.__anext__()
            except StopAsyncIteration:
                return
            while True:
                try:
                    sent = yield value
                except GeneratorExit:
                    await agen.aclose()
                    raise
                except BaseException as exc:
                    try:
                        value = await agen.athrow(exc)
                    except StopAsyncIteration:
                        return
                else:
                    try:
                        value = await agen.asend(sent)
                    except StopAsyncIteration:
                        return

    return agen_wrapper


def _grad_nodes(
    obj: Any, leaves: bool = True, depth: int = 0, out: list[Node] | None = None
) -> list[Node]:
    """The autograd nodes gradients of obj's tensors that require grad go to (their
    ``grad_fn``, or with ``leaves`` a leaf's gradient accumulator), deduplicated: obj a
    tensor, or tensors nested in tuples, lists and mappings (a ``ModelOutput`` is a
    dict)."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and (leaves or obj.grad_fn is not None):
            try:
                node = torch.autograd.graph.get_gradient_edge(obj).node
            except RuntimeError:
                return out
            if not any(n is node for n in out):
                out.append(node)
    elif depth < 6:
        if isinstance(obj, (tuple, list)):
            for x in obj:
                _grad_nodes(x, leaves, depth + 1, out)
        elif isinstance(obj, Mapping):
            for x in obj.values():
                _grad_nodes(x, leaves, depth + 1, out)
    return out


def _will_run(node: Any) -> bool:
    """Whether the running backward will execute node.  torch will not say it for a leaf's
    gradient accumulator while autograd.grad() runs (RuntimeError): grad() runs none."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        # torch's stubs of torch._C._functions leave AccumulateGrad out
        if isinstance(node, torch._C._functions.AccumulateGrad):  # type: ignore[attr-defined]
            return False
        raise


class _BackwardCall:
    """One module call's backward: opened when the gradient of its first output is
    ready, closed when the gradients of its inputs are (or when the backward ends, for
    a module whose inputs need none: ids, masks).  Holds no tensor, and no node that the
    graph's hooks could keep alive in a cycle."""

    __slots__ = ("begin", "end", "in_nodes", "left", "token")

    def __init__(
        self, begin: Callable[[], Any], end: Callable[[Any], None], in_nodes: list[Node]
    ) -> None:
        self.begin, self.end = begin, end
        self.in_nodes = in_nodes  # upstream of the outputs, whose hooks hold this call
        self.token: Any = None
        self.left = 0

    def start(self) -> None:
        if self.token is not None:
            return  # another output of the call, or a second pass of this backward
        try:
            self.token = self.begin()
            needed = [n for n in self.in_nodes if _will_run(n)]
            self.left = len(needed)
            _at_backward_end(self, needed)
        except Exception:  # noqa: BLE001 - accounting never raises into the caller
            log.exception("memlord track_modules: watching a backward failed")

    def input_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.finish()

    def finish(self) -> None:
        token, self.token = self.token, None
        if token is not None:
            self.end(token)


class _Hooked(list[_BackwardCall]):
    """Calls hooked on one node, in the order their hooks run (weakly referable)."""

    __slots__ = ("__weakref__",)


def _run_starts(calls: _Hooked, key: int, *_: Any) -> None:
    # the node is also the input of the calls that end here (a module's input is the
    # output of the module before it): they end before these start
    task = _TASKS.get(torch._C._current_graph_task_id())
    ends = task.ends.get(key) if task is not None else None
    if ends:
        _run_ends(ends)
    for call in list(calls):  # outermost first: the regions nest
        call.start()


def _run_ends(calls: _Hooked, *_: Any) -> None:
    done = list(calls)
    calls.clear()  # once per task: the start hooks of the node may have run them
    for call in reversed(done):  # innermost (latest opened) first
        call.input_done()


class _TaskCalls(list[_BackwardCall]):
    """The backward calls one graph task opened, in the order they opened, and the
    hooks it put on the nodes of their inputs."""

    __slots__ = ("__weakref__", "ends", "handles")

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[int, _Hooked] = {}  # node key -> calls; the nodes live meanwhile
        self.handles: list[RemovableHandle] = []


#: graph task id -> its calls; the strong reference is the callback queued on the task
#: (dropped with the task, also when its backward raises)
_TASKS: weakref.WeakValueDictionary[int, _TaskCalls] = weakref.WeakValueDictionary()
# re-entrant: a finalizer that a collection runs meanwhile may end a backward's calls
_TASKS_LOCK = threading.RLock()


def _finish_calls(calls: _TaskCalls) -> None:
    handles, calls.handles = calls.handles, []
    for h in handles:
        h.remove()
    calls.ends.clear()
    while calls:  # innermost (latest opened) first
        try:
            calls.pop().finish()
        except Exception:  # noqa: BLE001 - accounting never raises into the caller
            log.exception("memlord track_modules: closing a backward region failed")


def _at_backward_end(call: _BackwardCall, needed: list[Node]) -> None:
    """Finish call once the gradients of the needed input nodes are computed, or when
    the current backward ends."""
    task = torch._C._current_graph_task_id()
    with _TASKS_LOCK:
        calls = _TASKS.get(task)
        new = calls is None
        if calls is None:
            calls = _TASKS[task] = _TaskCalls()
        calls.append(call)
    if new:
        _ENGINE.queue_callback(functools.partial(_finish_calls, calls))
    for node in needed:
        key = _node_key(node)
        hooked = calls.ends.get(key)
        if hooked is None:
            hooked = calls.ends[key] = _Hooked()
            # a node where backward spans start (a module's output) runs the ends there
            # first (_run_starts): one Python call from the engine instead of two
            if not _starts_at(node):
                handle = node.register_prehook(functools.partial(_run_ends, hooked))
                calls.handles.append(handle)
        hooked.append(call)


#: per thread, output node key -> (weak output tensor, weak _Hooked): the calls whose
#: backward starts at that node, so that an enclosing module returning the same output
#: (its forward hook runs after the inner one's) opens its backward region first
_CLAIMS = threading.local()


_NODE_KEYS = itertools.count(1)
_NODE_KEY = "memlord.node"
_STARTS_KEY = "memlord.starts"  # in a node's metadata: _run_starts is hooked there


def _starts_at(node: Any) -> bool:
    try:
        return _STARTS_KEY in node.metadata
    except Exception:  # noqa: BLE001 - a node without metadata: hook its ends too
        return False


def _node_key(node: Any) -> int:
    """A key for a graph node that outlives its Python object: torch (2.11) may hand out a
    new Python object for the same node once the first one died (``t.grad_fn`` twice: two
    ids), so an ``id()`` kept from the forward missed the node in its backward.  The key
    lives in the node's own ``metadata`` dict (kept by the C++ node)."""
    try:
        meta = node.metadata
        key: int | None = meta.get(_NODE_KEY)
        if key is None:
            key = meta[_NODE_KEY] = -next(_NODE_KEYS)  # negative: never an id()
        return key
    except Exception:  # noqa: BLE001 - a node without metadata: its object's id
        return id(node)


def _grad_outputs(
    obj: Any, depth: int = 0, out: dict[int, tuple[Node, torch.Tensor]] | None = None
) -> dict[int, tuple[Node, torch.Tensor]]:
    """node key -> (node, tensor) for the non-leaf tensors needing a gradient in obj."""
    if out is None:
        out = {}
    if isinstance(obj, torch.Tensor):
        node = obj.grad_fn if obj.requires_grad else None
        if node is not None:
            out.setdefault(_node_key(node), (node, obj))
    elif depth < 6:
        if isinstance(obj, (tuple, list)):
            for x in obj:
                _grad_outputs(x, depth + 1, out)
        elif isinstance(obj, Mapping):
            for x in obj.values():
                _grad_outputs(x, depth + 1, out)
    return out


def _watch_backward(
    in_nodes: list[Node], output: Any, begin: Callable[[], Any], end: Callable[[Any], None]
) -> None:
    """Call begin() when a backward reaches the outputs of a module call (``output``,
    tensors nested as in :func:`_grad_nodes`) and end(begin's token) when it has computed
    the gradients of its inputs (whose nodes are ``in_nodes``), or at the end of that
    backward.  Hooks on the graph's nodes, not torch's full backward hooks: those wrap
    only a tensor or a tuple of tensors, warn when no input requires grad, and forbid an
    in-place change of the output afterwards.  Accounting never raises into autograd."""
    outs = _grad_outputs(output)  # a leaf's hooks would outlive the call: non-leaves only
    if not outs:
        return  # no graph (no_grad, inference)
    call = _BackwardCall(begin, end, in_nodes)
    claims = getattr(_CLAIMS, "map", None)
    if claims is None:
        claims = _CLAIMS.map = {}
    for key, (node, tensor) in outs.items():
        claim = claims.get(key)
        if claim is not None:
            t, hooked = claim[0](), claim[1]()
            if t is not None and hooked is not None and _node_key(t.grad_fn) == key:
                hooked.insert(0, call)  # encloses the calls already hooked there
                continue
        hooked = _Hooked([call])
        node.register_prehook(functools.partial(_run_starts, hooked, key))
        with contextlib.suppress(Exception):  # without metadata, _run_ends is hooked too
            # torch.autograd.graph.Node declares metadata a method; nodes have a dict
            node.metadata[_STARTS_KEY] = True  # type: ignore[index]
        claims[key] = (weakref.ref(tensor), weakref.ref(hooked))
    if len(claims) > 64:
        for key in [k for k, (t, h) in claims.items() if t() is None or h() is None]:
            del claims[key]


def _call_impl_inner() -> Any:
    """The code of the function inside ``nn.Module._call_impl`` that runs the forward
    hooks (torch 2.x: ``inner``), or None."""
    code = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)
    for const in getattr(code, "co_consts", ()):
        if isinstance(const, types.CodeType) and const.co_name == "inner":
            return const
    return None


_CALL_INNER = _call_impl_inner()


def _call_kwargs(frame: Any) -> dict[str, Any] | None:
    """The keyword inputs of the module call whose global forward pre-hook runs now, read
    from torch's frame that calls the hook (``frame``); None where it is not that frame."""
    if _CALL_INNER is None or frame.f_code is not _CALL_INNER:
        return None
    kwargs = frame.f_locals.get("kwargs")
    return kwargs if isinstance(kwargs, dict) else None


#: the ids of the global module hooks of the trackers that follow one model's modules
#: (no other module sees them): torch.compile(model)'s module does not warn of them
_FILTERED_HOOKS: set[int] = set()
_FILTERED_LOCK = threading.RLock()  # a model's finalizer may remove its hooks in a GC
_TORCH_HAS_ANY_GLOBAL_HOOK: list[Callable[[], bool]] = []  # torch's function, once seen


def _only_filtered_hooks() -> bool:
    """Whether every global module hook installed is one of a model tracker's."""
    torch_module = torch.nn.modules.module
    for attr in (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_hooks_always_called",
        "_global_forward_hooks_with_kwargs",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    ):
        ids = list(getattr(torch_module, attr, ()))  # another thread may add one meanwhile
        if not all(i in _FILTERED_HOOKS for i in ids):
            return False
    return True


def _has_any_global_hook() -> bool:
    """torch's ``torch.nn.modules.module._has_any_global_hook()`` leaving out the hooks
    of memlord's model trackers, while one is on.  torch asks it only when an
    ``OptimizedModule`` (``torch.compile(model)``) is called, to warn that global hooks
    fire an extra time for it: a model tracker's hooks pass every module but its model's
    untouched, so bare and tracked, nothing warns."""
    has = _TORCH_HAS_ANY_GLOBAL_HOOK[0]()
    if not has or not _FILTERED_HOOKS:
        return has
    try:
        return not _only_filtered_hooks()
    except Exception:  # noqa: BLE001 - never raises into torch: torch's answer
        return has


def _filter_hooks(ids: list[int], on: bool) -> None:
    """Count (``on``) or forget a model tracker's global hook ids; torch's
    ``_has_any_global_hook`` is memlord's while any is counted, torch's again after."""
    from torch.nn.modules import module as torch_module

    with _FILTERED_LOCK:
        current = getattr(torch_module, "_has_any_global_hook", None)
        if on:
            if current is None:
                return  # a torch that never warns of global hooks
            if current is not _has_any_global_hook:
                if not _TORCH_HAS_ANY_GLOBAL_HOOK:
                    _TORCH_HAS_ANY_GLOBAL_HOOK.append(current)
                elif current is not _TORCH_HAS_ANY_GLOBAL_HOOK[0]:
                    return  # another stand-in is there: left as it is (torch then warns)
                torch_module._has_any_global_hook = _has_any_global_hook
            _FILTERED_HOOKS.update(ids)
            return
        _FILTERED_HOOKS.difference_update(ids)
        if not _FILTERED_HOOKS and current is _has_any_global_hook:
            torch_module._has_any_global_hook = _TORCH_HAS_ANY_GLOBAL_HOOK[0]


def _compiled_original(module: Any) -> Any:
    """The module ``torch.compile(module)`` wrapped, when ``module`` is that wrapper (an
    ``OptimizedModule``), else None.  Without ``torch._dynamo`` imported there is none
    (memlord never imports it)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is None or not isinstance(module, wrapper):
        return None
    return module.__dict__.get("_modules", {}).get("_orig_mod")


#: an open span: (id of the module, or None for a backward span; the token; the nodes of
#: the inputs whose gradients end the call's backward span, or None; whether the keyword
#: inputs are still to be added after the call; whether its forward began in backward,
#: noted by _core._module_forward, whose end it must be told)
_Span = tuple[int | None, Any, list[Node] | None, bool, bool]


class _Stack(list[_Span]):
    """One thread's open spans of a ModuleSpans, innermost last; ``owner`` is that
    thread's ident."""

    __slots__ = ("__weakref__", "owner", "listed")

    def __init__(self) -> None:
        super().__init__()
        self.owner = threading.get_ident()
        self.listed = False  # in its ModuleSpans' _stacks

    # by identity, in a set (list's __hash__ is None: mypy sees no method to override)
    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__


class ModuleSpans:
    """The one per-module-call span tracker, behind ``lord.track_modules(model)`` and
    ``python -m memlord run --modules``.

    A span opens when a module's forward starts (``open(name) -> token``) and closes when
    it ends, also by an exception (``close(token)``); with ``backward`` a span named
    ``"<name> (backward)"`` covers the call's backward (:func:`_watch_backward`).  The
    hooks are torch's global module hooks, never hooks on the modules (the model pickles,
    deep-copies and scripts as without memlord).  With ``model`` the spans are those of
    that model's modules, each named by its qualified name (the root by its class name);
    without, of every module call, named by the qualified name under the first module
    called that contains it (the root itself by its class name).  The inputs whose
    gradients end a backward span are the call's positional and keyword inputs (the
    keyword ones read from torch's frame calling the hook; where that frame is not found,
    taken after the call).  Accounting never raises into the model."""

    def __init__(
        self,
        open: Callable[[str], Any],  # noqa: A002 - the span's two ends
        close: Callable[[Any], None],
        model: torch.nn.Module | None = None,
        backward: bool = True,
    ) -> None:
        self._open_span, self._close_span = open, close
        self._backward = backward
        self._local = threading.local()
        # every thread's stack that may hold spans, held strongly: a thread that ended
        # with spans open (a backward that raised there, its graph since freed) leaves
        # them to disable(), which closes the spans of all of them.  Empty stacks are
        # dropped when a thread makes its own; a dropped stack is listed again when its
        # thread opens a span in it (_push)
        self._stacks: set[_Stack] = set()
        # re-entrant: a finalizer or signal handler run while this thread registers its
        # stack (an allocation, so a collection) may disable() the tracker
        self._stacks_lock = threading.RLock()
        self._handles: list[Any] = []
        # Global hooks in both cases, never hooks on the model's modules: a hook a module
        # holds goes with it into pickle.dumps(model) and torch.save(model) (memlord's
        # closures do not pickle) and torch.jit.script(model) compiles it (it cannot):
        # the model must stay as it is. With a model, each of its modules is looked up by
        # id (a weak reference says it is the same one): other modules pass untouched.
        self._tracked: dict[int, tuple[Any, str]] | None = None
        self._model_gone: Any = None
        if model is None:
            self._names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        else:
            root = type(model).__name__
            self._tracked = {
                id(mod): (weakref.ref(mod), qname or root) for qname, mod in model.named_modules()
            }
            # the hooks go when the model does (hooks on its modules would have gone with
            # it): a tracker never disabled does not outlive its model
            self._model_gone = weakref.finalize(model, self._remove_hooks)
        self._filtered: list[int] = []
        _ops.run_outside_dynamo(ModuleSpans._pre, ModuleSpans._post)
        try:
            from torch.nn.modules import module as torch_module

            self._handles.append(torch_module.register_module_forward_pre_hook(self._pre))
            self._handles.append(
                torch_module.register_module_forward_hook(
                    self._post, with_kwargs=True, always_call=True
                )
            )
            # torch warns of global hooks when torch.compile(model)'s wrapper is called:
            # they would fire for the wrapper and again for the model.  These spans take
            # the wrapper's call as the model's, and leave out the model's own inside it
            self._filtered = [h.id for h in self._handles]
            _filter_hooks(self._filtered, True)
        except BaseException:
            self.disable()
            raise

    # ---- the hooks ----------------------------------------------------------------------

    def _name(self, module: Any) -> str | None:
        """A module's span name: its qualified name in the tracked model (None: not one
        of its modules), or under global hooks (see the class)."""
        tracked = self._tracked
        if tracked is not None:
            entry = tracked.get(id(module))
            if entry is not None and entry[0]() is module:
                return entry[1]
            # torch.compile(m)'s wrapper, called in m's place: m's name
            original = _compiled_original(module)
            return None if original is None else self._name(original)
        name = self._names.get(module)
        if name is None:
            original = _compiled_original(module)
            named = None if original is None else self._name(original)
            if named is not None:
                self._names[module] = named
                return named
            name = type(module).__name__
            self._names[module] = name
            for qual, sub in module.named_modules():
                if qual and sub not in self._names:
                    self._names[sub] = qual
        return name

    # Each hook does nothing while dynamo traces: dynamo folds the test to a constant, so
    # the spans' C calls and autograd reads add no graph break (torch.compile(model,
    # fullgraph=True) compiles as without memlord); a compiled call has no spans inside,
    # as torch's own ModTracker skips optimized modules. Dynamo never compiles the hooks'
    # own frames (_ops.run_outside_dynamo): a module that a compiled call runs eagerly (one
    # dynamo skips, as torch's own modules under model.compile()) has its spans.
    # torch.compile(model) returns a wrapper module, always called eagerly: its call is
    # the model's span (by the model's name); the model's own call inside it, which
    # torch runs eagerly for some modules and inside the compiled frame for others (an
    # nn.Sequential), adds none, so a compiled model has one span either way.

    def _pre(self, module: Any, args: Any) -> None:
        if _ops._dynamo_compiling():
            return
        try:
            name = self._name(module)
            if name is None:
                return
            wrapping: dict[int, int] | None = getattr(self._local, "wrapping", None)
            if wrapping and id(module) in wrapping:
                stack = self._stack()
                if stack and stack[-1][0] == wrapping[id(module)]:
                    return  # the wrapped model's own call: its wrapper's span is open
            original = _compiled_original(module)
            if original is not None:
                if wrapping is None:
                    wrapping = self._local.wrapping = {}
                wrapping[id(original)] = id(module)
            # torch passes a global pre-hook the positional inputs only
            kwargs = _call_kwargs(sys._getframe(1))
            self._enter(module, name, args if kwargs is None else (args, kwargs), kwargs is None)
        except Exception:  # noqa: BLE001 - accounting never raises into the caller
            log.exception("memlord module spans: opening a span failed")

    def _post(self, module: Any, args: Any, *rest: Any) -> None:
        # (kwargs, output) after a call; (output) when always_call runs it after a raise
        if _ops._dynamo_compiling():
            return
        kwargs, output = rest if len(rest) == 2 else (None, rest[-1])
        try:
            name = self._name(module)
            if name is not None:
                self._exit(module, name, output, kwargs)
                wrapping = getattr(self._local, "wrapping", None)
                if wrapping:  # a compiled model's wrapper is open on this thread
                    original = _compiled_original(module)
                    if original is not None:
                        wrapping.pop(id(original), None)
        except Exception:  # noqa: BLE001 - accounting never raises into the caller
            log.exception("memlord module spans: closing a span failed")

    # ---- the spans ----------------------------------------------------------------------

    def _stack(self) -> _Stack:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = _Stack()
            with self._stacks_lock:
                for old in [s for s in self._stacks if not s]:
                    old.listed = False
                    self._stacks.discard(old)
        return stack

    def _push(self, stack: _Stack, entry: _Span) -> None:
        """Push a span and make sure the stack is listed: both under the lock, so that no
        thread drops the stack as empty in between."""
        with self._stacks_lock:
            stack.append(entry)
            if not stack.listed:
                stack.listed = True
                self._stacks.add(stack)

    def _enter(self, module: Any, name: str, inputs: Any, more_after: bool) -> None:
        # the autograd nodes of the inputs, before the forward can change them in place
        nodes = _grad_nodes(inputs) if self._backward else None
        stack = self._stack()
        if not stack:
            # the outermost forward on this thread: what it receives is the model's input
            _ops.categorize_inputs(inputs, module)
        token = self._open_span(name)
        # a forward that backward runs (activation checkpointing's recomputation) makes
        # activations, as MemTracker counts them: noted for the categories
        again = _core._module_forward(True)
        # more_after: the keyword inputs were not seen, the hook after the call adds them
        self._push(stack, (id(module), token, nodes, more_after, again))
        if not self.enabled:
            # disable()d meanwhile (on another thread, in a finalizer), maybe before the
            # span was on the stack: the hook that would close it is gone
            self._close_stack(stack)

    def _exit(self, module: Any, name: str, output: Any, more_inputs: Any) -> None:
        stack = self._stack()
        key = id(module)
        if not any(entry[0] == key for entry in stack):
            return
        # close what a failed or re-entered call left open above this one
        while stack:
            k, token, nodes, more_after, again = stack.pop()
            if again:
                _core._module_forward(False)
            self._close_span(token)
            if k == key:
                break
        if nodes is not None:
            if more_inputs and more_after:
                nodes = _grad_nodes(more_inputs, out=list(nodes))
            bname = name + " (backward)"
            _watch_backward(
                nodes, output, functools.partial(self._open_backward, bname), self._close_backward
            )

    def _open_backward(self, bname: str) -> tuple[_Stack, _Span]:
        """Open a backward span on the thread autograd runs the module's backward on."""
        token = self._open_span(bname)
        stack = self._stack()
        entry: _Span = (None, token, None, False, False)
        self._push(stack, entry)
        if not self.enabled:  # disable()d meanwhile: as in _enter
            self._close_stack(stack)
        return stack, entry

    def _close_backward(self, handle: tuple[_Stack, _Span]) -> None:
        """Close a backward span from any thread (the end of a backward may be seen on
        another one)."""
        stack, entry = handle
        for i in range(len(stack) - 1, -1, -1):
            try:
                if stack[i] is entry:
                    del stack[i]
                    break
            except IndexError:  # the owning thread popped meanwhile
                break
        self._close_span(entry[1])

    # ---- the handle ---------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    def _remove_hooks(self) -> None:
        """Remove every hook; spans still open stay open."""
        if self._model_gone is not None:
            self._model_gone.detach()
        handles, self._handles = self._handles, []
        from torch.nn.modules import module as torch_module

        with_kwargs = getattr(torch_module, "_global_forward_hooks_with_kwargs", {})
        for h in handles:
            h.remove()
            # torch's handle of a global forward hook registered with_kwargs leaves its id
            # in _global_forward_hooks_with_kwargs (torch 2.13): torch.compile(model) would
            # warn of global module hooks for the rest of the process (ids are unique)
            with_kwargs.pop(h.id, None)
        filtered, self._filtered = self._filtered, []
        if filtered:
            _filter_hooks(filtered, False)

    def disable(self) -> None:
        """Remove every hook and close the spans still open, on every thread (a backward
        that raised leaves its spans open on the thread autograd ran it on)."""
        self._remove_hooks()
        with self._stacks_lock:
            stacks = list(self._stacks)
        for stack in stacks:
            self._close_stack(stack)

    def _close_stack(self, stack: _Stack) -> None:
        mine = stack.owner == threading.get_ident()
        while True:
            try:  # the owning thread may pop at the same time
                _, token, _, _, again = stack.pop()
            except IndexError:
                break
            if again and mine:
                # a recomputed forward whose end no hook will see: what the rest of the
                # backward makes is a temporary again.  The note is the thread's own; on
                # another thread's stack it lasts until that backward ends.
                _core._module_forward(False)
            self._close_span(token)


class ModuleTracker(ModuleSpans):
    """What ``lord.track_modules(model)`` returns: one region per submodule call, named
    by the qualified name (the root by its class name) and ``"<name> (backward)"`` for
    its backward.  ``disable()`` removes the hooks; a context manager disables on exit.
    ``regions(clear=False)`` aggregates the regions it opened, as ``lord.regions()``.
    """

    def __init__(self, lord: Lord, model: torch.nn.Module, backward: bool = True) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                "track_modules(): argument 'model' must be a torch.nn.Module, not "
                + type(model).__name__
            )
        if not isinstance(backward, bool):
            raise TypeError(
                "track_modules(): argument 'backward' must be a bool, not "
                + type(backward).__name__
            )
        self._lord = lord
        self._aggregate = _Aggregate()
        self._done: list[_Closed] = []
        super().__init__(self._open_region, self._close_region, model, backward)

    def _open_region(self, name: str) -> Region:
        region = self._lord._region_with_sink(name, self._done)
        region.__enter__()
        return region

    def _close_region(self, region: Region) -> None:
        region.__exit__(None, None, None)
        if len(self._done) > _FOLD_AT:
            self._aggregate.fold(self._done)

    def regions(self, clear: bool = False) -> dict[str, dict[str, Any]]:
        """The regions this tracker opened, aggregated per name (as lord.regions())."""
        if not isinstance(clear, bool):
            raise TypeError(
                "regions(): argument 'clear' must be a bool, not " + type(clear).__name__
            )
        return self._aggregate.result(self._done, clear)

    def __enter__(self) -> ModuleTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def __repr__(self) -> str:
        return f"<memlord ModuleTracker {'enabled' if self.enabled else 'disabled'}>"


class RegionsMixin(_LordBase):
    """The region methods of MemLord."""

    _region_aggregate: _Aggregate

    def regions(self, clear: bool = False) -> dict[str, dict[str, Any]]:
        """Every closed region aggregated per name: ``{name: {"count", "total_s",
        "devices": {device: {"total_delta", "avg_delta", "max_delta", "max_peak_delta",
        "categories": {category: {"total_delta", "max_delta", "max_peak_delta"}}}}}}``;
        ``clear=True`` empties the aggregate after reading."""
        if not isinstance(clear, bool):
            raise TypeError(
                "regions(): argument 'clear' must be a bool, not " + type(clear).__name__
            )
        return self._region_aggregate.result(self._region_done(), clear)

    def _region_history(self) -> tuple[list[_Closed], int]:
        """The newest ``REGION_HISTORY`` closed regions as ``(name, (duration_ns, rows,
        start_ns, thread, depth))``, oldest first, and the number closed in all."""
        return self._region_aggregate.history(self._region_done())

    def _region_fold(self) -> None:
        """Called by the C core when many closed regions wait to be aggregated."""
        self._region_aggregate.fold(self._region_done())

    def track_modules(self, model: torch.nn.Module, *, backward: bool = True) -> ModuleTracker:
        """Open a region per submodule forward (and backward) call; returns the handle."""
        tracker = ModuleTracker(self, model, backward)
        # weakly remembered for the OOM post-mortem (memlord/report/_postmortem.py): the
        # models name their storages, the trackers say which module regions are open
        d = self.__dict__
        d.setdefault("_tracked_models", weakref.WeakSet()).add(model)
        d.setdefault("_module_trackers", weakref.WeakSet()).add(tracker)
        return tracker
