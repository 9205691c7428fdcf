"""How often torch.autograd.detect_anomaly() and torchdebug.locate_nonfinite name the true origin line.

Runs every case of the fault-injection suite (tests/test_locate.py CASES plus the loss-code, float16
and optimizer cases) once under each tool. detect_anomaly counts as right when the true origin line
appears in the forward traceback it prints (anywhere in it, a generous reading); locate_nonfinite
when its ``location`` is exactly that line. Cases whose origin is the batch or a parameter have no
line: there the question is whether the tool says so (detect_anomaly never does).

    python benchmarks/fault_suite.py
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
        if line is None:
            da_ok = False  # it cannot say "the batch" / "this parameter"
        else:
            path, lineno = line.rsplit(":", 1)
            da_ok = raised and f'{os.path.abspath(path)}", line {lineno}' in text
        for p in model.parameters():
            p.grad = None
        a = td.locate_nonfinite(step, *args, model=model)
        td_ok = a is not None and (a.location == line if line else a.phase == phase)
        rows.append((name, raised, da_ok, td_ok, a.summary() if a is not None else "none"))
    w = max(len(r[0]) for r in rows)
    print(f"{'case':<{w}}  detect_anomaly  locate_nonfinite")
    for name, raised, da_ok, td_ok, _ in rows:
        da = ("origin line" if da_ok else "other line") if raised else "no error"
        print(f"{name:<{w}}  {da:<14}  {'exact' if td_ok else 'WRONG'}")
    n = len(rows)
    print(
        f"\n{n} cases: detect_anomaly points at the origin line in {sum(r[2] for r in rows)}, "
        f"raises at all in {sum(r[1] for r in rows)}; locate_nonfinite exact in {sum(r[3] for r in rows)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
