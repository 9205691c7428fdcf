"""How often torch.autograd.detect_anomaly() and torchdebug.locate_nonfinite name the true origin line.

Runs every case of the fault-injection suite (tests/test_locate.py CASES plus the loss-code, float16
and optimizer cases, and the diagnosis-II cases of tests/fixtures/diag_models.py: overflows that
become NaN later, fully masked softmaxes, the where-gradient trap, sqrt/pow/acos at their boundary)
once under each tool. detect_anomaly counts as right when the true origin line appears in the
forward traceback it prints (anywhere in it, a generous reading); locate_nonfinite when its
``location`` is exactly that line. Cases whose origin is the batch or a parameter have no line:
there the question is whether the tool says so (detect_anomaly never does). Healthy cases (masks,
and code that makes a NaN/Inf on purpose and drops it: loss, gradients and weights stay finite)
count as right when the tool stays silent.

    python benchmarks/fault_suite.py
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fixtures import diag_models as dm
from tests.fixtures import models as fx
from tests.fixtures.models import origin_line
from tests.test_locate import CASES

import torchdebug as td

Case = tuple[str, Callable[..., Any], tuple, Any, "str | None", str]


def _cases() -> list[Case]:
    """(name, step function, its args (the batch), the model, expected 'path:line' or None, phase)."""
    out = []
    for name, case in CASES.items():
        torch.manual_seed(0)
        model = case.build()
        if case.breaker:
            case.breaker(model)
        inp = case.inputs()

        def step(*batch: Any, case: Any = case, model: Any = model) -> Any:
            loss = case.loss(model(*batch), batch)
            loss.backward()
            return loss

        out.append((name, step, inp, model, origin_line(case.tag) if case.tag else None, case.phase))
    torch.manual_seed(0)
    mlp = fx.MLP()
    x = torch.randn(4, 8)
    out.append(
        (
            "handwritten-loss",
            lambda b: fx.handwritten_loss(mlp(b)).backward(),
            (x,),
            mlp,
            origin_line("loss"),
            "forward",
        )
    )
    out.append(
        (
            "loss-backward-sqrt",
            lambda b: fx.distance_loss(mlp(b)).backward(),
            (x,),
            mlp,
            origin_line("lossbwd"),
            "backward",
        )
    )
    half = fx.Half()
    xh = torch.full((2, 4), 100.0)

    def f16(b: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = half(b).float().mean()
        loss.backward()

    out.append(("float16-overflow", f16, (xh,), half, origin_line("f16"), "forward"))
    out += _diag_cases()
    return out


HEALTHY = "healthy"  # the phase of a case where the right answer is silence


def _diag_step(model: Any, ctx: Callable[[], Any] | None = None) -> Callable[..., Any]:
    def step(b: torch.Tensor) -> Any:
        with ctx() if ctx is not None else contextlib.nullcontext():
            out = model(b)
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss

    return step


def _diag_cases() -> list[Case]:
    """Diagnosis II: overflows, masks, healthy masked NaN patterns, backward boundaries."""
    f16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    armed: list[tuple[str, Callable[[], Any], torch.Tensor, Any, str, str]] = [
        ("overflow-exp", dm.ExpOverflowNet, torch.ones(2, 4), None, "exp", "forward"),
        ("overflow-exp-bf16-autocast", dm.ExpOverflowNet, torch.ones(2, 4), bf16, "exp", "forward"),
        ("overflow-inplace-mul", dm.MulOverflowNet, torch.randn(2, 4), None, "mul", "forward"),
        ("overflow-cast-half", dm.HalfCastNet, torch.randn(2, 4), None, "half", "forward"),
        (
            "overflow-cast-to-float16",
            lambda: dm.HalfCastNet(True),
            torch.randn(2, 4),
            None,
            "to16",
            "forward",
        ),
        ("overflow-fp16-matmul", dm.F16AttnNet, torch.ones(2, 3, 4), None, "f16attn", "forward"),
        (
            "overflow-fp16-autocast-matmul-masked",
            lambda: dm.F16AttnNet(False, causal=True),
            torch.ones(2, 3, 4),
            f16,
            "f16attn",
            "forward",
        ),
        (
            "where-gradient-trap",
            dm.WhereDivNet,
            torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 1.0, 1.0]]),
            None,
            "wherediv",
            "backward",
        ),
        (
            "boundary-sqrt-backward",
            lambda: dm.BoundaryNet("sqrt"),
            torch.randn(2, 4),
            None,
            "bsqrt",
            "backward",
        ),
        (
            "boundary-pow0.5-backward",
            lambda: dm.BoundaryNet("pow"),
            torch.randn(2, 4),
            None,
            "bpow",
            "backward",
        ),
        (
            "boundary-acos-backward",
            lambda: dm.BoundaryNet("acos"),
            torch.randn(2, 4),
            None,
            "bacos",
            "backward",
        ),
    ]
    out: list[Case] = []
    for name, build, x, ctx, tag, phase in armed:
        torch.manual_seed(0)
        model = build()
        dm.arm(model)
        out.append((name, _diag_step(model, ctx), (x,), model, dm.origin_line(tag), phase))
    for how in ("masked_fill", "full", "where", "neg_torch_inf"):
        torch.manual_seed(0)
        model = dm.MaskedAttention(how, all_masked=True)
        out.append(
            (
                f"fully-masked-softmax-{how}",
                _diag_step(model),
                (torch.randn(2, 3, 8),),
                model,
                dm.origin_line("maskedsoftmax"),
                "forward",
            )
        )
    torch.manual_seed(1)
    x = torch.randn(4, 4)  # no exact zeros
    for pattern in ("log_where", "sqrt_relu", "norm_zero"):
        torch.manual_seed(0)
        model = dm.MaskedNaNNet(pattern)
        out.append((f"healthy-{pattern}", _diag_step(model), (x,), model, None, HEALTHY))
        torch.manual_seed(0)
        model = dm.MaskedNaNNet(pattern)
        dm.arm(model)
        out.append(
            (f"{pattern}+real-fault", _diag_step(model), (x,), model, dm.origin_line("realfault"), "forward")
        )
    for how in ("masked_fill", "full", "where", "neg_torch_inf"):
        torch.manual_seed(0)
        model = dm.MaskedAttention(how)
        out.append(
            (f"healthy-causal-mask-{how}", _diag_step(model), (torch.randn(2, 3, 8),), model, None, HEALTHY)
        )
    return out


def _detect_anomaly(step: Callable[..., Any], args: tuple) -> tuple[bool, str]:
    """(raised?, the forward traceback text it printed)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                step(*args)
        except RuntimeError as exc:
            text = "\n".join(str(w.message) for w in caught)
            return True, text + "\n" + str(exc)
    return False, ""


def main() -> int:
    rows = []
    for name, step, args, model, line, phase in _cases():
        raised, text = _detect_anomaly(step, args)
        healthy = phase == HEALTHY
        if healthy:
            da_ok = not raised
        elif line is None:
            da_ok = False  # it cannot say "the batch" / "this parameter"
        else:
            path, lineno = line.rsplit(":", 1)
            da_ok = raised and f'{os.path.abspath(path)}", line {lineno}' in text
        for p in model.parameters():
            p.grad = None
        a = td.locate_nonfinite(step, *args, model=model)
        found = a is not None and (a.location == line if line else a.phase == phase)
        td_ok = a is None if healthy else found
        rows.append((name, healthy, raised, da_ok, td_ok, a.summary() if a is not None else "none"))
    w = max(len(r[0]) for r in rows)
    print(f"{'case':<{w}}  detect_anomaly      locate_nonfinite")
    for name, healthy, raised, da_ok, td_ok, _ in rows:
        if healthy:
            da = "silent" if not raised else "FALSE ALARM"
            tdv = "silent" if td_ok else "FALSE ALARM"
        else:
            da = ("origin line" if da_ok else "other line") if raised else "no error"
            tdv = "exact" if td_ok else "WRONG"
        print(f"{name:<{w}}  {da:<18}  {tdv}")
    faults = [r for r in rows if not r[1]]
    healthy_rows = [r for r in rows if r[1]]
    print(
        f"\n{len(faults)} faults: detect_anomaly points at the origin line in {sum(r[3] for r in faults)}, "
        f"raises at all in {sum(r[2] for r in faults)}; locate_nonfinite exact in {sum(r[4] for r in faults)}"
    )
    print(
        f"{len(healthy_rows)} healthy cases: detect_anomaly silent in {sum(r[3] for r in healthy_rows)}, "
        f"locate_nonfinite silent in {sum(r[4] for r in healthy_rows)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
