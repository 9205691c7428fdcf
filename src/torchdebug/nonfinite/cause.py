"""Whose fault a bad step is (the rare path): the model, the compiler, a kernel backend, or unknown.

Runs only after the sentinel's replay of the first bad step (:mod:`.replay`), once per session:

- the eager replay made the same NaN/Inf: the model, its data or its loss code, unless the origin op
  has other kernels (SDPA backends; TF32, cuDNN and deterministic algorithms on CUDA) and one of them
  is finite on the same step: then that kernel backend (:func:`backend_cause`);
- the eager replay came out finite and the model runs under ``torch.compile``: the step is replayed
  through the same compiled callable; non-finite there, the compiler, localised to the first module
  whose compiled output is non-finite from its eager inputs (:func:`compiler_cause`);
- nothing tried reproduced it: unknown, with what was tried. "Hardware" is said only by a replay on
  another rank (the ``replica`` hook the distributed coordinator fills, :data:`ReplicaCheck`).

Cost: each replay is one step; each compile is counted (``Cause.compiles``) and bounded by
``config.cause_budget`` seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import sys
import time
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .._frames import format_location, skip_frame, user_location
from .._step import SessionView
from .._trees import map_tensors, tensor_leaves
from ..events import Anomaly, Cause
from .locate import (
    StepCapture,
    Tracer,
    _autocast,
    _eager,
    _preserved_state,
    _rerun_tape,
    apart_from_user,
)

# The distributed coordinator's replay of the failing micro-step on another rank: given the session
# and the micro-step's index, a Cause ("hardware" when the fault stays on one rank, "unknown" for a
# transient fault) or None when it cannot tell. Asked only with several ranks, after every replay on
# this rank came out finite.
ReplicaCheck = Callable[[SessionView, int], "Cause | None"]

EAGER_TRIED = "two eager replays of the step (same batch, weights, buffers and RNG): finite"
# the end of a one-rank "not reproducible" hint with several ranks; the cross-rank replay replaces it
# with what it found (session/replica.py)
OTHER_RANK_HINT = "; a replay on another rank tells a faulty rank apart"

# -- model / kernel backend ------------------------------------------------------------------------

# the SDPA kernels, by the words their aten ops and autograd nodes carry
_SDPA = (
    ("flash_attention", "FlashAttention", "FLASH_ATTENTION"),
    ("efficient_attention", "EfficientAttention", "EFFICIENT_ATTENTION"),
    ("cudnn_attention", "CudnnAttention", "CUDNN_ATTENTION"),
    ("attention_math", "AttentionMath", "MATH"),
)
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "conv", "Mm", "Conv", "Addmm", "Bmm")


def sdpa_backend_of(op: str | None) -> str | None:
    """The SDPA backend whose kernel ``op`` (an aten op or an autograd node) is, else None."""
    for aten, node, name in _SDPA:
        if op and (aten in op or node in op):
            return name
    return None


def model_cause(a: Anomaly, replays: int) -> Cause:
    """The eager replay reproduced it: the model, its data or its loss code."""
    return Cause(
        verdict="model",
        evidence=f"the eager replay of the step (same batch, weights, buffers and RNG) made the same "
        f"{a.kind} in {a.site()}",
        tried=(f"eager replay of the step: {a.kind} again",),
        replays=replays,
    )


def _alternatives(op: str | None, uses_cuda: bool) -> tuple[str | None, list[tuple[str, Callable[[], Any]]]]:
    """(the kernel the step used, [(another kernel, a context that selects it)]) for ``op``."""
    sdpa = sdpa_backend_of(op)
    if sdpa is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        others = [n for _, _, n in _SDPA if n != sdpa]
        if not uses_cuda:  # on a CPU only MATH and FLASH_ATTENTION exist
            others = [n for n in others if n in ("MATH", "FLASH_ATTENTION")]
        return sdpa, [(n, functools.partial(sdpa_kernel, [getattr(SDPBackend, n)])) for n in others]
    if not uses_cuda or not op or not any(w in op for w in _MATMUL):
        return None, []
    alts: list[tuple[str, Callable[[], Any]]] = []
    used: list[str] = []
    if torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32:
        used.append("TF32")
        alts.append(("TF32 off", _tf32_off))
    if "conv" in op.lower() and torch.backends.cudnn.enabled:
        used.append("cuDNN")
        alts.append(("cuDNN off", lambda: torch.backends.cudnn.flags(enabled=False)))
    if not torch.are_deterministic_algorithms_enabled():
        used.append("nondeterministic algorithms")
        alts.append(("deterministic algorithms", _deterministic))
    return " + ".join(used) or None, alts


@contextlib.contextmanager
def _tf32_off() -> Iterator[None]:
    mm, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, cudnn


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False, warn_only=only)


def backend_cause(a: Anomaly, replay: Callable[[], Anomaly | None], uses_cuda: bool, replays: int) -> Cause:
    """The eager replay reproduced ``a``: re-run the step with each other kernel of its origin op.

    ``replay()`` re-runs the step under the tracer (the anomaly, or None when finite). Finite with
    another kernel: ``kernel_backend``, naming the one that made it; NaN with every kernel (or no other
    kernel): ``model``. Cost: one replay of the step per other kernel."""
    used, alts = _alternatives(a.op, uses_cuda)
    if used is None or not alts:
        return model_cause(a, replays)
    finite: list[str] = []
    bad: list[str] = []
    tried = [f"eager replay of the step with {used}: {a.kind}"]
    for name, select in alts:
        try:
            with select():
                again = replay()
        except RuntimeError as exc:  # no kernel of that backend for these inputs
            tried.append(f"{name}: not available ({str(exc).splitlines()[0][:80]})")
            continue
        replays += 1
        (bad if again is not None else finite).append(name)
        tried.append(f"{name}: {'finite' if again is None else again.kind}")
    if not finite:
        c = model_cause(a, replays)
        also = f"; NaN/Inf with {', '.join(bad)} too" if bad else ""
        return dataclasses.replace(c, evidence=c.evidence + also, tried=tuple(tried))
    nan_with = [used, *bad]
    return Cause(
        verdict="kernel_backend",
        evidence=f"finite with {', '.join(finite)}, {a.kind} only with {' and '.join(nan_with)} "
        f"(the step replayed with each kernel of {a.op})",
        tried=tuple(tried),
        replays=replays,
        module=a.module,
        location=a.location,
        backend=used,
    )


def backend_remedy(c: Cause) -> str:
    """What to do about a kernel backend's fault: select a kernel that was finite."""
    finite = c.evidence.removeprefix("finite with ").split(",")[0]
    if c.backend in {n for _, _, n in _SDPA}:
        return (
            f"the {c.backend} kernel is at fault, not the model: run this attention under "
            f"torch.nn.attention.sdpa_kernel(SDPBackend.{finite.split(' ')[0]}) and report it to PyTorch"
        )
    return f"the kernel is at fault, not the model: it is finite with {finite}"


def unknown_cause(tried: list[str], replays: int, compiles: int = 0) -> Cause:
    """Nothing tried reproduced it."""
    return Cause(
        verdict="unknown",
        evidence="nothing tried reproduced it: " + "; ".join(tried),
        tried=tuple(tried),
        replays=replays,
        compiles=compiles,
    )


# -- compiler --------------------------------------------------------------------------------------
STEP_FN_HINT = (
    "a forward inside a torch.compile'd function runs none of torchdebug's hooks: pass that function "
    "as td.watch(..., step_fn=step_fn) to replay the step through it"
)


def dynamo_compiled() -> bool:
    """Dynamo has compiled a graph in this process (only asked on the rare path, where it is imported)."""
    return "torch._dynamo" in sys.modules and _graphs() > 0


def uncaptured_cause() -> Cause:
    """The step's forward was never seen (no capture) while Dynamo compiles code in this process: the
    model ran inside a compiled function, most likely; nothing was replayed, so nothing is claimed."""
    n = _graphs()
    why = (
        "the step's forward was not captured (torchdebug's hooks do not run inside compiled code, and "
        f"Dynamo compiled {n} graph{'s' if n != 1 else ''} in this process), so neither an eager replay "
        "nor one through the compiled code was tried"
    )
    return Cause(verdict="unknown", evidence=f"nothing was replayed: {why}", tried=(f"no replay: {why}",))


def compiled_inside(model: nn.Module) -> bool:
    """A module of ``model`` runs compiled: a ``torch.compile`` wrapper held as a submodule
    (``self.net = torch.compile(net)``) or ``module.compile()`` in place. Rare path: one walk."""
    return any(
        [
            type(m).__name__ == "OptimizedModule" or m.__dict__.get("_compiled_call_impl") is not None
            for m in model.modules()
        ]
    )


def _graphs() -> int:
    """Graphs Dynamo has compiled in this process (each one a compile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Budget:
    """The compiles spent and the seconds left of ``config.cause_budget``."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.compiles = 0
        self.spent = False  # the budget ran out before the search ended

    def left(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.spent = True
        return not self.spent

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        before = _graphs()
        try:
            yield
        finally:
            self.compiles += _graphs() - before


def _nonfinite(x: Any) -> bool:
    return any(
        [
            bool((~torch.isfinite(t)).any())
            for t in tensor_leaves(x)
            if t.is_floating_point() or t.is_complex()
        ]
    )


def replay_through(
    mon: SessionView,
    cap: StepCapture,
    call: Callable[..., Any],
    start: Mapping[int, torch.Tensor] | None = None,
) -> str | None:
    """Re-run the captured micro-step through ``call`` (the compiled model), untraced: what came out
    non-finite (``"the loss"``, ``"the gradients of fc1.weight"``, ``"the output"``) or None.
    ``start``: the buffers the step wrote, as it began. The user's grads, buffers and RNG are
    restored after."""
    model = mon.model
    tracer = Tracer(model, frames=1, names=mon.names)  # not entered: the loss tape's bookkeeping only
    made: dict[int, torch.Tensor] = {}
    params = [p for p in model.parameters() if p.requires_grad]
    apart_from_user((cap.args, cap.kwargs, [(e[2], e[3]) for e in cap.tape]), {id(p) for p in params}, made)
    sub = lambda t: made.get(id(t), t)  # noqa: E731
    names = {id(p): n for n, p in model.named_parameters()}
    with _preserved_state(model, mon.uses_cuda, start):
        torch.set_rng_state(cap.rng_cpu)
        if cap.rng_cuda is not None:
            torch.cuda.set_rng_state_all(cap.rng_cuda)
        with torch.set_grad_enabled(cap.grad_enabled), _autocast(cap.autocast):
            out = call(*map_tensors(cap.args, sub), **map_tensors(cap.kwargs, sub))
            loss = _rerun_tape(cap, out, tracer, made) if cap.tape_complete else None
            if loss is not None:
                if _nonfinite(loss):
                    return "the loss"
                loss.backward(gradient=cap.loss_grad)
            else:
                pairs = [
                    (n, cap.out_grads[i])
                    for i, n in enumerate(tensor_leaves(out))
                    if i in cap.out_grads and n.requires_grad
                ]
                if pairs:
                    torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
                elif _nonfinite(out):
                    return "the output"
        bad = [names[id(p)] for p in params if p.grad is not None and _nonfinite(p.grad)]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return f"the gradients of {', '.join(bad[:3])}{more}"
    return None


@dataclasses.dataclass
class _Call:
    """One module's first call in the eager step: its inputs (copies), RNG state and call site, and
    (when the backward was recorded) the gradient each tensor of its output received."""

    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    rng: torch.Tensor
    site: str | None
    order: int
    grad_out: list[torch.Tensor | None] | None = None


def _copy(x: Any) -> Any:
    def one(t: torch.Tensor) -> torch.Tensor:
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad) if c.is_floating_point() or c.is_complex() else c

    return map_tensors(x, one)


@contextlib.contextmanager
def recorded(model: nn.Module, grads: bool) -> Iterator[list[_Call]]:
    """While the step runs eagerly inside: each module's inputs of its first call (and, with ``grads``,
    the gradient its output received in the step's backward), in the order they ran. Cost: a copy of
    every module's inputs (the step's activations, once) and of the gradients at their outputs."""
    calls: dict[nn.Module, _Call] = {}
    out: list[_Call] = []
    # a torch.compile wrapper held as a submodule is its ``_orig_mod``'s twin: that one is tried
    names = {m: n for n, m in model.named_modules() if type(m).__name__ != "OptimizedModule"}

    def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
        if m not in calls and m in names:
            site = user_location(sys._getframe(1))
            calls[m] = _Call(names[m], m, _copy(args), _copy(kwargs), torch.get_rng_state(), site, len(calls))

    def keep(c: _Call, i: int, g: torch.Tensor) -> None:
        assert c.grad_out is not None
        c.grad_out[i] = g.detach().clone()

    def post(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        c = calls.get(m)
        if c is None or c.grad_out is not None:
            return  # not watched, or not its first call
        leaves = tensor_leaves(output)
        c.grad_out = [None] * len(leaves)
        for i, t in enumerate(leaves):
            if t.requires_grad:
                t.register_hook(functools.partial(keep, c, i))

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in names]
    if grads:
        handles += [m.register_forward_hook(post, with_kwargs=True) for m in names]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
        out.extend(sorted(calls.values(), key=lambda c: c.order))


def _record_calls(
    mon: SessionView, cap: StepCapture, start: Mapping[int, torch.Tensor] | None, grads: bool = False
) -> list[_Call]:
    """Run the captured micro-step eagerly (its forward; with ``grads`` its loss and backward too) and
    keep each module's first call (:func:`recorded`). Cost: one step."""
    model = mon.model
    called = cap.module if cap.module is not None else model  # a driver's: what training_step called
    with recorded(model, grads) as calls, mon.eager(), _eager():
        if grads:
            replay_through(mon, cap, called, start)
        else:
            made: dict[int, torch.Tensor] = {}
            apart_from_user((cap.args, cap.kwargs, []), {id(p) for p in model.parameters()}, made)
            sub = lambda t: made.get(id(t), t)  # noqa: E731
            with _preserved_state(model, mon.uses_cuda, start):
                torch.set_rng_state(cap.rng_cpu)
                with torch.set_grad_enabled(cap.grad_enabled), _autocast(cap.autocast):
                    called(*map_tensors(cap.args, sub), **map_tensors(cap.kwargs, sub))
    return calls


def _order(calls: list[_Call]) -> list[_Call]:
    """Leaves first (in the order they ran), then the subtrees above them, deepest first: a
    miscompiled fusion can span modules, so when no leaf alone reproduces, their parents are tried."""
    leaves = [c for c in calls if not any(True for _ in c.module.children())]
    parents = [c for c in calls if any(True for _ in c.module.children())]
    parents.sort(key=lambda c: (-(c.name.count(".") + 1 if c.name else 0), c.order))
    return leaves + parents


def _fresh(module: nn.Module) -> Callable[..., Any]:
    """A new function that calls ``module``: compiled on its own code object, so each candidate gets
    a fresh Dynamo cache (none of the user's compiled code is touched or evicted)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    return types.FunctionType(
        call.__code__.replace(), call.__globals__, "torchdebug_candidate", None, call.__closure__
    )


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def _user_lines(traces: list[str]) -> list[str]:
    """The user's ``file:line`` of each graph node's ``stack_trace`` (innermost user frame), in order."""
    out: list[str] = []
    for trace in traces:
        frames = [(f, int(n)) for f, n in _FILE_LINE.findall(trace) if not skip_frame(f)]
        if frames:
            loc = format_location(*frames[-1])
            if loc not in out:
                out.append(loc)
    return out


def _inductor(traces: list[str]) -> Any:
    """Inductor, keeping each graph node's ``stack_trace`` (the source line the node came from)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        traces.extend(
            str(n.meta["stack_trace"])
            for n in gm.graph.nodes
            if n.op == "call_function" and n.meta.get("stack_trace")
        )
        return compile_fx(gm, example_inputs)

    return backend


@contextlib.contextmanager
def _faithful() -> Iterator[None]:
    """Compiled code as close to eager as Inductor can make it (random ops fall back to eager's RNG,
    low-precision casts emulated) and a Dynamo cache that does not give up on the candidates."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    with (
        inductor_config.patch(fallback_random=True, emulate_precision_casts=True),
        dynamo_config.patch(recompile_limit=1_000_000, accumulated_recompile_limit=1_000_000),
    ):
        yield


@dataclasses.dataclass
class _Try:
    call: _Call
    eager_bad: bool
    compiled_bad: bool
    diff: float  # the largest |compiled - eager| over the finite elements, relative to max |eager|
    lines: list[str]


def _grads(out: Any, c: _Call, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The gradients of ``c.module``'s inputs and parameters from the gradient its output received in
    the step (``c.grad_out``); [] when none was recorded."""
    pairs = [
        (t, g)
        for t, g in zip(tensor_leaves(out), c.grad_out or [])
        if g is not None and t.requires_grad and t.shape == g.shape
    ]
    wrt = [t for t in tensor_leaves((args, kwargs)) if t.requires_grad]
    wrt += [p for p in c.module.parameters() if p.requires_grad]
    if not pairs or not wrt:
        return []
    got = torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
    return [g for g in got if g is not None]


def _differs(eager: list[torch.Tensor], compiled: list[torch.Tensor]) -> float:
    diff = 0.0
    for e, k in zip(eager, compiled):
        if e.is_floating_point() and e.shape == k.shape:
            both = torch.isfinite(e) & torch.isfinite(k)
            if bool(both.any()):
                e_, k_ = e.detach()[both].double(), k.detach()[both].double()
                scale = max(float(e_.abs().max()), 1e-12)
                diff = max(diff, float((e_ - k_).abs().max()) / scale)
    return diff


def _try(c: _Call, budget: Budget, mon: SessionView, backward: bool = False) -> _Try | None:
    """Run ``c.module`` eagerly and compiled from the same inputs and RNG state (with ``backward``, each
    also backward from the gradient its output received in the step); None: it failed."""
    traces: list[str] = []
    try:
        with _preserved_state(mon.model, mon.uses_cuda), _faithful():
            torch.set_rng_state(c.rng)
            ea, ek = _copy(c.args), _copy(c.kwargs)
            with mon.eager(), _eager():
                eager = tensor_leaves(c.module(*ea, **ek))
                eg = _grads(eager, c, ea, ek) if backward else []
            torch.set_rng_state(c.rng)
            ka, kk = _copy(c.args), _copy(c.kwargs)
            with budget.counting():
                compiled = tensor_leaves(
                    torch.compile(_fresh(c.module), backend=_inductor(traces))(*ka, **kk)
                )
                kg = _grads(compiled, c, ka, kk) if backward else []
    except Exception:
        return None
    diff = _differs(eager + eg, compiled + kg)
    return _Try(c, _nonfinite(eager + eg), _nonfinite(compiled + kg), diff, _user_lines(traces))


# compiled and eager outputs differ: more than rounding (relative to the output's largest value)
_DIFFERS = 1e-3


def _label(c: _Call) -> str:
    return f"{c.name} ({type(c.module).__name__})" if c.name else type(c.module).__name__


def _where(t: _Try) -> str | None:
    """The source line of a candidate: its graph's user line, else where the step called it."""
    return t.lines[0] if t.lines else t.call.site


def localise(
    mon: SessionView, calls: list[_Call], budget: Budget, backward: bool = False
) -> tuple[_Try | None, _Try | None, list[str]]:
    """(the first candidate whose compiled output (with ``backward``: or its gradients) is non-finite
    while its eager one is finite, the leaf inside it whose compiled output differs most from eager,
    notes on what was tried)."""
    tried: list[_Try] = []
    notes: list[str] = []
    failed = 0
    for c in _order(calls):
        if not budget.left():
            notes.append(
                f"stopped after {len(tried)} of {len(calls)} modules: cause_budget of {budget.seconds:g} s spent"
            )
            break
        t = _try(c, budget, mon, backward)
        if t is None:
            failed += 1
            continue
        tried.append(t)
        if t.compiled_bad and not t.eager_bad:
            inside = [
                x
                for x in tried
                if x is not t
                and (t.call.name == "" or x.call.name.startswith(t.call.name + "."))
                and not any(True for _ in x.call.module.children())
                and x.diff > _DIFFERS
            ]
            # the leaf whose compiled output strays furthest from eager: the likeliest miscompiled op
            suspect = max(inside, key=lambda x: x.diff) if inside else None
            if failed:
                notes.append(f"{failed} modules could not be compiled alone")
            return t, suspect, notes
    if failed:
        notes.append(f"{failed} modules could not be compiled alone")
    return None, None, notes


@dataclasses.dataclass
class Compiled:
    """The compiled code a step ran, as the compiler's search sees it: ``what`` it is in words (``"the
    compiled model"``), ``replay()`` re-runs the failing micro-step through it (what came out
    non-finite, or None) and ``record(grads)`` runs the step eagerly keeping each module's first call."""

    what: str
    replay: Callable[[], str | None]
    record: Callable[[bool], list[_Call]]


def compiler_cause(
    mon: SessionView,
    idx: int,
    replays: int,
    tried: list[str],
    start: Mapping[int, torch.Tensor] | None = None,
) -> Cause | None:
    """The model runs compiled and the eager replay was finite: replay through the compiled callable,
    then localise. None (with ``tried`` extended) when the compiled replay is finite too. ``start``:
    the buffers the step wrote, as it began (the first micro-step's replay starts from them)."""
    cap = mon.state.captures[idx]
    # the module the step called: the model (its compile wrapper), or what a driver's training_step called
    called = cap.module if cap.module is not None else mon.called
    code = Compiled(
        "the compiled model",
        lambda: replay_through(mon, cap, called, start),
        lambda grads: _record_calls(mon, cap, start, grads),
    )
    return compiled_cause(mon, code, replays, tried)


def compiled_cause(mon: SessionView, code: Compiled, replays: int, tried: list[str]) -> Cause | None:
    """The eager replays were finite: replay through ``code``; non-finite there, the compiler's fault,
    localised to the first module whose compiled forward (or, when only the gradients went non-finite,
    whose compiled backward) is non-finite from its eager inputs. None (``tried`` extended) when the
    compiled replay is finite too."""
    budget = Budget(mon.config.cause_budget)
    with budget.counting():
        what = code.replay()
    replays += 1
    if what is None:
        tried.append(f"a replay through {code.what}: finite ({budget.compiles} compiles)")
        return None
    confirm = f"replayed through {code.what}, {what} went non-finite; the eager replays were finite"
    tried.append(f"a replay through {code.what}: {what} non-finite")
    backward = what.startswith("the gradients")  # the forward (and the loss) compiled finite
    bisect: str | None = None
    try:
        hit, suspect, notes = localise(mon, code.record(backward), budget, backward)
    except Exception as exc:  # the verdict stands on the replay; only the module stays unnamed
        hit, suspect, notes = None, None, [f"localising it failed ({exc!r})"]
    if hit is not None and mon.config.compiler_bisect:
        if budget.left():
            bisect, note = bisect_compiler(hit.call, mon, budget, backward)
        else:
            note = f"CompilerBisector not run: cause_budget of {budget.seconds:g} s spent"
        if note:
            notes.append(note)
    where = suspect if suspect is not None else hit
    alone = (
        "compiled alone from the step's eager inputs and the gradient its output received"
        if backward
        else "compiled alone from the step's eager inputs"
    )
    if hit is None:
        evidence = (
            f"{confirm}; no module {alone} went non-finite{' in its forward or backward' if backward else ''} "
            f"({'; '.join(notes) or 'every module tried'})"
        )
        module = location = None
    else:
        assert where is not None
        made = (
            "'s backward made NaN/Inf while its eager gradients are finite"
            if backward
            else " made NaN/Inf while its eager output is finite"
        )
        evidence = f"{confirm}; {alone}, {_label(hit.call)}{made}"
        if suspect is not None:
            evidence += (
                f"; inside it, {_label(suspect.call)}'s compiled {'gradients differ' if backward else 'output differs'} "
                f"from eager (by up to {suspect.diff:.3g} of its largest value)"
            )
        if notes:
            evidence += f" ({'; '.join(notes)})"
        module, location = where.call.name, _where(where)
    if bisect:
        evidence += f"; CompilerBisector: {bisect}"
    evidence += f" ({budget.compiles} compiles)"
    return Cause(
        verdict="compiler",
        evidence=evidence,
        tried=(*tried, *notes),
        compiles=budget.compiles,
        replays=replays,
        module=module,
        location=location,
        backend=bisect,
    )


def bisect_compiler(
    c: _Call, mon: SessionView, budget: Budget, backward: bool = False
) -> tuple[str | None, str]:
    """``CompilerBisector`` with the module's compiled call from its eager inputs as the test: the
    backend, subsystem and pass (or lowering) that makes it non-finite, e.g. ``inductor / lowerings /
    relu``, and a note when it named nothing. Cost: one compile per bisection step (about 20 for a
    one-op bug)."""
    from torch._inductor.compiler_bisector import CompilerBisector

    def finite() -> bool:
        if not budget.left():
            return True  # out of time: no more compiles (the bisection ends without an answer)
        with _preserved_state(mon.model, mon.uses_cuda), _faithful(), budget.counting():
            torch.set_rng_state(c.rng)
            try:
                args, kwargs = _copy(c.args), _copy(c.kwargs)
                out = tensor_leaves(torch.compile(_fresh(c.module), backend="inductor")(*args, **kwargs))
                grads = _grads(out, c, args, kwargs) if backward else []
            except Exception:
                return False
        return not _nonfinite(out + grads)

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the bisector narrates each step on stdout
            result = CompilerBisector.do_bisect(finite)
    except Exception as exc:
        return None, f"CompilerBisector failed ({exc!r})"
    if budget.spent:
        return None, f"CompilerBisector stopped: cause_budget of {budget.seconds:g} s spent"
    if result is None:
        return None, "CompilerBisector found no backend, subsystem or pass that changes it"
    parts = [result.backend, result.subsystem, result.debug_info]
    return " / ".join(str(p) for p in parts if p), ""
