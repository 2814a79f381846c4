"""What ``hook_into_python()`` sees beyond factories and conversions.

Two groups, installed when the first lord subscribes and removed after the last one
leaves (the C core, ``src/hooks/hooks.c``, calls :func:`_install`):

``"sources"`` (every ``hook_into_python()``): the category sources.
    - **gradients**: a post-accumulate-grad hook on each parameter a module registers
      while installed, and on every parameter an optimizer steps (its ``.grad``);
    - **torch.load**: every storage of what it returns, category ``loaded``;
    - **optimizer state**: torch.optim's global step hooks; what an optimizer holds in
      ``state`` after its step, and every storage made during the step, is
      ``optimizer_state``;
    - **parameters and buffers** as modules register them (torch's global registration
      hooks).

``"ops"`` (``hook_into_python(ops=True)``): :class:`OpsMode`, a ``TorchDispatchMode``
whose ``__torch_dispatch__`` is the C function ``_core._torch_dispatch``, put on the
dispatch-mode stack of the thread that turned it on, below that thread's user modes (so
theirs see every operator first and their exits pop their own mode) and above torch's infra
modes.  A higher-order operator (torch.cond, map, while_loop, scan, flex_attention,
invoke_subgraph...) reaches it as one call, with the mode off the stack while torch runs
its dense kernel: memlord puts the mode back while the operator's subgraphs run
(the operators inside are counted) and counts the storages of its outputs that no input
holds.  The autograd engine carries it to its own threads for backward.

Accounting never raises into the caller: a failing source is reported through
``sys.unraisablehook``.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import _core

#: the categories, in the order the C core numbers them (src/core/ledger.h)
CATEGORIES: tuple[str, ...] = tuple(_core.CATEGORIES)
_CAT = {name: i for i, name in enumerate(CATEGORIES)}
_SRC = {name: i for i, name in enumerate(_core.EVENT_SOURCES)}
_ALL = (1 << len(CATEGORIES)) - 1
_BIT = {name: 1 << i for name, i in _CAT.items()}


class OpsMode(_core.OpsModeBase, TorchDispatchMode):
    """memlord's dispatch mode (``hook_into_python(ops=True)``): runs every operator
    unchanged and counts the storages of the outputs it creates.

    ``__torch_dispatch__`` is a C method of ``_core.OpsModeBase`` (inherited, so
    TorchDispatchMode does not wrap it in a Python frame per operator).  Compiled code is
    left to ``torch.compile`` (``ignore_compile_internals``): while
    dynamo and inductor trace, the mode is off; the compiled artifact runs under it.
    Higher-order operators run unchanged, their subgraphs under the mode
    (:func:`_hop_prepare`)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __repr__(self) -> str:
        return "<memlord ops mode>"


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.mode: OpsMode | None = None
        self.mode_thread: int | None = None
        #: thread id -> the mode a disable() from another thread left on its stack
        self.orphans: dict[int, OpsMode] = {}
        self.sources_on = False
        self.handles: list[Any] = []
        self.grad_handles: list[Any] = []
        self.load_patches: list[tuple[Any, str, Any, Any]] = []
        #: optimizer or tracked model -> the ids of the parameters memlord's gradient hook
        #: was put on at its last step or forward: the same again need no look at their hooks
        self.watched: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


_state = _State()


def _report(where: str) -> None:
    """A source failed (inside its ``except``): say so through ``sys.unraisablehook``, never
    raise into the program.  (``sys`` has no ``UnraisableHookArgs`` to build the hook's
    argument with: the C core writes it.)"""
    try:
        error = sys.exc_info()[1]
        if error is not None:
            _core._write_unraisable(error, f"memlord: {where}")
    except Exception:  # noqa: BLE001 - reporting must not fail either
        pass


def _categorize(objs: Any, category: str, source: str | None, from_mask: int = _ALL) -> None:
    try:
        _core._categorize(objs, _CAT[category], -1 if source is None else _SRC[source], from_mask)
    except Exception:  # noqa: BLE001 - accounting never raises into the caller
        _report(f"categorizing {category}")


def categorize_inputs(inputs: Any, module: Any = None) -> None:
    """The tensors a tracked model's outermost forward receives (args and kwargs, nested):
    those tracked as activation or other become ``input``; nothing new is counted.  The
    module's parameters and buffers are categorised again (``model.cuda()`` made new
    storages for them), and memlord's gradient hook is put on its parameters: the
    gradients the backward of this forward accumulates are counted as made then (source
    ``grad``), even for a model made before the hooks."""
    if not _state.sources_on:
        return
    if module is not None:
        try:
            params = list(module.parameters())
            buffers = [b for b in module.buffers() if isinstance(b, torch.Tensor)]
        except Exception:  # noqa: BLE001
            _report("a model's parameters")
        else:
            if params:
                _categorize(params, "parameter", None)
                try:
                    with torch._C.DisableTorchFunction():  # a user's mode sees none of it
                        _watch_grads(module, params)
                except Exception:  # noqa: BLE001 - accounting never raises into the caller
                    _report("watching a model's gradients")
            if buffers:
                _categorize(buffers, "buffer", None, _ALL & ~_BIT["parameter"])
    try:
        found = [
            t
            for t in torch.utils._pytree.tree_leaves(inputs)
            if type(t) is torch.Tensor or type(t) is torch.nn.Parameter
        ]
    except Exception:  # noqa: BLE001
        _report("a model's inputs")
        return
    if found:
        _categorize(found, "input", None, _BIT["activation"] | _BIT["other"])


# ---- the dispatch mode ------------------------------------------------------------------


_INFRA_KEYS = tuple(
    getattr(torch._C._TorchDispatchModeKey, k)
    for k in ("FAKE", "PROXY", "FUNCTIONAL")
    if hasattr(torch._C._TorchDispatchModeKey, k)
)


def _push_mode() -> None:
    """Put memlord's mode at the bottom of this thread's user modes (above torch's infra
    modes, which sit below every user mode): a user's mode entered before keeps the top, so
    its ``__exit__`` (which pops whatever is on top) takes itself off, not memlord's mode;
    every user mode sees the operators first, as it does bare.  A mode left on this
    thread's stack by a ``disable()`` from another thread is taken up again, not doubled."""
    orphan = _state.orphans.pop(threading.get_ident(), None)
    if orphan is not None and any(m is orphan for m in _stack()):
        _state.mode = orphan
        _state.mode_thread = threading.get_ident()
        return
    mode = OpsMode()  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is unannotated
    infra = sum(torch._C._get_dispatch_mode(k) is not None for k in _INFRA_KEYS)
    above = []
    try:
        for _ in range(torch._C._len_torch_dispatch_stack() - infra):
            above.append(torch._C._pop_torch_dispatch_stack(None))
        torch._C._push_on_torch_dispatch_stack(mode)
    finally:
        for m in reversed(above):
            torch._C._push_on_torch_dispatch_stack(m)
    _state.mode = mode
    _state.mode_thread = threading.get_ident()


def _stack() -> list[Any]:
    return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]


def _pop_mode() -> None:
    """Take memlord's mode off this thread's stack, wherever it sits; the modes above
    it go back in their order.  From another thread it cannot be reached: it stays on
    its thread's stack, counting nothing (no lord subscribes), until ops are turned on
    again on that thread (:func:`_push_mode` takes it up) and off there."""
    mode, _state.mode = _state.mode, None
    if mode is None:
        return
    if _state.mode_thread != threading.get_ident():
        if _state.mode_thread is not None:
            _state.orphans[_state.mode_thread] = mode
        return
    _remove_from_stack(mode)  # nothing when a user's mode exit popped it already


def _remove_from_stack(mode: Any) -> None:
    """Take mode off this thread's dispatch stack wherever it is, the modes above it
    back in their order; nothing when it is not there."""
    if not any(m is mode for m in _stack()):
        return
    above = []
    while True:
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_dispatch_stack(m)


# ---- higher-order operators ---------------------------------------------------------------

#: the higher-order operators whose dense kernel calls subgraphs given as arguments: the
#: positions of those arguments.  Each is called with memlord's mode back on the stack;
#: so is the subgraph of a ``BaseHOP`` (its first argument: foreach_map, invoke_quant).
#: Another higher-order operator runs as it is; its outputs are counted.
_SUBGRAPH_ARGS: dict[str, tuple[int, ...]] = {
    "cond": (1, 2),
    "while_loop": (0, 1),
    "while_loop_stack_output": (0, 1),
    "map_impl": (0,),
    "scan": (0,),
    "associative_scan": (0,),
    "invoke_subgraph": (0,),
}

#: the higher-order operators whose dense kernel (the operator's CompositeExplicitAutograd
#: kernel, which is what torch runs once the mode has it) runs whole under the mode, as
#: torch's FakeTensorMode runs its own rule for them: the operators it runs (flex
#: attention's scores matrix), its score_mod's included, are counted.  (Not
#: flex_attention_backward: it has no CPU kernel in eager to check it against.)
_KERNEL_UNDER_MODE = frozenset({"flex_attention"})


def _take_off(mode: Any) -> None:
    """Take mode off this thread's dispatch stack (the top, as a rule); the modes above it
    go back in their order.  Nothing when it is not there (a ``disable()`` inside the
    subgraph took it off)."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return
    top = torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1)
    if top is mode:
        torch._C._pop_torch_dispatch_stack(None)
        return
    _remove_from_stack(mode)


def _is_base_hop(hop: Any) -> bool:
    """Whether hop is a ``torch._higher_order_ops.base_hop.BaseHOP``: its dense kernel
    calls its first argument, the subgraph, with the operands."""
    try:
        from torch._higher_order_ops.base_hop import BaseHOP
    except ImportError:  # a torch without it
        return False
    return isinstance(hop, BaseHOP)


def _is_subgraph(obj: Any) -> bool:
    return callable(obj) and not isinstance(
        obj, (torch.Tensor, type, torch._ops.OperatorBase, torch._ops.OpOverloadPacket)
    )


def _storages_of(obj: Any) -> tuple[dict[int, torch.Tensor], bool]:
    """The plain tensors in obj (nested containers) by their storage (one tensor each), and
    whether every tensor in obj is a plain one (none fake, functional, a subclass)."""
    found: dict[int, torch.Tensor] = {}
    plain = True
    for t in torch.utils._pytree.tree_leaves(obj):
        if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
            try:
                key = t.untyped_storage()._cdata
            except Exception:  # noqa: BLE001 - no storage (sparse, nested): not counted here
                plain = False
                continue
            found.setdefault(key, t)
        elif isinstance(t, torch.Tensor):
            plain = False
    return found, plain


def _hop_prepare(
    mode: Any, hop: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> tuple[Any, tuple[Any, ...], dict[str, Any] | None, dict[int, torch.Tensor]] | None:
    """Before a higher-order operator runs under memlord's mode (the C
    ``__torch_dispatch__`` asks, with the mode off the stack, then makes the call itself):
    what to call and the arguments to call it with, and the inputs' storages
    (:func:`_hop_count` leaves them out).  What to call is the operator, its subgraphs
    (:data:`_SUBGRAPH_ARGS`) wrapped to run with the mode back on top of the stack
    (``_core._in_mode``), or its dense kernel run under the mode
    (:data:`_KERNEL_UNDER_MODE`).  None when that fails (reported): the operator then
    runs as it was called."""
    try:
        with torch._C.DisableTorchFunction():
            inputs, plain = _storages_of((args, kwargs))
            name = getattr(hop, "_name", "")
            call = hop
            if not plain or any(torch._C._get_dispatch_mode(k) is not None for k in _INFRA_KEYS):
                # torch's rule for a fake, functional or traced run (or a subclass's) takes
                # it, not the dense kernel: nothing memlord counts runs inside
                pass
            elif mode is not None and name in _KERNEL_UNDER_MODE:
                kernel = hop.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
                if kernel is not None:
                    call = _core._in_mode(kernel, mode)
            elif mode is not None and (name in _SUBGRAPH_ARGS or _is_base_hop(hop)):
                wrapped = list(args)
                for i in _SUBGRAPH_ARGS.get(name, (0,)):
                    if i < len(wrapped) and _is_subgraph(wrapped[i]):
                        wrapped[i] = _core._in_mode(wrapped[i], mode)
                args = tuple(wrapped)
        return call, args, kwargs, inputs
    except Exception:  # noqa: BLE001 - accounting never raises into the caller
        _report(f"the higher-order operator {getattr(hop, '_name', hop)!r}")
        return None


def _hop_count(result: Any, inputs: dict[int, torch.Tensor]) -> None:
    """After a higher-order operator ran: the storages its outputs hold that none of its
    inputs held are counted (those tracked already add nothing: the operators inside its
    subgraphs made them)."""
    try:
        with torch._C.DisableTorchFunction():
            new = [t for key, t in _storages_of(result)[0].items() if key not in inputs]
        if new:
            _core._count_new(new)
    except Exception:  # noqa: BLE001 - accounting never raises into the caller
        _report("the outputs of a higher-order operator")


def run_outside_dynamo(*fns: Callable[..., Any]) -> None:
    """Mark the code of memlord's Python that torch or memlord's C core calls (the module
    spans' hooks, the higher-order operators' helpers) so that dynamo's frame evaluation
    never compiles a frame of theirs nor any frame they call: they run as plain Python
    wherever that evaluation is on.  Unmarked, a module hook's frame was a frame dynamo
    compiles where it skips every frame of torch's (``nn.Sequential``'s
    ``model.compile(fullgraph=True)`` ran where bare it raises "found no compiled
    frames"), and ``_hop_prepare``, called by the C dispatch mode inside the evaluation
    torch turns on for an eager ``torch.cond`` (once a cond failed under another mode),
    was compiled, failed, and counted nothing.  torch's per-code execution
    strategy lives in ``torch._C._dynamo`` (loaded with torch): memlord does not import
    ``torch._dynamo``.  Dynamo still traces a hook that it inlines into a graph it
    compiles (there the hook folds to nothing, see ModuleSpans).  A torch without that
    strategy keeps the frames as they were."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    action = getattr(eval_frame, "_FrameAction", None)
    strategy = getattr(eval_frame, "_FrameExecStrategy", None)
    if set_strategy is None or action is None or strategy is None:
        return
    try:
        skip = strategy(action.SKIP, action.SKIP)  # this frame, and the frames it calls
        for fn in fns:
            set_strategy(fn.__code__, skip)
    except Exception:  # noqa: BLE001 - an unknown torch: the frames stay as they were
        return


run_outside_dynamo(_hop_prepare, _hop_count)


# ---- the category sources ---------------------------------------------------------------


def _unseen(fn: Any) -> Any:
    """A source runs with ``__torch_function__`` off (modes and subclasses): a user's
    ``TorchFunctionMode`` sees none of memlord's own reads of tensors (``.grad``,
    ``untyped_storage()``, hook registrations), as without memlord.  While dynamo traces
    (a module built inside a compiled function registers its parameters) it does nothing:
    dynamo folds the test to a constant, so memlord's C calls add no graph break."""

    @functools.wraps(fn)
    def unseen(*args: Any) -> Any:
        if _dynamo_compiling():
            return None
        with torch._C.DisableTorchFunction():
            return fn(*args)

    return unseen


_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)


@_unseen
def _grad_hook(param: torch.Tensor) -> None:
    if _state.sources_on and param.grad is not None:
        _categorize(param.grad, "gradient", "grad")


def _watch_grad(param: Any) -> None:
    """Put memlord's post-accumulate-grad hook on a parameter that has none of it."""
    try:
        if not isinstance(param, torch.Tensor) or not param.requires_grad or not param.is_leaf:
            return
        hooks = param._post_accumulate_grad_hooks
        if hooks is not None and any(h is _grad_hook for h in hooks.values()):
            return
        handle = param.register_post_accumulate_grad_hook(_grad_hook)
        handles = _state.grad_handles
        handles.append(handle)
        if len(handles) > 1024 and len(handles) & (len(handles) - 1) == 0:
            # drop the handles of parameters that are gone (a power of two: amortised)
            handles[:] = [h for h in handles if h.hooks_dict_ref() is not None]
    except Exception:  # noqa: BLE001
        _report("watching a parameter's gradient")


# A storage a source sees that no source saw made (made before the hooks, or by code
# memlord does not see) is found, not made where it is seen: counted from then on under
# the source's category, with no call site, and no allocation of an open region's (source
# ``found``: it raises the region's entry level).  One a source saw made (a factory's, an
# operator's) is tracked already: only its category changes.


def _watch_grads(owner: Any, params: list[Any]) -> None:
    """Put memlord's gradient hook on every parameter of owner (an optimizer, a tracked
    model) that has none of it; the same parameters as at owner's last look need no look
    at their hooks."""
    ids = tuple(map(id, params))
    try:
        seen = _state.watched.get(owner)
    except TypeError:  # an owner that takes no weak reference
        seen = None
    if seen != ids:
        for p in params:
            _watch_grad(p)
        try:
            _state.watched[owner] = ids
        except TypeError:
            pass


@_unseen
def _param_registered(module: Any, name: str, param: Any) -> None:
    if param is not None:
        _categorize(param, "parameter", "found")
        _watch_grad(param)


@_unseen
def _buffer_registered(module: Any, name: str, buffer: Any) -> None:
    if isinstance(buffer, torch.Tensor):
        _categorize(buffer, "buffer", "found")


def _params_of(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _state_of(optimizer: Any) -> list[torch.Tensor]:
    """The tensors an optimizer's state holds: a dict per parameter (torch's optimizers),
    or whatever a custom one keeps."""
    held: list[torch.Tensor] = []
    for state in optimizer.state.values():
        if isinstance(state, torch.Tensor):
            held.append(state)
        elif isinstance(state, dict):
            held.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return held


@_unseen
def _optimizer_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    _core._optimizer_step(True)
    try:
        params = [p for p in _params_of(optimizer) if isinstance(p, torch.Tensor)]
        _watch_grads(optimizer, params)
        grads = [p.grad for p in params if p.grad is not None]
        if params:
            # what an optimizer steps is a parameter, however its storage was made (a
            # Module.to() under ops=True makes it with an operator); one no source saw
            # made (a model made before the hooks) is found, not made by this step:
            # counted, and no allocation of an open region's
            _categorize(params, "parameter", "found")
        if grads:
            # a gradient accumulated while memlord's hook was on its parameter, or made
            # by an operator under ops=True, is tracked already; one no source saw made
            # (accumulated before the hooks, or by a backward with ops off before the
            # parameter was watched) is found
            _categorize(grads, "gradient", "found")
        held = _state_of(optimizer)
        if held:
            # the state the optimizer holds before its step (an earlier step's, made
            # before the hooks): found too; what the step makes is counted after it
            _categorize(held, "optimizer_state", "found", _ALL & ~_BIT["parameter"])
    except Exception:  # noqa: BLE001
        _report("an optimizer's step")


@_unseen
def _optimizer_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    _core._optimizer_step(False)
    try:
        held = _state_of(optimizer)
        if held:
            # what the optimizer holds is its state, whatever made it
            _categorize(held, "optimizer_state", "tensor", _ALL & ~_BIT["parameter"])
    except Exception:  # noqa: BLE001
        _report("an optimizer's state")


def _tensors_in(obj: Any, out: list[Any], depth: int = 0) -> None:
    """The tensors of what torch.load returned: nested dicts, lists, tuples, modules.  Each
    object is looked at once: pickle keeps shared and cyclic references (a list holding
    itself), and a walk of every path through them would not end."""
    seen: set[int] = set()
    todo = [(obj, depth)]
    while todo:
        obj, depth = todo.pop()
        if depth > 64 or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, torch.nn.Module)):
            out.append(obj)
        elif isinstance(obj, dict):
            todo.extend((v, depth + 1) for v in reversed(list(obj.values())))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend((v, depth + 1) for v in reversed(list(obj)))


@_unseen
def _loaded(result: Any) -> None:
    try:
        found: list[Any] = []
        _tensors_in(result, found)
        if found:
            _categorize(found, "loaded", "load")
    except Exception:  # noqa: BLE001
        _report("torch.load")


def _after_load(result: Any) -> None:
    if _state.sources_on:
        _loaded(result)


def _wrap_load(owner: Any, original: Any) -> Any:
    """torch.load, seen by ``_after_load`` after it returns: a C hook, so that no frame of
    memlord's stands between torch.load and its caller (its warnings' ``stacklevel=2``
    names the program's line) and it introspects as torch.load itself."""
    return _core._after_hook(owner, "load", original, _after_load)


def _storage_made(storage: Any) -> None:
    """After ``torch.UntypedStorage(...)``: a storage no tensor holds yet, which no factory,
    operator or dispatch mode sees (``copy.deepcopy`` and ``pickle`` of a tensor, the typed
    storages make theirs so): counted like a factory's result."""
    if _state.sources_on:
        try:
            _core._storage_made(storage)
        except Exception:  # noqa: BLE001 - accounting never raises into the caller
            _report("torch.UntypedStorage")


def _install_sources() -> None:
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    handles = _state.handles
    try:
        handles.append(torch_module.register_module_parameter_registration_hook(_param_registered))
        handles.append(torch_module.register_module_buffer_registration_hook(_buffer_registered))
        handles.append(torch_optimizer.register_optimizer_step_pre_hook(_optimizer_pre))
        handles.append(torch_optimizer.register_optimizer_step_post_hook(_optimizer_post))
        import torch.serialization as serialization

        original = serialization.load
        wrapped = _wrap_load(serialization, original)
        for owner in (torch, serialization):
            if getattr(owner, "load", None) is original:
                _state.load_patches.append((owner, "load", original, wrapped))
                owner.load = wrapped  # type: ignore[attr-defined]
        if _state.load_patches:
            # torch.jit.script finds torch.load (aten::load) by id(): the hook takes its
            # entry while installed, as the C hooks do
            _core._jit_builtin_alias(wrapped, original, True)
        _patch_storage("__new__", _storage_made, True)
    except BaseException:
        _uninstall_sources()
        raise
    _state.sources_on = True


def _uninstall_sources() -> None:
    _state.sources_on = False
    for h in _state.handles:
        h.remove()
    _state.handles.clear()
    for h in _state.grad_handles:
        h.remove()
    _state.grad_handles.clear()
    _state.watched.clear()
    for owner, name, original, wrapped in reversed(_state.load_patches):
        _core._jit_builtin_alias(wrapped, original, False)
        if getattr(owner, name, None) is wrapped:
            setattr(owner, name, original)
    _state.load_patches.clear()
    _patch_storage("__new__", _storage_made, False)
    _core._optimizer_step(False)


def _storage_resized(storage: Any) -> None:
    """After ``UntypedStorage.resize_`` (it returns the storage): a tracked storage counts
    its new size."""
    try:
        _core._storage_resized(storage, storage.nbytes())
    except Exception:  # noqa: BLE001 - accounting never raises into the caller
        _report("UntypedStorage.resize_")


#: the ``torch.UntypedStorage`` attributes memlord hooks while installed: name -> (what the
#: class held as its own before the hook, or ``_NOT_OWN``: torch's is inherited from
#: StorageBase; the hook)
_storage_patches: dict[str, tuple[Any, Any]] = {}
_NOT_OWN = object()


def _patch_storage(name: str, after: Callable[[Any], None], on: bool) -> None:
    """A C hook on ``torch.UntypedStorage.<name>`` (on), or the class as it was (off).

    The hook calls torch's with the arguments exactly as given, then ``after(result)``, so
    that no frame of memlord's stands in the traceback of an error torch raises (as
    torch.load's).  ``resize_`` (with ops on) is no aten operator: the mode never sees it,
    and FSDP2 frees and re-allocates parameters with it.  ``__new__`` (with the sources on)
    makes a storage no tensor holds yet (``copy.deepcopy`` and ``pickle`` of a tensor, the
    typed storages), which no factory, operator or dispatch mode sees.  Off: put back what
    the class held as its own (or nothing), unless someone put a wrapper over memlord's
    meanwhile (MemTracker, over ``resize_``): that stays."""
    owner = torch.UntypedStorage
    if on:
        if name not in _storage_patches:
            if name == "__new__":
                _core._storage_new_slot(owner, False)
            own = owner.__dict__.get(name, _NOT_OWN)
            hook = _core._after_hook(owner, name, getattr(owner, name), after)
            setattr(owner, name, hook)
            _storage_patches[name] = (own, hook)
    elif name in _storage_patches:
        own, hook = _storage_patches.pop(name)
        if owner.__dict__.get(name) is hook:
            if own is not _NOT_OWN:
                setattr(owner, name, own)
            else:
                delattr(owner, name)
                if name == "__new__":
                    # CPython keeps its generic constructor slot after the delete: torch's
                    # own goes back, so storages are made exactly as fast as before the hooks
                    _core._storage_new_slot(owner, True)


def _install(group: str, on: bool) -> None:
    """Called by the C core: install (on) or remove a group ("ops", "sources")."""
    with _state.lock:
        if group == "ops":
            if on:
                _push_mode()
                _patch_storage("resize_", _storage_resized, True)
            else:
                _patch_storage("resize_", _storage_resized, False)
                _pop_mode()
        elif group == "sources":
            if on:
                _install_sources()
            else:
                _uninstall_sources()
        else:
            raise ValueError(f"_install(): unknown group {group!r}")
