"""Several models given wrapped (DistributedDataParallel, ``torch.compile``): each named as itself,
called through its wrapper, the DDP wrappers seen by the distributed coordinator as one.

``watch([DDP(G), torch.compile(D)], [opt_g, opt_d])`` names ``G.main.0`` and ``D.0``, not
``G.module.main.0`` or ``D._orig_mod.0``: the session's ``model`` is a ``ModuleDict`` of the wrapped
modules themselves. The step's roots (``mon.roots``, whose forward hooks mark each model's forward)
are the modules the loop's call runs eagerly: a DDP model's wrapped module (its hooks fire inside DDP's
forward, which marks whether the backward will all-reduce, as for one DDP model), a compiled model's
``OptimizedModule`` (the hooks inside a compiled region do not run; the replay runs it eagerly, since
Dynamo does not compile under the tracer's dispatch mode).

The coordinator gets a :class:`DDPGroup` where it would get the one wrapper: a forward syncs when it
runs through any of the wrappers with ``require_backward_grad_sync``; its replay runs under every
wrapper's ``no_sync()`` (the replay calls the wrapped modules themselves, so no reducer is prepared
for its backward and no collective runs); and the parameters of a trainable model that no wrapper
holds count as DDP-ignored (their gradients stay local, so the ranks compare verdicts instead of
sharing the measurement).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

from .distributed import split_ddp

if TYPE_CHECKING:
    from .protocol import Session


class DDPGroup:
    """Several ``DistributedDataParallel`` wrappers, as the coordinator uses one (see above)."""

    def __init__(self, wrappers: list[Any], local: list[str]) -> None:
        self.wrappers = wrappers
        self.parameters_to_ignore = local  # trainable parameters no wrapper all-reduces

    def syncs_now(self) -> bool:
        """True inside a forward of one of the wrappers whose backward will all-reduce the gradients
        (``distributed._ddp_syncs_now`` for each wrapper)."""
        from torch.nn.parallel import DistributedDataParallel

        active = DistributedDataParallel._active_ddp_module
        return any([w is active for w in self.wrappers]) and bool(
            getattr(active, "require_backward_grad_sync", False)
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for w in self.wrappers:
                stack.enter_context(w.no_sync())
            yield


def _compiled_orig(module: nn.Module) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) compiles, else None."""
    orig = getattr(module, "_orig_mod", None)
    return orig if type(module).__name__ == "OptimizedModule" and isinstance(orig, nn.Module) else None


def compiled_later(mon: Session, called: nn.Module) -> bool:
    """``called``, the module a framework's step calls, is a ``torch.compile`` wrapper of the one model
    the session watches, made after the session began: from now on the session calls through it
    (:meth:`PlainLoopDriver.call_through`). True when it switched. Cost: two identity tests."""
    if called is mon.called or mon.roots is not None or _compiled_orig(called) is not mon.model:
        return False
    mon._plain.call_through(called)
    return True


def is_compiled(modules: Iterable[nn.Module]) -> bool:
    """True when one of ``modules`` runs under ``torch.compile`` (a wrapper, or ``model.compile()``)."""
    return any(
        [_compiled_orig(m) is not None or m.__dict__.get("_compiled_call_impl") is not None for m in modules]
    )


def framework_ddp(wrapper: Any, model: nn.Module) -> Any:
    """``wrapper`` when it is the ``DistributedDataParallel`` a framework put around the model the
    session watches (Lightning's ``strategy.model``, which wraps the LightningModule in its own
    forward wrapper; the HF Trainer's ``model_wrapped``): it holds exactly the model's parameters.
    Else None. With it the coordinator knows the replicas are equal (the hardware leg of a cause, the
    parameter hash) and runs its replays under ``no_sync``. Cost: one walk over the parameters, once."""
    ddp, _ = split_ddp(wrapper) if isinstance(wrapper, nn.Module) else (None, None)
    if ddp is None:
        return None
    mine = {id(p) for p in model.parameters()}
    return ddp if mine and {id(p) for p in ddp.parameters()} == mine else None


def split_models(
    model: nn.Module, roots: dict[str, nn.Module] | None
) -> tuple[Any, nn.Module, dict[str, nn.Module] | None]:
    """``(ddp, model, roots)`` as the session keeps them (see above): one model as
    :func:`~.distributed.split_ddp` splits it; several models as their DDP wrappers (a
    :class:`DDPGroup`, or None), a new ``nn.ModuleDict`` of the wrapped modules (the user's container
    is left as it is) and the modules each call runs eagerly."""
    if roots is None:
        ddp, watched = split_ddp(model)
        return ddp, watched, None
    wrappers: list[Any] = []
    local: list[str] = []
    named: dict[str, nn.Module] = {}
    called: dict[str, nn.Module] = {}
    for name, root in roots.items():
        # torch.compile(DDP(m)) or DDP(torch.compile(m)): the call through the outer wrapper
        outer = _compiled_orig(root)
        ddp, inner = split_ddp(outer if outer is not None else root)
        orig = _compiled_orig(inner)
        named[name] = orig if orig is not None else inner
        called[name] = root if outer is not None else inner
        if ddp is not None:
            wrappers.append(ddp)
        else:
            local += [f"{name}.{n}" for n, p in named[name].named_parameters() if p.requires_grad]
    if all([named[n] is roots[n] for n in roots]):
        return None, model, roots  # nothing wrapped: the user's ModuleDict as it is
    return DDPGroup(wrappers, local) if wrappers else None, nn.ModuleDict(named), called
