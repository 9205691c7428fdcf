"""The demo's fault (an all-padding sequence makes a softmax row of -inf: NaN) on the devices users train on.

Each case runs on CPU here and on CUDA where a GPU is present (skipped with a reason otherwise): the
blocking read, ``sync="async"`` (the NaN step is read a step late, the origin must still be the
step it was born in), ``torch.compile`` (the replay runs the eager model), DDP over the backend of the
device (gloo on CPU, NCCL on CUDA; one rank), and, CUDA only, fp16 autocast with a ``GradScaler``
whose early overflow steps are recorded as skipped and warned about never.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchdebug as td
from torchdebug.demo import PAD, TinyGPT, synthetic_batch

VOCAB, BLOCK, BATCH, BAD_STEP = 64, 32, 16, 6
QUIET = {"log_performance": False}

CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def cuda_only(test: Any) -> Any:
    for mark in CUDA:
        test = mark(test)
    return test


def train(
    model: Any,
    opt: torch.optim.Optimizer,
    device: str,
    steps: int,
    *,
    bad_step: int | None,
    around: Callable[[int], AbstractContextManager[Any]] = lambda step: nullcontext(),
    **watch: Any,
) -> tuple[Any, td.NonFiniteError | None, list[str]]:
    """The demo's loop on ``device`` (``around(step)``: entered around each step's work): (the session,
    the error raised or None, torchdebug's warnings)."""
    err = None
    watch.setdefault("config", QUIET)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            with td.watch(model, opt, run=False, **watch) as mon:
                for step in range(steps):
                    idx = synthetic_batch(step, batch=BATCH, block=BLOCK, vocab=VOCAB, bad_step=bad_step)
                    idx = idx.to(device)
                    with around(step):
                        loss = F.cross_entropy(
                            model(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1), ignore_index=PAD
                        )
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                        mon.step()
        except td.NonFiniteError as e:
            err = e
    ours = [str(w.message) for w in said if issubclass(w.category, td.TorchDebugWarning)]
    return mon, err, ours


def gpt(device: str, *, fused: bool | None = None) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, block=BLOCK).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)


def assert_softmax_origin(err: td.NonFiniteError | None, module: str = "blocks.0.attn") -> None:
    assert err is not None, "the NaN step did not raise"
    a = err.anomaly
    assert (a.phase, a.module, a.op, a.kind, a.step) == ("forward", module, "aten._softmax", "nan", BAD_STEP)
    assert a.location is not None and a.location.endswith("torchdebug/demo.py:41"), a.location


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sync", ["blocking", "async"])
def test_the_softmax_nan_is_located_at_its_step(device: str, sync: str) -> None:
    model, opt = gpt(device, fused=sync == "async")  # async skips a bad update on the device: fused only
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mon, err, said = train(model, opt, device, BAD_STEP + 3, bad_step=BAD_STEP, sync=sync)
    assert_softmax_origin(err)
    assert [r.step for r in mon.records] == list(range(BAD_STEP))  # the bad step is not a record
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the NaN update never ran
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())  # 6 updates did
    assert said == []  # policy "raise": the error is the report


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_model_is_located_through_its_eager_replay(device: str) -> None:
    model, opt = gpt(device)
    compiled = torch.compile(model, backend="inductor" if device == "cuda" else "eager")
    mon, err, said = train(compiled, opt, device, BAD_STEP + 2, bad_step=BAD_STEP)
    assert_softmax_origin(err)
    assert said == []  # on CUDA "auto" leaves for blocking at the first update (AdamW not fused): silently
    assert mon.compiled  # named blocks.0.attn above, not _orig_mod.blocks.0.attn


@pytest.mark.parametrize(("device", "backend"), [("cpu", "gloo"), pytest.param("cuda", "nccl", marks=CUDA)])
def test_one_rank_ddp_is_named_without_its_wrapper(device: str, backend: str, tmp_path: Path) -> None:
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, opt = gpt(device)
        ddp = DDP(model, device_ids=[0] if device == "cuda" else None)
        mon, err, said = train(ddp, opt, device, BAD_STEP + 2, bad_step=BAD_STEP)
        assert_softmax_origin(err)
        assert said == []
        assert (err.anomaly.rank, err.anomaly.world_size) == (0, 1)
        assert len(mon.records) == BAD_STEP
    finally:
        dist.destroy_process_group()


@cuda_only
def test_fp16_scaler_overflow_steps_are_skips_not_warnings() -> None:
    # init_scale 2**40: the first backward overflows fp16 (max 65504) until the scaler has halved its
    # scale enough; those steps are the scaler's business (skipped, recorded), not a NaN to report.
    model, opt = gpt("cuda")
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)
    scales: list[float] = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with td.watch(model, opt, scaler=scaler, run=False, config=QUIET) as mon:
            for step in range(40):
                idx = synthetic_batch(step, batch=BATCH, block=BLOCK, vocab=VOCAB, bad_step=None).cuda()
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(idx[:, :-1])
                loss = F.cross_entropy(
                    logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1), ignore_index=PAD
                )
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
                mon.step()
    ours = [str(w.message) for w in said if issubclass(w.category, td.TorchDebugWarning)]
    assert ours == []
    dropped = sum(1 for a, b in zip([2.0**40, *scales], scales) if b < a)  # the scaler's own count
    assert dropped >= 1
    assert sum(r.skipped for r in mon.records) == dropped
    assert len(mon.records) == 40 and math.isfinite(mon.records[-1].loss or math.nan)


@contextmanager
def _no_sync_after_step_0(step: int) -> Iterator[None]:
    """From step 1 on (step 0 has no optimizer state yet) any host sync raises."""
    if step >= 1:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@cuda_only
def test_the_default_watch_never_waits_for_the_device_under_async() -> None:
    # every default instrument (the default config), 12 steps (detail step 10 among them: the
    # weight-update ratios are worked out there); the default sync "auto" reads late on CUDA
    model, opt = gpt("cuda", fused=True)
    mon, err, said = train(model, opt, "cuda", 12, bad_step=None, around=_no_sync_after_step_0, config=None)
    assert err is None and said == []
    assert mon.reads_late and mon.config.sync == "auto"
    assert [r.step for r in mon.records] == list(range(12))
    assert all(math.isfinite(r.loss or math.nan) for r in mon.records)
