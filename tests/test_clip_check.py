"""The gradient check carried by the user's clip: a loop that calls ``clip_grad_norm_`` right after
backward() has its gradients measured once, by the clip's own per-tensor norms, instead of a copy of
every gradient per step. Training stays bit for bit what it is without the session, and a NaN is still
named where it was born (backward, or code between backward() and the clip)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch

import torchdebug as td
from tests.fixtures import models as fx
from tests.fixtures.launch_models import WORKLOADS
from tests.fixtures.models import origin_line
from tests.fixtures.stack_models import PATH, GatedSqrt

SENTINEL_ONLY = td.DebugConfig(mode="anomaly_detection")


def _gpt2_steps(
    model: torch.nn.Module, batches: list, copies: list[int], config: td.DebugConfig | None = None
) -> tuple[list[torch.Tensor], list[float | None], list[int]]:
    """Six steps of the GPT-2-shaped workload (clip_grad_norm_(params, 1.0) right after backward()),
    watched under ``config`` if given: the clip's totals, the recorded gradient norms and the gradient
    copies of each step."""
    w = WORKLOADS["gpt2"]
    opt = w.optimizer(model)
    totals, norms, per_step = [], [], []
    with td.watch(model, opt, run=False, config=config) if config else contextlib.nullcontext() as mon:
        for i in range(6):
            before = copies[0]
            x, y = batches[i % 3]
            loss = w.loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).clone())
            opt.step()
            norms.append(mon.step().values.get("grad_norm") if mon is not None else None)
            per_step.append(copies[0] - before)
    return totals, norms, per_step


@pytest.mark.parametrize("config", [td.DebugConfig(), SENTINEL_ONLY], ids=["default", "sentinel"])
def test_a_clipping_loop_trains_bit_for_bit_as_without_the_session(
    config: td.DebugConfig, copies: list[int]
) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [WORKLOADS["gpt2"].batch(g) for _ in range(3)]  # 148 parameter tensors, AdamW
    torch.manual_seed(0)
    plain_model = WORKLOADS["gpt2"].build()
    model = copy.deepcopy(plain_model)
    plain_totals, _, _ = _gpt2_steps(plain_model, batches, copies)
    totals, norms, per_step = _gpt2_steps(model, batches, copies, config)
    # the clip's totals and the weights: torch's own, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(plain_totals, totals, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters(), strict=True))
    # step 0 measures after backward (no clip seen yet); from step 1 on the clip's norms are the check:
    # no copy of the gradients on an ordinary step
    assert per_step[0] >= 1 and per_step[1:] == [0, 0, 0, 0, 0]
    if config.mode == "anomaly_detection":
        assert norms == [None] * 6  # the sentinel alone records no gradient norm
    else:  # the gradient norm recorded is the clip's total (before clipping)
        assert norms[1:] == [float(t) for t in plain_totals[1:]]


def _sqrt_loop(
    model: GatedSqrt,
    mon: td.Monitor,
    opt: torch.optim.Optimizer,
    steps: int,
    micro: int,
    gate: Callable[[int, int], float],
    copies: list[int] | None = None,
    kept: list[list[torch.Tensor]] | None = None,
) -> list[int]:
    """SGD on GatedSqrt, ``micro`` micro-steps per update (``gate(step, micro_step)``), a clip before
    each update; ``kept`` gets the weights before each step. Returns the gradient copies of each step."""
    torch.manual_seed(0)
    kept = [] if kept is None else kept
    per_step = []
    for i in range(steps):
        kept.append([p.detach().clone() for p in model.parameters()])
        before = copies[0] if copies else 0
        opt.zero_grad()
        for k in range(micro):
            model.gate = gate(i, k)
            model(torch.randn(3, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        mon.step()
        per_step.append((copies[0] if copies else 0) - before)
    return per_step


def test_a_nan_born_in_backward_of_a_clipping_loop_is_named_and_never_reaches_the_weights() -> None:
    model = GatedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[list[torch.Tensor]] = []
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        _sqrt_loop(model, mon, opt, 5, 1, lambda i, k: 0.0 if i == 3 else 1.0, kept=kept)
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op, a.micro_step) == (3, "backward", "", "SqrtBackward0", None)
    assert a.location == origin_line("gated-sqrt", PATH) and a.reproducible
    assert mon.global_step == 3
    # the update of step 3 never ran: the weights are those before it, bit for bit
    assert len(kept) == 4
    assert all(torch.equal(a, b) for a, b in zip(kept[3], model.parameters(), strict=True))


def test_with_accumulation_the_last_micro_step_is_measured_by_the_clip(copies: list[int]) -> None:
    model = GatedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        per_step = _sqrt_loop(model, mon, opt, 4, 2, lambda i, k: 1.0, copies)
    # step 0 measures both micro-steps after backward (and probes the parameters: a detail step); from
    # step 1 on only the first micro-step is measured after backward, the clip measures the second
    assert per_step[1:] == [1, 1, 1]
    model = GatedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        _sqrt_loop(model, mon, opt, 5, 2, lambda i, k: 0.0 if (i, k) == (3, 1) else 1.0)
    a = ei.value.anomaly
    # the NaN is in the second micro-step (index 1) of step 3, the one the clip measured
    assert (a.step, a.phase, a.micro_step, a.op) == (3, "backward", 1, "SqrtBackward0")


def _mlp_with_an_edit_at_step_3(
    edit_before_clip: bool, each_step: Callable[[td.Monitor, int], None] = lambda mon, i: None
) -> td.Anomaly:
    """Five clipping steps of a small MLP; at step 3 code makes fc1.weight's gradient NaN in place,
    before or after the clip. ``each_step(mon, i)`` runs after the clip of the other steps. The anomaly
    raised."""
    torch.manual_seed(0)
    model = fx.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        for i in range(5):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if i == 3 and edit_before_clip:
                model.fc1.weight.grad.mul_(float("nan"))  # type: ignore[union-attr]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if i == 3 and not edit_before_clip:
                model.fc1.weight.grad.mul_(float("nan"))  # type: ignore[union-attr]
            elif i != 3:
                each_step(mon, i)
            opt.step()
            mon.step()
    return ei.value.anomaly


def test_an_edit_before_the_clip_on_one_step_is_still_the_edits() -> None:
    # three steps teach the session that the clip follows backward(); at step 3 code between them makes
    # fc1.weight's gradient NaN: the measure held for the clip runs late, on the edited gradients, and
    # the anomaly still names the edit, not backward()
    a = _mlp_with_an_edit_at_step_3(edit_before_clip=True)
    assert (a.step, a.phase, a.parameter, a.module, a.kind) == (
        3,
        "gradient_edit",
        "fc1.weight",
        "fc1",
        "nan",
    )


def test_an_edit_after_the_merged_clip_is_the_edits_and_the_clip_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the merged clip scales every gradient once: the edit check expects one more version each instead
    # of reading the gradients again (no rebase on an ordinary step). At step 3 code after the clip
    # makes fc1.weight's gradient NaN in place: one version more than that, so it is the edit's. (The
    # versions' path: where the session cannot watch the calls between backward() and the update.)
    from torchdebug._step import SeenGrads
    from torchdebug.nonfinite.edits import EditCheck

    monkeypatch.setattr(EditCheck, "watches_edits", lambda self: False)

    rebases: list[int] = []
    real = SeenGrads.rebase

    def counted(self: SeenGrads, idx: list[int], params: list) -> None:
        rebases.append(len(idx))
        real(self, idx, params)

    monkeypatch.setattr(SeenGrads, "rebase", counted)
    bumps: list[int] = []
    a = _mlp_with_an_edit_at_step_3(
        edit_before_clip=False, each_step=lambda mon, i: bumps.append(mon.state.seen.bump)
    )
    assert (a.step, a.phase, a.parameter, a.kind) == (3, "gradient_edit", "fc1.weight", "nan")
    assert bumps == [0, 1, 1]  # steps 0-2; step 0 measures after backward, torch's clip runs
    assert rebases == [4]  # step 0's clip only (torch's clip, the measure ran after backward)


def test_a_loop_that_stops_clipping_is_measured_after_backward_again(copies: list[int]) -> None:
    # the clip is predicted from the last update; when it does not come the held measure runs as the
    # update starts (nothing changed the gradients since backward()), and the next step measures at once
    model = GatedSqrt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    with pytest.raises(td.NonFiniteError) as ei, td.watch(model, opt, run=False, config=SENTINEL_ONLY) as mon:
        torch.manual_seed(0)
        for i in range(6):
            opt.zero_grad()
            model.gate = 0.0 if i == 4 else 1.0
            model(torch.randn(3, 4)).sum().backward()
            if i < 3:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            got.append(mon.step().values.get("grad_nonfinite"))
    assert got == [0.0, 0.0, 0.0, 0.0]
    a = ei.value.anomaly
    assert (a.step, a.phase, a.op) == (4, "backward", "SqrtBackward0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_clipping_loop_trains_bit_for_bit_as_without_the_session(dtype: torch.dtype) -> None:
    # blocking reads (sync="async" leaves the clip to torch); the fused foreach norm on the device
    torch.manual_seed(0)
    plain_model = WORKLOADS["gpt2"].build().to("cuda", dtype)
    model = copy.deepcopy(plain_model)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.cuda() for t in WORKLOADS["gpt2"].batch(g)) for _ in range(3)]
    totals: list[list[torch.Tensor]] = [[], []]
    for j, m in enumerate((plain_model, model)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
        with td.watch(m, opt, run=False, sync="blocking") if j else contextlib.nullcontext() as mon:
            for i in range(6):
                x, y = batches[i % 3]
                loss = WORKLOADS["gpt2"].loss(m(x).float(), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                totals[j].append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).clone())
                opt.step()
                if mon is not None:
                    mon.step()
    assert all(torch.equal(a, b) for a, b in zip(*totals, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters(), strict=True))


def test_a_clip_over_the_parameters_in_another_order_names_the_right_gradients() -> None:
    # the optimizer's group lists fc2 before fc1 and the loop clips in that order: the per-parameter
    # gradient norms the session reports are still each parameter's own (before the clip)
    torch.manual_seed(0)
    model = fx.MLP()
    order = [model.fc2.weight, model.fc2.bias, model.fc1.weight, model.fc1.bias]
    opt = torch.optim.SGD(order, lr=0.1)
    with td.watch(model, opt, run=False) as mon:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            want = {n: float(p.grad.norm()) for n, p in model.named_parameters()}  # type: ignore[union-attr]
            torch.nn.utils.clip_grad_norm_(order, 0.1)
            opt.step()
            mon.step()
            got = dict(zip(mon.param_names, mon.grad_norms_host or [], strict=True))
            assert got == pytest.approx(want, rel=1e-5)


def test_under_async_the_clip_carries_the_check_in_one_norm_pass(
    monkeypatch: pytest.MonkeyPatch, copies: list[int]
) -> None:
    # sync="async" reads each step one step later; the user's clip still measures the gradients once:
    # torch's per-tensor norms (one torch._foreach_norm call per step: the clip's), no copy of the
    # gradients for the session's own measure, and no host read for the check (the bitwise comparison
    # with torch's total travels with the staged numbers)
    calls = [0]
    orig = torch._foreach_norm

    def counted(*args: object, **kwargs: object) -> list[torch.Tensor]:
        calls[0] += 1
        return orig(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    w = WORKLOADS["mlp4"]
    g = torch.Generator().manual_seed(0)
    batches = [w.batch(g) for _ in range(3)]
    torch.manual_seed(0)
    plain_model = w.build()
    model = copy.deepcopy(plain_model)
    runs: dict[str, tuple[list[torch.Tensor], list[int], list[int]]] = {}
    for name, m in (("plain", plain_model), ("watched", model)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        totals, norms, copied = [], [], []
        session = td.watch(m, opt, run=False, sync="async") if name == "watched" else contextlib.nullcontext()
        with session as mon:
            for i in range(8):
                before_calls, before_copies = calls[0], copies[0]
                x, y = batches[i % 3]
                opt.zero_grad(set_to_none=True)
                w.loss(m(x), y).backward()
                totals.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).clone())
                opt.step()
                if mon is not None:
                    mon.step()
                norms.append(calls[0] - before_calls)
                copied.append(copies[0] - before_copies)
        runs[name] = (totals, norms, copied)
    totals, norms, copied = runs["watched"]
    # the clip's totals and the weights: torch's own, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(runs["plain"][0], totals, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), model.parameters(), strict=True))
    assert runs["plain"][1] == [1] * 8  # torch's clip: one _foreach_norm call a step
    # step 0 measures after backward (no clip seen yet) and is read blocking (no optimizer state yet);
    # step 1's clip also runs torch's total once (the bitwise comparison, read with step 1's numbers);
    # from step 2 on the clip's own norms are the check: one pass, no copy
    assert norms[2:] == [1] * 6 and copied[2:] == [0] * 6
    assert [r.step for r in mon.records] == list(range(8))
    assert [r.grad_norm for r in mon.records][2:] == [float(t) for t in totals[2:]]


@pytest.mark.parametrize("sync", ["blocking", "async"])
def test_a_nan_in_a_clipping_loop_is_named_the_same_read_blocking_or_late(sync: str) -> None:
    # step 3's input is zero: 0/0 in the forward (ZeroDivNet's ORIGIN:div), NaN gradients into the clip
    # the session carries its check in; fused AdamW takes the skip flag under async
    torch.manual_seed(0)
    model = fx.ZeroDivNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    kept: list[list[torch.Tensor]] = []
    with (
        pytest.raises(td.NonFiniteError) as ei,
        td.watch(model, opt, run=False, config=SENTINEL_ONLY, sync=sync) as mon,
    ):
        for i in range(6):
            kept.append([p.detach().clone() for p in model.parameters()])
            x = torch.zeros(3, 4) if i == 3 else torch.randn(3, 4)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            mon.step()
    a = ei.value.anomaly
    assert (a.step, a.phase, a.module, a.op) == (3, "forward", "", "aten.div")
    assert a.location == origin_line("div") and a.reproducible
    assert mon.stepper.grads._clip_checked  # steps 1-2 carried the check in the clip (compared once)
    # step 3's update never ran: blocking raises before it, async skipped it on the device and raised
    # at step 4's forward (whose weights are then those before step 3, bit for bit)
    assert len(kept) == (4 if sync == "blocking" else 5)
    assert all(torch.equal(a, b) for a, b in zip(kept[3], model.parameters(), strict=True))
