"""The seeds' own try/except recovery code, run against torchdebug: a NaN/Inf never reaches the weights.

Seeds 001/002/004 wrapped forward, backward and ``optimizer.step()`` in a debugging block and relied
on ``torch.autograd.detect_anomaly`` raising inside ``backward()`` (in both of seed 001's modes) to
skip the batch; seed 003 wrapped the backward in ``detector.detect_anomaly()`` with modes detect,
warn and raise. Each test runs the seed's snippet (imports adapted) on a batch holding a NaN and
asserts: the ``except`` branch ran (or, in a non-raising mode, the update was skipped), the weights
are exactly as before the batch, and the anomaly names the batch (phase ``input``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import torchdebug as td
from torchdebug import DebugConfig, DebugMode
from torchdebug.compat import AutogradAnomalyDetector, PyTorchDebugger, debug_context, debug_operation

logger = logging.getLogger("seed")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    out[1][0][2, 5] = float("nan")  # batch 1 arrives with a NaN
    return out


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], model: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, model.parameters()))


def _no_hooks(model: nn.Module) -> bool:
    from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    local = all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    return (
        local
        and not _global_forward_pre_hooks
        and not _global_forward_hooks
        and not _global_optimizer_pre_hooks
        and not _global_optimizer_post_hooks
        and not getattr(torch.Tensor.backward, "__torchdebug_wrapper__", False)
    )


class _ErrorTracker:  # seed 004's error_system.error_tracker
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def track_error(self, error: BaseException, **context: object) -> None:
        self.errors.append(error)


class _ErrorSystem:
    def __init__(self) -> None:
        self.error_tracker = _ErrorTracker()


def robust_training_step(model, data, target, optimizer, criterion, debugger):  # type: ignore[no-untyped-def]
    """Seed 004's ``robust_training_step``, as written (the error tracker's enums left out)."""
    try:
        with debugger.debug_context("training_step"):
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()

            # Check gradients
            gradient_info = debugger.check_gradients(model, loss)
            if gradient_info["gradient_anomalies"]:
                logger.warning(f"Gradient anomalies: {gradient_info['gradient_anomalies']}")

            optimizer.step()
            return loss.item()

    except Exception as e:
        # Log error with debug context
        debugger.error_system.error_tracker.track_error(error=e, context={"operation": "training_step"})

        # Attempt recovery
        optimizer.zero_grad()
        return None


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda es: PyTorchDebugger(error_system=es), id="default-warn"),
        pytest.param(
            lambda es: PyTorchDebugger(DebugConfig(anomaly_detection_mode="raise"), error_system=es),
            id="raise",
        ),
        pytest.param(
            lambda es: PyTorchDebugger(error_system=es, debug_mode=DebugMode.FULL_DEBUG),
            id="full-debug-traced",
        ),
    ],
)
def test_seed_004_robust_training_step_keeps_the_weights(make) -> None:  # type: ignore[no-untyped-def]
    model, es = _model(), _ErrorSystem()
    debugger = make(es)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    criterion = nn.CrossEntropyLoss()
    results, kept = [], []
    for data, target in _batches():
        kept.append(_weights(model))
        results.append(robust_training_step(model, data, target, optimizer, criterion, debugger))
    assert results[0] is not None and results[1] is None and results[2] is not None  # the except branch ran
    assert _same(kept[2], model) is False  # batch 2 trained
    # batch 1 changed nothing: the weights after it equal those before it
    after_nan = kept[2]
    assert all(torch.equal(a, b) for a, b in zip(kept[1], after_nan))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (err,) = es.error_tracker.errors
    assert isinstance(err, td.NonFiniteError) and err.anomaly.phase == "input"
    assert debugger.anomalies == [err.anomaly]
    ops = list(debugger.debug_history)
    assert [i.anomaly_detected for i in ops if i.operation == "training_step"] == [False, True, False]
    assert _no_hooks(model)


@pytest.mark.parametrize("mode", ["warn", "raise"])
def test_seed_001_debug_context_raises_in_backward_in_both_modes(mode: str) -> None:
    """Seed 001: both modes switched on detect_anomaly (they differed in the log line only)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = DebugConfig(
        mode=DebugMode.ANOMALY_DETECTION, enable_anomaly_detection=True, anomaly_detection_mode=mode
    )
    debugger = PyTorchDebugger(config)
    data, target = _batches()[1]
    before = _weights(model)
    reached = []
    caught = None
    try:
        with debugger.debug_context("custom_operation", "my_model", model=model) as debug_info:
            loss = nn.functional.cross_entropy(model(data), target)
            loss.backward()
            reached.append("after backward")
            optimizer.step()
    except td.NonFiniteError as e:
        caught = e
    assert caught is not None and reached == []
    assert _same(before, model)
    assert debug_info.anomaly is caught.anomaly and caught.anomaly.phase == "input"
    assert _no_hooks(model)


def test_seed_002_debug_context_block_keeps_the_weights() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data, target = _batches()[1]
    before = _weights(model)
    with pytest.raises(td.NonFiniteError) as err, debug_context(td.DebugLevel.BASIC, model=model):
        loss = nn.functional.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    assert _same(before, model) and err.value.anomaly.phase == "input"


def test_seed_003_error_recovery_raise_mode() -> None:
    """Seed 003's "Error Recovery": the forward outside the block, backward inside, update after it."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    anomaly_detector = AutogradAnomalyDetector()  # mode "raise" by default, as torch's detect_anomaly
    recovered = 0
    kept = []
    for data, target in _batches():
        kept.append(_weights(model))
        loss = nn.functional.cross_entropy(model(data), target)
        try:
            with anomaly_detector.detect_anomaly():
                loss.backward()
        except Exception as e:
            logger.error(f"Gradient computation error: {e}")
            optimizer.zero_grad()
            recovered += 1
            continue
        optimizer.step()
        optimizer.zero_grad()
    assert recovered == 1
    assert all(torch.equal(a, b) for a, b in zip(kept[1], kept[2]))
    assert len(anomaly_detector.anomalies) == 1


@pytest.mark.parametrize("mode", ["warn", "detect"])
def test_seed_003_detector_non_raising_modes_skip_the_update(mode: str) -> None:
    """Seed 003's integration loop: the block wraps forward and backward, ``optimizer.step()`` follows it."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    anomaly_detector = AutogradAnomalyDetector(mode=mode)
    kept = []
    for inputs, targets in _batches():
        kept.append(_weights(model))
        optimizer.zero_grad()
        if mode == "warn" and len(kept) == 2:
            with pytest.warns(td.TorchDebugWarning, match="input"), anomaly_detector.detect_anomaly():
                outputs = model(inputs)
                loss = nn.functional.cross_entropy(outputs, targets)
                loss.backward()
        else:
            with anomaly_detector.detect_anomaly():
                outputs = model(inputs)
                loss = nn.functional.cross_entropy(outputs, targets)
                loss.backward()
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(kept[1], kept[2]))  # the NaN batch changed nothing
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (a,) = anomaly_detector.anomalies
    # the NaN arrived with the batch: phase input, not the first op that read it (aten.addmm)
    assert (a.phase, a.module, a.op) == ("input", "", None)


def test_seed_004_debug_operation_decorator_skips_the_batch() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    @debug_operation(debug_mode=DebugMode.ANOMALY_DETECTION)
    def training_step(model, data, target, optimizer, criterion):  # type: ignore[no-untyped-def]
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        return loss

    data, target = _batches()[1]
    before = _weights(model)
    with pytest.raises(td.NonFiniteError) as err:
        training_step(model, data, target, optimizer, nn.CrossEntropyLoss())
    assert _same(before, model) and err.value.anomaly.phase == "input"
    assert err.value.anomaly.op is None  # not the first op that read it (aten.addmm)


def test_healthy_guarded_blocks_are_silent_and_train() -> None:
    """No warning (filterwarnings=error), no anomaly, the weights change, nothing left installed."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    debugger = PyTorchDebugger()
    before = _weights(model)
    for data, target in [b for i, b in enumerate(_batches()) if i != 1]:
        with debugger.debug_context("training_step"):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(data), target).backward()
            optimizer.step()
    assert debugger.anomalies == [] and not _same(before, model)
    assert not any(i.anomaly_detected for i in debugger.debug_history)
    assert _no_hooks(model)
