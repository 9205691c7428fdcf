"""The plain-loop driver: turns a hand-written training loop into the session's step protocol.

A hand-written loop calls nothing of torchdebug but ``mon.step()``; this driver produces the other
boundaries from what the loop does anyway:

- global patches, installed while at least one session is active: ``Tensor.backward`` /
  ``torch.autograd.backward`` (backward began / done), ``GradScaler.step`` (the scaler's verdict),
  ``Optimizer.zero_grad`` / ``Module.zero_grad`` (the loss tape steps aside while they run),
  ``torch.nn.utils.clip_grad_norm_`` (a clip the sentinel can judge without a pass over the
  gradients), ``nn.Module.__getstate__`` (copies and checkpoints of a watched model carry no hooks);
- per session: forward pre/post hooks on the module the loop calls (forward began / done), and the
  optimizer step pre/post hooks (update starting / done), which stand down while a framework driver
  owns the loop (``mon.driver`` set).

It also keeps ``torch.compile`` / ``model.compile()`` out of the way: torchdebug's module hooks are
no-ops while Dynamo traces, and the root's work runs around an in-place compiled call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._installs import Installs, optimizer_hooks
from .._step import StepPhase, Update
from .._tensors import in_functorch_transform
from .protocol import Session

_ACTIVE: list[Session] = []  # the sessions the global patches serve
_TLS = threading.local()
_ORIGINALS: dict[str, Any] = {}  # non-empty while the global patches are installed
_PATCHES = Installs()  # the global patches, shared by every active session


# -- global patches, installed while at least one session is active -----------------------------------
def _backward_wrapper(orig: Callable[..., Any], is_method: bool) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Tensor.backward calls torch.autograd.backward: only the outermost call counts
        if getattr(_TLS, "in_backward", False):
            mons = []
        elif len(_ACTIVE) == 1:  # one session (``_sessions_of``'s first answer, inlined: every backward)
            m = _ACTIVE[0]
            mons = [] if m.sentinel.replaying or m.closed else [m]
        elif not _ACTIVE:
            mons = []
        else:
            mons = _sessions_of(args[0] if args else None)
        if not mons:
            return orig(*args, **kwargs)
        _TLS.in_backward = True
        loss = args[0] if args else kwargs.get("tensors", kwargs.get("self"))
        gradient = args[1] if len(args) > 1 else kwargs.get("gradient", kwargs.get("grad_tensors"))
        for m in mons:
            roots = m._plain.roots
            if (  # model.compile() in place (any of several models; ``in_place_roots``, inlined for one)
                roots[0].__dict__.get("_compiled_call_impl") is not None
                if len(roots) == 1
                else m._plain.in_place_roots()
            ):
                m._plain.wrap_compiled()
            m.stepper.backward_started(loss, gradient)
        try:
            return orig(*args, **kwargs)
        finally:
            _TLS.in_backward = False
            for m in mons:
                m.stepper.backward_done()

    wrapper.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    _not_traced(wrapper)
    return wrapper


def _not_traced(fn: Callable[..., Any]) -> None:
    """Dynamo runs ``fn`` (and what it calls) as plain Python, never tracing it: a ``loss.backward()``
    inside a ``torch.compile``'d step function is a graph break after which Dynamo would otherwise try
    to compile this wrapper's own frame (graph breaks in it and a warning about ``threading``). Marked
    on the code object once: nothing per call (``torch.compiler.disable`` would add a wrapper)."""
    with contextlib.suppress(Exception):  # a torch without frame strategies: traced as before
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def _sessions_of(loss: Any) -> list[Session]:
    """The sessions a backward belongs to. One session: it, as ever. Several (two ``watch`` blocks in
    one process): none while one of them replays (its replay's own backward); else those whose model
    ran a forward since their last backward, and when that leaves none or several, those whose
    parameters the loss's graph reaches (a walk of the graph: only in that case)."""
    # (a session not replaying and not closed: ``accepts_backward``, inlined: every backward)
    mons = [m for m in _ACTIVE if not (m.sentinel.replaying or m.closed)]
    if len(_ACTIVE) < 2:
        return mons
    if any([m.replaying for m in _ACTIVE]):
        return []
    live = [m for m in mons if m.state.phase is StepPhase.FORWARD]
    if len(live) == 1:
        return live
    fn = getattr(loss, "grad_fn", None)
    if fn is None:
        return live or mons
    reached = _leaves(fn)
    return [m for m in mons if any([id(p) in reached for p in m.params])] or live or mons


def _leaves(fn: Any) -> set[int]:
    """The ids of the leaf tensors a backward from ``fn`` accumulates into (rare path: several
    sessions, a graph walk)."""
    seen, stack, out = set(), [fn], set()
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        var = getattr(f, "variable", None)
        if var is not None:
            out.add(id(var))
        stack.extend([n for n, _ in f.next_functions])
    return out


def _scaler_step_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        mons = [m for m in _ACTIVE if m.models.owns_optimizer(optimizer)]
        for m in mons:
            m.stepper.scaler_step_started(self)
        try:
            out = orig(self, optimizer, *args, **kwargs)
        except BaseException:
            for m in mons:
                m.stepper.scaler_step_done(self, failed=True)
            raise
        for m in mons:
            m.stepper.scaler_step_done(self)  # may raise NonFiniteError: a skipped step the scaler cannot fix
        return out

    step.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    return step


def _clip_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``clip_grad_norm_`` that tells the sessions which gradients it scaled and by what (device)."""

    @functools.wraps(orig)
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        mons = [m for m in _ACTIVE if m.accepts_backward()]
        if not mons:
            return orig(*args, **kwargs)
        parameters = args[0] if args else kwargs.get("parameters")
        params: list[Any] = []
        if isinstance(parameters, torch.Tensor):
            params = [parameters]
        elif parameters is not None:
            params = list(parameters)
            # an empty generator stays one: torch warns about it (for anything else a list and a
            # generator are the same to torch, which makes a list of it first; no frame per item)
            parameters = (
                (p for p in params) if isinstance(parameters, types.GeneratorType) and not params else params
            )
            if args:
                args = (parameters, *args[1:])
            else:
                kwargs["parameters"] = parameters
        clean = [m.stepper.grads.clip_starting(params) for m in mons]
        spec = clip_args(args, kwargs)
        total = None
        if len(mons) == 1 and not torch.compiler.is_dynamo_compiling():
            # the clip may carry the session's gradient check (session/gradcheck.py)
            total = mons[0].stepper.grads.clip_with_check(params, clean[0], spec)
        else:
            for m in mons:
                m.stepper.grads.flush_measure()
        if total is None:
            total = orig(*args, **kwargs)
        for m, idx in zip(mons, clean):
            m.stepper.grads.clip_done(idx, total, spec.get("max_norm"), spec["norm_type"])
        return total

    clip_grad_norm_.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    return clip_grad_norm_


_CLIP_SPEC = ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach")


def clip_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``clip_grad_norm_``'s arguments by name, with torch's defaults (``norm_type`` 2, no error, foreach
    as torch picks it)."""
    got: dict[str, Any] = {"norm_type": 2.0, "error_if_nonfinite": False, "foreach": None}
    got.update(zip(_CLIP_SPEC, args))
    got.update(kwargs)
    return got


def _zero_grad_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``zero_grad`` with the loss tape set aside: a loop that zeroes between the loss and backward()
    would send every ``p.grad`` read and write through the tape's ``__torch_function__`` (two per
    parameter, ~1 us each); the tape keeps none of them (they are not the loss's making)."""

    @functools.wraps(orig)
    def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE or torch.compiler.is_dynamo_compiling():
            return orig(self, *args, **kwargs)
        for m in _ACTIVE:
            s, st = m.sentinel, m.state
            if s.edits.watch is not None:
                s.edits.watch_edits_end(st)
            if m.stepper.grads.held is not None:
                m.stepper.grads.flush_measure()  # a measure held for a clip: the gradients before they go
            if s.edits.watch is not None or st.seen.watched:
                s.edits.watch_edits_end(st, judge=False)  # zeroed: edited
        n = torch._C._len_torch_function_stack()
        top = torch._C._get_function_stack_at(n - 1) if n else None
        if top is None or not any(m.sentinel.tape is top for m in _ACTIVE):
            return orig(self, *args, **kwargs)
        torch._C._pop_torch_function_stack()
        try:
            return orig(self, *args, **kwargs)
        finally:
            torch._C._push_on_torch_function_stack(top)

    zero_grad.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    return zero_grad


def is_ours(hook: Any) -> bool:
    """True for a hook torchdebug registered (a bound method, closure or partial from its modules)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    fn = getattr(hook, "__func__", hook)
    owner = getattr(hook, "__self__", None)
    names = (getattr(fn, "__module__", None) or "", type(owner).__module__ if owner is not None else "")
    return any(n == "torchdebug" or n.startswith("torchdebug.") for n in names)


def _getstate_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.__getstate__`` without torchdebug's hooks: pickling, ``copy.deepcopy``,
    ``torch.save(model)`` and ``AveragedModel`` see the module as it is without ``watch``."""

    @functools.wraps(orig)
    def __getstate__(self: nn.Module) -> dict:
        state: dict = orig(self)
        for key, hooks in list(state.items()):
            if not (key.startswith("_") and "hooks" in key and isinstance(hooks, dict) and hooks):
                continue
            ours = {k for k, h in hooks.items() if callable(h) and is_ours(h)}
            if ours:
                state[key] = type(hooks)((k, h) for k, h in hooks.items() if k not in ours)
                for flags in (
                    "_forward_pre_hooks_with_kwargs",
                    "_forward_hooks_with_kwargs",
                    "_forward_hooks_always_called",
                ):  # keyed by the same handle ids
                    d = state.get(flags)
                    if isinstance(d, dict) and ours & d.keys():
                        state[flags] = type(d)((k, v) for k, v in d.items() if k not in ours)
        return state

    __getstate__.__torchdebug_wrapper__ = True  # type: ignore[attr-defined]
    return __getstate__


def _install_patches() -> None:
    if len(_PATCHES):
        return
    _PATCHES.patch(nn.Module, "__getstate__", _getstate_wrapper(nn.Module.__getstate__))
    _PATCHES.patch(torch.Tensor, "backward", _backward_wrapper(torch.Tensor.backward, True))
    _PATCHES.patch(torch.autograd, "backward", _backward_wrapper(torch.autograd.backward, False))
    _PATCHES.patch(torch.optim.Optimizer, "zero_grad", _zero_grad_wrapper(torch.optim.Optimizer.zero_grad))
    _PATCHES.patch(nn.Module, "zero_grad", _zero_grad_wrapper(nn.Module.zero_grad))
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_mod

    for mod in (nn_utils, clip_mod):
        _PATCHES.patch(mod, "clip_grad_norm_", _clip_wrapper(mod.clip_grad_norm_))
    try:
        from torch.amp.grad_scaler import GradScaler

        _PATCHES.patch(GradScaler, "step", _scaler_step_wrapper(GradScaler.step))
    except ImportError:  # torch without torch.amp.grad_scaler
        pass
    _ORIGINALS["installed"] = True  # read by tests: {} once every session is gone


def _remove_patches() -> None:
    _PATCHES.close()  # a patch someone wrapped again after ours stays theirs
    _ORIGINALS.clear()


def _compile_guard(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` that does nothing while Dynamo traces (``is_compiling()`` folds to a constant: no break)
    or inside a ``torch.func`` transform (``grad``, ``vmap``: a tensor kept from in there escapes its
    transform and fails when read; a read of the dispatch keys, ~0.1 µs)."""

    @functools.wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling() or in_functorch_transform():
            return None
        return hook(*args, **kwargs)

    guarded.__torchdebug_guard__ = True  # type: ignore[attr-defined]
    return guarded


class PlainLoopDriver:
    """Produces the step protocol of one session from a hand-written loop (see the module docstring).

    ``root`` is the module the loop calls (a ``torch.compile`` wrapper, else the model); ``model`` the
    module the session names and watches.
    """

    def __init__(
        self, mon: Session, root: nn.Module, model: nn.Module, roots: list[nn.Module] | None = None
    ) -> None:
        self.mon = mon
        self.root = root
        self.model = model
        self.roots = roots or [root]  # several models: each one's forward is a root of the step
        self.in_compiled_call = False  # inside an in-place compiled call: the hooks of its eager fallback
        self._handles: list[Any] = []
        self._root_handles: list[Any] = []

    def install(self) -> None:
        mon = self.mon
        _ACTIVE.append(mon)
        _install_patches()
        add = mon.installs.hook
        self.hook_roots()
        self._handles.append(add(optimizer_hooks(self._opt_pre, self._opt_post)))
        sf = mon.sentinel.step_fn  # watch(step_fn=...): its calls kept, as no forward hook runs inside it
        if sf is not None:
            self._handles.append(add(sf.install(mon.sentinel, lambda: mon.global_step, mon.uses_cuda)))

    def call_through(self, wrapper: nn.Module) -> None:
        """The model was compiled after the session began, by a framework (the HF Trainer's
        ``torch_compile=True``, through accelerate): the root hooks move to the ``torch.compile`` wrapper
        the loop calls, as for ``watch(torch.compile(model))``, so the step is captured outside compiled
        code and replayed through it."""
        self.root = self.mon._called = wrapper
        self.hook_roots([wrapper])
        self.guard_module_hooks()

    def hook_roots(self, roots: list[nn.Module] | None = None) -> None:
        """Forward hooks on the modules the loop calls (``roots``: a new set, the old hooks removed)."""
        for h in self._root_handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._root_handles.clear()
        if roots is not None:
            self.roots = roots
        add, mon = self.mon.installs.hook, self.mon
        for root in self.roots:
            self._root_handles.append(
                add(root.register_forward_pre_hook(mon.stepper.forward_started, with_kwargs=True))
            )
            self._root_handles.append(add(root.register_forward_hook(mon.stepper.forward_done)))

    def remove(self) -> None:
        self.unwrap_compiled()
        for h in self._root_handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._root_handles.clear()
        for h in self._handles:
            with contextlib.suppress(Exception):
                h.remove()
        self._handles.clear()
        if self.mon in _ACTIVE:
            _ACTIVE.remove(self.mon)
        if not _ACTIVE:
            _remove_patches()

    # -- optimizer hooks: update starting / done -----------------------------------------------------
    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        mon = self.mon
        models = mon.models
        # (``owns_optimizer``'s first answer, inlined: every update)
        if mon.sentinel.replaying or not (
            (opt is models.bare and opt is not None) or models.owns_optimizer(opt)
        ):
            return
        if mon.state.update is Update.IN_SCALER:
            mon.sentinel.update_not_skipped(
                mon.state
            )  # inside GradScaler.step: the scaler let the update run
        if mon.driver is None:
            mon.stepper.update_starting(opt)

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        mon = self.mon
        # the pre-hook's update_starting(opt) named it (``state.updating``) if it is ours: not asked again
        if mon.sentinel.replaying or mon.driver is not None or mon.state.updating is not opt:
            return
        mon.stepper.update_done(opt)

    # -- torch.compile / model.compile() -------------------------------------------------------------
    def guard_module_hooks(self) -> None:
        """Make every torchdebug module hook a no-op while Dynamo traces (``model.compile()`` compiles
        ``_call_impl`` with its hooks): no graph break, no Dynamo warning, the same graphs as without
        watch. Per-module instruments then record nothing inside compiled regions; the root's work runs
        outside them (:meth:`wrap_compiled`)."""
        for mod in {*self.root.modules(), *self.model.modules()}:
            for attr in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = getattr(mod, attr, None)
                if not isinstance(hooks, dict):
                    continue
                for k, h in list(hooks.items()):
                    if is_ours(h) and not getattr(h, "__torchdebug_guard__", False):
                        hooks[k] = _compile_guard(h)

    def in_place_roots(self) -> list[nn.Module]:
        """The roots compiled in place (``model.compile()``: their call goes through
        ``_compiled_call_impl``). One model: the module called is the one root; several: each model
        (``root`` is then their container, which the loop never calls)."""
        return [r for r in self.roots if r.__dict__.get("_compiled_call_impl") is not None]

    def wrap_compiled(self) -> None:
        """``model.compile()`` in place: run each root's capture around its compiled call, outside
        Dynamo (several models: every member compiled so, ``G.compile()`` beside a plain ``D``).

        Called at enter and at each backward (a model compiled after ``watch`` began is picked up one
        micro-step later). Restored at exit.
        """
        for root in self.in_place_roots():
            self._wrap_one(root)

    def _wrap_one(self, root: nn.Module) -> None:
        impl = root.__dict__.get("_compiled_call_impl")
        if impl is None or getattr(impl, "__torchdebug_compiled__", None) is not None:
            return
        ref = weakref.ref(self)

        def call(*args: Any, **kwargs: Any) -> Any:
            drv = ref()
            if drv is None or drv.mon.closed:
                return impl(*args, **kwargs)
            drv.mon.stepper.forward_started(root, args, kwargs, outside=True)
            drv.in_compiled_call = True  # the hooks inside (eager fallback) must not run twice
            try:
                out = impl(*args, **kwargs)
            finally:
                drv.in_compiled_call = False
            drv.mon.stepper.forward_done(root, args, out, outside=True)
            return out

        call.__torchdebug_compiled__ = impl  # type: ignore[attr-defined]
        root._compiled_call_impl = call  # type: ignore[assignment]

    def unwrap_compiled(self) -> None:
        for root in self.in_place_roots():
            orig = getattr(root.__dict__.get("_compiled_call_impl"), "__torchdebug_compiled__", None)
            if orig is not None:
                root._compiled_call_impl = orig

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the models eagerly (the replay traces ops one by one): bypass in-place compiles."""
        roots = [r for r in self.in_place_roots() if not (r is self.root and self.model is not self.root)]
        impls = [r.__dict__["_compiled_call_impl"] for r in roots]
        for r in roots:
            r._compiled_call_impl = None
        try:
            yield
        finally:
            for r, impl in zip(roots, impls):
                r._compiled_call_impl = impl
