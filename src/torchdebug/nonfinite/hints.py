"""Hints: the likely cause of a non-finite origin in plain words, derived from the op and its evidence.

A hint is what a user acts on, so it says only what the evidence shows: which inputs were exactly 0
(and only for ops singular at 0: a division, log, rsqrt, a negative power), which magnitudes
overflowed which dtype, what an op's gradient is singular at (eigh: equal eigenvalues, with the
smallest gap). The evidence is gathered once, where the tracer makes the event (:func:`gather`); the
words are chosen from it here (:func:`make_hint`), never contradicting the statistics printed beside
the hint ("from finite inputs" only when every input shown is finite).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..events import Phase
from ..stats import TensorStats

_DTYPE_MAX = {"float16": "65504", "bfloat16": "3.39e38", "float32": "3.4e38", "float64": "1.8e308"}
_DTYPE_MAXF = {"float16": 65504.0, "bfloat16": 3.39e38, "float32": 3.4e38, "float64": 1.8e308}
# exp(x) overflows above log(max): float16 11.09, bfloat16 and float32 88.72, float64 709.78
_EXP_LIMIT = {"float16": 11.09, "bfloat16": 88.72, "float32": 88.72, "float64": 709.78}
_CAST_OPS = ("_to_copy", "copy_")

# Ops that square their input on the way (a variance, a sum of squares): values above sqrt(max) of the
# dtype they accumulate in overflow there even though the result would be small. half/bfloat16
# inputs accumulate in float32 (torch's opmath type).
_SQUARING = {
    "native_layer_norm": "variance",
    "native_batch_norm": "variance",
    "_native_batch_norm_legit": "variance",
    "_native_batch_norm_legit_no_training": "variance",
    "_batch_norm_with_update": "variance",
    "_batch_norm_no_update": "variance",
    "native_group_norm": "variance",
    "var": "variance",
    "var_mean": "variance",
    "std": "variance",
    "std_mean": "variance",
    "_fused_rms_norm": "mean of squares",
    "linalg_vector_norm": "sum of squares",
    "norm": "sum of squares",
}

# Ops singular at 0, and which input is the one that must not be 0: (input index, what it is called).
_ZERO_SINGULAR = {
    "div": (1, "denominator"),
    "div_": (1, "denominator"),
    "reciprocal": (0, "input"),
    "reciprocal_": (0, "input"),
    "log": (0, "input"),
    "log_": (0, "input"),
    "log2": (0, "input"),
    "log2_": (0, "input"),
    "log10": (0, "input"),
    "log10_": (0, "input"),
    "rsqrt": (0, "input"),
    "rsqrt_": (0, "input"),
    "pow": (0, "base"),  # only with a negative exponent
    "pow_": (0, "base"),
    "addcdiv": (2, "denominator"),  # self + value * t1 / t2 (Adam's update)
    "addcdiv_": (2, "denominator"),
}

# Autograd nodes whose gradient divides by differences of eigenvalues (or of squared singular values).
_SPECTRAL = {
    "LinalgEighBackward0": "eigenvalues",
    "LinalgEigBackward0": "eigenvalues",
    "LinalgSvdBackward0": "singular values",
    "SvdBackward0": "singular values",
}
_GAP_MAX_N = 4096  # at most this many eigenvalues per matrix are compared pairwise (rare path only)


@dataclass(frozen=True)
class Evidence:
    """What the hint is derived from, beyond the input statistics the event already holds.

    ``aten``: the aten op that made the value (``"div"``, also inside a backward node);
    ``custom``: it ran in a custom ``autograd.Function``'s backward; ``scalars``: the op's numeric
    arguments that are not tensors (pow's exponent, a divisor); ``gap``: for a spectral backward,
    (smallest gap, and the two values it lies between) of the saved eigen/singular values.
    """

    aten: str = ""
    custom: bool = False
    scalars: tuple[float, ...] = ()
    gap: tuple[float, float, float] | None = None
    inputs_finite: bool | None = None  # every input was finite before the op (an in-place op's too)
    state: str = ""  # an optimizer update: the state tensor it made non-finite (``exp_avg_sq``)
    empty_mean: str = ""  # a loss's mean over zero counted targets: what made the count 0 (nll_loss)


def gather(
    func: Any, args: tuple, node: Any, *, inputs_finite: bool | None = None, state: str = ""
) -> Evidence:
    """The evidence of an op that just made a non-finite value (rare path: one event at a time)."""
    # a multi-tensor op is worded as its one-tensor form (its inputs are the failing item's)
    aten = func._schema.name.split("::")[-1].removeprefix("_foreach_") if func is not None else ""
    scalars = tuple(
        float(a) for a in args if isinstance(a, (int, float)) and not isinstance(a, bool) and a is not None
    )
    custom = node is not None and isinstance(node, torch.autograd.function.BackwardCFunction)
    gap = _spectral_gap(node) if node is not None and type(node).__name__ in _SPECTRAL else None
    empty = _empty_mean(aten, args) if aten in _NLL else ""
    return Evidence(aten, custom, scalars, gap, inputs_finite, state, empty)


# nll_loss's forward ops: (self, target, weight, reduction, ignore_index); cross_entropy ends in one
_NLL = ("nll_loss_forward", "nll_loss2d_forward")
_MEAN = 1  # torch's Reduction::Mean


def _empty_mean(aten: str, args: tuple) -> str:
    """nll_loss with mean reduction divides by the summed weight of the targets it counts: 0/0 = NaN when
    every target is ``ignore_index`` (or every counted class has weight 0). Says which, or ""."""
    if len(args) < 5 or args[3] != _MEAN or not isinstance(args[1], torch.Tensor):
        return ""
    target, weight, ignore = args[1], args[2], int(args[4])
    with contextlib.suppress(Exception), torch.no_grad():  # rare path: one event
        counted = target != ignore
        n, total = target.numel(), int(counted.sum())
        if total == 0:
            return (
                f"all {n} targets are ignore_index ({ignore}): {aten.removesuffix('_forward')} with "
                "reduction='mean' divides the summed loss by the number of counted targets, 0/0 = NaN; "
                "skip batches without a labelled target, or use reduction='sum' and divide by max(count, 1)"
            )
        if isinstance(weight, torch.Tensor):
            w = weight[target[counted].long()].sum()
            if float(w) == 0.0:
                return (
                    f"the class weights of the {total} counted targets sum to 0: "
                    f"{aten.removesuffix('_forward')} with reduction='mean' divides by that sum, 0/0 = NaN"
                )
    return ""


def _spectral_gap(node: Any) -> tuple[float, float, float] | None:
    """The smallest gap between two eigenvalues (singular values) of any matrix the node saved."""
    vals = None
    for attr in ("_saved_eigenvalues", "_saved_S"):
        with contextlib.suppress(Exception):  # released, or not saved under this name
            vals = getattr(node, attr)
            break
    if not isinstance(vals, torch.Tensor) or vals.dim() < 1 or not 1 < vals.shape[-1] <= _GAP_MAX_N:
        return None
    with torch._C.DisableTorchFunction(), torch.no_grad():
        v = vals.detach().reshape(-1, vals.shape[-1])
        v = v.abs().double() if v.is_complex() else v.double()  # eig: compared by magnitude (cheap bound)
        d = (v.unsqueeze(-1) - v.unsqueeze(-2)).abs()  # (M, n, n)
        n = v.shape[-1]
        same = torch.eye(n, dtype=torch.bool, device=d.device)  # not a value with itself
        d = d.masked_fill(same | torch.isnan(d), math.inf)
        flat = d.reshape(-1)
        k = int(flat.argmin())
        m, rest = divmod(k, n * n)
        i, j = divmod(rest, n)
        gap = float(flat[k])
        if not math.isfinite(gap):
            return None
        a, b = sorted((float(v[m, i]), float(v[m, j])))
        return gap, a, b


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _zeros(s: TensorStats) -> int:
    """Exactly-zero elements of the tensor ``s`` describes (zero_fraction is over its finite values)."""
    finite = s.numel - s.nan_count - s.posinf_count - s.neginf_count
    return round((s.zero_fraction or 0.0) * finite)


def _of(s: TensorStats) -> str:
    k = _zeros(s)
    if k == s.numel:
        return f"all {k} values are exactly 0" if k > 1 else "its one value is exactly 0"
    return f"{k} of {s.numel} values {'is' if k == 1 else 'are'} exactly 0"


def _zero_cause(ev: Any, ev_aten: str, scalars: tuple[float, ...]) -> tuple[str, TensorStats | None] | None:
    """(what is singular, the input that holds the zeros) when the op is singular at 0 and was fed 0."""
    spec = _ZERO_SINGULAR.get(ev_aten)
    if spec is None:
        return None
    idx, role = spec
    ins = ev.inputs
    if ev_aten.startswith("pow"):
        exps = [x for x in scalars]
        if len(ins) > 1 and ins[1].max is not None:
            exps.append(ins[1].max)  # pow(Tensor, Tensor): the largest exponent shown
        if not exps or max(exps) >= 0:
            return None
        what = f"pow(x, {_fmt(max(exps))}) of 0"
    elif ev_aten.startswith(("div", "addcdiv")):
        if ev_aten.startswith("div") and len(ins) < 2:  # divided by a Python number
            return ("division by the constant 0", None) if scalars and scalars[0] == 0 else None
        what = "0/0" if ev.kind == "nan" else "division by zero"
    else:
        what = f"{ev_aten.rstrip('_')} of 0"
    if idx >= len(ins) or _zeros(ins[idx]) == 0:
        return None
    return f"{what}: the {role} holds exact zeros ({_of(ins[idx])})", ins[idx]


def make_hint(ev: Any) -> str:
    """Plain words for the likely cause of an event (a ``locate._Event``), from its op and evidence."""
    op = ev.op.removeprefix("aten.")
    evid: Evidence = getattr(ev, "evidence", None) or Evidence()
    aten = evid.aten or op
    ins = ev.inputs
    mins = [s.min for s in ins if s.min is not None]
    maxs = [s.max for s in ins if s.max is not None]
    lo = min(mins) if mins else None
    hi = max(maxs) if maxs else None
    absmax = max((s.abs_max for s in ins if s.abs_max is not None), default=None)
    # an in-place op's first input is shown as it is after the op: judge finiteness from before it
    before = evid.inputs_finite is not True
    in_inf = before and any(s.posinf_count or s.neginf_count for s in ins)
    in_nan = before and any(s.nan_count for s in ins)
    out_dtype = ev.tensor.dtype if ev.tensor is not None else ""
    related_inf = ev.related is not None and ev.related.kind != "nan"
    overflow = ev.kind in ("inf", "-inf") and not in_inf and not in_nan and not ev.explicit
    zero = _zero_cause(ev, aten, evid.scalars) if not (in_inf or in_nan) else None
    squares = _squares_overflow(aten, ins) if not (in_inf or in_nan) else None
    if ev.phase == Phase.BACKWARD.value:
        return _backward_hint(
            ev, evid, zero, squares, absmax, in_inf, in_nan, related_inf, overflow, out_dtype
        )
    if evid.empty_mean and ev.kind == "nan" and not in_nan:
        return evid.empty_mean
    if aten in ("log", "log2", "log10", "log_") and lo is not None and not in_nan and lo < 0:
        return f"log of negative input (min {lo:.3g})"
    if op == "log1p" and lo is not None and lo <= -1:
        return f"log1p of input <= -1 (min {lo:.3g})"
    if op in ("sqrt", "rsqrt") and lo is not None and lo < 0:
        return f"{op} of negative input (min {lo:.3g})"
    if op in ("pow",) and lo is not None and lo < 0 and ev.kind == "nan":
        return f"pow of negative base with a fractional exponent (min {lo:.3g})"
    if zero is not None:
        what, _ = zero
        if ev.phase == Phase.OPTIMIZER.value and aten.startswith("addcdiv"):
            return (
                f"the update makes {what}; an Adam-type update divides by sqrt(exp_avg_sq) + eps, which is 0 "
                "where a gradient was 0 and eps is 0: set eps > 0"
            )
        if aten.startswith("log"):
            return f"{what}; log(0) = -inf: add eps (log(x + eps)) or clamp the input"
        return f"{what}; add eps or make it safe first: torch.where(d != 0, d, 1)"
    if aten.startswith("div") and overflow and len(ins) > 1 and ins[1].abs_min is not None:
        return (
            f"{out_dtype} max is {_DTYPE_MAX.get(out_dtype, '?')}: the division overflowed (numerator up to "
            f"{_fmt(ins[0].abs_max or 0.0)}, smallest nonzero |denominator| {_fmt(ins[1].abs_min)}); "
            "clamp the denominator away from 0"
        )
    if op in ("acos", "asin"):
        return (
            f"{op} of input outside [-1, 1] (range [{lo:.3g}, {hi:.3g}])"
            if lo is not None and hi is not None
            else f"{op} outside [-1, 1]"
        )
    if op in ("_softmax", "_log_softmax", "softmax", "log_softmax") and ev.kind == "nan" and not in_nan:
        if ev.related is not None and ev.related.explicit:
            return "softmax over a row whose entries are all -inf (a fully masked row)"
        if in_inf and any(s.posinf_count for s in ins):
            return f"softmax over a row holding +Inf: exp(inf - inf) is NaN ({sum(s.posinf_count for s in ins)} +Inf in the input)"
        return "softmax over a row whose entries are all -inf (a fully masked row)"
    if op == "exp" and overflow and hi is not None:
        limit = _EXP_LIMIT.get(out_dtype, 88.72)
        return (
            f"exp overflows {out_dtype} above ~{limit}: the largest input was {_fmt(hi)}; subtract the "
            "max first (softmax/logsumexp do) or clamp the input"
        )
    if op in _CAST_OPS and overflow and out_dtype in _DTYPE_MAX:
        big = f" of values up to {_fmt(absmax)}" if absmax is not None else ""
        return (
            f"{out_dtype} max is {_DTYPE_MAX[out_dtype]}: the cast to {out_dtype}{big} overflowed to Inf; "
            "scale or clamp before casting, or keep float32 / use bfloat16"
        )
    if squares is not None:
        return squares
    if overflow and out_dtype == "float16":
        big = f" (inputs up to {_fmt(absmax)})" if absmax is not None else ""
        return (
            f"float16 max is 65504: {op} overflowed{big}; use bfloat16, scale down, or compute it in float32"
        )
    if overflow and out_dtype in _DTYPE_MAX:
        big = f" (inputs up to {_fmt(absmax)})" if absmax is not None else ""
        return f"{out_dtype} max is {_DTYPE_MAX[out_dtype]}: {op} overflowed{big}; scale the values down"
    if ev.kind == "nan" and (in_inf or ev.cause is not None):
        return f"{op} made NaN from an Inf input (inf-inf, inf*0 or inf/inf)" + (
            "; the Inf was born earlier (see related)" if related_inf else ""
        )
    if in_nan or in_inf:
        return f"{op} produced {ev.kind} from a non-finite input"
    big = f" (inputs up to {_fmt(absmax)})" if absmax is not None else ""
    return f"{op} produced {'NaN' if ev.kind == 'nan' else ev.kind} from finite inputs{big}"


def _squares_overflow(aten: str, ins: tuple[TensorStats, ...]) -> str | None:
    """Inputs whose squares overflow the dtype an op accumulates a variance / sum of squares in."""
    what = _SQUARING.get(aten)
    if what is None or not ins or ins[0].abs_max is None:
        return None
    dtype = ins[0].dtype
    acc = "float32" if dtype in ("float16", "bfloat16") else dtype
    top = _DTYPE_MAXF.get(acc)
    big = float(ins[0].abs_max)
    if top is None or big * big <= top:
        return None
    return (
        f"inputs up to {_fmt(big)}; {acc} {what} overflows (squares up to {_fmt(big * big)} > max "
        f"{_DTYPE_MAX[acc]}): {aten} cannot {'take the norm of' if what == 'sum of squares' else 'normalise'} "
        "values this large; find what made them (the module calls before it) or scale them down"
    )


def _backward_hint(
    ev: Any,
    evid: Evidence,
    zero: tuple[str, TensorStats | None] | None,
    squares: str | None,
    absmax: float | None,
    in_inf: bool,
    in_nan: bool,
    related_inf: bool,
    overflow: bool,
    out_dtype: str,
) -> str:
    node = ev.op
    if ev.kind == "nan" and (in_inf or ev.cause is not None):
        return f"{node} turned an Inf into NaN (inf*0 or inf-inf)"
    spectral = _SPECTRAL.get(node)
    if spectral is not None:
        fn = "eigh" if "Eigh" in node else ("eig" if "Eig" in node else "svd")
        diff = "1/(λi - λj)" if spectral == "eigenvalues" else "1/(σi² - σj²)"
        seen = (
            f": the smallest gap is {_fmt(evid.gap[0])} (between {_fmt(evid.gap[1])} and {_fmt(evid.gap[2])})"
            if evid.gap is not None
            else ""
        )
        return (
            f"the gradient of {fn} divides by gaps between {spectral} ({diff}), infinite where two are "
            f"equal: degenerate or near-equal {spectral}{seen}; break the tie (add a small distinct "
            f"diagonal, A + eps * diag(arange(n))) or make the loss depend only on the {spectral}"
        )
    if not evid.custom:
        if node.startswith("Sqrt"):
            return "sqrt at 0 in backward: add eps inside the sqrt (sqrt(x + eps))"
        if node.startswith(("Norm", "LinalgVectorNorm")):
            return "norm of an all-zero vector in backward: add eps (sqrt(sum(x**2) + eps))"
        if node.startswith("Pow"):
            return "pow with a fractional exponent at 0 in backward: add eps to the base"
        if node.startswith("Log"):
            return "log at 0 in backward (the gradient is 1/x): clamp the input or add eps"
        if node.startswith("Div"):
            return (
                "division by zero in backward: the gradient of x / d is NaN/Inf where d == 0 even when "
                "torch.where or a mask drops that forward result (0 * inf = NaN); make the denominator "
                "safe before dividing: x / torch.where(d != 0, d, 1), or add eps"
            )
        if node.startswith(("Acos", "Asin")):
            return f"{node[:4].lower()} at +-1 in backward: clamp the input to (-1+eps, 1-eps)"
    if zero is not None:  # a custom backward (or a node named above for no reason) fed 0 to a division/log
        what, _ = zero
        who = f"the custom backward {node}" if evid.custom else node
        return (
            f"{who} computes aten.{evid.aten}: {what}; guard it in the backward (torch.where(d != 0, d, 1) "
            "or + eps); scaling the loss does not help"
        )
    if ev.kind == "nan" and related_inf:
        return f"{node} turned an Inf into NaN (inf*0 or inf-inf); the Inf was born earlier (see related)"
    if squares is not None:
        return f"{node}: {squares}"
    big = f" (inputs up to {_fmt(absmax)})" if absmax is not None else ""
    if (
        overflow
        and out_dtype in _DTYPE_MAXF
        and absmax is not None
        and absmax * absmax > _DTYPE_MAXF[out_dtype]
    ):
        # only values that large can overflow by themselves: then scaling down is the fix
        return (
            f"{out_dtype} max is {_DTYPE_MAX[out_dtype]}: {node} overflowed in backward{big}; scale the "
            "loss or gradients down"
        )
    if in_inf or in_nan:
        return f"{node} produced {ev.kind}"
    inner = f" in aten.{evid.aten}" if evid.aten else ""
    return f"{node} produced {ev.kind}{inner} from finite gradients{big}"
