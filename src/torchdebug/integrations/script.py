"""``torchdebug run train.py [args...]``: an unmodified training script under watch().

How the session finds what to watch: ``torch.optim.Optimizer.__init__`` is wrapped while the script
runs; at the first optimizer the script creates, the model is the outermost ``nn.Module`` alive that
owns all of that optimizer's parameters, and ``watch(model, optimizer)`` starts there (so the first
forward is already captured). A step ends after each step of that optimizer (its step post-hook
calls ``mon.step()``), since the script never calls it.
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

    def __enter__(self) -> ScriptSession:
        orig = self._orig_init = torch.optim.Optimizer.__init__
        session = self

        @functools.wraps(orig)
        def init(opt: Any, *args: Any, **kwargs: Any) -> None:
            orig(opt, *args, **kwargs)
            if session.monitor is None and not session.notes:
                try:
                    session._found(opt)  # the first optimizer only
                except NonFiniteError:
                    raise  # the weights are already NaN/Inf (a bad checkpoint): the script stops here
                except Exception as exc:  # never break the script: it runs unwatched, and says so
                    session.notes.append(f"finding the model failed ({exc!r}); nothing is watched")

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
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # registered after the session's own post-hook, so update_done() has run: the step ends here
        self._handles.append(register_optimizer_step_post_hook(self._step_end))

    def _step_end(self, opt: Any, args: Any, kwargs: Any) -> None:
        mon = self.monitor
        if (
            mon is not None
            and not mon.closed
            and not mon.replaying
            and unwrap_optimizer(opt) is mon.optimizer
        ):
            mon.step()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._orig_init is not None:
            torch.optim.Optimizer.__init__ = self._orig_init  # type: ignore[method-assign]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        mon = self.monitor
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
