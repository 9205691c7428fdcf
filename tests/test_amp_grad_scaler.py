"""fp16 autocast + GradScaler: ordinary overflow steps are skipped steps, NaN and collapse are anomalies.

The stored numbers are the true ones: non-finite gradient norms and counts on overflow steps,
unscaled norms on finite steps.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchdebug as td
from tests.fixtures.models import origin_line
from tests.fixtures.stack_models import PATH, CausalAttention, Steep


def _lm_step(model: CausalAttention, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict:
    """One nanoGPT fp16 step; returns the reference numbers measured by hand on the unscaled gradients."""
    idx = torch.randint(0, 16, (2, 6))
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(idx)
    loss = F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # the reference: the gradients as the update sees them (unscaled)
    grads = [p.grad for p in model.parameters()]
    ref = {
        "nonfinite": sum(not bool(torch.isfinite(g).all()) for g in grads),
        "norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))),
    }
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)  # as nanoGPT: the gradients are gone before mon.step()
    return ref


def test_ordinary_overflow_steps_are_skipped_with_true_numbers_and_no_warning(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = CausalAttention(gain=30.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)  # fp16 backward overflows at steps 0, 1 and 3
    refs, records = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=tmp_path) as mon:
            for _ in range(6):
                refs.append(_lm_step(model, opt, scaler))
                records.append(mon.step())
    assert not mon.anomalies and mon.counters["anomaly_steps"] == 0
    assert [r.skipped for r in records] == [True, True, False, True, False, False]
    # the scale each step used: halved after each skipped step (backoff 0.5)
    assert [r.scale for r in records] == [2.0**14, 2.0**13, 2.0**12, 2.0**12, 2.0**11, 2.0**11]
    assert all("GradScaler" in r.skip_reason for r in records if r.skipped)
    assert [r.values["grad_nonfinite"] for r in records] == [float(x["nonfinite"]) for x in refs]
    assert [x["nonfinite"] for x in refs] == [1, 1, 0, 1, 0, 0]  # measured by hand above
    for r, ref in zip(records, refs):
        if math.isfinite(ref["norm"]):
            assert r.grad_norm == pytest.approx(ref["norm"], rel=1e-5)  # unscaled, as the update sees it
        else:
            assert r.grad_norm is not None and not math.isfinite(r.grad_norm)
            assert math.isnan(r.grad_norm) == math.isnan(ref["norm"])
    with td.open_run(mon.run_dir) as run:
        stored = run.series("grad_nonfinite").values
        norms = run.series("grad_norm").values
        assert run.anomalies() == []
    assert list(stored) == [float(x["nonfinite"]) for x in refs]
    assert (
        not math.isfinite(norms[0])
        and not math.isfinite(norms[1])
        and norms[2] == pytest.approx(refs[2]["norm"])
    )


def test_overflow_that_makes_a_nan_loss_is_an_anomaly_located_at_its_step() -> None:
    torch.manual_seed(0)
    model = CausalAttention(gain=3000.0)  # fp16 logits overflow to +inf; softmax of [+inf, -inf] is NaN
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False) as mon:
        for _ in range(3):
            _lm_step(model, opt, scaler)
            mon.step()
    a = ei.value.anomaly
    # the fp16 overflow of q @ k^T is the origin (issue 12.1); the softmax is where it became NaN
    assert (a.step, a.phase, a.module, a.op, a.kind) == (0, "forward", "", "aten.bmm", "inf")
    assert a.location == origin_line("logits", PATH)
    assert a.noticed is not None and (a.noticed.op, a.noticed.kind) == ("aten._softmax", "nan")
    assert a.noticed.location == origin_line("softmax", PATH)
    assert mon.counters["anomaly_steps"] == 1 and mon.counters["replays"] == 1


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_nan_loss_under_the_scaler_is_recorded_every_step_and_weights_stay_finite(policy: str) -> None:
    torch.manual_seed(0)
    model = CausalAttention(gain=3000.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    records = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with td.watch(
            model, opt, run=False, policy=policy, config=td.DebugConfig(mode="anomaly_detection")
        ) as mon:
            for _ in range(3):
                _lm_step(model, opt, scaler)
                records.append(mon.step())
    assert mon.counters["anomaly_steps"] == 3
    assert [a.step for a in mon.anomalies] == [0, 1, 2] and mon.anomalies[0].op == "aten.bmm"
    assert all(r.skipped for r in records)  # the scaler skipped every update
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    msgs = [str(w.message) for w in caught if issubclass(w.category, td.TorchDebugWarning)]
    assert len(msgs) == (1 if policy == "warn" else 0)


def test_overflow_below_the_scale_floor_is_a_collapse_anomaly() -> None:
    # loss = sum(out^4) with out = 4000: d loss/d out = 4 * 4000^3 = 2.6e11 overflows fp16 (max 65504) at
    # any scale >= 1e-6: the scale 2 -> 1 (ordinary skips, scale >= floor 1.0) -> 0.5: below the floor
    model = Steep()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    records = []
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False) as mon:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.ones(2, 4))
            opt.zero_grad()
            scaler.scale(out.float().pow(4).sum()).backward()
            loss_line = sys._getframe().f_lineno - 1
            scaler.step(opt)
            scaler.update()
            records.append(mon.step())
    assert [(r.skipped, r.scale) for r in records] == [(True, 2.0), (True, 1.0)]
    a = ei.value.anomaly
    # the first op that made the Inf: the backward of the loss code's out.float() casts the fp32
    # gradient 2.6e11 down to float16 (issue 12.1: an overflow is the origin); the loss line
    assert (a.step, a.phase, a.module, a.kind, a.op) == (2, "backward", "", "inf", "ToCopyBackward0")
    assert a.location is not None and a.location.endswith(f"test_amp_grad_scaler.py:{loss_line}")
    assert a.hint.startswith("float16 max is 65504")
    assert mon.counters["anomaly_steps"] == 1


def test_driver_announcing_the_update_after_unscale_sees_ordinary_overflow_as_a_skip() -> None:
    # Lightning's MixedPrecision order: closure (backward), scaler.unscale_(opt), on_before_optimizer_step
    # (the driver's update_starting), scaler.step(opt) (skips on Inf/NaN), then the step ends
    torch.manual_seed(0)
    model = CausalAttention(gain=30.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    records = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with td.watch(model, opt, run=False, scaler=scaler) as mon:
            mon.driver = "test"
            for _ in range(6):
                idx = torch.randint(0, 16, (2, 6))
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(idx)
                loss = F.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                mon.update_starting(opt)
                scaler.step(opt)
                mon.update_done(opt)
                scaler.update()
                records.append(mon.step())
    assert not mon.anomalies
    assert [r.skipped for r in records] == [True, True, False, True, False, False]  # as the plain loop
    assert mon.counters["skipped_steps"] == 3
