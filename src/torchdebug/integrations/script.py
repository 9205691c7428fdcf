"""``torchdebug run train.py [args...]``: an unmodified training script under watch().

How the session finds what to watch: ``torch.optim.Optimizer.__init__`` is wrapped while the script
runs; at the first optimizer the script creates, the model is the outermost ``nn.Module`` alive that
owns all of that optimizer's parameters, and ``watch(model, optimizer)`` starts there (so the first
forward is already captured). A step ends after each step of that optimizer (its step post-hook
calls ``mon.step()``), since the script never calls it.

Every optimizer the script creates later is watched too (``mon.watch_also``): a model not watched
yet joins the session before its first step (a GAN's G and D, named after the script's variables).
With several optimizers a step ends at the next forward of a watched model once every optimizer has
stepped since the last step ended (one ``mon.step()`` per G-and-D iteration) or one has stepped
twice (a critic stepped several times per generator step), and at the script's end.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import runpy
import sys
from typing import Any

import torch
from torch import nn

from .._errors import NonFiniteError
from .._tensors import unwrap_optimizer
from ..session.monitor import Monitor, watch

FALLBACK = (
    "fall back to three lines in the script: `with td.watch(model, optimizer) as mon:` around the loop "
    "and `mon.step()` after `optimizer.step()`"
)


def _user_frame() -> Any:
    """The script's frame that created the optimizer (the first outside torch and torchdebug)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("torch", "torchdebug"):
        frame = frame.f_back  # type: ignore[assignment]
    return frame


def _owner(params: list[torch.Tensor]) -> tuple[nn.Module | None, int]:
    """The outermost live module owning the most of ``params`` (all of them, normally), and how many."""
    want = {id(p) for p in params}
    best: list[tuple[int, nn.Module]] = []
    for obj in gc.get_objects():  # once, when the first optimizer is created
        if issubclass(type(obj), nn.Module):  # not isinstance: no __class__ lookups on odd proxies
            n = len(want & {id(p) for p in obj.parameters()})
            if n:
                best.append((n, obj))
    if not best:
        return None, 0
    top = max(n for n, _ in best)
    cands = [m for n, m in best if n == top]
    inner = {id(c) for m in cands for c in m.modules() if c is not m}
    outer = [m for m in cands if id(m) not in inner]  # a wrapper that is called (DDP) over what it wraps
    return (outer or cands)[0], top


class ScriptSession:
    """Finds the model and optimizer as the script creates them and runs watch() over them."""

    def __init__(self, **watch_kwargs: Any) -> None:
        self.watch_kwargs = watch_kwargs
        self.monitor: Monitor | None = None
        self.notes: list[str] = []
        self._handles: list[Any] = []
        self._orig_init: Any = None
        self._stepped: set[int] = set()  # several optimizers: those that stepped since the last step end
        self._again = False  # ... and one of them stepped twice

    def __enter__(self) -> ScriptSession:
        orig = self._orig_init = torch.optim.Optimizer.__init__
        session = self

        @functools.wraps(orig)
        def init(opt: Any, *args: Any, **kwargs: Any) -> None:
            orig(opt, *args, **kwargs)
            if session.monitor is None and not session.notes:
                try:
                    session._found(opt)  # the first optimizer
                except NonFiniteError:
                    raise  # the weights are already NaN/Inf (a bad checkpoint): the script stops here
                except Exception as exc:  # never break the script: it runs unwatched, and says so
                    session.notes.append(f"finding the model failed ({exc!r}); nothing is watched")
            elif session.monitor is not None and not session.monitor.closed:
                try:
                    session._also(opt, _user_frame())  # every later one
                except Exception as exc:
                    session.notes.append(f"watching {type(opt).__name__} too failed ({exc!r})")

        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign,assignment]
        return self

    def _found(self, opt: torch.optim.Optimizer) -> None:
        opt = unwrap_optimizer(opt)
        params = [p for g in opt.param_groups for p in g["params"]]
        model, n = _owner(params)
        if model is None:
            self.notes.append(
                f"the first optimizer ({type(opt).__name__}) steps tensors that no nn.Module owns; "
                "nothing is watched"
            )
            return
        if n < len(params):
            self.notes.append(
                f"no single module owns all {len(params)} parameters of {type(opt).__name__}; watching "
                f"{type(model).__name__}, which owns {n}"
            )
        self.monitor = watch(model, opt, **self.watch_kwargs)
        self.monitor.__enter__()
        self._hook(model)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # registered after the session's own post-hook, so update_done() has run: the step ends here
        self._handles.append(register_optimizer_step_post_hook(self._step_end))

    def _also(self, opt: torch.optim.Optimizer, caller: Any) -> None:
        """A later optimizer: watched too, and its model when the session does not hold it yet."""
        mon = self.monitor
        assert mon is not None
        opt = unwrap_optimizer(opt)
        model, _ = _owner([p for g in opt.param_groups for p in g["params"]])
        if mon.watch_also(model, opt, caller):
            if model is not None:
                self._hook(model)
        else:
            self.notes.append(
                f"{type(opt).__name__} was created after training began: its model is not watched"
            )

    def _hook(self, model: nn.Module) -> None:
        # before the session's own forward hook: the step that ended is closed before the next begins
        self._handles.append(model.register_forward_pre_hook(self._forward, prepend=True))

    def _step_end(self, opt: Any, args: Any, kwargs: Any) -> None:
        mon = self.monitor
        if mon is None or mon.closed or mon.replaying or not mon.owns_optimizer(opt):
            return
        if len(mon.optimizers) > 1:  # several: the step ends at the next forward (see the module docstring)
            key = id(unwrap_optimizer(opt))
            self._again = self._again or key in self._stepped  # one stepped twice: end at the next forward
            self._stepped.add(key)
        elif unwrap_optimizer(opt) is mon.optimizer:
            mon.step()

    def _forward(self, module: nn.Module, args: Any) -> None:
        mon = self.monitor
        if (
            mon is not None
            and not mon.closed
            and not mon.replaying
            and self._stepped
            and (self._again or self._stepped >= {id(o) for o in mon.optimizers})
            and torch.is_grad_enabled()
        ):
            self._stepped.clear()
            self._again = False
            mon.step()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._orig_init is not None:
            torch.optim.Optimizer.__init__ = self._orig_init  # type: ignore[method-assign]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        mon = self.monitor
        if mon is not None and not mon.closed and exc is None and self._stepped:
            self._stepped.clear()
            try:
                mon.step()  # several optimizers: the last step ends with the script
            except BaseException as err:
                exc_type, exc, tb = type(err), err, err.__traceback__
        if mon is not None and not mon.closed:
            mon.__exit__(exc_type, exc, tb)
        if mon is None and not self.notes:
            self.notes.append(
                "the script created no torch.optim optimizer, so no model was found; nothing was watched"
            )


def run_script(path: str, argv: list[str], **watch_kwargs: Any) -> tuple[ScriptSession, BaseException | None]:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *argv]`` under a :class:`ScriptSession`.

    Returns the session (``.monitor``: the watch session or None; ``.notes``: what could not be found)
    and the exception that ended the script, if any (``SystemExit(0)`` counts as a normal end).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"torchdebug run: no such script {path!r}")
    old_argv = sys.argv
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    session = ScriptSession(**watch_kwargs)
    error: BaseException | None = None
    try:
        with session:
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
    except BaseException as e:  # reported by the caller; the session is closed as failed
        error = e
    finally:
        sys.argv = old_argv
        with contextlib.suppress(ValueError):
            sys.path.remove(os.path.dirname(os.path.abspath(path)))
    return session, error
