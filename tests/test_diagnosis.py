"""Diagnosis II: an overflow is the origin of the NaN it becomes; no alarm without a symptom; replays
that say when a fault does not reproduce. Fault models: tests/fixtures/diag_models.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import torchdebug as td
from tests.fixtures import diag_models as dm
from tests.fixtures import models as fx
from tests.fixtures.diag_models import origin_line
from tests.test_locate import CASES as LOCATE_CASES
from tests.test_watch import SENTINEL_ONLY, _train
from torchdebug.compat import AutogradAnomalyDetector, PyTorchDebugger, debug_context


@pytest.fixture(autouse=True)
def _no_modes_left() -> Iterator[None]:
    yield
    assert torch._C._len_torch_function_stack() == 0


def _no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def _locate(model: nn.Module, x: torch.Tensor, ctx: Callable[[], Any] = contextlib.nullcontext) -> Any:
    def step() -> torch.Tensor:
        with ctx():
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss

    return td.locate_nonfinite(step, model=model)


def _f16() -> Any:
    return torch.autocast("cpu", dtype=torch.float16)


def _bf16() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


# -- 1. an Inf made by overflow is the origin, also when it becomes NaN later ------------------------
@dataclass
class Overflow:
    build: Callable[[], nn.Module]
    x: Callable[[], torch.Tensor]
    module: str
    op: str
    tag: str
    hint: str  # the exact hint (worked out from the fixture's numbers)
    noticed: tuple[str, str, str]  # (module, op, tag) where the Inf became NaN
    ctx: Callable[[], Any] = contextlib.nullcontext


# ExpOverflowNet: fc(ones(2, 4)) = 4 per unit (weights 1, bias 0); x 100 = 400 > 88.72: exp = +Inf
# everywhere; the head's weights alternate +-1, so its addmm makes inf - inf = NaN.
# MulOverflowNet: fc(x) is O(1); x 1e30 x 1e30 = O(1e60) > 3.4e38 (the first mul_ stays finite).
# HalfCastNet: fc(x) x 1e6 is O(1e6) > 65504. F16AttnNet: q = k = 4 x 100 = 400 per dim (weights 1),
# q . k = 8 x 400 x 400 = 1.28e6 > 65504 in every score: softmax of an all-+Inf row is NaN.
OVERFLOWS: dict[str, Overflow] = {
    "exp-float32": Overflow(
        dm.ExpOverflowNet,
        lambda: torch.ones(2, 4),
        "act",
        "aten.exp",
        "exp",
        "exp overflows float32 above ~88.72: the largest input was 400; subtract the max first "
        "(softmax/logsumexp do) or clamp the input",
        ("head", "aten.addmm", "head"),
    ),
    "exp-bf16-autocast": Overflow(
        dm.ExpOverflowNet,
        lambda: torch.ones(2, 4),
        "act",
        "aten.exp",
        "exp",
        "exp overflows bfloat16 above ~88.72: the largest input was 400; subtract the max first "
        "(softmax/logsumexp do) or clamp the input",
        ("head", "aten.addmm", "head"),
        _bf16,
    ),
    "inplace-mul": Overflow(
        dm.MulOverflowNet,
        lambda: torch.randn(2, 4),
        "",
        "aten.mul_",
        "mul",
        "float32 max is 3.4e38: mul_ overflowed",
        ("head", "aten.addmm", "mulhead"),
    ),
    "cast-half": Overflow(
        dm.HalfCastNet,
        lambda: torch.randn(2, 4),
        "",
        "aten._to_copy",
        "half",
        "float16 max is 65504: the cast to float16 of values up to",
        ("head", "aten.addmm", "halfhead"),
    ),
    "cast-to-float16": Overflow(
        lambda: dm.HalfCastNet(via_to=True),
        lambda: torch.randn(2, 4),
        "",
        "aten._to_copy",
        "to16",
        "float16 max is 65504: the cast to float16 of values up to",
        ("head", "aten.addmm", "halfhead"),
    ),
    "fp16-matmul": Overflow(
        dm.F16AttnNet,
        lambda: torch.ones(2, 3, 4),
        "attn",
        "aten.bmm",
        "f16attn",
        "float16 max is 65504: bmm overflowed (inputs up to 400); use bfloat16, scale down, or compute "
        "it in float32",
        ("attn", "aten._softmax", "f16softmax"),
    ),
    "fp16-autocast-matmul": Overflow(
        lambda: dm.F16AttnNet(explicit_half=False),
        lambda: torch.ones(2, 3, 4),
        "attn",
        "aten.bmm",
        "f16attn",
        "float16 max is 65504: bmm overflowed (inputs up to 400); use bfloat16, scale down, or compute "
        "it in float32",
        ("attn", "aten._softmax", "f16softmax"),
        _f16,
    ),
    "fp16-autocast-matmul-causal-mask": Overflow(
        lambda: dm.F16AttnNet(explicit_half=False, causal=True),
        lambda: torch.ones(2, 3, 4),
        "attn",
        "aten.bmm",
        "f16attn",
        "float16 max is 65504: bmm overflowed (inputs up to 400); use bfloat16, scale down, or compute "
        "it in float32",
        ("attn", "aten._softmax", "f16softmax"),
        _f16,
    ),
}


def _check_overflow(a: td.Anomaly | None, case: Overflow) -> None:
    assert a is not None, "no anomaly"
    assert (a.phase, a.module, a.op, a.kind, a.location) == (
        "forward",
        case.module,
        case.op,
        "inf",
        origin_line(case.tag),
    ), str(a)
    assert a.hint.startswith(case.hint), a.hint
    assert a.related is None
    assert a.noticed is not None, str(a)
    n_mod, n_op, n_tag = case.noticed
    assert (a.noticed.kind, a.noticed.phase, a.noticed.module, a.noticed.op, a.noticed.location) == (
        "nan",
        "forward",
        n_mod,
        n_op,
        origin_line(n_tag),
    )
    # the NaN-maker's own hint never calls its Inf input finite
    assert "finite inputs" not in a.noticed.hint and "Inf" in a.noticed.hint, a.noticed.hint
    # the printed inputs of the origin are finite, and its hint says it overflowed from them
    assert all(s.nan_count + s.posinf_count + s.neginf_count == 0 for s in a.inputs)
    text = str(a)
    assert f"  became    nan in forward of {a.noticed.where}: {n_op} at {origin_line(n_tag)}" in text
    d = json.loads(json.dumps(a.to_dict()))
    assert d["noticed"]["op"] == n_op and d["noticed"]["site"].startswith("forward of ")


@pytest.mark.parametrize("name", list(OVERFLOWS))
def test_overflow_is_the_origin_under_locate(name: str) -> None:
    torch.manual_seed(0)
    case = OVERFLOWS[name]
    model = case.build()
    assert _locate(model, case.x(), case.ctx) is None  # healthy before the fault is armed
    dm.arm(model)
    model.zero_grad()
    _check_overflow(_locate(model, case.x(), case.ctx), case)
    assert _no_hooks(model)


@pytest.mark.parametrize("name", list(OVERFLOWS))
def test_overflow_is_the_origin_under_watch(name: str) -> None:
    torch.manual_seed(0)
    case = OVERFLOWS[name]
    model = case.build()

    def before(i: int) -> None:
        if i == 2:
            dm.arm(model)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean()

    x = case.x()
    batches = lambda i: (x,)  # noqa: E731

    with pytest.raises(td.NonFiniteError) as ei:
        if case.ctx is contextlib.nullcontext:
            _train(model, batches, steps=4, before=before, loss_fn=loss_fn)
        else:
            _train_autocast(model, x, case.ctx, before)
    a = ei.value.anomaly
    assert a.step == 2 and a.detected_by == "sentinel" and a.reproducible is True
    _check_overflow(a, case)
    assert _no_hooks(model)


def _train_autocast(model: nn.Module, x: torch.Tensor, ctx: Callable[[], Any], before: Any) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(4):
            before(i)
            with ctx():
                out = model(x)
            loss = out.float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step()


# -- masks stay: an explicit -inf is never an origin ------------------------------------------------
MASKS = ["masked_fill", "full", "where", "neg_torch_inf", "buffer"]
MASK_OP = {
    "masked_fill": "aten.masked_fill",
    "full": "aten.full",
    "where": "aten.scalar_tensor",
    "neg_torch_inf": "aten.index_put_",
    "buffer": "aten.add",  # the buffer's -inf was made before the trace: the add carries it on
}


@pytest.mark.parametrize("how", MASKS)
def test_causal_masks_are_healthy(how: str) -> None:
    torch.manual_seed(0)
    model = dm.MaskedAttention(how)
    assert _locate(model, torch.randn(2, 3, 8)) is None
    mon = _train(model, lambda i: (torch.randn(2, 3, 8),), steps=3)
    assert mon.anomalies == []


@pytest.mark.parametrize("how", MASKS)
def test_fully_masked_row_names_the_softmax_not_the_mask(how: str) -> None:
    torch.manual_seed(0)
    model = dm.MaskedAttention(how, all_masked=True)
    a = _locate(model, torch.randn(2, 3, 8))
    assert a is not None
    assert (a.phase, a.module, a.op, a.kind, a.location) == (
        "forward",
        "",
        "aten._softmax",
        "nan",
        origin_line("maskedsoftmax"),
    )
    assert a.hint == "softmax over a row whose entries are all -inf (a fully masked row)"
    assert a.noticed is None
    assert a.related is not None and a.related.op == MASK_OP[how] and a.related.kind == "-inf"


def test_demo_model_all_padding_still_names_the_softmax() -> None:
    from torchdebug.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=16, d=16, n_layer=1, n_head=2, block=8)
    idx = torch.randint(1, 16, (2, 6))
    idx[1] = 0  # an all-padding sequence

    def step() -> torch.Tensor:
        loss = model(idx).float().logsumexp(-1).mean()
        loss.backward()
        return loss

    a = td.locate_nonfinite(step, model=model)
    assert a is not None
    assert (a.module, a.op, a.kind) == ("blocks.0.attn", "aten._softmax", "nan")
    assert a.hint == "softmax over a row whose entries are all -inf (a fully masked row)"
    assert a.related is not None and a.related.op == "aten.masked_fill"


# -- 2. no alarm without a symptom -----------------------------------------------------------------
PATTERNS = ["log_where", "sqrt_relu", "norm_zero"]


def _step_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 4)  # no exact zeros: log's backward 0/x stays finite where it is dropped


@pytest.mark.parametrize("pattern", PATTERNS)
def test_healthy_masked_patterns_are_silent_everywhere(pattern: str) -> None:
    torch.manual_seed(0)
    model = dm.MaskedNaNNet(pattern)
    x = _x()
    # the premise: the pattern makes a non-finite value inside, yet loss, gradients and weights are finite
    loss = _step_of(model, x)
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.zero_grad()
    assert td.locate_nonfinite(_step_of, model, x, model=model) is None
    det = AutogradAnomalyDetector(mode="raise", model=model)
    with det.detect_anomaly():
        _step_of(model, x)
    assert det.anomalies == []
    dbg = PyTorchDebugger(td.DebugConfig(enable_anomaly_detection=True, anomaly_detection_mode="raise"))
    with dbg.debug_context("step", model=model) as info:
        _step_of(model, x)
    assert not info.anomaly_detected and dbg.anomalies == []
    with debug_context(td.DebugLevel.BASIC, model=model) as seed_dbg:  # warns on an anomaly: errors here
        _step_of(model, x)
    assert seed_dbg.anomalies == []
    mon = _train(model, lambda i: (x,), steps=3)
    assert mon.anomalies == [] and mon.counters["anomaly_steps"] == 0
    assert _no_hooks(model)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_masked_pattern_beside_a_real_fault_names_the_real_fault(pattern: str) -> None:
    torch.manual_seed(0)
    model = dm.MaskedNaNNet(pattern)
    x = _x()
    dm.arm(model)
    expected = ("forward", "", "aten.log", "nan", origin_line("realfault"))
    a = td.locate_nonfinite(_step_of, model, x, model=model)
    assert a is not None and (a.phase, a.module, a.op, a.kind, a.location) == expected, str(a)
    assert a.hint.startswith("log of negative input")
    det = AutogradAnomalyDetector(mode="detect", model=model)
    with det.detect_anomaly():
        _step_of(model, x)
    (b,) = det.anomalies
    assert (b.phase, b.module, b.op, b.kind, b.location) == expected
    model = dm.MaskedNaNNet(pattern)

    def before(i: int) -> None:
        if i == 1:
            dm.arm(model)

    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: (x,), steps=3, before=before)
    c = ei.value.anomaly
    assert (c.step, c.phase, c.module, c.op, c.kind, c.location) == (1, *expected)
    assert c.reproducible is True


def test_where_gradient_trap_is_named_at_the_division() -> None:
    torch.manual_seed(0)
    model = dm.WhereDivNet()
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 1.0, 1.0]])  # zeros in d = x
    dm.arm(model)
    out = model(x)
    assert torch.isfinite(out).all()  # the forward is finite: torch.where dropped h / 0
    a = td.locate_nonfinite(_step_of, model, x, model=model)
    assert a is not None
    # d/dd (h / d) = -h / d**2 and d/dh = 1 / d at d = 0, times the 0 the where hands back: 0/0 = NaN
    assert (a.phase, a.module, a.op, a.kind, a.location) == (
        "backward",
        "",
        "DivBackward0",
        "nan",
        origin_line("wherediv"),
    )
    assert "make the denominator safe before dividing" in a.hint
    assert a.symptom.startswith("nan in the gradient of fc.")

    model = dm.WhereDivNet()

    def before(i: int) -> None:
        if i == 2:
            dm.arm(model)

    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: (x,), steps=4, before=before)
    b = ei.value.anomaly
    assert (b.step, b.phase, b.op, b.location, b.reproducible) == (
        2,
        "backward",
        "DivBackward0",
        origin_line("wherediv"),
        True,
    )


@pytest.mark.parametrize(
    ("fn", "node", "kind", "tag", "hint"),
    [
        # sqrt(z) at z = 0: dz = g / (2 sqrt(0)); g = 2 out / n = 0 there: 0/0 = NaN
        ("sqrt", "SqrtBackward0", "nan", "bsqrt", "sqrt at 0 in backward"),
        # z ** 0.5 at 0: 0.5 * 0 ** -0.5 = +Inf first (then x 0 = NaN inside the same node)
        ("pow", "PowBackward0", "inf", "bpow", "pow with a fractional exponent at 0"),
        # acos(1 - z) at z = 0: -1 / sqrt(1 - 1) = -Inf
        ("acos", "AcosBackward0", "inf", "bacos", "acos at +-1 in backward"),
    ],
)
def test_boundary_backward_reaching_the_weights_names_its_node(
    fn: str, node: str, kind: str, tag: str, hint: str
) -> None:
    torch.manual_seed(0)
    model = dm.BoundaryNet(fn)
    x = torch.randn(2, 4)
    assert td.locate_nonfinite(_step_of, model, x, model=model) is None
    dm.arm(model)
    model.zero_grad()
    a = td.locate_nonfinite(_step_of, model, x, model=model)
    assert a is not None
    assert (a.phase, a.module, a.op, a.kind, a.location) == ("backward", "", node, kind, origin_line(tag))
    assert a.hint.startswith(hint) and a.noticed is None  # NaN made inside the same node is not news
    assert a.symptom.startswith(f"{a.symptom.split()[0]} in the gradient of fc.")


def test_untraced_nonfinite_values_before_the_block_are_not_blamed() -> None:
    model = fx.MLP()
    with torch.no_grad():
        model.fc1.weight.grad = torch.full_like(model.fc1.weight, float("nan"))  # left over, not made here
    det = AutogradAnomalyDetector(mode="raise", model=model)
    with det.detect_anomaly():
        model(torch.randn(2, 8)).sum()  # forward only: nothing reaches a gradient
    assert det.anomalies == []


def test_forward_only_block_reports_a_nan_reaching_the_models_output() -> None:
    model = fx.DeepLogNet()
    model.blocks[1].act.shift = -5.0
    det = AutogradAnomalyDetector(mode="detect", model=model)
    with det.detect_anomaly():
        model(torch.randn(6, 8))
    (a,) = det.anomalies
    assert (a.module, a.op, a.symptom) == ("blocks.1.act", "aten.log", "nan in the model's output")


# -- 3. replay that knows when a fault does not reproduce ------------------------------------------
def test_one_off_corruption_is_reported_as_not_reproducible() -> None:
    torch.manual_seed(0)
    model = fx.MLP()
    calls = 0

    def corrupt_once(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        nonlocal calls
        calls += 1
        if calls != 3:  # the third forward (step 2) only: the replays are later calls
            return None
        out = out.clone()
        out[0, 0] = float("nan")
        return out

    handle = model.fc1.register_forward_hook(corrupt_once)
    try:
        with pytest.raises(td.NonFiniteError) as ei:
            _train(model, lambda i: (torch.randn(2, 8),), steps=5)
    finally:
        handle.remove()
    a = ei.value.anomaly
    assert calls == 5  # steps 0-2, then two replays of step 2
    assert a.reproducible is False
    assert (a.step, a.kind, a.module, a.op, a.location, a.parameter) == (2, "nan", None, None, None, None)
    assert a.noticed is None and a.related is None
    # what was observed, in plain words: the loss and every gradient (the NaN was in fc1's output)
    names = "fc1.weight, fc1.bias, fc2.weight, fc2.bias"
    assert a.symptom == f"the loss (nan) and the gradients of {names} held NaN/Inf in the step"
    assert a.hint.startswith(
        f"not reproducible: in the step, the loss (nan) and the gradients of {names} held NaN/Inf; "
        "replayed twice with the same batch, weights, buffers and RNG state, the loss and every "
        "gradient came out finite. Nothing tried reproduced it: a nondeterministic kernel or race, a "
        "hook or state that changed between the step and the replay, or loss code the replay did not "
        "capture"
    )
    assert "hardware" not in a.hint  # said only by a replay on another rank
    assert a.cause is not None and a.cause.verdict == "unknown" and a.cause.replays == 2
    assert a.summary().startswith("nan not reproducible: ")
    text = str(a)
    assert "origin not traced" not in text and "module    no traced origin" in text
    d = json.loads(json.dumps(a.to_dict()))
    assert d["reproducible"] is False and d["module"] is None


def test_not_reproducible_is_stored_and_reported(tmp_path: Any) -> None:
    from torchdebug.store import open_run
    from torchdebug.views.report._format import anomaly_rows

    torch.manual_seed(0)
    model = fx.MLP()
    calls = 0

    def corrupt_once(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        nonlocal calls
        calls += 1
        return out * float("nan") if calls == 2 else None

    model.fc2.register_forward_hook(corrupt_once)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with td.watch(model, opt, run=str(tmp_path), config=SENTINEL_ONLY, policy="skip") as mon:
        for _ in range(3):
            with warnings_ok():
                loss = model(torch.randn(2, 8)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step()
        run_dir = mon.run_dir
    (doc,) = open_run(run_dir).anomalies()
    assert doc["reproducible"] is False and doc["module"] is None and doc["step"] == 1
    rows = dict(anomaly_rows(doc))
    assert rows["module"] == "no traced origin"
    assert rows["reproducible"] == "no: finite when the step was replayed twice"


@contextlib.contextmanager
def warnings_ok() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", td.TorchDebugWarning)
        yield


@pytest.mark.parametrize(
    "name",
    [n for n, c in LOCATE_CASES.items() if c.breaker is None and c.phase not in ("input", "parameter")],
)
def test_deterministic_faults_are_reproducible(name: str) -> None:
    case = LOCATE_CASES[name]
    torch.manual_seed(0)
    model = case.build()
    inp = case.inputs()
    with pytest.raises(td.NonFiniteError) as ei:
        _train(model, lambda i: inp, steps=2, loss_fn=lambda out: case.loss(out, inp))
    a = ei.value.anomaly
    assert a.reproducible is True and a.op == case.op, str(a)


def test_gradient_sink_hooks_are_removed_on_exit() -> None:
    from torchdebug.nonfinite.locate import Tracer

    model = fx.MLP()
    x = torch.randn(2, 8)
    tracer = Tracer(model)
    with tracer:
        model(x).pow(2).mean().backward()
    assert tracer.symptom is None
    model.zero_grad()
    # the same graph nodes (AccumulateGrad is kept per parameter) see a NaN gradient after the trace:
    # a leftover pre-hook would record it on the finished tracer
    (model(x) * float("nan")).sum().backward()
    assert tracer.symptom is None and tracer.internal_errors == []
    assert _no_hooks(model)
