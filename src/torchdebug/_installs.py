"""The one registry of what torchdebug puts into torch and the user's model, and takes off on exit.

Every instrument installs through an ``Installs``: hook handles (module, global module, optimizer,
tensor hooks), patches (``setattr`` on torch or a module) and thread-bound contexts (dispatch and
function modes, saved-tensor hooks). ``close()`` takes everything off in reverse order, whatever
happened in between: an instrument that failed half-way, a forward that ran in a worker thread, a
``torch.func`` transform that refused a context after its hooks were registered.

Thread-bound contexts live on the stack of the thread that entered them (torch keeps mode stacks
and saved-tensor hooks per thread), so only that thread can leave them. ``leave``/``close`` on
another thread: if the entering thread has ended, its stack ended with it and nothing is left;
if it still runs, the context cannot be reached from here and is counted in ``stranded`` (the
instruments enter contexts only on the thread that runs them to the end, so this stays 0).
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

_MISSING = object()


class Installs:
    """Hooks, patches and contexts of one session (or one standalone tool), removed by ``close()``.

    Example::

        inst = Installs()
        inst.hook(model.register_forward_hook(fn))
        inst.patch(torch.Tensor, "backward", wrapped)
        mode = inst.enter(MyDispatchMode())
        ...
        inst.close()  # the hook removed, Tensor.backward restored, the mode left (on its thread)

    Cost: one list append per install; nothing on the hot path.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, Any] = {}  # id -> handle, in install order (O(1) removal)
        self._patches: list[tuple[Any, str, Any, Any]] = []  # (owner, name, original, installed)
        self._contexts: list[tuple[Any, threading.Thread]] = []
        self.stranded = 0  # contexts whose thread still runs elsewhere at close (see module docstring)

    def __len__(self) -> int:
        return len(self._handles) + len(self._patches) + len(self._contexts)

    # -- installing ----------------------------------------------------------------------------------
    def hook(self, handle: Any) -> Any:
        """Keep a handle with ``remove()`` (a ``RemovableHandle``); returns it."""
        with self._lock:
            self._handles[id(handle)] = handle
        return handle

    def patch(self, owner: Any, name: str, value: Any) -> Any:
        """``setattr(owner, name, value)``, the original restored by ``close()``; returns the original."""
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
        setattr(owner, name, value)
        with self._lock:
            self._patches.append((owner, name, original, value))
        return original

    def enter(self, ctx: Any) -> Any:
        """Enter a context (a mode, ``saved_tensors_hooks``) on this thread; returns what it gives.

        If entering raises, nothing is recorded and the error propagates.
        """
        out = ctx.__enter__()
        with self._lock:
            self._contexts.append((ctx, threading.current_thread()))
        return out

    # -- removing ------------------------------------------------------------------------------------
    def remove(self, handle: Any) -> None:
        """Remove one handle now (and forget it)."""
        with self._lock:
            self._handles.pop(id(handle), None)
        handle.remove()

    def leave(self, ctx: Any) -> bool:
        """Leave one context entered with ``enter``; True when it is off a live stack or gone with its
        thread, False when another live thread holds it (it stays recorded, counted at ``close``)."""
        with self._lock:
            entry = next((e for e in self._contexts if e[0] is ctx), None)
            if entry is None:
                return True
            thread = entry[1]
            if thread is not threading.current_thread() and thread.is_alive():
                return False
            self._contexts.remove(entry)
        if thread is threading.current_thread():
            ctx.__exit__(None, None, None)
        return True

    def close(self) -> list[BaseException]:
        """Take everything off, newest first: contexts (on their own thread), handles, patches.

        Never raises; returns the errors met (each item is still taken off where possible).
        """
        errors: list[BaseException] = []
        with self._lock:
            contexts, self._contexts = self._contexts, []
            handles, self._handles = list(self._handles.values()), {}
            patches, self._patches = self._patches, []
        me = threading.current_thread()
        for ctx, thread in reversed(contexts):
            if thread is me:
                try:
                    ctx.__exit__(None, None, None)
                except Exception as e:  # another mode was left open above it: pop what we can
                    errors.append(e)
            elif thread.is_alive():
                self.stranded += 1
        for h in reversed(handles):
            try:
                h.remove()
            except Exception as e:
                errors.append(e)
        for owner, name, original, installed in reversed(patches):
            try:
                current = owner.__dict__.get(name) if hasattr(owner, "__dict__") else getattr(owner, name)
                if current is not installed:
                    continue  # someone patched over us: theirs stays (restoring would drop it)
                if original is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            except Exception as e:
                errors.append(e)
        return errors


__all__ = ["Installs"]


# -- torch's global optimizer hooks, shared -------------------------------------------------------------
# torch iterates its table of global optimizer hooks while calling them (torch/optim/optimizer.py,
# ``for pre_hook in chain(_global_optimizer_pre_hooks.values(), ...)``): a hook that registers or
# removes another there (a replay's tracer, inside a session's pre-hook) makes the user's opt.step()
# raise "OrderedDict mutated during iteration" whenever a hook follows ours. So torchdebug registers
# one pre-hook and one post-hook there, which call every torchdebug hook from a copy of their list.
_OPT_HOOKS: dict[str, dict[int, Any]] = {"pre": {}, "post": {}}
_OPT_RELAY: list[Any] = []  # torch's handles of the two relays, while any hook is registered
_OPT_IDS = iter(range(1 << 62))


# An optimizer subclass whose ``step`` calls ``super().step()`` runs torch's hook wrapper twice when
# the parent class was also instantiated (torch patches ``step`` per class, on its first instance):
# the global hooks would see one update as two, nested. The relays pass only the outermost call of
# each optimizer: the pre relay keeps torch's wrapper frame of that call, and a nested call is one
# whose caller chain holds it (walked only while one is kept: a dict read on an ordinary step).
_OUTER: dict[int, Any] = {}  # id(optimizer) -> torch's wrapper frame of its outermost step call
_NESTED: dict[int, int] = {}  # id(optimizer) -> nested calls open inside it
_NEST_DEPTH = 16  # frames walked up from a nested wrapper: subclass layers, decorators


def _nested_in_outer(opt: Any) -> bool:
    outer = _OUTER.get(id(opt))
    if outer is None:
        return False
    # relay <- torch's wrapper <- its caller: a subclass's step, or the user
    f: FrameType | None = sys._getframe(3)
    for _ in range(_NEST_DEPTH):
        if f is None:
            break
        if f is outer:
            return True
        f = f.f_back
    return False  # the kept call raised before its post-hooks: it is over


def _pre_relay(opt: Any, args: Any, kwargs: Any) -> None:
    key = id(opt)
    if key in _OUTER and _nested_in_outer(opt):
        _NESTED[key] = _NESTED.get(key, 0) + 1
        return
    _OUTER[key] = sys._getframe(1)
    _NESTED.pop(key, None)
    for fn in list(_OPT_HOOKS["pre"].values()):  # a hook added while they run waits for the next
        fn(opt, args, kwargs)


def _post_relay(opt: Any, args: Any, kwargs: Any) -> None:
    key = id(opt)
    if _NESTED.get(key):
        _NESTED[key] -= 1
        return
    _OUTER.pop(key, None)
    for fn in list(_OPT_HOOKS["post"].values()):
        fn(opt, args, kwargs)


_pre_relay.__module__ = _post_relay.__module__ = __name__  # torchdebug's own (``is_ours``)


class _OptimizerHooks:
    """The handle of :func:`optimizer_hooks`: ``remove()`` takes both hooks off (idempotent)."""

    def __init__(self, key: int) -> None:
        self.key = key

    def remove(self) -> None:
        for hooks in _OPT_HOOKS.values():
            hooks.pop(self.key, None)
        if _OPT_RELAY and not any(_OPT_HOOKS.values()):  # the last one: torch's table as it was
            for h in _OPT_RELAY:
                h.remove()
            _OPT_RELAY.clear()
            _OUTER.clear()
            _NESTED.clear()


def optimizer_hooks(pre: Any, post: Any) -> _OptimizerHooks:
    """Register a global optimizer step pre-hook and post-hook (``fn(opt, args, kwargs)``, returning
    None) through torchdebug's one pair in torch's table; returns a handle with ``remove()``.

    Registering or removing while torch calls the hooks (a replay inside a session's pre-hook) leaves
    torch's table untouched as long as another torchdebug hook stays registered."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    key = next(_OPT_IDS)
    _OPT_HOOKS["pre"][key], _OPT_HOOKS["post"][key] = pre, post
    if not _OPT_RELAY:
        _OPT_RELAY.append(register_optimizer_step_pre_hook(_pre_relay))
        _OPT_RELAY.append(register_optimizer_step_post_hook(_post_relay))
    return _OptimizerHooks(key)
