"""Hints derived from the evidence: each op is fed its real failing inputs (tiny models, CPU) and the
hint's key facts (which inputs were 0, the magnitudes that overflowed, the eigenvalue gap) are exact."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

import torchdebug as td
from tests.fixtures import models as fx

_THIS = os.path.abspath(__file__)


def origin_line(tag: str) -> str:
    return fx.origin_line(tag, _THIS)


def _locate(model: nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None) -> td.Anomaly:
    def step() -> torch.Tensor:
        loss = model(x).float().sum()
        loss.backward(gradient=grad)
        return loss

    a = td.locate_nonfinite(step, model=model)
    assert a is not None, "no anomaly"
    return a


class Normed(nn.Module):
    """LayerNorm of the input times a gain: with inputs near 1e23 its float32 variance overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.ln = nn.LayerNorm(4)  # its bias is all zeros: a zero input that does not matter here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x * self.gain)  # ORIGIN:layernorm


def test_layernorm_over_huge_inputs_says_the_variance_overflows_not_zero() -> None:
    # one exact 0 among the inputs (as dropout leaves) and an all-zero bias: neither is the cause
    x = torch.tensor([[1e23, -1e23, 0.0, 2e23]])
    a = _locate(Normed(), x)
    assert (a.phase, a.module, a.op, a.kind, a.location) == (
        "forward",
        "ln",
        "aten.native_layer_norm",
        "nan",
        origin_line("layernorm"),
    )
    # float32(2e23) ** 2 = 4e46 > 3.4e38: the variance (a mean of squares) overflows
    assert a.hint == (
        "inputs up to 2e+23; float32 variance overflows (squares up to 4e+46 > max 3.4e38): "
        "native_layer_norm cannot normalise values this large; find what made them (the module calls "
        "before it) or scale them down"
    )
    assert "zero" not in a.hint


def test_layernorm_in_half_precision_accumulates_in_float32() -> None:
    # float16 inputs up to 60000 square to 3.6e9: fine in the float32 the variance is kept in, so a
    # NaN there is not blamed on the variance
    from torchdebug.nonfinite.hints import _squares_overflow
    from torchdebug.stats import analyze_tensor

    small = analyze_tensor(torch.tensor([60000.0, 0.0], dtype=torch.float16))
    assert _squares_overflow("native_layer_norm", (small,)) is None
    # 65504 ** 2 = 4.29e9 < 3.4e38 even at float16's max: never an overflow of the variance
    huge = analyze_tensor(torch.tensor([3e19, 0.0], dtype=torch.float32))
    assert _squares_overflow("var", (huge,)) == (
        "inputs up to 3e+19; float32 variance overflows (squares up to 9e+38 > max 3.4e38): var cannot "
        "normalise values this large; find what made them (the module calls before it) or scale them down"
    )


class ZeroDivGrad(torch.autograd.Function):
    """Doubles its input; the backward divides by a tensor it saved, which is all zeros here."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(d)
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (d,) = ctx.saved_tensors
        return g / d, None


class SafeScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.ones(2, 4)
        d[1, 2] = 0.0  # one exact zero
        return ZeroDivGrad.apply(self.fc(x), d)  # ORIGIN:customdiv


def test_custom_backward_dividing_by_exact_zero_is_not_called_an_overflow() -> None:
    torch.manual_seed(0)
    a = _locate(SafeScale(), torch.randn(2, 4))
    assert (a.phase, a.module, a.op, a.kind, a.location) == (
        "backward",
        "",
        "ZeroDivGradBackward",
        "inf",
        origin_line("customdiv"),
    )
    # the incoming gradient is all ones (sum), so 1 / 0 = +Inf at the one zero of d (1 of 8 values)
    assert a.hint == (
        "the custom backward ZeroDivGradBackward computes aten.div: division by zero: the denominator "
        "holds exact zeros (1 of 8 values is exactly 0); guard it in the backward "
        "(torch.where(d != 0, d, 1) or + eps); scaling the loss does not help"
    )
    assert "overflow" not in a.hint


def test_custom_backward_of_the_fixture_names_all_zeros() -> None:
    torch.manual_seed(0)
    a = _locate(fx.CustomFnNet(), torch.randn(3, 4))
    # BadGrad's backward is g / zeros_like(g): the (3, 4) denominator is all 12 zeros
    assert a.hint.startswith(
        "the custom backward BadGradBackward computes aten.div: division by zero: the denominator holds "
        "exact zeros (all 12 values are exactly 0)"
    ), a.hint


class Spectral(nn.Module):
    """Eigenvectors of a symmetric matrix whose eigenvalues are 1, 1 and 2 (a repeated one)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.diag(x) + (self.w + self.w.T) / 2
        _, vecs = torch.linalg.eigh(a)  # ORIGIN:eigh
        return vecs


def test_eigh_backward_names_the_degenerate_eigenvalues_and_their_gap() -> None:
    a = _locate(Spectral(), torch.tensor([1.0, 1.0, 2.0]))
    assert (a.phase, a.op, a.location) == ("backward", "LinalgEighBackward0", origin_line("eigh"))
    # eigenvalues 1, 1, 2: the gradient's 1/(λi - λj) for the two 1s is 1/0; the smallest gap is 0
    assert a.hint == (
        "the gradient of eigh divides by gaps between eigenvalues (1/(λi - λj)), infinite where two are "
        "equal: degenerate or near-equal eigenvalues: the smallest gap is 0 (between 1 and 1); break the "
        "tie (add a small distinct diagonal, A + eps * diag(arange(n))) or make the loss depend only on "
        "the eigenvalues"
    )


class Op(nn.Module):
    """``fn(x * w)`` for a weight of ones: the op sees the input's values as they are."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x * self.w)


def test_negative_power_of_zero_names_the_zero_base() -> None:
    a = _locate(Op(lambda h: h.pow(-0.5)), torch.tensor([4.0, 0.0, 1.0, 9.0]))  # ORIGIN:pow
    assert (a.phase, a.op, a.kind, a.location) == ("forward", "aten.pow", "inf", origin_line("pow"))
    # 0 ** -0.5 = +Inf at the one zero (1 of 4)
    assert a.hint == (
        "pow(x, -0.5) of 0: the base holds exact zeros (1 of 4 values is exactly 0); add eps or make it "
        "safe first: torch.where(d != 0, d, 1)"
    )


def test_log_of_zero_counts_the_zeros() -> None:
    a = _locate(Op(torch.log), torch.tensor([0.0, 0.0, 1.0, 2.0]))
    assert (a.op, a.kind) == ("aten.log", "-inf")
    assert a.hint == (
        "log of 0: the input holds exact zeros (2 of 4 values are exactly 0); log(0) = -inf: add eps "
        "(log(x + eps)) or clamp the input"
    )


def test_division_by_a_zero_denominator_names_it() -> None:
    torch.manual_seed(0)
    a = _locate(fx.ZeroDivNet(), torch.zeros(3, 4))
    # relu(fc(0)) * 0 = 0 everywhere, and so is its row sum: 0/0 in all 3 denominators
    assert (a.op, a.kind) == ("aten.div", "nan")
    assert a.hint.startswith(
        "0/0: the denominator holds exact zeros (all 3 values are exactly 0); add eps"
    ), a.hint


def test_a_zero_input_is_not_blamed_where_the_op_is_not_singular_at_zero() -> None:
    # acos(x) is NaN outside [-1, 1]; the zero among its inputs is beside the point
    a = _locate(Op(torch.acos), torch.tensor([0.0, 3.0, 0.5, -0.5]))
    assert a.hint == "acos of input outside [-1, 1] (range [-0.5, 3])"


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 1e10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w  # ORIGIN:scaled


def test_backward_overflow_of_large_gradients_says_scale_down_with_magnitudes() -> None:
    # the loss is finite (4 x 1e10 x 1e10 = 4e20); backward with gradient 1e30:
    # d/dw = 1e30 x x = 1e30 x 1e10 = 1e40 > 3.4e38
    a = _locate(Scaled(), torch.full((4,), 1e10), grad=torch.tensor(1e30))
    assert (a.phase, a.op, a.kind, a.location) == ("backward", "MulBackward0", "inf", origin_line("scaled"))
    assert a.hint == (
        "float32 max is 3.4e38: MulBackward0 overflowed in backward (inputs up to 1e+30); scale the loss "
        "or gradients down"
    )


def test_division_by_a_tiny_nonzero_denominator_is_an_overflow_with_its_magnitudes() -> None:
    # no zero anywhere: 1e10 / 1e-30 = 1e40 > 3.4e38 overflows float32 (the other quotients are finite)
    a = _locate(Op(lambda h: h / torch.full_like(h, 1e-30)), torch.tensor([1e10, 1.0, 2.0, 3.0]))
    assert (a.op, a.kind) == ("aten.div", "inf")
    assert a.hint == (
        "float32 max is 3.4e38: the division overflowed (numerator up to 1e+10, smallest nonzero "
        "|denominator| 1e-30); clamp the denominator away from 0"
    )
