"""``locate_nonfinite`` of a compiled callable judges the compiled run's values: eager tracing of a
bf16 loss can make a -Inf (a softmax probability that underflows bfloat16, then its log) that the
compiled kernels, computing in float32 and rounding once, never make. That is said as a disagreement,
not located as the run's NaN/Inf; a loss the compiled run makes non-finite too is located as before.

The compiler here is a backend of ``torch.compile`` that runs the captured graph in float32 and rounds
its outputs to the input's dtype once, as inductor's fused kernels do (inductor itself needs minutes to
build a CPU kernel on a shared test machine).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import torchdebug as td
from tests.fixtures.models import origin_line

LOG_LINE = origin_line("bf16_log", __file__)


def fp32_kernels(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Compute in float32, round the outputs to bfloat16 once."""

    def run(*args: Any) -> Any:
        up = [a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a for a in args]
        outs = gm(*up)
        return type(outs)(o.to(torch.bfloat16) if o.is_floating_point() else o for o in outs)

    return run


def nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, -1)
    return -torch.log(probs).gather(1, target[:, None]).mean()  # ORIGIN:bf16_log


def _batch(gap: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.zeros(4, 3, dtype=torch.bfloat16)
    logits[:, 0] = gap  # the other classes' probability: exp(-gap)
    return logits, torch.tensor([1, 0, 2, 0])


def test_a_compiled_loss_finite_where_its_eager_trace_is_not_is_a_disagreement_not_an_anomaly() -> None:
    # exp(-100) = 3.7e-44: below bfloat16's smallest subnormal (9.2e-41), so eagerly softmax's bf16
    # output is 0 and its log -Inf; in float32 (a subnormal) log gives -100: the compiled loss is 50
    torch._dynamo.reset()
    loss_fn = torch.compile(nll, backend=fp32_kernels)
    logits, target = _batch(100.0)
    assert torch.isfinite(loss_fn(logits, target)) and not torch.isfinite(nll(logits, target))
    with pytest.warns(td.TorchDebugWarning) as said:
        assert td.locate_nonfinite(loss_fn, logits, target) is None
    (w,) = said
    assert str(w.message) == (
        "torchdebug: locate_nonfinite ran the compiled callable eagerly to trace it, and the eager run "
        f"made -inf (aten.log at {LOG_LINE}), but the compiled run is finite: eager and compiled numerics "
        "differ here, and the compiled run is the one that trains; nothing to locate"
    )


def test_a_compiled_loss_non_finite_in_the_compiled_run_too_is_located() -> None:
    # exp(-1e4) underflows float32 as well: both runs make -Inf at the log
    torch._dynamo.reset()
    loss_fn = torch.compile(nll, backend=fp32_kernels)
    logits, target = _batch(1e4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = td.locate_nonfinite(loss_fn, logits, target)
    assert a is not None and (a.phase, a.op, a.kind, a.location) == ("forward", "aten.log", "-inf", LOG_LINE)


def test_the_compiled_run_is_undone_so_the_step_runs_once() -> None:
    """A compiled model's step with an update: after locate, the weights, gradients and the optimizer's
    state are those of one step (the traced one), as without the compiled run before it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(net.state_dict())
    model = torch.compile(net, backend="eager")
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    x = torch.randn(4, 3)

    def step(m: Any, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert td.locate_nonfinite(step, model, opt, model=model, optimizer=opt) is None
    step(ref, ref_opt)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert opt.state_dict()["state"][0]["step"] == ref_opt.state_dict()["state"][0]["step"] == 1
