"""Out-of-memory recovery: re-run a training step on smaller pieces of the batch (``on_oom="retry_half"``)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._trees import map_tensors, tensor_leaves

ON_OOM_CHOICES = ("raise", "retry_half")

# CPU allocators do not raise torch.OutOfMemoryError; these are the messages they use instead.
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` is an out-of-memory error (``torch.OutOfMemoryError`` or an allocator RuntimeError).

    Example:
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory"))
        True
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _OOM_MESSAGES)
    return False


def batch_size_of(batch: Any) -> int | None:
    """Size of dim 0 of the first tensor in ``batch`` (tensors, tuples, lists, dicts); None if none has a dim 0."""
    for t in tensor_leaves(batch):
        if t.dim() > 0:
            return int(t.shape[0])
    return None


def split_batch(batch: Any, parts: int = 2) -> list[Any]:
    """Split every tensor in ``batch`` along dim 0 into ``parts`` contiguous pieces (the last may be shorter).

    Args:
        batch: a tensor, or tuples/lists/dicts (nested) of tensors; non-tensor leaves are copied into
            every piece unchanged.
        parts: number of pieces (>= 2), capped at the batch size.

    Returns:
        The pieces, in order; their sizes add up to the batch size.

    Raises:
        ValueError: no tensor with a dim 0, tensors disagree on their dim 0 size, or the batch has one sample.

    Example:
        >>> x, y = split_batch((torch.zeros(5, 3), torch.zeros(5)))
        >>> x[0].shape[0], y[0].shape[0]
        (3, 2)
    """
    if parts < 2:
        raise ValueError(f"parts must be >= 2, got {parts}")
    sizes = {int(t.shape[0]) for t in tensor_leaves(batch) if t.dim() > 0}
    if not sizes:
        raise ValueError("cannot split a batch without a tensor that has a dim 0; pass split= to say how")
    if len(sizes) > 1:
        raise ValueError(
            f"tensors in the batch disagree on their dim 0 size {sorted(sizes)}; pass split= to say how to split it"
        )
    n = sizes.pop()
    if n < 2:
        raise ValueError("cannot split a batch of one sample")
    parts = min(parts, n)
    chunk = -(-n // parts)  # ceil: same piece sizes as torch.chunk
    bounds = [(i, min(i + chunk, n)) for i in range(0, n, chunk)]

    def piece(lo: int, hi: int) -> Any:
        return map_tensors(batch, lambda t: t[lo:hi] if t.dim() > 0 else t)

    return [piece(lo, hi) for lo, hi in bounds]


@dataclass(frozen=True)
class OomRetry:
    """What one OOM recovery did: the failing batch size, the piece sizes that finally ran, the error text."""

    batch_size: int | None
    piece_sizes: tuple[int, ...]
    error: str

    def __str__(self) -> str:
        return (
            f"out of memory on a batch of {self.batch_size}; re-ran it as {len(self.piece_sizes)} pieces "
            f"{list(self.piece_sizes)} with gradient accumulation"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "piece_sizes": list(self.piece_sizes), "error": self.error}


def _free_memory() -> None:
    gc.collect()  # the failed attempt's frames may sit in reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _zero_grads(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None


def _run_scaled(
    step_fn: Callable[[Any], Any], batch: Any, scale: float, params: Sequence[torch.Tensor]
) -> Any:
    """Run ``step_fn(batch)`` with every parameter's incoming gradient multiplied by ``scale``.

    A leaf tensor hook runs before the gradient is accumulated into ``.grad``, so scaling there is the
    same as scaling the loss (backward is linear in the loss) without touching ``step_fn``.
    """
    if scale == 1.0:
        return step_fn(batch)
    handles = [p.register_hook(lambda g, s=scale: g * s) for p in params if p.requires_grad]
    try:
        return step_fn(batch)
    finally:
        for h in handles:
            h.remove()


def _halve_all(pieces: list[Any], split: Callable[[Any], Sequence[Any]] | None) -> list[Any]:
    """Halve every piece that has at least two samples; single-sample pieces stay as they are."""
    out: list[Any] = []
    for p in pieces:
        n = batch_size_of(p)
        if n is None or n < 2:
            out.append(p)
        else:
            out.extend(split(p) if split is not None else split_batch(p, 2))
    return out


def _run_pieces(
    step_fn: Callable[[Any], Any],
    pieces: list[Any],
    params: Sequence[torch.Tensor],
    before_attempt: Callable[[Any], None] | None,
) -> Any:
    """Run every piece with its gradient scaled by its sample share; return the weighted loss (detached)."""
    piece_n = [batch_size_of(p) for p in pieces]
    if any(k is None for k in piece_n):
        raise ValueError("split= returned a piece without a tensor of dim >= 1; cannot weight its loss")
    total = sum(k for k in piece_n if k is not None)
    out: Any = None
    for p, k in zip(pieces, piece_n):
        assert k is not None
        scale = k / total
        if before_attempt is not None:
            before_attempt(p)
        loss = _run_scaled(step_fn, p, scale, params)
        if loss is None:
            continue
        part = loss.detach() * scale if isinstance(loss, torch.Tensor) else loss * scale
        out = part if out is None else out + part
    return out


def run_step_with_oom_retry(
    step_fn: Callable[[Any], Any],
    batch: Any,
    *,
    on_oom: str = "retry_half",
    optimizer: torch.optim.Optimizer | None = None,
    params: Iterable[torch.Tensor] | None = None,
    split: Callable[[Any], Sequence[Any]] | None = None,
    max_halvings: int = 4,
    on_retry: Callable[[OomRetry], None] | None = None,
    before_attempt: Callable[[Any], None] | None = None,
) -> Any:
    """Run ``step_fn(batch)`` (forward + loss + backward, returns the loss); on OOM, re-run it on halves.

    With ``on_oom="retry_half"``, an out-of-memory error frees what it can (the failed attempt's
    frames, gradients, the CUDA cache), zeroes the gradients and runs ``step_fn`` on each half of the
    batch with each half's gradient scaled by its share of the samples (``n_half / n``), so for a
    mean-reduced loss the accumulated gradients equal the full-batch gradients. If a piece still
    runs out of memory, every piece is halved again from zeroed gradients, up to ``max_halvings`` times. The optimizer step is the
    caller's, after this returns.

    Args:
        step_fn: ``step_fn(batch) -> loss``; must call backward itself and must not zero gradients.
        batch: a tensor or tuples/lists/dicts of tensors whose dim 0 is the batch.
        on_oom: ``"raise"`` (just run it) or ``"retry_half"``.
        optimizer: its parameters are the ones zeroed and scaled (or pass ``params``).
        params: parameters to zero and scale when there is no optimizer.
        split: ``split(batch) -> pieces`` to override the dim-0 halving (piece weights come from
            each piece's dim 0 size).
        max_halvings: how many times to halve again (all pieces, from zeroed gradients) while a piece
            still runs out of memory.
        on_retry: called once with an :class:`OomRetry` after a successful recovery (the monitor records it).
        before_attempt: called with each piece before ``step_fn`` runs it during a retry (the monitor
            uses it to start a new micro-step: the failed attempt never reached its backward).

    Returns:
        ``step_fn``'s loss, or after a retry the sample-weighted sum of the pieces' losses (detached),
        which equals the full-batch mean loss.

    Raises:
        ValueError: unknown ``on_oom``, or ``retry_half`` without ``optimizer``/``params``.
        torch.OutOfMemoryError: still out of memory after ``max_halvings`` halvings (or on single samples).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> def step_fn(b):
        ...     loss = model(b).pow(2).mean()
        ...     loss.backward()
        ...     return loss
        >>> loss = run_step_with_oom_retry(step_fn, torch.ones(8, 4), optimizer=opt)

    Cost: nothing extra unless an OOM happens; a retry costs the wasted attempts plus the pieces.
    Known limitations: losses that are not means over the batch (sums, per-token means over a
    varying token count) are weighted by sample count, which is exact only for per-sample means;
    batch-statistics layers (BatchNorm) see smaller batches in the pieces.
    """
    if on_oom not in ON_OOM_CHOICES:
        raise ValueError(f"on_oom must be one of {ON_OOM_CHOICES}, got {on_oom!r}")
    if on_oom == "raise":
        return step_fn(batch)
    plist: list[torch.Tensor] = []
    if optimizer is not None:
        plist.extend(p for g in optimizer.param_groups for p in g["params"])
    if params is not None:
        seen = {id(p) for p in plist}
        plist.extend(p for p in params if id(p) not in seen)
    if not plist:
        raise ValueError("on_oom='retry_half' needs optimizer= or params= to zero and scale the gradients")
    try:
        return step_fn(batch)
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        n = batch_size_of(batch)
        if n is None or n < 2:
            raise
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    # Left the except block: the traceback and the frames holding the failed attempt's activations
    # are released before the retry.
    pieces = [batch]
    for _ in range(max_halvings):
        finer = _halve_all(pieces, split)
        if len(finer) == len(pieces):
            break  # every piece is a single sample: nothing left to split
        pieces = finer
        # A failed piece may have accumulated part of its gradient before the error, so each level
        # restarts from zeroed gradients: exact, at the price of the wasted work.
        _zero_grads(plist, optimizer)
        _free_memory()
        try:
            out = _run_pieces(step_fn, pieces, plist, before_attempt)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            continue
        if on_retry is not None:
            on_retry(
                OomRetry(batch_size=n, piece_sizes=tuple(batch_size_of(p) or 0 for p in pieces), error=error)
            )
        return out
    _zero_grads(plist, optimizer)
    raise torch.OutOfMemoryError(
        f"still out of memory after splitting the batch of {n} into {len(pieces)} pieces "
        f"(max_halvings={max_halvings}); first error: {error}"
    )


__all__ = [
    "ON_OOM_CHOICES",
    "OomRetry",
    "batch_size_of",
    "is_oom_error",
    "run_step_with_oom_retry",
    "split_batch",
]
